"""Promote / roll back ``latest.json`` by hand, and what the registry page reads, against the
real S3 server (SeaweedFS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from horovod_airflow.core import contract, storage
from horovod_airflow.core.contract import GATE, LATEST, PROMOTION
from horovod_airflow.operators.exceptions import ChampionChangedError, PublishRefusedError
from horovod_airflow.operators.model_registry import RunModel, read_latest
from horovod_airflow.operators.model_registry.promote import (
    PromotionRefusedError,
    list_models,
    list_refused_candidates,
    list_versions,
    promote_version,
    read_history,
    refused_runs,
)
from horovod_airflow.operators.model_registry.refused import record_refused
from tests.conftest import REPO
from tests.operators.test_model_registry import _fake_run, _gate, _publish

V1 = "v20261201T000000Z-111111111111"
V2 = "v20261202T000000Z-222222222222"


def _two_versions(s3_server) -> tuple[str, object]:
    """A bucket with V1 (97 %) then V2 (99 %) published through the real registry."""
    bucket = s3_server.new_bucket("promote")
    for version, accuracy, run_id in ((V1, 0.97, "manual__1"), (V2, 0.99, "manual__2")):
        run, onnx, parity = _fake_run(s3_server, bucket, accuracy)
        _publish(s3_server, bucket, run, onnx, parity, version, dag_run_id=run_id)
    return f"s3://{bucket}", s3_server.client()


def _promote(bucket_uri, client, version=V1, **kw):
    args = dict(bucket_uri=bucket_uri, model_name="mnist_cnn", version=version, actor="ana",
                reason="v2 misclassifies sevens", min_accuracy_floor=0.0,
                client=client)  # fmt: skip
    return promote_version(**{**args, **kw})


def test_a_rollback_moves_latest_by_cas_and_records_who_and_why(s3_server):
    bucket_uri, client = _two_versions(s3_server)
    assert [v["version"] for v in list_versions(bucket_uri, "mnist_cnn", client=client)] == [V2, V1]
    before, etag_before = read_latest(bucket_uri, "mnist_cnn", client=client)
    assert before["version"] == V2 and before["since"] == before["published_at"]

    latest, record = _promote(bucket_uri, client)

    now, etag = read_latest(bucket_uri, "mnist_cnn", client=client)
    assert now == latest and etag != etag_before
    assert now["format"] == LATEST.format and now["version"] == V1
    assert now["val_accuracy"] == 0.97 and now["uri"].endswith(f"/models/mnist_cnn/{V1}")
    manifest = list_versions(bucket_uri, "mnist_cnn", client=client)[1]
    assert now["onnx_sha256"] == manifest["files"]["model.onnx"]["sha256"]
    assert record["action"] == "rollback" and record["previous_version"] == V2
    assert record["actor"] == "ana" and record["override"] is False
    assert now["promotion"]["reason"] == "v2 misclassifies sevens"
    assert now["since"] == record["at"]
    history = read_history(bucket_uri, "mnist_cnn", client=client)
    assert history == [record] and history[0]["format"] == PROMOTION.format

    # Promoting forward again is the same kind of move, recorded too; a repeat changes nothing.
    latest2, record2 = _promote(bucket_uri, client, version=V2, reason="fixed the data")
    assert record2["action"] == "promote" and latest2["version"] == V2
    again, none = _promote(bucket_uri, client, version=V2, reason="again")
    assert none is None and again == latest2
    assert len(read_history(bucket_uri, "mnist_cnn", client=client)) == 2


def test_a_publish_gated_before_a_rollback_cannot_undo_it(s3_server):
    bucket_uri, client = _two_versions(s3_server)
    bucket = storage.parse(bucket_uri).bucket
    run, onnx, parity = _fake_run(s3_server, bucket, 0.995)
    gate = _gate(s3_server, bucket, 0.995)  # read latest.json (V2) before the roll back
    _promote(bucket_uri, client)
    with pytest.raises(ChampionChangedError, match="changed after the gate read it"):
        _publish(s3_server, bucket, run, onnx, parity, "v20261203T000000Z-3", gate=gate,
                 dag_run_id="manual__3")  # fmt: skip
    assert read_latest(bucket_uri, "mnist_cnn", client=client)[0]["version"] == V1


def test_below_the_floor_needs_an_admin_override_recorded_with_its_reason(s3_server):
    bucket_uri, client = _two_versions(s3_server)
    for kw, says in [
        ({}, "below the deployment floor 98.0000%.*needs an admin override"),
        ({"admin": True}, "needs an override reason"),
        ({"override_reason": "no admin"}, "needs an admin override"),
    ]:
        with pytest.raises(PromotionRefusedError, match=says):
            _promote(bucket_uri, client, min_accuracy_floor=0.98, **kw)
        assert read_latest(bucket_uri, "mnist_cnn", client=client)[0]["version"] == V2
    assert read_history(bucket_uri, "mnist_cnn", client=client) == []

    latest, record = _promote(bucket_uri, client, min_accuracy_floor=0.98, admin=True,
                              override_reason="incident 42: v2 is worse in production")  # fmt: skip
    assert latest["version"] == V1 and record["override"] is True
    assert record["override_reason"] == "incident 42: v2 is worse in production"
    assert "below the deployment floor" in record["checks"][0]


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        (
            {"version": "v9"},
            f"v9: it is neither a published version nor a refused candidate"
            f".*published: {V2}, {V1}; refused candidates: none",
        ),
        ({"version": "../v1"}, "not a safe version name"),
        ({"actor": " "}, "say who"),
        ({"reason": ""}, "say who .* and why"),
    ],
)
def test_a_bad_request_is_refused_naming_what_is_wrong(s3_server, kw, says):
    bucket_uri, client = _two_versions(s3_server)
    before = storage.read_text(f"{bucket_uri}/models/mnist_cnn/latest.json", client=client)
    with pytest.raises(PromotionRefusedError, match=says):
        _promote(bucket_uri, client, **kw)
    assert storage.read_text(f"{bucket_uri}/models/mnist_cnn/latest.json", client=client) == before


def test_a_latest_v2_document_is_still_read(s3_server):
    bucket_uri, client = _two_versions(s3_server)
    doc, _ = read_latest(bucket_uri, "mnist_cnn", client=client)
    old = {k: v for k, v in doc.items() if k not in ("since", "promotion")}
    old["format"] = contract.LEGACY_LATEST_FORMAT
    storage.write_text(f"{bucket_uri}/models/mnist_cnn/latest.json", json.dumps(old),
                       client=client)  # fmt: skip
    assert read_latest(bucket_uri, "mnist_cnn", client=client)[0]["version"] == V2
    latest, record = _promote(bucket_uri, client)  # and a move replaces it with a v3 one
    assert latest["format"] == LATEST.format and record["previous_version"] == V2


def test_the_page_reads_models_and_refused_runs(s3_server):
    bucket_uri, client = _two_versions(s3_server)
    refused = {"passed": False, "reason": "below the floor 98.0000%", "challenger_accuracy": 0.9,
               "min_accuracy": 0.98, "max_regression": 0.01}  # fmt: skip
    storage.write_text(f"{bucket_uri}/runs/dag/run-x/gate.json", GATE.dumps(refused),
                       client=client)  # fmt: skip
    assert list_models(bucket_uri, client=client) == ["mnist_cnn"]
    runs = refused_runs(bucket_uri, client=client)
    assert [r.run_uri for r in runs] == [f"{bucket_uri}/runs/dag/run-x"]
    assert runs[0].gate["reason"] == "below the floor 98.0000%"


def test_the_cli_refuses_without_a_serving_asset_and_changes_nothing(s3_server, airflow_db):
    """The CLI checks that the Asset serving follows exists before it moves anything."""
    bucket_uri, client = _two_versions(s3_server)
    before = read_latest(bucket_uri, "mnist_cnn", client=client)
    env = {**os.environ, **s3_server.env, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "horovod_airflow.operators.model_registry",
         "--bucket-uri", bucket_uri, "promote", "mnist_cnn", V1, "--reason", "test"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "no Asset 'mnist_cnn_latest'" in done.stderr
    assert read_latest(bucket_uri, "mnist_cnn", client=client) == before
    listed = subprocess.run(
        [sys.executable, "-m", "horovod_airflow.operators.model_registry",
         "--bucket-uri", bucket_uri, "list", "mnist_cnn"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    out = json.loads(listed.stdout)
    assert out["latest"]["version"] == V2 and [v["version"] for v in out["versions"]] == [V2, V1]
    assert out["refused_candidates"] == []


CONSUMER = """
from datetime import UTC, datetime
from airflow.sdk import Asset, dag, task

