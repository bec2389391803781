"""The champion/challenger gate and publishing, against the real S3 server."""

from __future__ import annotations

import hashlib
import json
import re
import time
from datetime import UTC, datetime

import pytest
from airflow.sdk.exceptions import AirflowFailException

from horovod_airflow.core import contract, storage
from horovod_airflow.core.contract import (
    LATEST,
    LEGACY_METRICS_FORMAT,
    METRICS,
    PARITY,
    STEP_SERIES,
    ContractError,
)
from horovod_airflow.operators.exceptions import ChampionChangedError, PublishRefusedError
from horovod_airflow.operators.model_registry import (
    RunModel,
    decide_gate,
    publish_model,
    read_champion,
    read_latest,
    render_training_curves,
    run_version,
    safe_key,
    write_latest,
)
from horovod_airflow.operators.model_registry.summaries import accuracy_limits, step_series
from horovod_airflow.trainer.model import preprocessing

HISTORY = [
    {"epoch": 1, "train_loss": 0.40, "val_loss": 0.10, "val_accuracy": 0.970,
     "samples_per_sec": 5000.0, "epoch_seconds": 12.0},
    {"epoch": 2, "train_loss": 0.08, "val_loss": 0.04, "val_accuracy": 0.991,
     "samples_per_sec": 5100.0, "epoch_seconds": 11.8},
]  # fmt: skip


@pytest.mark.parametrize(
    ("acc", "floor", "champion", "margin", "passed", "reason"),
    [
        (0.99, 0.98, None, 0.005, True, "no champion yet"),
        (0.97, 0.98, None, 0.005, False, "below the floor"),
        (0.990, 0.98, 0.992, 0.005, True, "champion v1 has 99.2000%"),
        (0.985, 0.98, 0.992, 0.005, False, "worse than the champion v1"),
        (0.9999, 0.98, 0.992, 0.0, True, "champion"),
        (0.50, 0.50, None, 0.0, True, "no champion"),  # the floor is inclusive
    ],
)
def test_gate_matrix(acc, floor, champion, margin, passed, reason):
    champ = (
        None
        if champion is None
        else {"val_accuracy": champion, "version": "v1", "dataset_content_hash": "h" * 64}
    )
    d = decide_gate(
        acc, min_accuracy=floor, champion=champ, max_regression=margin,
        challenger_dataset_hash="h" * 64,
    )  # fmt: skip
    assert d.passed is passed
    assert reason in d.reason
    assert d.challenger_accuracy == acc
    assert d.champion_accuracy == champion


@pytest.mark.parametrize("champion_hash", ["a" * 64, None])
def test_gate_refuses_a_champion_measured_on_other_data(champion_hash):
    champ = {"val_accuracy": 0.90, "version": "v1", "dataset_content_hash": champion_hash}
    d = decide_gate(0.99, min_accuracy=0.5, champion=champ, max_regression=0.01,
                    challenger_dataset_hash="b" * 64)  # fmt: skip
    assert d.passed is False
    assert "not comparable" in d.reason and "b" * 16 in d.reason
    assert ("a" * 16 if champion_hash else "unknown (not recorded)") in d.reason
    assert d.champion_accuracy is None and d.champion_stored_accuracy == 0.90


def test_gate_compares_with_the_champion_rescored_on_this_data():
    champ = {"val_accuracy": 0.90, "version": "v1", "dataset_content_hash": "a" * 64}
    kwargs = dict(min_accuracy=0.5, champion=champ, max_regression=0.01,
                  challenger_dataset_hash="b" * 64)  # fmt: skip
    worse = decide_gate(0.95, champion_rescored_accuracy=0.97, **kwargs)
    assert worse.passed is False and worse.champion_rescored is True
    assert worse.champion_accuracy == 0.97 and "re-scored on this run's dataset" in worse.reason
    assert "measured at 90.0000%" in worse.reason
    better = decide_gate(0.99, champion_rescored_accuracy=0.97, **kwargs)
    assert better.passed is True and "re-scored" in better.reason


