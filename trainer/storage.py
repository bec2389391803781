"""The one storage module: read and write artifacts at a URI, on S3 or on a local path.

A URI is either ``s3://bucket/key/prefix`` or a local filesystem path (``file://`` allowed).
On S3 the client comes from boto3's standard configuration — ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION`` and
``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) — so the same code runs against AWS,
MinIO or a local S3 server. Callers that already hold a client (the Airflow side gets one
from its AWS connection) pass it as ``client=``.

Writes are atomic for readers: a local file is written to a temporary name and renamed; an
S3 object appears whole when its PUT completes.

Importable without torch and without Airflow: the trainer (Horovod ranks) and the pipeline
tasks (Airflow workers) share it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHUNK = 1 << 20


class StorageError(RuntimeError):
    """A URI could not be read or written."""


@dataclass(frozen=True)
class Location:
    """A parsed URI: ``scheme`` is ``"s3"`` or ``"file"``."""

    scheme: str
    bucket: str  # empty for local paths
    key: str  # S3 key, or the absolute local path

    @property
    def is_s3(self) -> bool:
        return self.scheme == "s3"

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}" if self.is_s3 else self.key


def parse(uri: str) -> Location:
    """Parse ``s3://bucket/key`` or a local path; raise ``ValueError`` naming what is wrong."""
    if not uri or not isinstance(uri, str):
        raise ValueError(f"storage URI must be a non-empty string, got {uri!r}")
    if uri.startswith("s3://"):
        rest = uri[len("s3://") :]
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise ValueError(f"S3 URI {uri!r} has no bucket (expected s3://bucket/prefix)")
        return Location("s3", bucket, key.strip("/"))
    if "://" in uri and not uri.startswith("file://"):
        scheme = uri.split("://", 1)[0]
        raise ValueError(f"unsupported URI scheme {scheme!r} in {uri!r}: use s3:// or a path")
    path = uri[len("file://") :] if uri.startswith("file://") else uri
    return Location("file", "", str(Path(path).expanduser().resolve()))


def join(uri: str, *parts: str) -> str:
    """Append path parts to a URI with single slashes."""
    base = uri.rstrip("/")
    tail = "/".join(p.strip("/") for p in parts if p)
    return f"{base}/{tail}" if tail else base


def s3_client(**kwargs: Any) -> Any:
    """A boto3 S3 client from the standard AWS environment (endpoint included)."""
    import boto3
    from botocore.config import Config

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(
        retries={"max_attempts": 5, "mode": "standard"}, s3={"addressing_style": "path"}
    )
    return boto3.client("s3", endpoint_url=endpoint or None, config=config, **kwargs)


def _client(client: Any | None) -> Any:
    return client if client is not None else s3_client()


def exists(uri: str, *, client: Any | None = None) -> bool:
    loc = parse(uri)
    if not loc.is_s3:
        return os.path.exists(loc.key)
    from botocore.exceptions import ClientError

    try:
        _client(client).head_object(Bucket=loc.bucket, Key=loc.key)
        return True
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise StorageError(f"cannot check {uri}: {e}") from e


def read_bytes(uri: str, *, client: Any | None = None) -> bytes:
    loc = parse(uri)
    try:
        if not loc.is_s3:
            return Path(loc.key).read_bytes()
        body = _client(client).get_object(Bucket=loc.bucket, Key=loc.key)["Body"]
        return bytes(body.read())
    except FileNotFoundError as e:
        raise StorageError(f"{uri} does not exist") from e
    except Exception as e:
        if type(e).__name__ in ("NoSuchKey", "ClientError"):
            raise StorageError(f"cannot read {uri}: {e}") from e
        raise


def read_text(uri: str, *, client: Any | None = None) -> str:
    return read_bytes(uri, client=client).decode("utf-8")


