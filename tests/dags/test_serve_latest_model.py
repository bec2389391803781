"""The serving DAG in real Airflow runs: it serves the version of the Asset event that
triggered it, and falls back to ``latest.json`` only for a manual run.

The producer is a real task with the ``mnist_cnn_latest`` outlet that publishes through the
registry and sets the event's ``extra`` as the retraining DAG's ``publish`` does; Airflow's
task runner records that event. ``dag.test()`` always creates a manual run, so the asset-
triggered run is made the way the scheduler makes one: the run's ``consumed_asset_events``
get the queued events (``SchedulerJobRunner`` does ``dag_run.consumed_asset_events.extend``).
"""

from __future__ import annotations

import importlib
import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from horovod_airflow.apps.mnist import MNIST
from horovod_airflow.core import contract, layout
from horovod_airflow.operators.staging import stage_dataset
from horovod_airflow.trainer.model import preprocessing
from tests.operators.helpers import centroid_classifier, linear_onnx_model, publish_fake_model

REPO = Path(__file__).resolve().parents[2]

PRODUCER = """
from datetime import datetime

from airflow.sdk import DAG, task

from horovod_airflow.operators.model_registry import asset_event_extra
from horovod_airflow.apps.mnist import MNIST
from tests.operators.helpers import publish_fake_model

LATEST_MODEL = MNIST.latest_asset

with DAG("fake_publisher", schedule=None, start_date=datetime(2026, 1, 1)) as dag:

    @task(outlets=[LATEST_MODEL])
    def publish(outlet_events=None):
        import boto3
        import json
        import os
        from pathlib import Path

        s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        measured = json.loads(os.environ["HVA_TEST_MEASURED"])  # what the model scores, where
        latest = publish_fake_model(
            s3, os.environ["HVA_BUCKET"], version="v-event",
            onnx_bytes=Path(os.environ["HVA_TEST_ONNX"]).read_bytes(), dag_run_id="producer",
            **measured,
        )
        outlet_events[LATEST_MODEL].extra = asset_event_extra(latest)
        return latest["version"]

    publish()
"""


def _bundles(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    bundles = [
        {"name": "dags-folder", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
         "kwargs": {}},
        {"name": "serve-test", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
         "kwargs": {"path": str(folder), "refresh_interval": 0}},
    ]  # fmt: skip
    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps(bundles))