@pytest.mark.parametrize("field", ["min_accuracy", "max_regression"])
def test_gate_rejects_values_outside_0_1(field):
    kwargs = {"min_accuracy": 0.9, "champion": None, "max_regression": 0.01, field: 1.5}
    with pytest.raises(ValueError, match=f"{field} must be a fraction in \\[0, 1\\]"):
        decide_gate(0.9, **kwargs)


@pytest.mark.parametrize(
    ("run_id", "readable"),
    [
        ("manual__2026-12-02T10:00:00.123+00:00", "manual__2026-12-02T10_00_00.123_00_00"),
        ("scheduled__2026-12-06T00:00:00+00:00", "scheduled__2026-12-06T00_00_00_00_00"),
        ("a/b c", "a_b_c"),
    ],
)
def test_safe_key_is_readable_then_a_hash_of_the_exact_value(run_id, readable):
    key = safe_key(run_id)
    assert key == f"{readable}-{hashlib.sha256(run_id.encode()).hexdigest()[:12]}"
    assert re.fullmatch(r"[A-Za-z0-9._-]+", key)
    assert safe_key(run_id) == key  # deterministic: every try of a run finds its prefix


@pytest.mark.parametrize(
    "values",
    [
        ["a:b", "a+b", "a b", "a_b", "a/b"],
        ["manual__2026-12-02T10:00:00+00:00", "manual__2026-12-02T10_00_00_00_00"],
        ["x" * 300 + "1", "x" * 300 + "2", "x" * 80],  # differ only after the readable part
        ["._run", "run", "run.", "-run-"],  # differ only in characters that are stripped
    ],
)
def test_safe_key_gives_distinct_inputs_distinct_keys(values):
    keys = [safe_key(v) for v in values]
    assert len(set(keys)) == len(values), keys
    assert all(len(k) <= 93 and re.fullmatch(r"[A-Za-z0-9._-]+", k) for k in keys), keys


@pytest.mark.parametrize("bad", ["", None])
def test_safe_key_refuses_an_empty_value(bad):
    with pytest.raises(ValueError, match="non-empty string"):
        safe_key(bad)


def test_safe_key_of_only_unsafe_characters_is_the_hash():
    assert re.fullmatch(r"[0-9a-f]{12}", safe_key("::"))
    assert safe_key("::") != safe_key("++")


def test_training_curves_png():
    png = render_training_curves(HISTORY)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000


def test_accuracy_axis_stays_within_0_and_100_percent_and_holds_one_epoch():
    assert accuracy_limits([99.16]) == (98.0, 100.0)  # a one-epoch run: a readable band
    low, high = accuracy_limits([97.0, 99.1])
    assert high == 100.0 and low < 97.0
    assert accuracy_limits([0.5]) == (0.0, 2.0)


def test_metrics_v1_still_read_and_drawn_without_steps():
    legacy = json.dumps({"format": LEGACY_METRICS_FORMAT, "val_accuracy": 0.99, "history": HISTORY})
    metrics = METRICS.loads(legacy, "old/metrics.json")
    assert step_series(metrics) is None
    assert render_training_curves(metrics["history"], None).startswith(b"\x89PNG")


def test_a_malformed_step_record_is_refused_naming_it():
    steps = STEP_SERIES.stamp({"every": 1, "step": [1, 2], "epoch": [0.5], "loss": [1.0, 0.9],
                               "lr": [0.1, 0.1]})  # fmt: skip
    with pytest.raises(ContractError, match=r"'steps'.*equal lengths.*'epoch': 1"):
        step_series({"steps": steps}, "run/metrics.json")
    with pytest.raises(ContractError, match=r"'steps'.*lacks 'lr'"):
        step_series({"steps": {"format": STEP_SERIES.format, "every": 1, "step": [],
                               "epoch": [], "loss": []}})  # fmt: skip


