"""PublishModelOperator: its settings, and publishing through the real S3 server."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from horovod_airflow.operators import (
    ChampionChangedError,
    HorovodConfigError,
    ModelGateOperator,
    PublishModelOperator,
    PublishRefusedError,
    RecordRefusedOperator,
)
from horovod_airflow.operators.model_registry import run_version
from tests.operators.helpers import put_run_artifacts, undocumented_template_fields

DATASET = {"uri": "s3://data/datasets/mnist/abc", "content_hash": "abc"}
DUE = datetime(2026, 12, 2, 10, 15, tzinfo=UTC)


def publish_op(**kwargs) -> PublishModelOperator:
    base = {
        "task_id": "publish",
        "bucket_uri": "s3://bucket",
        "model_name": "mnist_cnn",
        "metrics": {"val_accuracy": 0.99, "output": "s3://bucket/runs/r"},
        "exported": {"onnx_uri": "s3://bucket/runs/r/onnx/model.onnx",
                     "parity_uri": "s3://bucket/runs/r/onnx/parity.json"},
        "dataset": DATASET,
        "decision": {"passed": True, "champion_etag": None},
    }  # fmt: skip
    return PublishModelOperator(**{**base, **kwargs})


def test_template_fields_are_the_settings_a_run_varies_and_are_documented():
    assert set(PublishModelOperator.template_fields) == {
        "bucket_uri", "model_name", "metrics", "exported", "dataset", "decision", "version",
    }  # fmt: skip
    assert undocumented_template_fields(PublishModelOperator) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_uri": None}, "bucket_uri must be a URI"),
        ({"model_name": "../mnist"}, "model_name must be a name"),
        ({"metrics": {"val_accuracy": 0.99}}, r"metrics lacks \['output'\]"),
        ({"exported": {"onnx_uri": "s3://b/m.onnx"}}, r"exported lacks \['parity_uri'\]"),
        ({"decision": True}, "decision must be a dict"),
        ({"decision": {"reason": "?"}}, r"decision lacks \['passed'\]"),
        ({"dataset": ["s3://b/d"]}, "dataset must be a dict"),
        ({"version": "v1/../../x"}, "version must be a name"),
    ],
)
def test_bad_settings_are_named_at_parse_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        publish_op(**kwargs)


def test_init_builds_no_hook():
    op = publish_op(aws_conn_id="no_such_connection", version="{{ params.version }}")
    assert "s3_hook" not in op.__dict__


def _context(run_id: str = "manual__2026-12-02T10:15:00+00:00") -> dict:
    """What the task runner hands execute: the run, its id and the outlet event accessors."""
    from airflow.models.dagrun import DagRun
    from airflow.sdk.execution_time.context import OutletEventAccessors

    dag_run = DagRun(dag_id="retrain", run_id=run_id, run_after=DUE, run_type="manual")
    return {"dag_run": dag_run, "run_id": run_id, "outlet_events": OutletEventAccessors()}


def _objects(client, bucket: str, prefix: str) -> dict[str, str]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = f"{o['ETag']}@{o['LastModified'].isoformat()}"
    return out


def _gate_and_publish(s3_server, bucket: str, accuracy: float, run_name: str, elastic=None):
    """A gated run ready to publish: its artifacts on S3, the real gate's decision."""
    from airflow.sdk import Asset

    trained, exported = put_run_artifacts(
        s3_server.client(), f"s3://{bucket}/runs/{run_name}", accuracy=accuracy,
        onnx_bytes=f"onnx-{run_name}".encode(), elastic=elastic,
    )  # fmt: skip
    gate = ModelGateOperator(
        task_id="gate", bucket_uri=f"s3://{bucket}", model_name="mnist_cnn", metrics=trained,
        dataset=DATASET, min_accuracy=0.5, max_regression=0.5, aws_conn_id=None,
    )  # fmt: skip
    decision = gate.execute({})
    asset = Asset(name=f"{bucket}_latest", uri=f"s3://{bucket}/models/mnist_cnn/latest.json")
    publish = PublishModelOperator(
        task_id="publish", bucket_uri=f"s3://{bucket}", model_name="mnist_cnn", metrics=trained,
        exported=exported, dataset=DATASET, decision=decision, aws_conn_id=None,
        outlets=[asset],
    )  # fmt: skip
    return publish, asset


