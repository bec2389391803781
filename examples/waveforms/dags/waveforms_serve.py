"""
### Serving-side check of the published example waveform model

Scheduled on the `waveform_cnn_latest` Asset that `waveforms_horovod_retrain` emits. Serves
the version named by the triggering event (a manual run: the one `latest.json` names now):
downloads it, checks its sha256 against the version manifest
(`horovod_airflow.operators.serving.open_published_model`), prepares fresh waveforms with the
preprocessing
the ONNX metadata records, predicts them with onnxruntime and fails when the accuracy is
below `min_accuracy`. Needs onnxruntime and numpy on the worker — no torch.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from airflow.sdk import Asset, Param, dag, get_current_context, task

from examples.waveforms.settings import LATEST_MODEL_ASSET_NAME, LATEST_MODEL_URI, MODEL_NAME
from horovod_airflow.operators.settings import AWS_CONN_ID, BUCKET_URI, RUN_TIMEOUT, TASK_TIMEOUT

LATEST_MODEL = Asset(name=LATEST_MODEL_ASSET_NAME, uri=LATEST_MODEL_URI)


@dag(
    dag_id="waveforms_serve_latest_model",
    doc_md=__doc__,
    schedule=[LATEST_MODEL],
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=RUN_TIMEOUT,
    default_args={"execution_timeout": TASK_TIMEOUT},
    tags=["serving", "onnx", "example"],
    params={
        "sample_count": Param(64, type="integer", minimum=1, maximum=10000, title="Samples",
                              description="Fresh waveforms to predict."),
        "min_accuracy": Param(0.5, type="number", minimum=0, maximum=1,
                              title="Minimum accuracy",
                              description="The check fails below this accuracy (0-1)."),
    },
)  # fmt: skip
def waveforms_serve_latest_model() -> None:
    @task
    def check_latest() -> dict[str, Any]:
        """Fetch the triggering event's model, verify it, predict fresh waveforms."""
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        from examples.waveforms.serving import serving_check
        from horovod_airflow.operators.serving import published_from_events

        context = get_current_context()
        params = context["params"]
        return serving_check(
            BUCKET_URI,
            MODEL_NAME,
            client=S3Hook(aws_conn_id=AWS_CONN_ID).get_conn(),
            published=published_from_events(context["triggering_asset_events"], LATEST_MODEL),
            sample_count=int(params["sample_count"]),
            min_accuracy=float(params["min_accuracy"]),
        )

    check_latest()


serve_dag = waveforms_serve_latest_model()