def _fake_run(s3_server, bucket: str, accuracy: float) -> tuple[str, str, str]:
    """Artifacts as a real run leaves them (contents opaque to the registry)."""
    client = s3_server.client()
    run = f"s3://{bucket}/runs/dag/run-{accuracy}"
    storage.write_bytes(f"{run}/checkpoint.pt", b"checkpoint-bytes", client=client)
    metrics = {"val_accuracy": accuracy, "val_loss": 0.04, "val_correct": int(accuracy * 10000),
               "val_samples": 10000, "epochs": 2, "world_size": 2, "train_seconds": 24.0,
               "history": HISTORY, "versions": {"torch": "2.14.1", "horovod": "0.28.1"},
               "artifacts": {"checkpoint": f"{run}/checkpoint.pt"}}  # fmt: skip
    storage.write_text(f"{run}/metrics.json", METRICS.dumps(metrics), client=client)
    storage.write_bytes(f"{run}/onnx/model.onnx", b"onnx-bytes-" + str(accuracy).encode(),
                        client=client)  # fmt: skip
    parity = {"passed": True, "max_abs_diff": 1e-6, "argmax_mismatches": 0, "samples": 256,
              "tolerance": 1e-4, "preprocessing": preprocessing()}  # fmt: skip
    storage.write_text(f"{run}/onnx/parity.json", PARITY.dumps(parity), client=client)
    return run, f"{run}/onnx/model.onnx", f"{run}/onnx/parity.json"


def _gate(s3_server, bucket, accuracy=0.99) -> dict:
    """The gate decision as the gate task makes it: champion and its ETag read from S3."""
    champion, etag = read_latest(f"s3://{bucket}", "mnist_cnn", client=s3_server.client())
    return decide_gate(accuracy, min_accuracy=0.5, champion=champion, max_regression=0.5,
                       challenger_dataset_hash="abc", champion_etag=etag).as_dict()  # fmt: skip


def _publish(s3_server, bucket, run, onnx, parity, version, gate=None, dag_run_id="manual__1"):
    return publish_model(f"s3://{bucket}", RunModel(
        model_name="mnist_cnn", run_output=run, onnx_uri=onnx,
        parity_uri=parity, dataset={"uri": "s3://x/datasets/mnist/abc", "content_hash": "abc"},
        gate=gate or _gate(s3_server, bucket), dag_run_id=dag_run_id, version=version,
    ), client=s3_server.client())  # fmt: skip


def test_publish_writes_a_complete_version_then_latest(s3_server):
    client = s3_server.client()
    bucket = s3_server.new_bucket("registry")
    assert read_champion(f"s3://{bucket}", "mnist_cnn", client=client) is None
    run, onnx, parity = _fake_run(s3_server, bucket, 0.991)
    latest = _publish(s3_server, bucket, run, onnx, parity, "v1")

    prefix = f"s3://{bucket}/models/mnist_cnn/v1"
    names = {u.rsplit("/", 1)[-1] for u in storage.list_uris(prefix, client=client)}
    assert names == {"model.onnx", "checkpoint.pt", "metrics.json", "parity.json",
                     "training_curves.png", "summary.md", "manifest.json"}  # fmt: skip
    manifest = json.loads(storage.read_text(f"{prefix}/manifest.json", client=client))
    for name, entry in manifest["files"].items():
        data = storage.read_bytes(f"{prefix}/{name}", client=client)
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], name
    assert manifest["metrics"]["val_accuracy"] == 0.991
    assert manifest["dataset"]["content_hash"] == "abc"
    assert manifest["versions"]["horovod"] == "0.28.1"
    assert manifest["format"] == contract.VERSION_MANIFEST.format
    assert manifest["preprocessing"] == preprocessing()  # recorded next to the model
    assert read_champion(f"s3://{bucket}", "mnist_cnn", client=client) == latest
    assert latest["onnx_sha256"] == hashlib.sha256(b"onnx-bytes-0.991").hexdigest()
    summary = storage.read_text(f"{prefix}/summary.md", client=client)
    assert "99.1000%" in summary and "no champion yet" in summary