def test_publish_names_the_version_by_the_run_and_emits_the_asset_extra(s3_server):
    client = s3_server.client()
    bucket = s3_server.new_bucket("publish")
    publish, asset = _gate_and_publish(s3_server, bucket, 0.991, "a")
    context = _context()

    latest = publish.execute(context)
    version = run_version("retrain", context["run_id"], DUE)
    assert latest["version"] == version
    assert latest["uri"] == f"s3://{bucket}/models/mnist_cnn/{version}"
    stored = client.get_object(Bucket=bucket, Key="models/mnist_cnn/latest.json")["Body"].read()
    assert json.loads(stored) == latest
    extra = context["outlet_events"][asset].extra
    assert extra["version"] == version and extra["onnx_sha256"] == latest["onnx_sha256"]
    assert extra["val_accuracy"] == 0.991 and extra["dataset_content_hash"] == "abc"


def test_an_elastic_runs_world_history_is_in_the_manifest_and_the_summary(s3_server):
    client = s3_server.client()
    bucket = s3_server.new_bucket("publish")
    history = [
        {"time": 1.0, "epoch": 1, "samples_into_epoch": 0, "from": 0, "to": 3, "left": [],
         "joined": ["e1", "e2", "e3"], "redone_steps_so_far": 0},
        {"time": 2.0, "epoch": 1, "samples_into_epoch": 960, "from": 3, "to": 2,
         "left": ["e3"], "joined": [], "redone_steps_so_far": 3},
    ]  # fmt: skip
    elastic = {"commit_every": 20, "world_sizes": [3, 2], "world_history": history,
               "redone_steps": 3, "redone_samples": 384, "commits": 12}  # fmt: skip
    publish, _ = _gate_and_publish(s3_server, bucket, 0.991, "a", elastic=elastic)
    latest = publish.execute(_context())
    key = latest["manifest_uri"].removeprefix(f"s3://{bucket}/")
    manifest = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert manifest["format"] == "horovod-airflow/version-v3"
    assert manifest["elastic"]["world_sizes"] == [3, 2]
    assert manifest["elastic"]["world_history"][1]["left"] == ["e3"]
    assert "commits" not in manifest["elastic"]  # one rank's timing, not the run's record
    summary = client.get_object(Bucket=bucket, Key=key.replace("manifest.json", "summary.md"))
    text = summary["Body"].read().decode()
    assert "## Elastic world" in text and "world sizes: 3 → 2" in text
    assert "| 1 | 960 | 3 → 2 | e3 | — |" in text


def test_a_non_elastic_run_has_no_elastic_record(s3_server):
    client = s3_server.client()
    bucket = s3_server.new_bucket("publish")
    publish, _ = _gate_and_publish(s3_server, bucket, 0.991, "a")
    latest = publish.execute(_context())
    key = latest["manifest_uri"].removeprefix(f"s3://{bucket}/")
    manifest = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert "elastic" not in manifest
    summary = client.get_object(Bucket=bucket, Key=key.replace("manifest.json", "summary.md"))
    assert "Elastic" not in summary["Body"].read().decode()


def test_a_retried_publish_rewrites_nothing_and_returns_the_same_document(s3_server):
    client = s3_server.client()
    bucket = s3_server.new_bucket("publish")
    publish, asset = _gate_and_publish(s3_server, bucket, 0.991, "a")
    first = publish.execute(_context())
    objects = _objects(client, bucket, "models/")

    retry = _context()  # the same run, a later try: same run id, same decision XCom
    again = publish.execute(retry)
    assert again == first
    assert _objects(client, bucket, "models/") == objects  # latest.json included
    assert retry["outlet_events"][asset].extra["version"] == first["version"]


