"""Retention on a real bucket (the suite's S3 server): published, rolled-back-from, refused,
failed and in-flight runs and staged datasets; the dry run lists, the real run deletes exactly
the expected keys, and serving and a roll-forward still work after it.

Ages are measured at a chosen ``now``: the bucket is written in two phases a few seconds
apart ("old", then "young"), and the plan is made one in-flight window after the split
between them, so the old phase is older than the window and the young one is not.
"""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from horovod_airflow.apps.mnist import smoke_test_published_model
from horovod_airflow.core import layout, storage
from horovod_airflow.core.contract import GATE, METRICS
from horovod_airflow.operators import retention
from horovod_airflow.operators.exceptions import RetentionConflictError
from horovod_airflow.operators.model_registry import RunModel, read_latest, safe_key, write_latest
from horovod_airflow.operators.staging import stage_dataset
from tests.mnist_subset import write_subset
from tests.operators.helpers import publish_centroid_model, publish_fake_model
from tests.s3_faults import faulty_s3

WINDOW = timedelta(hours=1)
V1 = "v20261101T000000Z-00000000000a"
V2 = "v20261108T000000Z-00000000000b"


def _hash(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def fake_dataset(s3: Any, bucket: str, name: str) -> tuple[str, str]:
    """A staged dataset's objects (manifest last); returns its prefix URI and content hash."""
    content_hash = _hash(name)
    prefix = f"s3://{bucket}/datasets/{name}/{content_hash[:16]}"
    storage.write_bytes(f"{prefix}/data.bin", b"d" * 1000, client=s3)
    storage.write_text(f"{prefix}/manifest.json", '{"format": "fake"}', client=s3)
    return prefix, content_hash


def run_prefix(bucket: str, dag_id: str, run_id: str) -> str:
    return f"s3://{bucket}/runs/{dag_id}/{safe_key(run_id)}"


def write_run(
    s3: Any,
    prefix: str,
    *,
    gate: bool | None = None,
    dataset: tuple[str, str] | None = None,
    gate_hash_only: str | None = None,
) -> None:
    """A run's outputs: a checkpoint; metrics (recording ``dataset``) and a gate decision
    when ``gate`` is given (True: passed, its export and publish still to come)."""
    storage.write_bytes(f"{prefix}/checkpoint.pt", b"c" * 5000, client=s3)
    if gate is None:
        return
    metrics: dict[str, Any] = {"val_accuracy": 0.5}
    if dataset is not None:
        metrics["dataset"] = {"uri": dataset[0], "content_hash": dataset[1]}
    storage.write_text(f"{prefix}/metrics.json", METRICS.dumps(metrics), client=s3)
    hashed = gate_hash_only or (dataset[1] if dataset else None)
    decision = {"passed": gate, "reason": "passed" if gate else "accuracy 50% is below the floor",
                "challenger_accuracy": 0.5, "min_accuracy": 0.9, "max_regression": 0.01,
                "challenger_dataset_hash": hashed}  # fmt: skip
    storage.write_text(f"{prefix}/gate.json", GATE.dumps(decision), client=s3)


def keys(s3: Any, bucket: str, under: str = "") -> dict[str, str]:
    """Every key of the bucket (below ``under``) with its ETag."""
    found = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=under):
        for obj in page.get("Contents", []):
            found[obj["Key"]] = obj["ETag"]
    return found


def staged_copy(mnist_subset: Path, tmp_path: Path, test: int) -> tuple[Path, Any, Any]:
    """A second real dataset (other sizes, so other content): its folder and its splits."""
    folder = write_subset(mnist_subset, tmp_path / f"subset-{test}", train=1500, test=test)
    return folder, *_splits(folder)


def _splits(folder: Path) -> tuple[Any, Any]:
    files = layout.find_source_files(folder)
    return (
        (layout.read_idx(files[("train", "images")]), layout.read_idx(files[("train", "labels")])),
        (layout.read_idx(files[("test", "images")]), layout.read_idx(files[("test", "labels")])),
    )


def _split_phases() -> datetime:
    """A moment strictly between what was written before and what is written after it (S3
    keeps whole seconds)."""
    time.sleep(1.5)
    split = datetime.now(UTC)
    time.sleep(1.5)
    return split