def test_a_failed_publish_leaves_latest_untouched(s3_server):
    client = s3_server.client()
    bucket = s3_server.new_bucket("registry")
    run, onnx, parity = _fake_run(s3_server, bucket, 0.991)
    _publish(s3_server, bucket, run, onnx, parity, "v1")
    latest_uri = f"s3://{bucket}/models/mnist_cnn/latest.json"
    before = storage.read_bytes(latest_uri, client=client)

    run2, _, parity2 = _fake_run(s3_server, bucket, 0.995)
    with pytest.raises(storage.StorageError):
        _publish(s3_server, bucket, run2, f"{run2}/onnx/missing.onnx", parity2, "v2")
    assert storage.read_bytes(latest_uri, client=client) == before

    bad_gate = decide_gate(0.1, min_accuracy=0.5, champion=None, max_regression=0.0).as_dict()
    with pytest.raises(PublishRefusedError, match="refusing to publish: the gate did not pass"):
        publish_model(f"s3://{bucket}", RunModel(
            model_name="mnist_cnn", run_output=run2, onnx_uri=f"{run2}/onnx/model.onnx",
            parity_uri=parity2, dataset={}, gate=bad_gate, dag_run_id="r", version="v2",
        ), client=client)  # fmt: skip
    assert storage.read_bytes(latest_uri, client=client) == before


def _versions(client, bucket) -> set[str]:
    uris = storage.list_uris(f"s3://{bucket}/models/mnist_cnn", client=client)
    keys = {u.split("/models/mnist_cnn/", 1)[1] for u in uris}
    return {k.split("/", 1)[0] for k in keys if "/" in k}


def test_run_version_is_the_same_on_every_try_and_distinct_per_run():
    from datetime import UTC, datetime

    due = datetime(2026, 12, 2, 10, 15, tzinfo=UTC)
    v = run_version("dag", "manual__2026-12-02T10:15:00+00:00", due)
    assert v == run_version("dag", "manual__2026-12-02T10:15:00+00:00", due)
    assert re.fullmatch(r"v20261202T101500Z-[0-9a-f]{12}", v)
    assert v != run_version("dag", "manual__2026-12-02T10_15_00_00_00", due)
    assert v != run_version("other_dag", "manual__2026-12-02T10:15:00+00:00", due)


def test_a_publish_retried_after_latest_was_written_adds_nothing(s3_server):
    """Try 1 wrote latest.json then failed (say, the worker died); try 2 must not re-publish."""
    client = s3_server.client()
    bucket = s3_server.new_bucket("registry")
    run, onnx, parity = _fake_run(s3_server, bucket, 0.991)
    gate = _gate(s3_server, bucket)  # the one gate decision both tries get from XCom
    first = _publish(s3_server, bucket, run, onnx, parity, "v1-run", gate=gate)
    objects = {k: v for k, v in _objects(client, bucket).items() if k.startswith("models/")}

    again = _publish(s3_server, bucket, run, onnx, parity, "v1-run", gate=gate)
    assert again == first
    assert _versions(client, bucket) == {"v1-run"}
    assert {k: v for k, v in _objects(client, bucket).items() if k.startswith("models/")} == (
        objects
    )  # not one object rewritten, latest.json included


def test_a_publish_retried_after_the_version_was_copied_reuses_it(s3_server):
    """Try 1 copied the version (manifest written) but died before latest.json."""
    client = s3_server.client()
    bucket = s3_server.new_bucket("registry")
    run, onnx, parity = _fake_run(s3_server, bucket, 0.991)
    gate = _gate(s3_server, bucket)
    other = {"model": "mnist_cnn", "version": "v0-other", "uri": "s3://x/v0",
             "manifest_uri": "s3://x/v0/manifest.json", "onnx_uri": "s3://x/v0/model.onnx",
             "onnx_sha256": "0" * 64, "val_accuracy": 0.5}  # fmt: skip
    storage.write_text(f"s3://{bucket}/models/mnist_cnn/latest.json", LATEST.dumps(other),
                       client=client)  # fmt: skip
    with pytest.raises(ChampionChangedError):  # someone else's latest.json: try 1 fails late
        _publish(s3_server, bucket, run, onnx, parity, "v1-run", gate=gate)
    client.delete_object(Bucket=bucket, Key="models/mnist_cnn/latest.json")
    version_objects = _objects(client, bucket, "models/mnist_cnn/v1-run/")
    assert "models/mnist_cnn/v1-run/manifest.json" in version_objects

    latest = _publish(s3_server, bucket, run, onnx, parity, "v1-run", gate=gate)
    assert latest["version"] == "v1-run"
    assert _objects(client, bucket, "models/mnist_cnn/v1-run/") == version_objects
    assert _versions(client, bucket) == {"v1-run"}


