"""
### Retrain the example waveform 1-D CNN on the same operators as MNIST, and publish it

`stage_dataset` → `train` → `gate` → `export_onnx` → `publish`, each the project's operator,
given this model's own pieces:

1. **stage_dataset**: `StageDatasetOperator(files=["*.npy"])` stages the example's `.npy`
   files (`examples/waveforms/dataset/`) as a content-addressed file set at
   `s3://<bucket>/datasets/waveforms/<hash16>/`, after its data checks against the previous
   one (each `.npy` file's samples, shapes, dtypes and duplicates, the class balance of the
   label files: `examples.waveforms.settings.DATA_CHECKS`).
2. **train**: `HorovodTrainOperator(entrypoint=python -m examples.waveforms.train)`, 2 ranks by
   default, allreduced exact metrics in `metrics.json`.
3. **gate**: `ModelGateOperator` against the published `waveform_cnn`; a champion measured
   on other data is re-scored by `examples.waveforms.serving:score_published_model`.
4. **export_onnx**: `HorovodExportOperator(entrypoint=python -m examples.waveforms.export)`:
   ONNX with its preprocessing in the metadata, parity checked by onnxruntime.
5. **publish**: `PublishModelOperator` to `s3://<bucket>/models/waveform_cnn/`, next to
   `mnist_cnn`, emitting the `waveform_cnn_latest` Asset (`waveforms_serve_latest_model`
   checks it).

The six tasks, their settings and alerts are the pipeline's
(`horovod_airflow.operators.pipeline.retraining_pipeline`), exactly as for MNIST; this model's
part is `examples.waveforms.settings.WAVEFORMS` (a `ModelApp`). The ranks import
`examples.waveforms`: with `launcher=local` the repository root must be on the worker's
`PYTHONPATH`; the docker and kubernetes launchers run the app's image (`HVA_WAVEFORMS_IMAGE`,
built by `examples/waveforms/Dockerfile` on the project's trainer image, which holds `core/`
and `trainer/` only).
"""

from __future__ import annotations

from datetime import UTC, datetime

from airflow.sdk import Param, dag

from examples.waveforms.settings import WAVEFORMS
from horovod_airflow.operators.pipeline import (
    retraining_dag_args,
    retraining_params,
    retraining_pipeline,
)


@dag(
    dag_id="waveforms_horovod_retrain",
    doc_md=__doc__,
    schedule=None,
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    tags=["horovod", "training", "example"],
    params=retraining_params(
        num_proc=2,
        max_num_proc=64,
        min_accuracy=0.6,
        max_regression=0.02,
        epochs=Param(12, type="integer", minimum=1, maximum=200, title="Epochs",
                     description="Training epochs."),
    ),
    **retraining_dag_args(),
)  # fmt: skip
def waveforms_horovod_retrain() -> None:
    retraining_pipeline(WAVEFORMS)


retrain_dag = waveforms_horovod_retrain()