def _umask() -> int:
    """The process umask, read without changing it where Linux reports it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: the classic read-by-setting, restored at once
    os.umask(mask)
    return mask


def _temp_beside(dest: Path) -> tuple[int, str]:
    """An open temporary file next to ``dest`` with the mode ``open()`` would give ``dest``.

    ``mkstemp`` creates 0600 files; after the rename that would hide artifacts from the other
    users of a shared folder or volume (a serving container, a second Airflow worker).
    """
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~_umask())
    return fd, tmp


def write_bytes(uri: str, data: bytes, *, client: Any | None = None) -> str:
    """Write ``data`` at ``uri`` atomically; return the URI."""
    loc = parse(uri)
    if loc.is_s3:
        _client(client).put_object(Bucket=loc.bucket, Key=loc.key, Body=data)
        return uri
    path = Path(loc.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return uri


def write_text(uri: str, text: str, *, client: Any | None = None) -> str:
    return write_bytes(uri, text.encode("utf-8"), client=client)


def upload_file(local_path: str | os.PathLike[str], uri: str, *, client: Any | None = None) -> str:
    """Copy a local file to ``uri`` (S3 multipart for large files; atomic rename locally)."""
    loc = parse(uri)
    if loc.is_s3:
        _client(client).upload_file(str(local_path), loc.bucket, loc.key)
        return uri
    dest = Path(loc.key)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_beside(dest)
    os.close(fd)
    try:
        shutil.copyfile(local_path, tmp)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return uri


def download_file(
    uri: str, local_path: str | os.PathLike[str], *, client: Any | None = None
) -> Path:
    """Copy ``uri`` to a local file, atomically (a partial download never has the final name)."""
    dest = Path(local_path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_beside(dest)
    os.close(fd)
    loc = parse(uri)
    try:
        if loc.is_s3:
            _client(client).download_file(loc.bucket, loc.key, tmp)
        else:
            shutil.copyfile(loc.key, tmp)
        os.replace(tmp, dest)
    except FileNotFoundError as e:
        Path(tmp).unlink(missing_ok=True)
        raise StorageError(f"{uri} does not exist") from e
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if type(e).__name__ == "ClientError":
            raise StorageError(f"cannot download {uri}: {e}") from e
        raise
    return dest


def copy(src_uri: str, dest_uri: str, *, client: Any | None = None) -> str:
    """Copy one object; server-side when both ends are in S3."""
    src, dest = parse(src_uri), parse(dest_uri)
    if src.is_s3 and dest.is_s3:
        _client(client).copy({"Bucket": src.bucket, "Key": src.key}, dest.bucket, dest.key)
        return dest_uri
    if not src.is_s3:
        return upload_file(src.key, dest_uri, client=client)
    return str(download_file(src_uri, dest.key, client=client))


def list_uris(prefix_uri: str, *, client: Any | None = None) -> Iterator[str]:
    """Every object (file) below ``prefix_uri``, as full URIs, in key order."""
    loc = parse(prefix_uri)
    if not loc.is_s3:
        root = Path(loc.key)
        if root.is_dir():
            for p in sorted(root.rglob("*")):
                if p.is_file():
                    yield str(p)
        return
    prefix = loc.key + "/" if loc.key else ""
    paginator = _client(client).get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=loc.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            yield f"s3://{loc.bucket}/{obj['Key']}"


def ensure_bucket(uri: str, *, client: Any | None = None) -> bool:
    """Create the bucket of an S3 URI if it is missing; return True when it was created."""
    loc = parse(uri)
    if not loc.is_s3:
        return False
    from botocore.exceptions import ClientError

    c = _client(client)
    try:
        c.head_bucket(Bucket=loc.bucket)
        return False
    except ClientError:
        pass
    region = c.meta.region_name
    if region and region != "us-east-1":
        c.create_bucket(Bucket=loc.bucket, CreateBucketConfiguration={"LocationConstraint": region})
    else:
        c.create_bucket(Bucket=loc.bucket)
    return True


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
