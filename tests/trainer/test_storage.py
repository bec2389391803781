"""Local-folder side of ``horovod_airflow.core.storage``: atomic writes with the modes
``open()`` would give."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from horovod_airflow.core import storage


@pytest.fixture
def umask_027() -> Iterator[None]:
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_follow_the_umask_not_mkstemps_0600(tmp_path: Path, umask_027) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(b"payload")  # open(): 0o666 & ~umask
    expected = _mode(source)
    assert expected == 0o640

    storage.write_bytes(str(tmp_path / "a" / "metrics.json"), b"{}")
    storage.upload_file(source, str(tmp_path / "b" / "model.onnx"))
    storage.download_file(str(source), tmp_path / "c" / "copy.bin")

    for path in (tmp_path / "a/metrics.json", tmp_path / "b/model.onnx", tmp_path / "c/copy.bin"):
        assert _mode(path) == expected, path
        assert path.read_bytes() in (b"{}", b"payload")
    leftovers = [p.name for p in tmp_path.rglob(".*.tmp")]
    assert leftovers == []  # the temporary files were renamed, none left behind


def test_failed_download_leaves_no_temporary_file(tmp_path: Path) -> None:
    dest = tmp_path / "out" / "x.bin"
    with pytest.raises(storage.StorageError, match="does not exist"):
        storage.download_file(str(tmp_path / "missing.bin"), dest)
    assert list((tmp_path / "out").iterdir()) == []


def _unreachable_client() -> object:
    import boto3
    from botocore.config import Config

    from tests.conftest import free_port

    return boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        aws_access_key_id="AKIAEXAMPLE",
        aws_secret_access_key="never-in-a-message",
        region_name="us-east-1",
        config=Config(retries={"max_attempts": 1}, connect_timeout=2),
    )


@pytest.mark.parametrize(
    ("operation", "call"),
    [
        ("GetObject", lambda c: storage.read_bytes("s3://b/k", client=c)),
        ("PutObject", lambda c: storage.write_bytes("s3://b/k", b"x", client=c)),
        ("HeadObject", lambda c: storage.exists("s3://b/k", client=c)),
        ("ListObjectsV2", lambda c: list(storage.list_uris("s3://b/p", client=c))),
        ("HeadBucket", lambda c: storage.ensure_bucket("s3://b", client=c)),
    ],
)
def test_an_unreachable_endpoint_is_named_with_the_operation(operation, call) -> None:
    client = _unreachable_client()
    endpoint = client.meta.endpoint_url
    with pytest.raises(storage.StorageError) as err:
        call(client)
    message = str(err.value)
    assert f"S3 {operation} of s3://b" in message and f"at {endpoint} failed" in message
    assert "EndpointConnectionError" in message
    assert "never-in-a-message" not in message
    assert isinstance(err.value, storage.TransientStorageError)  # a retry may reach it


def test_download_from_an_unreachable_endpoint_names_it(tmp_path: Path) -> None:
    client = _unreachable_client()
    with pytest.raises(storage.StorageError, match=r"S3 download \(GetObject\) of s3://b/k at"):
        storage.download_file("s3://b/k", tmp_path / "k", client=client)
    assert list(tmp_path.iterdir()) == []


def test_the_servers_refusal_is_named_with_its_code(s3_server) -> None:
    client = s3_server.client()
    with pytest.raises(storage.StorageError) as err:
        storage.write_bytes("s3://no-such-bucket-here/k", b"x", client=client)
    message = str(err.value)
    assert f"S3 PutObject of s3://no-such-bucket-here/k at {s3_server.endpoint} failed" in message
    assert "NoSuchBucket" in message
    assert not isinstance(err.value, storage.TransientStorageError)
    bucket = s3_server.new_bucket("missing-key")
    with pytest.raises(storage.StorageError, match="does not exist") as missing:
        storage.read_bytes(f"s3://{bucket}/absent", client=client)
    assert not isinstance(missing.value, storage.TransientStorageError)
    assert storage.exists(f"s3://{bucket}/absent", client=client) is False


@pytest.mark.parametrize(
    ("status", "code", "transient"),
    [
        (503, "SlowDown", True),
        (500, "InternalError", True),
        (503, "ServiceUnavailable", True),
        (429, "TooManyRequests", True),
        (403, "AccessDenied", False),
        (400, "InvalidArgument", False),
    ],
)
def test_what_a_retry_may_cure_is_told_apart(s3_server, status, code, transient) -> None:
    """The store's answer over the wire (a proxy in front of the real server answers GETs
    itself): throttling and 5xx are transient, a refusal is not; both name the code."""
    import boto3
    from botocore.config import Config

    from tests.s3_faults import faulty_s3

    bucket = s3_server.new_bucket("faults")
    s3_server.client().put_object(Bucket=bucket, Key="k", Body=b"x")
    rule = lambda method, path: (status, code) if method == "GET" else None  # noqa: E731
    with faulty_s3(s3_server.endpoint, rule) as proxy:
        client = boto3.client(
            "s3", endpoint_url=proxy.endpoint, region_name="us-east-1",
            aws_access_key_id=s3_server.worker.access_key,
            aws_secret_access_key=s3_server.worker.secret_key,
            config=Config(retries={"max_attempts": 2, "mode": "standard"}),
        )  # fmt: skip
        assert storage.exists(f"s3://{bucket}/k", client=client)  # HEAD goes through
        with pytest.raises(storage.StorageError, match=code) as err:
            storage.read_bytes(f"s3://{bucket}/k", client=client)
    assert isinstance(err.value, storage.TransientStorageError) is transient
    assert proxy.answered and all(a[2] == status for a in proxy.answered)
