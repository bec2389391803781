"""
### Serving-side check of the published example waveform model

Scheduled on the `waveform_cnn_latest` Asset that `waveforms_horovod_retrain` emits. Serves
the version named by the triggering event (a manual run: the one `latest.json` names now):
downloads it, checks its sha256 against the version manifest
(`horovod_airflow.operators.serving.open_published_model`), prepares fresh waveforms with the
preprocessing the ONNX metadata records, predicts them with onnxruntime and fails when the
accuracy is below `min_accuracy` (`examples.waveforms.serving.serving_check`, the app's
`serving_check`, given the form's params). Needs onnxruntime and numpy on the worker — no torch.
"""

from __future__ import annotations

from datetime import UTC, datetime

from airflow.sdk import Param, dag

from examples.waveforms.settings import WAVEFORMS
from horovod_airflow.operators.pipeline import serving_dag_args, serving_pipeline


@dag(
    dag_id="waveforms_serve_latest_model",
    doc_md=__doc__,
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    tags=["serving", "onnx", "example"],
    params={
        "sample_count": Param(64, type="integer", minimum=1, maximum=10000, title="Samples",
                              description="Fresh waveforms to predict."),
        "min_accuracy": Param(0.5, type="number", minimum=0, maximum=1,
                              title="Minimum accuracy",
                              description="The check fails below this accuracy (0-1)."),
    },
    **serving_dag_args(WAVEFORMS),
)  # fmt: skip
def waveforms_serve_latest_model() -> None:
    serving_pipeline(WAVEFORMS)


serve_dag = waveforms_serve_latest_model()