def test_a_cleared_gate_of_an_older_run_cannot_move_serving_back(s3_server):
    """Run A published, then run B (due later). A's gate and what follows are cleared: the
    gate compares A with B and passes within max_regression, but publish refuses to move
    latest.json back to A (no Asset event, latest.json untouched)."""
    client = s3_server.client()
    bucket = s3_server.new_bucket("registry")
    run_a, onnx_a, parity_a = _fake_run(s3_server, bucket, 0.991)
    run_b, onnx_b, parity_b = _fake_run(s3_server, bucket, 0.990)
    v_a = run_version("retrain", "scheduled__a", datetime(2026, 12, 1, tzinfo=UTC))
    v_b = run_version("retrain", "scheduled__b", datetime(2026, 12, 8, tzinfo=UTC))
    _publish(s3_server, bucket, run_a, onnx_a, parity_a, v_a, dag_run_id="scheduled__a")
    _publish(s3_server, bucket, run_b, onnx_b, parity_b, v_b, dag_run_id="scheduled__b")
    before = _objects(client, bucket, "models/mnist_cnn/latest.json")

    regate = _gate(s3_server, bucket, accuracy=0.991)  # A against B: passes
    assert regate["passed"] and regate["champion_version"] == v_b
    with pytest.raises(PublishRefusedError, match="Publishing only moves forward") as refused:
        _publish(s3_server, bucket, run_a, onnx_a, parity_a, v_a, gate=regate,
                 dag_run_id="scheduled__a")  # fmt: skip
    assert f"serving uses {v_b}, which is newer" in str(refused.value)
    assert isinstance(refused.value, AirflowFailException)
    assert _objects(client, bucket, "models/mnist_cnn/latest.json") == before


def test_a_version_named_by_hand_is_ordered_by_when_it_was_published(s3_server):
    client = s3_server.client()
    bucket = s3_server.new_bucket("registry")
    run_a, onnx_a, parity_a = _fake_run(s3_server, bucket, 0.991)
    run_b, onnx_b, parity_b = _fake_run(s3_server, bucket, 0.990)
    _publish(s3_server, bucket, run_a, onnx_a, parity_a, "first", dag_run_id="a")
    time.sleep(1.1)  # published_at has whole seconds
    _publish(s3_server, bucket, run_b, onnx_b, parity_b, "second", dag_run_id="b")
    with pytest.raises(PublishRefusedError, match=r"it was copied at .* before second"):
        _publish(s3_server, bucket, run_a, onnx_a, parity_a, "first",
                 gate=_gate(s3_server, bucket), dag_run_id="a")  # fmt: skip
    assert read_champion(f"s3://{bucket}", "mnist_cnn", client=client)["version"] == "second"


