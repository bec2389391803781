"""The maintenance DAG in real Airflow runs (``dag.test()``) on a real bucket: a dry run by
default lists what would go and deletes nothing; with ``dry_run`` false it deletes exactly
that; Airflow's word that a DAG is running keeps that DAG's runs; and its settings are
validated naming the bad value.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from typing import Any

import pytest

from horovod_airflow.core import storage
from horovod_airflow.core.contract import GATE, METRICS
from horovod_airflow.operators.model_registry import safe_key
from tests.operators.helpers import publish_fake_model

DAG_ID = "horovod_bucket_retention"


def _load_dag() -> Any:
    import horovod_airflow.operators.settings

    importlib.reload(horovod_airflow.operators.settings)
    return importlib.reload(importlib.import_module("dags.bucket_retention")).retention_dag


def refused_run(s3: Any, bucket: str, dag_id: str, run_id: str) -> list[str]:
    """A run whose gate refused: its keys."""
    prefix = f"runs/{dag_id}/{safe_key(run_id)}"
    storage.write_bytes(f"s3://{bucket}/{prefix}/checkpoint.pt", b"c" * 100, client=s3)
    storage.write_text(f"s3://{bucket}/{prefix}/metrics.json",
                       METRICS.dumps({"val_accuracy": 0.5, "dataset": {
                           "uri": f"s3://{bucket}/datasets/mnist/abc", "content_hash": "abc"}}),
                       client=s3)  # fmt: skip
    decision = {"passed": False, "reason": "below the floor", "challenger_accuracy": 0.5,
                "min_accuracy": 0.9, "max_regression": 0.01}  # fmt: skip
    storage.write_text(f"s3://{bucket}/{prefix}/gate.json", GATE.dumps(decision), client=s3)
    return [f"{prefix}/{name}" for name in ("checkpoint.pt", "metrics.json", "gate.json")]


def _keys(s3: Any, bucket: str) -> set[str]:
    return {o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}


def _result(dag_run: Any) -> dict[str, Any]:
    from airflow.sdk import DagRunState

    assert dag_run.state == DagRunState.SUCCESS, dag_run.state
    (ti,) = [t for t in dag_run.get_task_instances() if t.task_id == "apply_retention"]
    assert str(ti.state) == "success", ti.state
    return ti.xcom_pull(task_ids="apply_retention")


def test_the_dag_lists_then_deletes_and_keeps_a_running_dags_runs(
    s3_server, airflow_db, monkeypatch
):
    s3 = s3_server.client()
    bucket = s3_server.new_bucket("retain-dag")
    monkeypatch.setenv("HVA_BUCKET", bucket)
    old = refused_run(s3, bucket, "nightly", "scheduled__1") + refused_run(
        s3, bucket, "nightly", "scheduled__2"
    )
    newest = refused_run(s3, bucket, "nightly", "scheduled__3")
    # Runs under this DAG's own id: while its task asks, Airflow reports its run running.
    own = refused_run(s3, bucket, DAG_ID, "scheduled__a") + refused_run(
        s3, bucket, DAG_ID, "scheduled__b"
    )
    publish_fake_model(s3, bucket, version="v20261101T000000Z-00000000000a", onnx_bytes=b"m",
                       accuracy=0.99, dataset_hash="abc", dag_run_id="scheduled__v1")  # fmt: skip
    before = _keys(s3, bucket)
    assert set(old) | set(newest) | set(own) <= before
    retention_dag = _load_dag()

    dry = _result(retention_dag.test(run_conf={"keep_runs": 1}))
    assert dry["dry_run"] is True and dry["deleted"] == []
    assert _keys(s3, bucket) == before
    would = {p["prefix"]: p for p in dry["delete"]}
    assert set(would) == {f"s3://{bucket}/runs/nightly/{safe_key(f'scheduled__{i}')}"
                          for i in (1, 2)}  # fmt: skip
    assert all(p["objects"] == 3 and p["bytes"] > 100 for p in would.values())
    kept = {p["prefix"]: p["reason"] for p in dry["keep"]}
    for run_id in ("scheduled__a", "scheduled__b"):
        assert (
            "Airflow reports an active run of horovod_bucket_retention"
            in (kept[f"s3://{bucket}/runs/{DAG_ID}/{safe_key(run_id)}"])
        )

    real = _result(retention_dag.test(run_conf={"keep_runs": 1, "dry_run": False}))
    assert real["dry_run"] is False
    assert {p["prefix"] for p in real["deleted"]} == set(would)
    assert before - _keys(s3, bucket) == set(old)
    assert {k for k in _keys(s3, bucket) if k.startswith("models/")} == {
        k for k in before if k.startswith("models/")
    }


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HVA_RETENTION_KEEP_RUNS": "0"},
         "HVA_RETENTION_KEEP_RUNS='0': expected a whole number from 1 to 100000; default 10"),
        ({"HVA_RETENTION_KEEP_RUNS": "ten"},
         "HVA_RETENTION_KEEP_RUNS='ten': expected a whole number from 1 to 100000"),
        ({"HVA_RETENTION_DRY_RUN": "maybe"},
         "HVA_RETENTION_DRY_RUN='maybe': expected one of true, 1, yes, on, false, 0, no, off"),
        ({"HVA_RETENTION_IN_FLIGHT_MINUTES": "60"},
         "HVA_RETENTION_IN_FLIGHT_MINUTES=60: expected at least HVA_RUN_TIMEOUT_MINUTES (720)"),
    ],
)  # fmt: skip
def test_a_bad_retention_setting_is_named(env: dict[str, str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import horovod_airflow.operators.settings"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )  # fmt: skip
    assert done.returncode != 0
    assert message in done.stderr
