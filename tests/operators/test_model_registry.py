"""The champion/challenger gate and publishing, against the real S3 server."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from operators.model_registry import (
    decide_gate,
    publish_model,
    read_champion,
    render_training_curves,
    safe_key,
)
from trainer import storage

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
    champ = None if champion is None else {"val_accuracy": champion, "version": "v1"}
    d = decide_gate(acc, min_accuracy=floor, champion=champ, max_regression=margin)
    assert d.passed is passed
    assert reason in d.reason
    assert d.challenger_accuracy == acc
    assert d.champion_accuracy == champion


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


def _fake_run(s3_server, bucket: str, accuracy: float) -> tuple[str, str, str]:
    """Artifacts as a real run leaves them (contents opaque to the registry)."""
    client = s3_server.client()
    run = f"s3://{bucket}/runs/dag/run-{accuracy}"
    storage.write_bytes(f"{run}/checkpoint.pt", b"checkpoint-bytes", client=client)
    metrics = {"val_accuracy": accuracy, "val_loss": 0.04, "val_correct": int(accuracy * 10000),
               "val_samples": 10000, "epochs": 2, "world_size": 2, "train_seconds": 24.0,
               "history": HISTORY, "versions": {"torch": "2.14.1", "horovod": "0.28.1"},
               "artifacts": {"checkpoint": f"{run}/checkpoint.pt"}}  # fmt: skip
    storage.write_text(f"{run}/metrics.json", json.dumps(metrics), client=client)
    storage.write_bytes(f"{run}/onnx/model.onnx", b"onnx-bytes-" + str(accuracy).encode(),
                        client=client)  # fmt: skip
    parity = {"passed": True, "max_abs_diff": 1e-6, "argmax_mismatches": 0, "samples": 256,
              "tolerance": 1e-4}  # fmt: skip
    storage.write_text(f"{run}/onnx/parity.json", json.dumps(parity), client=client)
    return run, f"{run}/onnx/model.onnx", f"{run}/onnx/parity.json"


def _publish(s3_server, bucket, run, onnx, parity, version):
    gate = decide_gate(0.99, min_accuracy=0.5, champion=None, max_regression=0.01).as_dict()
    return publish_model(
        bucket_uri=f"s3://{bucket}", model_name="mnist_cnn", run_output=run, onnx_uri=onnx,
        parity_uri=parity, dataset={"uri": "s3://x/datasets/mnist/abc", "content_hash": "abc"},
        gate=gate, dag_run_id="manual__1", client=s3_server.client(), version=version,
    )  # fmt: skip


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
    with pytest.raises(ValueError, match="refusing to publish: the gate did not pass"):
        publish_model(bucket_uri=f"s3://{bucket}", model_name="mnist_cnn", run_output=run2,
                      onnx_uri=f"{run2}/onnx/model.onnx", parity_uri=parity2, dataset={},
                      gate=bad_gate, dag_run_id="r", client=client)  # fmt: skip
    assert storage.read_bytes(latest_uri, client=client) == before
