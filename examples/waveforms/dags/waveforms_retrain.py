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

The ranks import `examples.waveforms`: with `launcher=local` the repository root must be on
the worker's `PYTHONPATH`; the docker and kubernetes launchers need an image that holds it
(the project's trainer image holds `trainer/` only).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import Asset, Param, dag

from examples.waveforms.settings import (
    CHAMPION_SCORER,
    DATA_CHECKS,
    DATASET_FILES,
    DATASET_NAME,
    DATASET_SOURCE,
    EXPORT_ENTRYPOINT,
    LATEST_MODEL_ASSET_NAME,
    LATEST_MODEL_URI,
    MODEL_NAME,
    TRAIN_ENTRYPOINT,
)
from horovod_airflow.operators import (
    HorovodExportOperator,
    HorovodTrainOperator,
    ModelGateOperator,
    PublishModelOperator,
    StageDatasetOperator,
    safe_key,
)
from horovod_airflow.operators.settings import (
    AWS_CONN_ID,
    BUCKET_URI,
    DEFAULT_LAUNCHER,
    MAX_REGRESSION_CEILING,
    MIN_ACCURACY_FLOOR,
    RUN_DEADLINE_ALERTS,
    RUN_TIMEOUT,
    TASK_TIMEOUT,
    TRAINER_JOB,
    gate_param,
)

LATEST_MODEL = Asset(name=LATEST_MODEL_ASSET_NAME, uri=LATEST_MODEL_URI)

RUN_PREFIX = BUCKET_URI + "/runs/{{ dag.dag_id }}/{{ run_id | safe_key }}"


@dag(
    dag_id="waveforms_horovod_retrain",
    doc_md=__doc__,
    schedule=None,
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    user_defined_filters={"safe_key": safe_key},
    dagrun_timeout=RUN_TIMEOUT,
    deadline=RUN_DEADLINE_ALERTS,
    default_args={"retries": 1, "retry_delay": timedelta(seconds=30),
                  "execution_timeout": TASK_TIMEOUT},
    tags=["horovod", "training", "example"],
    params={
        "num_proc": Param(2, type="integer", minimum=1, maximum=64, title="Ranks",
                          description="Horovod ranks (processes)."),
        "epochs": Param(12, type="integer", minimum=1, maximum=200, title="Epochs",
                        description="Training epochs."),
        "min_accuracy": Param(**gate_param("min_accuracy", 0.6)),
        "max_regression": Param(**gate_param("max_regression", 0.02)),
        "launcher": Param(DEFAULT_LAUNCHER, type="string",
                          enum=["local", "docker", "kubernetes"], title="Launcher",
                          description="Where ranks run (docker/kubernetes: an image holding "
                                      "examples/)."),
    },
)  # fmt: skip
def waveforms_horovod_retrain() -> None:
    stage = StageDatasetOperator(
        task_id="stage_dataset",
        source=DATASET_SOURCE,
        files=DATASET_FILES,
        bucket_uri=BUCKET_URI,
        dataset_name=DATASET_NAME,
        checks=DATA_CHECKS,
        aws_conn_id=AWS_CONN_ID,
    )

    train = HorovodTrainOperator(
        task_id="train",
        entrypoint=TRAIN_ENTRYPOINT,
        launcher="{{ params.launcher }}",
        num_proc="{{ params.num_proc }}",
        data="{{ ti.xcom_pull(task_ids='stage_dataset')['uri'] }}",
        output=RUN_PREFIX,
        trainer_args={"epochs": "{{ params.epochs }}"},
        **TRAINER_JOB,
    )

    gate = ModelGateOperator(
        task_id="gate",
        bucket_uri=BUCKET_URI,
        model_name=MODEL_NAME,
        metrics=train.output,
        dataset=stage.output,
        min_accuracy="{{ params.min_accuracy }}",
        max_regression="{{ params.max_regression }}",
        champion_scorer=CHAMPION_SCORER,
        min_accuracy_floor=MIN_ACCURACY_FLOOR,
        max_regression_ceiling=MAX_REGRESSION_CEILING,
        aws_conn_id=AWS_CONN_ID,
    )

    export_onnx = HorovodExportOperator(
        task_id="export_onnx",
        entrypoint=EXPORT_ENTRYPOINT,
        launcher="{{ params.launcher }}",
        checkpoint="{{ ti.xcom_pull(task_ids='train')['checkpoint_uri'] }}",
        output=RUN_PREFIX + "/onnx",
        data="{{ ti.xcom_pull(task_ids='stage_dataset')['uri'] }}",
        **TRAINER_JOB,
    )

    publish = PublishModelOperator(
        task_id="publish",
        bucket_uri=BUCKET_URI,
        model_name=MODEL_NAME,
        metrics=train.output,
        exported=export_onnx.output,
        dataset=stage.output,
        decision=gate.output,
        aws_conn_id=AWS_CONN_ID,
        outlets=[LATEST_MODEL],
    )

    stage >> train >> gate >> export_onnx >> publish


retrain_dag = waveforms_horovod_retrain()