@dag(dag_id="registry_cli_consumer", schedule=[Asset(name="mnist_cnn_latest", uri={uri!r})],
     start_date=datetime(2026, 1, 1, tzinfo=UTC), catchup=False)
def consumer():
    @task
    def noop():
        return None
    noop()

dag = consumer()
"""


def test_the_cli_rolls_back_and_records_the_event_serving_follows(
    s3_server, airflow_db, tmp_path, monkeypatch
):
    """With a parsed DAG scheduled on the model's Asset, the CLI moves latest.json by CAS and
    records the Asset event (its extra names the rolled-back version) in Airflow's database."""
    import importlib.util

    from airflow.models.asset import AssetActive, AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import delete, select

    from horovod_airflow.operators.model_registry import latest_uri

    bucket_uri, client = _two_versions(s3_server)
    uri = latest_uri(bucket_uri, "mnist_cnn")
    with create_session() as session:  # other tests' buckets registered the name first
        session.execute(delete(AssetActive).where(AssetActive.name == "mnist_cnn_latest"))
    folder = tmp_path / "bundle"
    folder.mkdir()
    (folder / "registry_cli_consumer.py").write_text(CONSUMER.format(uri=uri))
    bundles = [
        {"name": "dags-folder", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
         "kwargs": {}},
        {"name": "registry-cli", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
         "kwargs": {"path": str(folder), "refresh_interval": 0}},
    ]  # fmt: skip
    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps(bundles))
    spec = importlib.util.spec_from_file_location("registry_cli_consumer",
                                                  folder / "registry_cli_consumer.py")  # fmt: skip
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert str(module.dag.test().state) == "success"  # parses and syncs the DAG and its Asset

    env = {**os.environ, **s3_server.env, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "horovod_airflow.operators.model_registry",
         "--bucket-uri", bucket_uri, "promote", "mnist_cnn", V1, "--reason", "v2 regressed",
         "--actor", "oncall"],
        capture_output=True, text=True, env=env, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout)
    assert answer["promotion"]["actor"] == "oncall" and answer["latest"]["version"] == V1
    assert read_latest(bucket_uri, "mnist_cnn", client=client)[0] == answer["latest"]
    with create_session() as session:
        extras = session.scalars(
            select(AssetEvent.extra)
            .join(AssetModel, AssetModel.id == AssetEvent.asset_id)
            .where(AssetModel.uri == uri)
        ).all()
    assert [e["version"] for e in extras] == [V1]
    assert extras[0]["onnx_sha256"] == answer["latest"]["onnx_sha256"]


