"""stage_dataset against the real S3 server: content-addressed, idempotent, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from horovod_airflow.core import layout, storage
from horovod_airflow.operators.staging import stage_dataset
from tests.mnist_subset import write_subset

REPO = Path(__file__).resolve().parents[2]


def _objects(client, bucket: str) -> dict[str, tuple[str, object]]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            out[o["Key"]] = (o["ETag"], o["LastModified"])
    return out


def test_stage_is_content_addressed_and_idempotent(s3_server, mnist_subset):
    client = s3_server.client()
    bucket = f"stage-{id(mnist_subset) % 10**8}"  # created by stage_dataset itself
    first = stage_dataset(str(mnist_subset), f"s3://{bucket}", client=client)

    manifest = layout.build_manifest("mnist", layout.find_source_files(mnist_subset))
    assert first["uri"] == f"s3://{bucket}/datasets/mnist/{manifest['content_hash'][:16]}"
    assert first["splits"] == {"train": 2000, "test": 500}
    assert sorted(first["uploaded"]) == sorted(
        [p.name for p in layout.find_source_files(mnist_subset).values()] + ["manifest.json"]
    )
    staged = layout.parse_manifest(
        storage.read_bytes(first["uri"] + "/manifest.json", client=client)
    )
    assert staged == manifest
    before = _objects(client, bucket)

    second = stage_dataset(str(mnist_subset), f"s3://{bucket}", client=client)
    assert second["uri"] == first["uri"]
    assert second["uploaded"] == []
    assert _objects(client, bucket) == before


def test_changed_dataset_gets_a_new_prefix_and_a_damaged_one_is_restaged(s3_server, tmp_path):
    client = s3_server.client()
    bucket = s3_server.new_bucket("stage")
    a = write_subset(REPO / "data" / "mnist", tmp_path / "a", train=300, test=100)
    b = write_subset(REPO / "data" / "mnist", tmp_path / "b", train=400, test=100)
    first = stage_dataset(str(a), f"s3://{bucket}", client=client)
    other = stage_dataset(str(b), f"s3://{bucket}", client=client)
    assert first["uri"] != other["uri"]
    assert other["content_hash"] != first["content_hash"]

    # A prefix whose file was truncated is not "already staged": it is uploaded again.
    loc = storage.parse(first["uri"])
    client.put_object(Bucket=loc.bucket, Key=f"{loc.key}/t10k-labels-idx1-ubyte.gz", Body=b"x")
    again = stage_dataset(str(a), f"s3://{bucket}", client=client)
    assert "t10k-labels-idx1-ubyte.gz" in again["uploaded"]


def test_stage_from_an_s3_source(s3_server, mnist_subset):
    client = s3_server.client()
    bucket = s3_server.new_bucket("src")
    for path in mnist_subset.iterdir():
        storage.upload_file(path, f"s3://{bucket}/incoming/{path.name}", client=client)
    staged = stage_dataset(f"s3://{bucket}/incoming", f"s3://{bucket}", client=client)
    manifest = json.loads(storage.read_text(staged["uri"] + "/manifest.json", client=client))
    assert manifest["splits"] == {"train": 2000, "test": 500}


def test_vendored_default_is_the_real_mnist(s3_server):
    client = s3_server.client()
    bucket = s3_server.new_bucket("vendored")
    staged = stage_dataset("vendored", f"s3://{bucket}", client=client)
    assert staged["splits"] == {"train": 60000, "test": 10000}


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("ftp://host/mnist", "use 'vendored', an s3:// prefix or a local folder"),
        ("/nonexistent/folder", "is not a folder"),
    ],
)
def test_bad_sources_are_named(s3_server, source, message):
    with pytest.raises(layout.DatasetError, match=message):
        stage_dataset(source, f"s3://{s3_server.new_bucket('bad')}", client=s3_server.client())


def test_incomplete_source_names_the_missing_files(s3_server, mnist_subset):
    (mnist_subset / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(layout.DatasetError, match=r"lacks t10k-labels-idx1-ubyte\[\.gz\]"):
        stage_dataset(str(mnist_subset), f"s3://{s3_server.new_bucket('bad')}",
                      client=s3_server.client())  # fmt: skip


def test_mismatched_image_and_label_counts_are_rejected(tmp_path, mnist_subset):
    b = write_subset(REPO / "data" / "mnist", tmp_path / "short", train=100, test=100)
    (mnist_subset / "train-labels-idx1-ubyte.gz").write_bytes(
        (b / "train-labels-idx1-ubyte.gz").read_bytes()
    )
    with pytest.raises(layout.DatasetError, match="split 'train'"):
        layout.build_manifest("mnist", layout.find_source_files(mnist_subset))


def test_read_idx_matches_torchvision_and_rejects_a_truncated_body(tmp_path, mnist_subset):
    import gzip

    from torchvision.datasets.mnist import read_sn3_pascalvincent_tensor

    gz = mnist_subset / "train-labels-idx1-ubyte.gz"
    plain = tmp_path / "train-labels-idx1-ubyte"
    plain.write_bytes(gzip.decompress(gz.read_bytes()))
    labels = layout.read_idx(gz)
    assert labels.shape == (2000,)
    assert labels[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]  # MNIST's first labels
    assert (labels == read_sn3_pascalvincent_tensor(str(plain)).numpy()).all()

    plain.write_bytes(plain.read_bytes()[:-1])
    with pytest.raises(layout.DatasetError, match="header says"):
        layout.read_idx(plain)


def test_the_vendored_mnist_folder_follows_hva_vendored_mnist(monkeypatch, tmp_path):
    """The Airflow image keeps the MNIST files apart from the package: staging and serving
    both find them through HVA_VENDORED_MNIST, and a wrong folder is named."""
    from horovod_airflow.apps import mnist
    from horovod_airflow.core import layout
    from horovod_airflow.operators import staging

    monkeypatch.setenv("HVA_VENDORED_MNIST", str(staging.VENDORED_MNIST))
    assert staging.vendored_mnist() == staging.VENDORED_MNIST
    images, labels = mnist.load_test_images(3)
    assert images.shape == (3, 28, 28) and labels.shape == (3,)
    monkeypatch.setenv("HVA_VENDORED_MNIST", str(tmp_path / "nowhere"))
    with pytest.raises(layout.DatasetError, match="nowhere; set HVA_VENDORED_MNIST"):
        mnist.load_test_images(3)
