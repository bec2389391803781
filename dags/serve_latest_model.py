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
training's reported one within 0.2 points (`horovod_airflow.apps.mnist.smoke_test_published_model`,
the app's `serving_check`). Needs onnxruntime and numpy on the worker — no torch.
"""

from __future__ import annotations

from datetime import UTC, datetime

from airflow.sdk import dag

from horovod_airflow.apps.mnist import MNIST
from horovod_airflow.operators.pipeline import serving_dag_args, serving_pipeline


@dag(
    dag_id="mnist_serve_latest_model",
    doc_md=__doc__,
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    tags=["serving", "onnx", "mnist"],
    **serving_dag_args(MNIST),
)
def mnist_serve_latest_model() -> None:
    serving_pipeline(MNIST)


serve_dag = mnist_serve_latest_model()