V3 = "v20261203T000000Z-333333333333"
REFUSAL = {
    "passed": False,
    "reason": "accuracy 99.5000% is below the floor 99.9900%",
    "challenger_accuracy": 0.995,
    "min_accuracy": 0.9999,
    "max_regression": 0.01,
}


def _refused_candidate(s3_server, bucket_uri, client):
    """V3: a run the gate refused, its export kept as a refused candidate."""
    bucket = bucket_uri.removeprefix("s3://")
    run, onnx, parity = _fake_run(s3_server, bucket, 0.995)
    storage.write_text(f"{run}/gate.json", GATE.dumps(REFUSAL), client=client)
    dataset = {"uri": "s3://x/datasets/mnist/abc", "content_hash": "abc"}
    refused = RunModel(model_name="mnist_cnn", version=V3, run_output=run, onnx_uri=onnx,
                       parity_uri=parity, dag_run_id="scheduled__3", gate=REFUSAL,
                       dataset=dataset)  # fmt: skip
    return record_refused(bucket_uri, refused, client=client), refused


def test_a_refused_run_is_kept_as_a_candidate_that_serving_never_sees(s3_server):
    bucket_uri, client = _two_versions(s3_server)
    before = storage.read_text(f"{bucket_uri}/models/mnist_cnn/latest.json", client=client)
    candidate, refused = _refused_candidate(s3_server, bucket_uri, client)

    assert candidate["gate"] == REFUSAL and candidate["version"] == V3
    prefix = f"{bucket_uri}/models/mnist_cnn/refused/{V3}"
    for name, entry in candidate["files"].items():
        assert entry["uri"] == f"{prefix}/{name}"
        data = storage.read_bytes(entry["uri"], client=client)
        assert storage.sha256_bytes(data) == entry["sha256"], name
    # latest.json untouched; the candidate is listed as one, not as a published version.
    assert storage.read_text(f"{bucket_uri}/models/mnist_cnn/latest.json", client=client) == before
    assert [v["version"] for v in list_versions(bucket_uri, "mnist_cnn", client=client)] == [V2, V1]
    candidates = list_refused_candidates(bucket_uri, "mnist_cnn", client=client)
    assert [c["version"] for c in candidates] == [V3]
    assert not storage.exists(f"{bucket_uri}/models/mnist_cnn/{V3}/manifest.json", client=client)
    # A retry finds it complete; a passed decision, or another run's model, is refused.
    assert record_refused(bucket_uri, refused, client=client) == candidate
    passed = replace(refused, gate={**REFUSAL, "passed": True})
    with pytest.raises(PublishRefusedError, match="the gate passed"):
        record_refused(bucket_uri, passed, client=client)
    other = replace(refused, dag_run_id="scheduled__other")
    with pytest.raises(PublishRefusedError, match="already holds the model of run"):
        record_refused(bucket_uri, other, client=client)


