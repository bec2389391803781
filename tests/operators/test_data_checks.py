"""The data checks of the staging step: each check and threshold on real IDX / .npy files, and
staging against the real S3 server (a refused dataset uploads nothing and never becomes the
baseline of a later staging)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from horovod_airflow.core import contract, fileset, layout, storage
from horovod_airflow.operators.data_checks import DataCheckError, DataChecks, compare
from horovod_airflow.operators.exceptions import DatasetRefusedError
from horovod_airflow.operators.retry import classify
from horovod_airflow.operators.stage import StageDatasetOperator
from horovod_airflow.operators.staging import stage_dataset, stage_files
from tests.mnist_subset import read_split, write_dataset, write_subset

REPO = Path(__file__).resolve().parents[2]
MNIST = REPO / "data" / "mnist"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """The first 3000 train / 1000 test samples of the real MNIST, as arrays."""
    folder = write_subset(MNIST, tmp_path_factory.mktemp("base"), train=3000, test=1000)
    return {split: read_split(folder, split) for split in ("train", "test")}


def _manifest(tmp_path: Path, splits: dict[str, tuple[Any, Any]], name: str = "x") -> dict:
    folder = write_dataset(tmp_path / f"ds-{len(list(tmp_path.iterdir()))}", splits)
    return layout.build_manifest("mnist", layout.find_source_files(folder))


def _take(split: tuple[Any, Any], keep: Any) -> tuple[Any, Any]:
    return split[0][keep], split[1][keep]


def test_manifest_v2_records_what_the_checks_compare(tmp_path, base):
    manifest = _manifest(tmp_path, base)
    assert manifest["format"] == contract.DATASET_FORMAT == "horovod-airflow/dataset-v2"
    images = layout.entry_for(manifest, "train", "images")
    labels = layout.entry_for(manifest, "train", "labels")
    assert images["samples"] == 3000 and images["shape"] == [3000, 28, 28]
    assert images["dtype"] == "uint8" and images["duplicates"] == 0
    want = np.bincount(base["train"][1], minlength=10)
    assert labels["classes"] == {str(c): int(n) for c, n in enumerate(want)}
    assert layout.parse_manifest(json.dumps(manifest)) == manifest


def test_unchanged_and_slightly_grown_pass(tmp_path, base):
    checks = DataChecks()
    before = _manifest(tmp_path, base)
    assert compare(before, before, checks) == []
    grown = {"train": _take(base["train"], slice(0, 3000)), "test": base["test"]}
    extra = write_subset(MNIST, tmp_path / "more", train=3300, test=1000)
    grown["train"] = read_split(extra, "train")
    assert compare(_manifest(tmp_path, grown), before, checks) == []


def test_a_tenth_of_the_rows_fails_naming_the_split_and_the_drop(tmp_path, base):
    before = _manifest(tmp_path, base)
    tenth = {s: _take(base[s], slice(0, len(base[s][0]) // 10)) for s in base}
    problems = compare(_manifest(tmp_path, tenth), before, DataChecks())
    assert "train: 300 samples, previously 3000 (-90.0 %, allowed -50 %)" in problems
    assert "test: 100 samples, previously 1000 (-90.0 %, allowed -50 %)" in problems
    # A looser threshold lets the same drop through (a 100-sample split's class shares are
    # noisy: they are the class balance check's business, not this one's).
    loose = compare(_manifest(tmp_path, tenth), before, DataChecks(max_sample_drop=0.95))
    assert [p for p in loose if "class" not in p] == [], loose


def test_a_missing_class_fails_naming_it(tmp_path, base):
    before = _manifest(tmp_path, base)
    without_7 = {"train": _take(base["train"], base["train"][1] != 7), "test": base["test"]}
    problems = compare(_manifest(tmp_path, without_7), before, DataChecks())
    share = (base["train"][1] == 7).mean()
    assert problems == [
        f"class 7 missing from train (previously {(base['train'][1] == 7).sum()} samples, "
        f"{100 * share:.1f} %)"
    ], problems


def test_a_class_share_change_beyond_the_threshold_fails(tmp_path, base):
    before = _manifest(tmp_path, base)
    labels = base["train"][1]
    # Drop three quarters of the 1s: their share falls from ~11 % to ~3 %.
    ones = np.flatnonzero(labels == 1)
    keep = np.ones(len(labels), bool)
    keep[ones[: 3 * len(ones) // 4]] = False
    skewed = {"train": _take(base["train"], keep), "test": base["test"]}
    problems = compare(_manifest(tmp_path, skewed), before, DataChecks())
    (one,) = [p for p in problems if "class 1 " in p]
    assert one.startswith("train: class 1 is ") and "allowed ±5 points" in one, problems
    assert (
        compare(_manifest(tmp_path, skewed), before, DataChecks(max_class_share_change=0.2)) == []
    )


def test_duplicates_beyond_the_threshold_fail_even_on_a_first_staging(tmp_path, base):
    images, labels = base["train"]
    doubled = (np.concatenate([images, images[:600]]), np.concatenate([labels, labels[:600]]))
    manifest = _manifest(tmp_path, {"train": doubled, "test": base["test"]})
    assert layout.entry_for(manifest, "train", "images")["duplicates"] == 600
    want = "train: 600 of 3600 samples (16.7 %) repeat an earlier sample (allowed 5 %)"
    assert compare(manifest, None, DataChecks()) == [want]
    assert compare(manifest, None, DataChecks(max_duplicate_fraction=0.2)) == []


def _npy_set(folder: Path, signals: Any, labels: Any) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "train_signals.npy", signals)
    np.save(folder / "train_labels.npy", labels)
    return [folder / "train_labels.npy", folder / "train_signals.npy"]


def test_a_file_set_compares_its_npy_arrays_shapes_dtypes_and_declared_labels(tmp_path):
    rng = np.random.default_rng(0)
    signals = rng.normal(size=(400, 16)).astype("float32")
    labels = np.arange(400, dtype=np.int64) % 4
    checks = DataChecks(class_labels=("train_labels.npy",))
    before = fileset.build_manifest(
        "w", _npy_set(tmp_path / "a", signals, labels), class_labels=checks.class_labels
    )
    assert before["format"] == contract.FILESET_FORMAT == "horovod-airflow/fileset-v2"
    entries = {e["name"]: e for e in before["files"]}
    assert entries["train_signals.npy"]["shape"] == [400, 16]
    assert entries["train_signals.npy"]["dtype"] == "float32"
    assert entries["train_labels.npy"]["classes"] == {"0": 100, "1": 100, "2": 100, "3": 100}

    def manifest(folder: str, s: Any, y: Any) -> dict:
        files = _npy_set(tmp_path / folder, s, y)
        return fileset.build_manifest("w", files, class_labels=checks.class_labels)

    assert compare(manifest("same", signals, labels), before, checks) == []
    problems = compare(manifest("f64", signals.astype("float64")[:100], labels[:100]), before,
                       checks)  # fmt: skip
    assert "train_signals.npy: dtype float64, previously float32" in problems
    assert "train_signals.npy: 100 samples, previously 400 (-75.0 %, allowed -50 %)" in problems
    wide = manifest("wide", rng.normal(size=(400, 32)).astype("float32"), labels)
    assert compare(wide, before, checks) == [
        "train_signals.npy: samples shaped [32], previously [16]"
    ]
    no_3 = manifest("no3", signals[labels != 3], labels[labels != 3])
    assert "class 3 missing from train_labels.npy (previously 100 samples, 25.0 %)" in compare(
        no_3, before, checks
    )
    only_signals = tmp_path / "only"
    only_signals.mkdir()
    np.save(only_signals / "train_signals.npy", signals)
    lone = fileset.build_manifest("w", [only_signals / "train_signals.npy"])
    assert compare(lone, before, checks) == ["train_labels.npy: missing (previously 400 samples)"]


def test_a_v1_manifest_is_read_and_compared_by_what_it_has(tmp_path, base):
    before = _manifest(tmp_path, base)
    v1 = {**before, "format": contract.LEGACY_DATASET_FORMAT}
    v1["files"] = [{k: v for k, v in e.items() if k not in ("dtype", "duplicates", "classes")}
                   for e in before["files"]]  # fmt: skip
    parsed = layout.parse_manifest(json.dumps(v1))
    without_7 = {"train": _take(base["train"], base["train"][1] != 7), "test": base["test"]}
    # A v1 previous has no class counts: the missing class is not seen, the counts are.
    assert compare(_manifest(tmp_path, without_7), parsed, DataChecks()) == []
    tenth = {s: _take(base[s], slice(0, len(base[s][0]) // 10)) for s in base}
    assert len(compare(_manifest(tmp_path, tenth), parsed, DataChecks())) == 2
    old_fileset = {"format": contract.LEGACY_FILESET_FORMAT, "name": "w", "files": [
        {"name": "a.npy", "size": 1, "sha256": "0" * 64}]}  # fmt: skip
    old_fileset["content_hash"] = layout.content_hash(old_fileset["files"])
    assert fileset.parse_manifest(json.dumps(old_fileset)) == old_fileset


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_sample_drop": 1.5}, "DataChecks.max_sample_drop must be from 0 to 1, got 1.5"),
        ({"max_sample_drop": -0.1}, "DataChecks.max_sample_drop must be from 0 to 1"),
        ({"max_class_share_change": "0.1"}, "DataChecks.max_class_share_change must be a number"),
        ({"max_duplicate_fraction": True}, "DataChecks.max_duplicate_fraction must be a number"),
        ({"max_duplicate_fraction": math.nan}, "DataChecks.max_duplicate_fraction must be a num"),
        ({"class_labels": "labels.npy"}, "DataChecks.class_labels must be a list of file names"),
        ({"class_labels": ("a/b.npy",)}, "DataChecks.class_labels must be a list of file names"),
        ({"check": "no_colon"}, "DataChecks.check must be an import path 'package.module:func"),
        ({"check": ":f"}, "DataChecks.check must be an import path"),
    ],
)
def test_bad_thresholds_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("'", "'")):
        DataChecks(**kwargs)


def test_the_operator_checks_by_default_with_the_documented_thresholds():
    op = StageDatasetOperator(task_id="s", source="vendored", bucket_uri="s3://b",
                              dataset_name="mnist")  # fmt: skip
    assert op.checks is not None
    assert (op.checks.max_sample_drop, op.checks.max_class_share_change,
            op.checks.max_duplicate_fraction) == (0.5, 0.05, 0.05)  # fmt: skip
    assert op.checks.class_labels == () and op.checks.check is None
    with pytest.raises(ValueError, match="checks must be a DataChecks or None"):
        StageDatasetOperator(task_id="s", source="vendored", bucket_uri="s3://b",
                             dataset_name="mnist", checks={"max_sample_drop": 0.5})  # fmt: skip
    with pytest.raises(ValueError, match="class_labels names label files of a file set"):
        StageDatasetOperator(task_id="s", source="vendored", bucket_uri="s3://b",
                             dataset_name="mnist",
                             checks=DataChecks(class_labels=("y.npy",)))  # fmt: skip


def too_few_sines(manifest: dict, previous: dict | None, files: dict[str, Path]) -> list[str]:
    """A user check (by import path): fewer than 50 samples of class 0 is refused."""
    labels = np.load(files["train_labels.npy"])
    n = int((labels == 0).sum())
    return [f"only {n} sine samples (at least 50)"] if n < 50 else []


def test_a_user_check_by_import_path_refuses_a_file_set_and_uploads_nothing(tmp_path):
    labels = np.arange(400, dtype=np.int64) % 4
    signals = np.random.default_rng(1).normal(size=(400, 8)).astype("float32")
    checks = DataChecks(check="tests.operators.test_data_checks:too_few_sines")
    bucket = tmp_path / "bucket"
    _npy_set(tmp_path / "good", signals, labels)
    good = stage_files(str(tmp_path / "good"), str(bucket), name="w", patterns=["*.npy"],
                       checks=checks)  # fmt: skip
    assert good["checks"] == {"passed": True, "previous": None, "previous_staged_at": None}
    few = labels.copy()
    few[few == 0] = 1
    few[:10] = 0
    _npy_set(tmp_path / "bad", signals, few)
    before = sorted(storage.list_uris(str(bucket)))
    with pytest.raises(DataCheckError, match="too_few_sines: only 10 sine samples"):
        stage_files(str(tmp_path / "bad"), str(bucket), name="w", patterns=["*.npy"],
                    checks=checks)  # fmt: skip
    assert sorted(storage.list_uris(str(bucket))) == before
    with pytest.raises(ValueError, match=r"DataChecks\.check .* does not import"):
        stage_files(str(tmp_path / "bad"), str(bucket), name="w", patterns=["*.npy"],
                    checks=DataChecks(check="tests.no_such_module:f"))  # fmt: skip


def _keys(client: Any, bucket: str) -> dict[str, str]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            out[o["Key"]] = o["ETag"]
    return out


def test_staging_on_s3_refuses_and_a_refused_dataset_never_becomes_the_baseline(
    s3_server, tmp_path, base, caplog
):
    client = s3_server.client()
    bucket = s3_server.new_bucket("checks")
    uri = f"s3://{bucket}"
    checks = DataChecks()
    full = write_dataset(tmp_path / "full", base)
    with caplog.at_level("INFO", logger="horovod_airflow.operators.data_checks"):
        first = stage_dataset(str(full), uri, client=client, checks=checks)
    assert first["checks"]["previous"] is None
    assert "first staged dataset named 'mnist': nothing to compare with" in caplog.text

    tenth = write_dataset(tmp_path / "tenth", {s: _take(base[s], slice(0, len(base[s][0]) // 10))
                                              for s in base})  # fmt: skip
    before = _keys(client, bucket)
    with pytest.raises(DataCheckError) as refused:
        stage_dataset(str(tenth), uri, client=client, checks=checks)
    message = str(refused.value)
    assert f"against {first['uri']} (staged " in message
    assert "train: 300 samples, previously 3000 (-90.0 %, allowed -50 %)" in message
    assert "Nothing was staged at" in message
    assert _keys(client, bucket) == before  # nothing uploaded: no prefix, no manifest
    assert classify(refused.value)[0] == "fail"  # a ValueError: the retry policy fails it

    # A prefix an interrupted upload left without its manifest is not a candidate either.
    client.put_object(Bucket=bucket, Key="datasets/mnist/0123456789abcdef/x.gz", Body=b"x")
    # 15 % of the rows: would pass against the refused tenth (+50 %), fails against the first.
    cut = {s: _take(base[s], slice(0, 15 * len(base[s][0]) // 100)) for s in base}
    with pytest.raises(DataCheckError, match=r"train: 450 samples, previously 3000 \(-85.0 %"):
        stage_dataset(str(write_dataset(tmp_path / "cut", cut)), uri, client=client,
                      checks=checks)  # fmt: skip

    # Slightly grown: passes against the first, and becomes the next baseline.
    grown_dir = write_subset(MNIST, tmp_path / "grown", train=3300, test=1000)
    grown = stage_dataset(str(grown_dir), uri, client=client, checks=checks)
    assert grown["checks"]["previous"] == first["uri"] and grown["uploaded"]
    again = stage_dataset(str(full), uri, client=client, checks=checks)
    assert again["checks"]["previous"] == grown["uri"] and again["uploaded"] == []


def test_the_operator_fails_a_refused_dataset_without_retry(tmp_path, base):
    from airflow.sdk.exceptions import AirflowFailException

    bucket = tmp_path / "bucket"
    source = str(write_dataset(tmp_path / "a", base))
    op = StageDatasetOperator(task_id="stage", source=source, bucket_uri=str(bucket),
                              dataset_name="mnist", aws_conn_id=None)  # fmt: skip
    assert op.execute({})["checks"]["passed"] is True
    without_7 = {"train": _take(base["train"], base["train"][1] != 7), "test": base["test"]}
    op.source = str(write_dataset(tmp_path / "b", without_7))
    with pytest.raises(DatasetRefusedError, match="stage: dataset 'mnist' refused") as e:
        op.execute({})
    assert isinstance(e.value, AirflowFailException)
    assert "class 7 missing from train" in str(e.value)


def test_the_waveforms_app_declares_its_checks_and_its_own_check_refuses_nan(tmp_path):
    from examples.waveforms import data
    from examples.waveforms.settings import DATA_CHECKS, DATASET_DIR

    assert DATA_CHECKS.class_labels == ("train_labels.npy", "test_labels.npy")
    bucket = str(tmp_path / "bucket")
    first = stage_files(str(DATASET_DIR), bucket, name="waveforms", patterns=["*.npy"],
                        checks=DATA_CHECKS)  # fmt: skip
    assert first["checks"]["previous"] is None
    broken = tmp_path / "broken"
    data.write_dataset(broken)
    signals = np.load(broken / "train_signals.npy")
    signals[:5, 3] = np.nan
    np.save(broken / "train_signals.npy", signals)
    with pytest.raises(DataCheckError, match=r"train_signals\.npy: 5 samples hold NaN or inf"):
        stage_files(str(broken), bucket, name="waveforms", patterns=["*.npy"], checks=DATA_CHECKS)
    labels = np.load(broken / "train_labels.npy")
    data.write_dataset(broken)
    np.save(broken / "train_labels.npy", labels[labels != 2])
    with pytest.raises(DataCheckError) as e:
        stage_files(str(broken), bucket, name="waveforms", patterns=["*.npy"], checks=DATA_CHECKS)
    assert "class 2 missing from train_labels.npy (previously 300 samples, 25.0 %)" in str(e.value)
    assert "train_labels.npy must be integers [1200]" in str(e.value)  # the example's own check


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_a_local_bucket_finds_its_previous_dataset_by_path_or_file_uri(tmp_path, base, scheme):
    bucket = f"{scheme}{tmp_path / 'bucket'}"
    first = stage_dataset(str(write_dataset(tmp_path / "a", base)), bucket, checks=DataChecks())
    tenth = {s: _take(base[s], slice(0, len(base[s][0]) // 10)) for s in base}
    with pytest.raises(DataCheckError, match=f"against {first['uri']} "):
        stage_dataset(str(write_dataset(tmp_path / "b", tenth)), bucket, checks=DataChecks())