def test_a_publish_regated_after_the_champion_changed_records_the_new_decision(s3_server):
    """A was gated against C and copied, but B won latest.json first (ChampionChangedError).
    The gate runs again (A against B); A's publish then records that decision, not the first."""
    client = s3_server.client()
    bucket = s3_server.new_bucket("registry")
    run_c, onnx_c, parity_c = _fake_run(s3_server, bucket, 0.980)
    run_a, onnx_a, parity_a = _fake_run(s3_server, bucket, 0.995)
    run_b, onnx_b, parity_b = _fake_run(s3_server, bucket, 0.990)
    due = {k: datetime(2026, 12, d, tzinfo=UTC) for k, d in (("c", 1), ("b", 2), ("a", 3))}
    ver = {k: run_version("retrain", f"run_{k}", t) for k, t in due.items()}
    _publish(s3_server, bucket, run_c, onnx_c, parity_c, ver["c"], dag_run_id="run_c")
    first = _gate(s3_server, bucket, accuracy=0.995)  # A against C
    _publish(s3_server, bucket, run_b, onnx_b, parity_b, ver["b"], dag_run_id="run_b")
    with pytest.raises(ChampionChangedError):
        _publish(s3_server, bucket, run_a, onnx_a, parity_a, ver["a"], gate=first,
                 dag_run_id="run_a")  # fmt: skip
    manifest_uri = f"s3://{bucket}/models/mnist_cnn/{ver['a']}/manifest.json"
    assert json.loads(storage.read_text(manifest_uri, client=client))["gate"] == first

    second = _gate(s3_server, bucket, accuracy=0.995)  # A against B
    assert second["champion_version"] == ver["b"] != first["champion_version"]
    latest = _publish(s3_server, bucket, run_a, onnx_a, parity_a, ver["a"], gate=second,
                      dag_run_id="run_a")  # fmt: skip
    assert latest["version"] == ver["a"]
    manifest = json.loads(storage.read_text(manifest_uri, client=client))
    assert manifest["gate"] == second
    summary = storage.read_text(manifest["files"]["summary.md"]["uri"], client=client)
    assert ver["b"] in summary and ver["c"] not in summary


def test_a_version_holding_another_runs_model_is_refused(s3_server):
    bucket = s3_server.new_bucket("registry")
    run, onnx, parity = _fake_run(s3_server, bucket, 0.991)
    _publish(s3_server, bucket, run, onnx, parity, "v1")
    with pytest.raises(PublishRefusedError, match="already holds the model of run 'manual__1'"):
        _publish(s3_server, bucket, run, onnx, parity, "v1", dag_run_id="manual__2")


def test_two_publishes_racing_for_latest_one_wins_the_other_fails(s3_server):
    """Both gates read the same champion; the second conditional put fails, nothing is lost."""
    client = s3_server.client()
    bucket = s3_server.new_bucket("registry")
    run0, onnx0, parity0 = _fake_run(s3_server, bucket, 0.980)
    _publish(s3_server, bucket, run0, onnx0, parity0, "v0", dag_run_id="run0")
    run_a, onnx_a, parity_a = _fake_run(s3_server, bucket, 0.991)
    run_b, onnx_b, parity_b = _fake_run(s3_server, bucket, 0.995)
    gate_a, gate_b = _gate(s3_server, bucket), _gate(s3_server, bucket)
    assert gate_a["champion_version"] == gate_b["champion_version"] == "v0"
    assert gate_a["champion_etag"]

    won = _publish(s3_server, bucket, run_a, onnx_a, parity_a, "va", gate=gate_a, dag_run_id="a")
    with pytest.raises(ChampionChangedError, match="changed after the gate read it") as lost:
        _publish(s3_server, bucket, run_b, onnx_b, parity_b, "vb", gate=gate_b, dag_run_id="b")
    assert "nothing was overwritten" in str(lost.value)
    assert isinstance(lost.value, AirflowFailException)  # a retry of publish cannot fix it

    latest = json.loads(storage.read_text(f"s3://{bucket}/models/mnist_cnn/latest.json",
                                          client=client))  # fmt: skip
    assert latest == won and latest["version"] == "va"
    manifest = json.loads(storage.read_text(latest["manifest_uri"], client=client))
    assert manifest["version"] == "va" and set(manifest["files"]) >= {"model.onnx"}
    onnx_bytes = storage.read_bytes(latest["onnx_uri"], client=client)
    assert hashlib.sha256(onnx_bytes).hexdigest() == latest["onnx_sha256"]