def test_a_refused_candidate_is_promoted_only_by_an_admin_with_a_reason(s3_server):
    bucket_uri, client = _two_versions(s3_server)
    _refused_candidate(s3_server, bucket_uri, client)
    for kw, says in [
        ({}, "its gate did not pass .*below the floor 99.9900%.*needs an admin override"),
        ({"admin": True}, "needs an override reason"),
        ({"override_reason": "no admin"}, "needs an admin override"),
    ]:
        with pytest.raises(PromotionRefusedError, match=says):
            _promote(bucket_uri, client, version=V3, **kw)
        assert read_latest(bucket_uri, "mnist_cnn", client=client)[0]["version"] == V2
        assert not storage.exists(f"{bucket_uri}/models/mnist_cnn/{V3}/manifest.json",
                                  client=client)  # fmt: skip
    assert read_history(bucket_uri, "mnist_cnn", client=client) == []

    latest, record = _promote(bucket_uri, client, version=V3, admin=True,
                              override_reason="the floor was a typo")  # fmt: skip
    # Published first (models/<model>/<version>/, where serving loads from), then latest.json.
    assert latest["version"] == V3 and latest["uri"] == f"{bucket_uri}/models/mnist_cnn/{V3}"
    assert read_latest(bucket_uri, "mnist_cnn", client=client)[0] == latest
    assert record["action"] == "promote" and record["override"] is True
    assert record["override_reason"] == "the floor was a typo"
    assert "its gate did not pass" in record["checks"][0]
    (published,) = [m for m in list_versions(bucket_uri, "mnist_cnn", client=client)
                    if m["version"] == V3]  # fmt: skip
    assert published["gate"] == REFUSAL  # it stays marked refused
    for name, entry in published["files"].items():
        assert entry["uri"] == f"{bucket_uri}/models/mnist_cnn/{V3}/{name}"
        data = storage.read_bytes(entry["uri"], client=client)
        assert storage.sha256_bytes(data) == entry["sha256"], name
    assert latest["onnx_sha256"] == published["files"]["model.onnx"]["sha256"]
    assert list_refused_candidates(bucket_uri, "mnist_cnn", client=client) == []
    assert list_models(bucket_uri, client=client) == ["mnist_cnn"]
