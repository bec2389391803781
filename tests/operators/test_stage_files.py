"""Staging any files (a content-addressed file set) and the gate's pluggable champion scorer:
the generic pieces a second model needs, against the real S3 server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from horovod_airflow.core import fileset, storage
from horovod_airflow.core.layout import DatasetError, DatasetIntegrityError
from horovod_airflow.operators import HorovodConfigError, ModelGateOperator, StageDatasetOperator
from horovod_airflow.operators.model_registry import gate_challenger, resolve_champion_scorer
from horovod_airflow.operators.staging import stage_files
from tests.operators.helpers import publish_fake_model


def _folder(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.npy").write_bytes(b"alpha" * 100)
    (src / "b.npy").write_bytes(b"beta" * 100)
    (src / "notes.txt").write_text("not staged")
    return src


def test_stage_files_is_content_addressed_idempotent_and_verified_on_fetch(s3_server, tmp_path):
    client = s3_server.client()
    bucket = s3_server.new_bucket("files")
    src = _folder(tmp_path)
    first = stage_files(str(src), f"s3://{bucket}", name="sig", patterns=["*.npy"], client=client)
    manifest = fileset.build_manifest("sig", [src / "a.npy", src / "b.npy"])
    assert first["uri"] == f"s3://{bucket}/datasets/sig/{manifest['content_hash'][:16]}"
    assert first["files"] == ["a.npy", "b.npy"]
    assert first["uploaded"] == ["a.npy", "b.npy", "manifest.json"]
    staged = fileset.read_manifest(first["uri"], client=client)
    assert staged == manifest and staged["format"] == "horovod-airflow/fileset-v2"

    again = stage_files(str(src), f"s3://{bucket}", name="sig", patterns=["*.npy"], client=client)
    assert again["uri"] == first["uri"] and again["uploaded"] == []

    # From an s3:// source too: the same content, the same prefix.
    from_s3 = stage_files(first["uri"], f"s3://{bucket}", name="sig", patterns=["a.npy", "b.*"],
                          client=client)  # fmt: skip
    assert from_s3["uri"] == first["uri"] and from_s3["uploaded"] == []

    got, paths = fileset.fetch_files(first["uri"], tmp_path / "fetched", client=client)
    assert got == manifest and paths["a.npy"].read_bytes() == b"alpha" * 100

    loc = storage.parse(first["uri"])
    client.put_object(Bucket=loc.bucket, Key=f"{loc.key}/b.npy", Body=b"beta" * 99 + b"gamm")
    with pytest.raises(DatasetIntegrityError, match=r"b\.npy: sha256"):
        fileset.fetch_files(first["uri"], tmp_path / "again", client=client)


def test_stage_files_refuses_bad_sources_and_patterns_naming_them(tmp_path):
    src = _folder(tmp_path)
    with pytest.raises(DatasetError, match=r"no file matches \['\*\.csv'\]"):
        stage_files(str(src), str(tmp_path / "b"), name="sig", patterns=["*.npy", "*.csv"])
    with pytest.raises(DatasetError, match="'vendored' is the bundled MNIST"):
        stage_files("vendored", str(tmp_path / "b"), name="sig", patterns=["*.npy"])
    with pytest.raises(ValueError, match="no '/'"):
        stage_files(str(src), str(tmp_path / "b"), name="sig", patterns=["sub/*.npy"])
    with pytest.raises(ValueError, match="non-empty list"):
        StageDatasetOperator(task_id="s", source=str(src), bucket_uri="s3://b",
                             dataset_name="sig", files="*.npy")  # fmt: skip
    with pytest.raises(ValueError, match="'vendored' is the bundled MNIST"):
        StageDatasetOperator(task_id="s", source="vendored", bucket_uri="s3://b",
                             dataset_name="sig", files=["*.npy"])  # fmt: skip
    with pytest.raises(DatasetError, match="'format' must be one of horovod-airflow/fileset-v2, "):
        fileset.parse_manifest(json.dumps({"format": "horovod-airflow/dataset-v1"}))


def test_stage_operator_stages_files_to_a_local_bucket(tmp_path):
    src = _folder(tmp_path)
    op = StageDatasetOperator(task_id="s", source=str(src), bucket_uri=str(tmp_path / "bucket"),
                              dataset_name="sig", files=["*.npy"], aws_conn_id=None)  # fmt: skip
    result = op.execute({})
    assert result["files"] == ["a.npy", "b.npy"] and "splits" not in result
    assert sorted(p.name for p in Path(result["uri"]).iterdir()) == [
        "a.npy", "b.npy", "manifest.json"
    ]  # fmt: skip


def fixed_scorer(published: dict[str, Any], dataset_uri: str, *, client: Any = None) -> dict:
    """A champion scorer for the tests: the champion scores 0.9 on any dataset."""
    return {"accuracy": 0.9, "version": published["version"], "dataset_uri": dataset_uri}


def test_champion_scorer_is_resolved_from_a_path_or_refused_naming_it():
    assert resolve_champion_scorer(f"{__name__}:fixed_scorer") is fixed_scorer
    assert resolve_champion_scorer(fixed_scorer) is fixed_scorer
    assert resolve_champion_scorer(None) is None
    with pytest.raises(ValueError, match=r"'package\.module:function'"):
        resolve_champion_scorer("tests.operators.test_stage_files.fixed_scorer")
    with pytest.raises(ValueError, match="does not import"):
        resolve_champion_scorer("tests.operators.nowhere:f")
    with pytest.raises(ValueError, match=r"'package\.module:function'"):
        ModelGateOperator(task_id="g", bucket_uri="s3://b", model_name="m",
                          metrics={"val_accuracy": 1.0, "output": "s3://b/r"},
                          dataset={"uri": "s3://b/d"}, min_accuracy=0.5,
                          champion_scorer=42)  # fmt: skip


def test_the_gate_rescores_a_champion_on_other_data_with_the_given_scorer(s3_server):
    client = s3_server.client()
    bucket = s3_server.new_bucket("scorer")
    publish_fake_model(client, bucket, version="v-champ", onnx_bytes=b"opaque", accuracy=0.95,
                       dataset_hash="a" * 64, dag_run_id="r-champ")  # fmt: skip
    kwargs: dict[str, Any] = {
        "task_id": "gate", "bucket_uri": f"s3://{bucket}", "model_name": "mnist_cnn",
        "metrics": {"val_accuracy": 0.89, "output": f"s3://{bucket}/runs/new"},
        "dataset": {"uri": f"s3://{bucket}/datasets/x/b", "content_hash": "b" * 64},
        "min_accuracy": 0.5, "max_regression": 0.02, "aws_conn_id": None,
    }  # fmt: skip
    decision = ModelGateOperator(**kwargs, champion_scorer=f"{__name__}:fixed_scorer").execute({})
    assert decision is not None and decision["passed"] is True
    assert decision["champion_rescored"] is True and decision["champion_accuracy"] == 0.9
    assert decision["champion_stored_accuracy"] == 0.95

    refused = gate_challenger(
        bucket_uri=f"s3://{bucket}", model_name="mnist_cnn", metrics=kwargs["metrics"],
        dataset=kwargs["dataset"], min_accuracy=0.5, max_regression=0.02, client=client,
        champion_scorer=None,
    )  # fmt: skip
    assert refused.passed is False and "not re-scored" in refused.reason

    with pytest.raises(HorovodConfigError, match="does not import"):
        ModelGateOperator(**kwargs, champion_scorer="tests.nowhere:f").execute({})