def test_the_first_publish_is_conditional_on_there_being_no_champion(s3_server):
    bucket = s3_server.new_bucket("registry")
    gate = _gate(s3_server, bucket)  # no champion: If-None-Match: *
    assert gate["champion_etag"] is None
    run, onnx, parity = _fake_run(s3_server, bucket, 0.991)
    _publish(s3_server, bucket, run, onnx, parity, "first", dag_run_id="first")
    with pytest.raises(ChampionChangedError, match=re.escape("no latest.json (no champion)")):
        _publish(s3_server, bucket, run, onnx, parity, "second", gate=gate, dag_run_id="second")
    assert read_champion(f"s3://{bucket}", "mnist_cnn", client=s3_server.client())["version"] == (
        "first"
    )


def _latest(version: str) -> dict:
    return {"format": LATEST.format, "model": "m", "version": version, "uri": f"/r/{version}",
            "manifest_uri": f"/r/{version}/manifest.json", "onnx_uri": f"/r/{version}/model.onnx",
            "onnx_sha256": "0" * 64, "val_accuracy": 0.9}  # fmt: skip


def test_write_latest_on_a_local_folder_is_conditional_too(tmp_path):
    root = str(tmp_path / "registry")
    write_latest(root, "m", _latest("a"), expected_etag=None)
    doc, etag = read_latest(root, "m")
    assert doc == _latest("a") and etag
    with pytest.raises(ChampionChangedError):
        write_latest(root, "m", _latest("b"), expected_etag=None)
    write_latest(root, "m", _latest("b"), expected_etag=etag)
    with pytest.raises(ChampionChangedError):
        write_latest(root, "m", _latest("c"), expected_etag=etag)
    assert read_latest(root, "m")[0] == _latest("b")
    with pytest.raises(ContractError, match="lacks 'model'"):  # a writer checks it too
        write_latest(root, "m", {"version": "d"}, expected_etag=read_latest(root, "m")[1])


def _objects(client, bucket: str, prefix: str = "") -> dict[str, str]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = f"{o['ETag']}@{o['LastModified'].isoformat()}"
    return out


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ({"passed": True}, "has no 'format'; supported: horovod-airflow/parity-v1"),
        ({"format": "horovod-airflow/parity-v9", "passed": True},
         "has format 'horovod-airflow/parity-v9'; supported: horovod-airflow/parity-v1"),
        ({"format": PARITY.format, "passed": True}, "lacks 'max_abs_diff'"),
    ],
)  # fmt: skip
def test_publish_refuses_a_parity_json_that_breaks_its_contract(s3_server, content, says):
    client = s3_server.client()
    bucket = s3_server.new_bucket("registry")
    run, onnx, parity = _fake_run(s3_server, bucket, 0.991)
    storage.write_text(parity, json.dumps(content), client=client)
    with pytest.raises(ContractError) as refused:
        _publish(s3_server, bucket, run, onnx, parity, "v1")
    assert str(refused.value).startswith(f"{parity}: parity.json ")
    assert says in str(refused.value)
    assert _objects(client, bucket, "models/") == {}  # nothing published


def test_publish_refuses_a_metrics_json_without_format(s3_server):
    client = s3_server.client()
    bucket = s3_server.new_bucket("registry")
    run, onnx, parity = _fake_run(s3_server, bucket, 0.991)
    storage.write_text(f"{run}/metrics.json", json.dumps({"val_accuracy": 0.991}), client=client)
    with pytest.raises(
        ContractError,
        match=re.escape(
            f"{run}/metrics.json: metrics.json has no 'format'; supported: horovod-airflow/"
        ),
    ):
        _publish(s3_server, bucket, run, onnx, parity, "v1")  # fmt: skip


def test_a_latest_json_of_an_unknown_format_is_refused_by_every_reader(s3_server):
    client = s3_server.client()
    bucket = s3_server.new_bucket("registry")
    uri = f"s3://{bucket}/models/mnist_cnn/latest.json"
    storage.write_text(uri, json.dumps({"format": "horovod-airflow/latest-v9"}), client=client)
    with pytest.raises(ContractError) as refused:
        read_champion(f"s3://{bucket}", "mnist_cnn", client=client)
    message = str(refused.value)
    assert uri in message and "'horovod-airflow/latest-v9'" in message
    assert (
        "supported: horovod-airflow/latest-v3, horovod-airflow/latest-v2, horovod-airflow/model-v1"
        in message
    )