def _load(module: str, path: Path | None = None) -> Any:
    import horovod_airflow.operators.settings

    importlib.reload(horovod_airflow.operators.settings)
    if path is None:
        return importlib.reload(importlib.import_module(module))
    spec = importlib.util.spec_from_file_location(module, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _xcom(dag_run: Any, task_id: str) -> Any:
    (ti,) = [t for t in dag_run.get_task_instances() if t.task_id == task_id]
    assert str(ti.state) == "success", ti.state
    return ti.xcom_pull(task_ids=task_id)


def test_serving_uses_the_triggering_event_then_latest_for_a_manual_run(
    s3_server, airflow_db, tmp_path, monkeypatch, mnist_subset
):
    from airflow.models import dagrun as dagrun_module
    from airflow.models.asset import AssetActive, AssetEvent, AssetModel
    from airflow.sdk import DagRunState
    from airflow.utils.session import create_session
    from sqlalchemy import delete, select

    s3 = s3_server.client()
    bucket = s3_server.new_bucket("serve")
    monkeypatch.setenv("HVA_BUCKET", bucket)
    # Other tests' runs registered the Asset name with their own bucket's URI; Airflow keeps
    # the first (name, uri) active and refuses outlets that conflict with it. One deployment
    # has one bucket: let this test's URI be the active one.
    with create_session() as session:
        session.execute(delete(AssetActive).where(AssetActive.name == "mnist_cnn_latest"))
    files = layout.find_source_files(mnist_subset)
    weights, bias = centroid_classifier(
        layout.read_idx(files[("train", "images")]), layout.read_idx(files[("train", "labels")])
    )
    onnx_path = tmp_path / "model.onnx"
    onnx_path.write_bytes(linear_onnx_model(weights, bias))
    monkeypatch.setenv("HVA_TEST_ONNX", str(onnx_path))
    # The dataset the model is measured on, staged to the bucket, and its true accuracy there
    # (the serving check predicts the same test images and must find the same accuracy).
    staged = stage_dataset(str(mnist_subset), f"s3://{bucket}", client=s3)
    images, labels = (
        layout.read_idx(files[("test", "images")]),
        layout.read_idx(files[("test", "labels")]),
    )
    x = contract.apply_preprocessing(preprocessing(), images).reshape(len(images), -1)
    accuracy = float(((x @ weights + bias).argmax(axis=1) == labels).mean())
    measured = {"accuracy": accuracy, "dataset_hash": staged["content_hash"],
                "dataset_uri": staged["uri"], "val_samples": len(labels)}  # fmt: skip
    monkeypatch.setenv("HVA_TEST_MEASURED", json.dumps(measured))
    folder = tmp_path / "bundle"
    folder.mkdir()
    (folder / "fake_publisher.py").write_text(textwrap.dedent(PRODUCER))
    _bundles(monkeypatch, folder)

    # 1. A real task publishes v-event and emits the Asset event with its extra.
    producer = _load("fake_publisher", folder / "fake_publisher.py").dag
    prun = producer.test()
    assert prun.state == DagRunState.SUCCESS
    assert _xcom(prun, "publish") == "v-event"
    _load("horovod_airflow.operators.settings")
    with create_session() as session:
        events = session.scalars(
            select(AssetEvent)
            .join(AssetModel, AssetModel.id == AssetEvent.asset_id)
            .where(AssetModel.uri == MNIST.latest_uri)
        ).all()
        assert [e.extra["version"] for e in events] == ["v-event"]
        extra = events[0].extra
        event_ids = [e.id for e in events]
    assert set(extra) >= {"version", "onnx_uri", "onnx_sha256", "val_accuracy",
                          "dataset_content_hash"}  # fmt: skip
    assert extra["dataset_content_hash"] == staged["content_hash"]
    assert extra["val_accuracy"] == accuracy

    # 2. Another publish moves latest.json on before serving runs.
    publish_fake_model(s3, bucket, version="v-later", onnx_bytes=onnx_path.read_bytes(),
                       dag_run_id="later", **measured)  # fmt: skip

    # 3. The asset-triggered serving run serves the event's version.
    serve = _load("dags.serve_latest_model").serve_dag
    real_create = dagrun_module.get_or_create_dagrun

    def create_with_consumed_events(**kwargs: Any) -> Any:
        dr = real_create(**kwargs)
        session = kwargs["session"]
        dr.consumed_asset_events.extend(
            session.scalars(select(AssetEvent).where(AssetEvent.id.in_(event_ids)))
        )
        session.commit()
        return dr

    monkeypatch.setattr(dagrun_module, "get_or_create_dagrun", create_with_consumed_events)
    srun = serve.test()
    assert srun.state == DagRunState.SUCCESS
    served = _xcom(srun, "smoke_test_latest")
    assert served["version"] == "v-event" and served["source"] == "asset event"
    assert served["onnx_sha256"] == extra["onnx_sha256"]
    assert served["served_accuracy"] == accuracy and served["samples"] == len(labels)

    # 4. A manual run has no event: it serves what latest.json names now.
    monkeypatch.setattr(dagrun_module, "get_or_create_dagrun", real_create)
    mrun = serve.test()
    assert mrun.state == DagRunState.SUCCESS
    manual = _xcom(mrun, "smoke_test_latest")
    assert manual["version"] == "v-later" and manual["source"] == "latest.json"
    assert os.environ["HVA_BUCKET"] == bucket