@pytest.fixture
def bucket_with_history(s3_server, mnist_subset, tmp_path) -> dict[str, Any]:
    """The prepared bucket; returns what the tests check, by name."""
    s3 = s3_server.client()
    bucket = s3_server.new_bucket("retain")
    uri = f"s3://{bucket}"
    # --- old phase ---------------------------------------------------------------------
    # v1 and v2: real models published on two real staged datasets; then latest.json is
    # rolled back from v2 to v1 (a person's rollback: write_latest over the current one).
    staged1 = stage_dataset(str(mnist_subset), uri, client=s3)
    v1 = publish_centroid_model(s3, bucket, staged1, *_splits(mnist_subset), version=V1,
                                dag_run_id="scheduled__v1")  # fmt: skip
    folder2, train2, test2 = staged_copy(mnist_subset, tmp_path, 400)
    staged2 = stage_dataset(str(folder2), uri, client=s3, name="mnist2")
    v2 = publish_centroid_model(s3, bucket, staged2, train2, test2, version=V2,
                                dag_run_id="scheduled__v2")  # fmt: skip
    _, etag = read_latest(uri, "mnist_cnn", client=s3)
    write_latest(uri, "mnist_cnn", v1, expected_etag=etag, client=s3)  # the rollback
    d_refused = fake_dataset(s3, bucket, "refused-only")
    d_orphan = fake_dataset(s3, bucket, "orphan")
    d_run = fake_dataset(s3, bucket, "in-flight-run")
    d_gate = fake_dataset(s3, bucket, "gate-hash-only")
    d_nightly = fake_dataset(s3, bucket, "nightly")
    refused_old = run_prefix(bucket, "fake", "scheduled__refused-old")
    write_run(s3, refused_old, gate=False, dataset=d_refused)
    failed_old = run_prefix(bucket, "fake", "scheduled__failed-in-training")
    write_run(s3, failed_old)  # a checkpoint, then the run failed: no metrics, no gate
    nightly = run_prefix(bucket, "nightly", "scheduled__nightly-refused")
    write_run(s3, nightly, gate=False, dataset=d_nightly)
    split = _split_phases()
    # --- young phase -------------------------------------------------------------------
    d_young = fake_dataset(s3, bucket, "just-staged")
    in_flight = run_prefix(bucket, "fake", "scheduled__exporting")
    write_run(s3, in_flight, gate=True, dataset=d_run)  # gate passed: export and publish next
    refused_new = run_prefix(bucket, "fake", "manual__refused-new")
    time.sleep(1.1)  # the newest run of "fake" by its last write
    write_run(s3, refused_new, gate=False, gate_hash_only=d_gate[1])
    return {
        "s3": s3, "bucket": bucket, "uri": uri, "now": split + WINDOW, "v1": v1, "v2": v2,
        "staged1": staged1, "staged2": staged2, "d_refused": d_refused, "d_orphan": d_orphan,
        "d_run": d_run, "d_gate": d_gate, "d_nightly": d_nightly, "d_young": d_young,
        "refused_old": refused_old, "failed_old": failed_old, "nightly": nightly,
        "in_flight": in_flight, "refused_new": refused_new,
    }  # fmt: skip


def _key(uri: str) -> str:
    return storage.parse(uri).key


def expected_deleted_keys(b: dict[str, Any]) -> set[str]:
    """What the policy (1 run kept per DAG) lets go, key by key."""
    run_files = ["checkpoint.pt", "metrics.json", "onnx/model.onnx", "onnx/parity.json"]
    published_runs = [f"runs/fake/{V1}/{f}" for f in run_files] + [
        f"runs/fake/{V2}/{f}" for f in run_files
    ]
    refused = [f"{_key(b['refused_old'])}/{f}" for f in
               ("checkpoint.pt", "metrics.json", "gate.json")]  # fmt: skip
    failed = [f"{_key(b['failed_old'])}/checkpoint.pt"]
    datasets = [f"{_key(b[d][0])}/{f}" for d in ("d_refused", "d_orphan")
                for f in ("data.bin", "manifest.json")]  # fmt: skip
    return {*published_runs, *refused, *failed, *datasets}


POLICY = retention.RetentionPolicy(keep_runs=1, in_flight_window=WINDOW)