def test_a_legacy_latest_json_is_read_and_a_new_publish_replaces_it(s3_server):
    """A champion published before the contract (model-v1, no preprocessing) can be replaced."""
    client = s3_server.client()
    bucket = s3_server.new_bucket("registry")
    legacy = {"format": contract.LEGACY_MODEL_FORMAT, "model": "mnist_cnn", "version": "v0",
              "uri": "s3://x/v0", "manifest_uri": "s3://x/v0/manifest.json",
              "onnx_uri": "s3://x/v0/model.onnx", "onnx_sha256": "0" * 64,
              "val_accuracy": 0.9, "dataset_content_hash": "abc"}  # fmt: skip
    storage.write_text(f"s3://{bucket}/models/mnist_cnn/latest.json", json.dumps(legacy),
                       client=client)  # fmt: skip
    assert read_champion(f"s3://{bucket}", "mnist_cnn", client=client) == legacy
    run, onnx, parity = _fake_run(s3_server, bucket, 0.991)
    latest = _publish(s3_server, bucket, run, onnx, parity, "v1")
    assert latest["format"] == LATEST.format and latest["version"] == "v1"


def test_publish_probes_conditional_writes_and_leaves_no_probe(s3_server):
    client = s3_server.client()
    bucket = s3_server.new_bucket("registry")
    run, onnx, parity = _fake_run(s3_server, bucket, 0.991)
    _publish(s3_server, bucket, run, onnx, parity, "v1")
    assert not [k for k in _objects(client, bucket) if ".cas-probe" in k]
    assert _versions(client, bucket) == {"v1"}


def test_a_server_that_ignores_conditional_writes_is_refused(moto_s3):
    """A server that drops If-None-Match / If-Match (older MinIO, some gateways) would let two
    publishers both replace latest.json: the probe finds out and the publish is refused,
    naming what the server accepted; latest.json is not written.

    On moto, not SeaweedFS: the proxy plays such a server by removing the two headers in
    flight, which breaks the request's signature, and only a server that checks none lets
    the request through."""
    s3_server = moto_s3
    import boto3

    from horovod_airflow.operators.model_registry import ConditionalWritesUnsupportedError
    from tests.s3_faults import faulty_s3

    bucket = s3_server.new_bucket("no-cas")
    run, onnx, parity = _fake_run(s3_server, bucket, 0.991)
    with faulty_s3(s3_server.endpoint, lambda m, p: None,
                   drop_headers=("If-Match", "If-None-Match")) as proxy:  # fmt: skip
        careless = boto3.client(
            "s3", endpoint_url=proxy.endpoint, region_name="us-east-1",
            aws_access_key_id=s3_server.worker.access_key,
            aws_secret_access_key=s3_server.worker.secret_key,
        )  # fmt: skip
        with pytest.raises(ConditionalWritesUnsupportedError) as refused:
            publish_model(f"s3://{bucket}", RunModel(
                model_name="mnist_cnn", run_output=run, onnx_uri=onnx, parity_uri=parity,
                dataset={"uri": "s3://x/datasets/mnist/abc", "content_hash": "abc"},
                gate=_gate(s3_server, bucket), dag_run_id="manual__1", version="v1",
            ), client=careless)  # fmt: skip
    message = str(refused.value)
    assert "does not honour conditional writes" in message
    assert "a second create with If-None-Match: *" in message
    assert "If-Match of a wrong ETag" in message and "If-Match on a missing key" in message
    assert isinstance(refused.value, AirflowFailException)
    client = s3_server.client()
    assert "models/mnist_cnn/latest.json" not in _objects(client, bucket)
    assert _versions(client, bucket) == set()  # refused before anything was copied