def test_a_publish_after_another_run_won_fails_and_overwrites_nothing(s3_server):
    """Two runs gated against the same champion: the second's conditional put fails."""
    client = s3_server.client()
    bucket = s3_server.new_bucket("publish")
    first, _ = _gate_and_publish(s3_server, bucket, 0.991, "a")
    second, _ = _gate_and_publish(s3_server, bucket, 0.995, "b")
    won = first.execute(_context("run_a"))
    with pytest.raises(ChampionChangedError, match="changed after the gate read it"):
        second.execute(_context("run_b"))
    stored = client.get_object(Bucket=bucket, Key="models/mnist_cnn/latest.json")["Body"].read()
    assert json.loads(stored) == won


def test_a_failed_decision_is_refused(s3_server):
    bucket = s3_server.new_bucket("publish")
    publish, _ = _gate_and_publish(s3_server, bucket, 0.991, "a")
    publish.decision = {**publish.decision, "passed": False, "reason": "below the floor"}
    with pytest.raises(PublishRefusedError, match="the gate did not pass"):
        publish.execute(_context())
    assert _objects(s3_server.client(), bucket, "models/") == {}


def test_a_decision_that_renders_as_text_fails_naming_it():
    op = publish_op(decision="{{ ti.xcom_pull(task_ids='gate') }}", aws_conn_id=None)
    op.decision = "{'passed': True}"  # rendered without render_template_as_native_obj
    with pytest.raises(HorovodConfigError, match="publish: decision must be a dict"):
        op.execute(_context())


def _record_refused_op(trained: dict, exported: dict, bucket: str) -> RecordRefusedOperator:
    return RecordRefusedOperator(
        task_id="record_refused", bucket_uri=f"s3://{bucket}", model_name="mnist_cnn",
        metrics=trained, exported=exported, dataset=DATASET, aws_conn_id=None,
    )  # fmt: skip


def test_record_refused_template_fields_are_documented():
    assert set(RecordRefusedOperator.template_fields) == {
        "bucket_uri", "model_name", "metrics", "exported", "dataset",
    }  # fmt: skip
    assert undocumented_template_fields(RecordRefusedOperator) == []


def test_record_refused_keeps_a_refused_runs_model_and_skips_after_a_pass(s3_server):
    """The refused branch: a refusal (the run's gate.json) keeps the model as the candidate
    named by the run, latest.json untouched; after a pass the task skips itself."""
    from airflow.sdk.exceptions import AirflowSkipException

    client = s3_server.client()
    bucket = s3_server.new_bucket("refused")
    publish, _ = _gate_and_publish(s3_server, bucket, 0.991, "champion")
    publish.execute(_context("manual__champion"))
    before = _objects(client, bucket, "models/mnist_cnn/")
    trained, exported = put_run_artifacts(client, f"s3://{bucket}/runs/worse", accuracy=0.6)
    gate = ModelGateOperator(
        task_id="gate", bucket_uri=f"s3://{bucket}", model_name="mnist_cnn", metrics=trained,
        dataset=DATASET, min_accuracy=0.9, aws_conn_id=None,
    )  # fmt: skip
    assert gate.execute({"task": gate}) is None  # refused: writes gate.json, no decision
    context = _context()

    kept = _record_refused_op(trained, exported, bucket).execute(context)

    version = run_version("retrain", context["run_id"], DUE)
    prefix = f"s3://{bucket}/models/mnist_cnn/refused/{version}"
    assert kept["recorded"] is True and kept["version"] == version and kept["uri"] == prefix
    assert kept["val_accuracy"] == 0.6 and "below the floor" in kept["gate_reason"]
    after = _objects(client, bucket, "models/mnist_cnn/")
    assert {k: v for k, v in after.items() if k in before} == before  # latest.json too
    assert all(k.startswith(f"models/mnist_cnn/refused/{version}/") for k in after.keys() - before)

    passed, passed_export = put_run_artifacts(client, f"s3://{bucket}/runs/fine", accuracy=0.995)
    ModelGateOperator(
        task_id="gate", bucket_uri=f"s3://{bucket}", model_name="mnist_cnn", metrics=passed,
        dataset=DATASET, min_accuracy=0.9, max_regression=0.5, aws_conn_id=None,
    ).execute({})  # fmt: skip
    with pytest.raises(AirflowSkipException, match="the gate passed"):
        _record_refused_op(passed, passed_export, bucket).execute(_context("manual__fine"))