def test_dry_run_lists_and_the_real_run_deletes_exactly_the_expected_keys(bucket_with_history):
    b = bucket_with_history
    s3, bucket = b["s3"], b["bucket"]
    before = keys(s3, bucket)
    expected = expected_deleted_keys(b)
    assert expected <= set(before)

    dry = retention.apply_retention(b["uri"], POLICY, dry_run=True, client=s3, now=b["now"])
    assert keys(s3, bucket) == before  # a dry run deletes nothing
    listed = {p.uri: p for p in dry.plan.delete}
    assert set(listed) == {
        f"s3://{bucket}/runs/fake/{V1}", f"s3://{bucket}/runs/fake/{V2}",
        b["refused_old"], b["failed_old"], b["d_refused"][0], b["d_orphan"][0],
    }  # fmt: skip
    sizes = {o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    for p in dry.plan.delete:  # each with its size, summed from the store's own listing
        assert p.size == sum(sizes[_key(o.uri)] for o in p.objects) > 0
    assert {_key(o.uri) for p in dry.plan.delete for o in p.objects} == expected
    assert dry.plan.delete_bytes == sum(sizes[k] for k in expected)
    reasons = {uri: p.reason for uri, p in listed.items()}
    assert f"published as mnist_cnn {V2}" in reasons[f"s3://{bucket}/runs/fake/{V2}"]
    assert "the gate refused it" in reasons[b["refused_old"]]
    assert "ended without publishing or a refusal" in reasons[b["failed_old"]]
    kept = {p.uri: p.reason for p in dry.plan.keep}
    assert "in flight" in kept[b["in_flight"]]
    assert "one of the last 1 runs of fake" in kept[b["refused_new"]]
    assert "one of the last 1 runs of nightly" in kept[b["nightly"]]
    assert "published mnist_cnn " + V1 in kept[b["staged1"]["uri"]]
    assert "models/mnist_cnn/latest.json" in kept[b["staged1"]["uri"]]
    assert "published mnist_cnn " + V2 in kept[b["staged2"]["uri"]]  # rolled back from
    assert "kept run" in kept[b["d_run"][0]] and "kept run" in kept[b["d_gate"][0]]
    assert "kept run" in kept[b["d_nightly"][0]]
    assert "staged 59 min ago (< in-flight window 60 min)" in kept[b["d_young"][0]]
    assert dry.as_dict()["dry_run"] is True and dry.as_dict()["deleted"] == []

    real = retention.apply_retention(b["uri"], POLICY, dry_run=False, client=s3, now=b["now"])
    after = keys(s3, bucket)
    assert set(before) - set(after) == expected
    assert set(after) <= set(before)
    assert {p.uri for p in real.deleted} == set(listed) and real.left == []
    assert real.as_dict()["deleted_bytes"] == dry.plan.delete_bytes
    # Everything under models/ is untouched, byte for byte (same ETags).
    assert keys(s3, bucket, "models/") == {k: v for k, v in before.items()
                                           if k.startswith("models/")}  # fmt: skip
    # Serving still serves the champion (v1, rolled back to) from the registry, predicting
    # its own dataset; and the version rolled back from (v2) still opens, sha256 checked, with
    # its dataset: a roll-forward to it would work.
    served = smoke_test_published_model(b["uri"], "mnist_cnn", client=s3)
    assert served["version"] == V1
    rolled_back_from = smoke_test_published_model(b["uri"], "mnist_cnn", client=s3,
                                                  published=b["v2"])  # fmt: skip
    assert rolled_back_from["version"] == V2

    again = retention.apply_retention(b["uri"], POLICY, dry_run=False, client=s3, now=b["now"])
    assert again.deleted == [] and keys(s3, bucket) == after  # nothing more to do


def test_dataset_deletions_wait_for_a_run_that_does_not_record_its_dataset(s3_server):
    s3 = s3_server.client()
    bucket = s3_server.new_bucket("retain-wait")
    orphan = fake_dataset(s3, bucket, "orphan")
    old_refused = run_prefix(bucket, "fake", "scheduled__old")
    write_run(s3, old_refused, gate=False, dataset=orphan)
    split = _split_phases()
    training = run_prefix(bucket, "fake", "scheduled__training")
    write_run(s3, training)  # checkpoints only: which dataset it reads is not recorded yet
    before = keys(s3, bucket)

    plan = retention.plan_retention(f"s3://{bucket}", POLICY, client=s3, now=split + WINDOW)
    kept = {p.uri: p.reason for p in plan.keep}
    assert [p.uri for p in plan.delete] == [old_refused]
    assert "does not record its dataset yet" in kept[orphan[0]]
    assert plan.notes and "scheduled__training" in plan.notes[0]

    # A DAG that Airflow reports running keeps all its runs, and no dataset goes.
    active = retention.plan_retention(f"s3://{bucket}", POLICY, client=s3, now=split + WINDOW,
                                      dag_is_active=lambda dag_id: dag_id == "fake")  # fmt: skip
    assert active.delete == ()
    assert (
        "Airflow reports an active run of fake"
        in {p.uri: p.reason for p in active.keep}[old_refused]
    )
    assert keys(s3, bucket) == before  # planning reads only


def test_a_publish_between_plan_and_delete_refuses_the_plan_and_a_replan_keeps_its_dataset(
    bucket_with_history, monkeypatch
):
    b = bucket_with_history
    s3, bucket = b["s3"], b["bucket"]
    plan = retention.plan_retention(b["uri"], POLICY, client=s3, now=b["now"])
    orphan = b["d_orphan"][0]
    assert orphan in {p.uri for p in plan.delete}

    def publish_on_orphan(version: str, run_id: str) -> None:
        """A publish of a model measured on the dataset the plan would delete."""
        publish_fake_model(s3, bucket, version=version, onnx_bytes=b"onnx", accuracy=0.99,
                           dataset_hash=b["d_orphan"][1], dataset_uri=orphan,
                           dag_run_id=run_id)  # fmt: skip

    publish_on_orphan("v20261201T000000Z-00000000000c", "scheduled__v3")
    before = keys(s3, bucket)
    with pytest.raises(RetentionConflictError, match=r"latest\.json ETag .* → .*appeared"):
        retention.apply_plan(plan, client=s3)
    assert keys(s3, bucket) == before  # refused before the first deletion

    # The operator's path plans again: a publish right after its first plan is seen by the
    # second, whose plan keeps the dataset the new version names.
    real_plan = retention.plan_retention
    calls = []

    def plan_then_publish(*args: Any, **kwargs: Any) -> retention.RetentionPlan:
        made = real_plan(*args, **kwargs)
        calls.append(made)
        if len(calls) == 1:
            publish_on_orphan("v20261202T000000Z-00000000000d", "scheduled__v4")
        return made

    monkeypatch.setattr(retention, "plan_retention", plan_then_publish)
    result = retention.apply_retention(b["uri"], POLICY, dry_run=False, client=s3, now=b["now"])
    assert len(calls) == 2
    assert orphan not in {p.uri for p in result.deleted}
    assert f"{_key(orphan)}/manifest.json" in keys(s3, bucket)
    assert "published mnist_cnn v20261202T000000Z" in {p.uri: p.reason for p in
                                                       result.plan.keep}[orphan]  # fmt: skip
    latest, _ = read_latest(b["uri"], "mnist_cnn", client=s3)
    assert latest is not None and latest["version"] == "v20261202T000000Z-00000000000d"


def test_a_run_that_writes_after_the_plan_is_left(bucket_with_history):
    b = bucket_with_history
    s3 = b["s3"]
    plan = retention.plan_retention(b["uri"], POLICY, client=s3, now=b["now"])
    storage.write_bytes(f"{b['failed_old']}/checkpoint.pt", b"resumed", client=s3)
    result = retention.apply_plan(plan, client=s3)
    assert [left["prefix"] for left in result.left] == [b["failed_old"]]
    assert storage.exists(f"{b['failed_old']}/checkpoint.pt", client=s3)
    assert b["refused_old"] in {p.uri for p in result.deleted}


def test_a_failed_delete_is_loud_and_names_what_was_deleted(bucket_with_history, s3_server):
    b = bucket_with_history
    denied = f"/{b['bucket']}/{_key(b['d_orphan'][0])}/data.bin"

    def deny(method: str, path: str) -> tuple[int, str] | None:
        return (403, "AccessDenied") if method == "DELETE" and path.startswith(denied) else None

    import boto3

    with faulty_s3(s3_server.endpoint, deny) as proxy:
        client = boto3.client("s3", endpoint_url=proxy.endpoint,
                              aws_access_key_id=s3_server.env["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=s3_server.env["AWS_SECRET_ACCESS_KEY"],
                              region_name=s3_server.env["AWS_DEFAULT_REGION"])  # fmt: skip
        with pytest.raises(storage.StorageError) as caught:
            retention.apply_retention(b["uri"], POLICY, dry_run=False, client=client,
                                      now=b["now"])  # fmt: skip
    message = str(caught.value)
    assert f"deleting {b['d_orphan'][0]}/data.bin failed" in message
    assert "AccessDenied" in message
    assert "Deleted before it: 12 objects of 4 prefixes" in message
    # The completion marker went first: the half-deleted dataset no longer looks staged.
    remaining = keys(b["s3"], b["bucket"], _key(b["d_orphan"][0]) + "/")
    assert list(remaining) == [f"{_key(b['d_orphan'][0])}/data.bin"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_runs": 0}, r"keep_runs=0: expected a whole number of runs from 1 to 100000"),
        ({"keep_runs": True}, r"keep_runs=True: expected a whole number"),
        ({"keep_runs": "5"}, r"keep_runs='5': expected a whole number"),
        ({"in_flight_window": timedelta(0)}, r"in_flight_window=.*expected a positive"),
        ({"in_flight_window": 60}, r"in_flight_window=60: expected a positive timedelta"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_value_and_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        retention.RetentionPolicy(**kwargs)


def test_only_the_layouts_prefixes_are_touched_and_what_latest_json_reaches_stays(s3_server):
    from horovod_airflow.core.contract import LATEST

    s3 = s3_server.client()
    bucket = s3_server.new_bucket("retain-shape")
    refused = run_prefix(bucket, "fake", "scheduled__refused")
    write_run(s3, refused, gate=False)
    # A record written by hand whose model lives in an old run's prefix: what it points at
    # stays, whatever the run's age or rank.
    reached = run_prefix(bucket, "fake", "scheduled__hand-published")
    write_run(s3, reached, gate=False)
    storage.write_bytes(f"{reached}/onnx/model.onnx", b"m", client=s3)
    record = {"model": "mnist_cnn", "version": "hand", "uri": reached,
              "manifest_uri": f"{reached}/manifest.json", "onnx_uri": f"{reached}/onnx/model.onnx",
              "onnx_sha256": "0" * 64, "val_accuracy": 0.9}  # fmt: skip
    storage.write_text(f"s3://{bucket}/models/mnist_cnn/latest.json", LATEST.dumps(record),
                       client=s3)  # fmt: skip
    # Not of the layout's shape: a run written under runs/<run_id>/ by hand, a folder under
    # datasets/ that no content hash names.
    storage.write_bytes(f"s3://{bucket}/runs/manual_run/onnx/model.onnx", b"m", client=s3)
    storage.write_bytes(f"s3://{bucket}/datasets/mine/latest/data.bin", b"d", client=s3)
    split = _split_phases()
    write_run(s3, run_prefix(bucket, "fake", "scheduled__newest"), gate=False)

    plan = retention.plan_retention(f"s3://{bucket}", POLICY, client=s3, now=split + WINDOW)
    assert [p.uri for p in plan.delete] == [refused]
    kept = {p.uri: p.reason for p in plan.keep}
    assert kept[reached] == "files in it are named by models/mnist_cnn/latest.json"
    listed = {p.uri for p in plan.delete} | set(kept)
    assert not any("manual_run" in uri or "datasets/mine" in uri for uri in listed)
    retention.apply_plan(plan, client=s3)
    remaining = keys(s3, bucket)
    assert {"runs/manual_run/onnx/model.onnx", "datasets/mine/latest/data.bin"} <= set(remaining)
    assert f"{_key(reached)}/onnx/model.onnx" in remaining
    assert not any(k.startswith(_key(refused)) for k in remaining)


def test_the_operators_templated_settings_are_documented_and_checked_at_parse_time():
    from horovod_airflow.operators import BucketRetentionOperator
    from tests.operators.helpers import undocumented_template_fields

    assert set(BucketRetentionOperator.template_fields) == {"bucket_uri", "keep_runs",
                                                            "list_only"}  # fmt: skip
    assert undocumented_template_fields(BucketRetentionOperator) == []
    base = {"task_id": "retain", "bucket_uri": "s3://b"}
    for kwargs, message in [
        ({"keep_runs": 0}, r"keep_runs=0: expected a whole number of runs from 1 to 100000"),
        ({"list_only": "maybe"}, r"list_only must be true or false, got 'maybe'"),
        ({"in_flight_window": timedelta(0)}, r"in_flight_window=.*expected a positive"),
        ({"bucket_uri": ""}, r"bucket_uri must be a URI"),
    ]:
        with pytest.raises(ValueError, match=message):
            BucketRetentionOperator(**{**base, **kwargs})
    # Templates are checked once rendered, in execute.
    BucketRetentionOperator(**base, keep_runs="{{ params.keep_runs }}",
                            list_only="{{ params.dry_run }}")  # fmt: skip


def test_a_running_dag_without_a_run_prefix_yet_holds_dataset_deletions(s3_server):
    s3 = s3_server.client()
    bucket = s3_server.new_bucket("retain-first")
    orphan = fake_dataset(s3, bucket, "orphan")
    split = _split_phases()
    asked: list[str] = []

    def first_run_staging(dag_id: str) -> bool:
        asked.append(dag_id)
        return dag_id == "mnist_horovod_retrain"

    plan = retention.plan_retention(f"s3://{bucket}", POLICY, client=s3, now=split + WINDOW,
                                    dag_is_active=first_run_staging,
                                    dag_ids=["mnist_horovod_retrain"])  # fmt: skip
    assert asked == ["mnist_horovod_retrain"] and plan.delete == ()
    assert {p.uri: p.reason for p in plan.keep}[orphan[0]] == (
        "dataset deletions wait: Airflow reports an active run of mnist_horovod_retrain"
    )
    idle = retention.plan_retention(f"s3://{bucket}", POLICY, client=s3, now=split + WINDOW,
                                    dag_is_active=lambda dag_id: False,
                                    dag_ids=["mnist_horovod_retrain"])  # fmt: skip
    assert [p.uri for p in idle.delete] == [orphan[0]]


def test_a_refused_candidate_and_the_dataset_it_names_are_kept(s3_server):
    """A refused run's model kept as a refused candidate (an admin may promote it): nothing
    under models/ goes, and its dataset stays though no published version names it."""
    from horovod_airflow.core.contract import GATE
    from horovod_airflow.operators.model_registry.refused import record_refused
    from tests.operators.helpers import put_run_artifacts

    s3 = s3_server.client()
    bucket = s3_server.new_bucket("retain-refused")
    dataset, content_hash = fake_dataset(s3, bucket, "mnist")
    refused = run_prefix(bucket, "fake", "scheduled__refused")
    _, exported = put_run_artifacts(s3, refused, accuracy=0.5)
    gate = {"passed": False, "reason": "below the floor", "challenger_accuracy": 0.5,
            "min_accuracy": 0.9, "max_regression": 0.0}  # fmt: skip
    storage.write_text(f"{refused}/gate.json", GATE.dumps(gate), client=s3)
    record_refused(f"s3://{bucket}", RunModel(
        model_name="mnist_cnn", version=V1, run_output=refused, onnx_uri=exported["onnx_uri"],
        parity_uri=exported["parity_uri"], gate=gate, dag_run_id="scheduled__refused",
        dataset={"uri": dataset, "content_hash": content_hash}), client=s3)  # fmt: skip
    split = _split_phases()
    write_run(s3, run_prefix(bucket, "fake", "scheduled__newest"), gate=False)
    models_before = {k: v for k, v in keys(s3, bucket).items() if k.startswith("models/")}
    assert any(k.startswith(f"models/mnist_cnn/refused/{V1}/") for k in models_before)

    plan = retention.plan_retention(f"s3://{bucket}", POLICY, client=s3, now=split + WINDOW)
    kept = {p.uri: p.reason for p in plan.keep}
    assert kept[dataset] == f"named by published mnist_cnn {V1} (refused candidate)", kept
    assert [p.uri for p in plan.delete] == [refused]  # the candidate holds its own copy
    retention.apply_plan(plan, client=s3)
    remaining = keys(s3, bucket)
    assert {k: v for k, v in remaining.items() if k.startswith("models/")} == models_before
    assert f"{_key(dataset)}/manifest.json" in remaining
