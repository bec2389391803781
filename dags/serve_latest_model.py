"""
### Serving-side consumer: check and smoke-test the newly published MNIST model

Scheduled on the `mnist_cnn_latest` Asset (the `latest.json` that
`mnist_horovod_retrain` writes last), not on time. It serves the version named by the Asset
event that triggered the run (its `extra`), so a later publish cannot swap the model under
it; a manual run, which has no event, uses the version `latest.json` names now. It
downloads that model from the registry (whatever location the event names), checks its
sha256 against the version's `manifest.json`, and predicts the raw test images of the dataset
the manifest records, prepared only as the model's own metadata says (a model without it is
refused, never served with guessed numbers). The task fails unless that accuracy equals the
training's reported one within 0.2 points. Needs onnxruntime and numpy on the worker — no torch.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from airflow.sdk import Asset, dag, get_current_context, task

from horovod_airflow.operators.settings import (
    AWS_CONN_ID,
    BUCKET_URI,
    LATEST_MODEL_ASSET_NAME,
    LATEST_MODEL_URI,
    MODEL_NAME,
    RUN_TIMEOUT,
    TASK_TIMEOUT,
)

LATEST_MODEL = Asset(name=LATEST_MODEL_ASSET_NAME, uri=LATEST_MODEL_URI)


@dag(
    dag_id="mnist_serve_latest_model",
    doc_md=__doc__,
    schedule=[LATEST_MODEL],
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=RUN_TIMEOUT,
    default_args={"execution_timeout": TASK_TIMEOUT},
    tags=["serving", "onnx", "mnist"],
)
def mnist_serve_latest_model() -> None:
    @task
    def smoke_test_latest() -> dict[str, Any]:
        """The triggering event's model serves the accuracy its training reported, or fail."""
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        from horovod_airflow.operators.serving import (
            published_from_events,
            smoke_test_published_model,
        )

        events = get_current_context()["triggering_asset_events"]
        client = S3Hook(aws_conn_id=AWS_CONN_ID).get_conn()
        return smoke_test_published_model(
            BUCKET_URI,
            MODEL_NAME,
            client=client,
            published=published_from_events(events, LATEST_MODEL),
        )

    smoke_test_latest()


serve_dag = mnist_serve_latest_model()
