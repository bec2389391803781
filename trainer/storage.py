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

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

CHUNK = 1 << 20


class StorageError(RuntimeError):
    """A URI could not be read or written."""


class TransientStorageError(StorageError):
    """The store could not be reached, timed out, or answered "try again" (5xx, 429,
    throttling): the same call may succeed later. Nothing may be decided on such an error
    (a gate refusing, a file taken as missing): the task fails and Airflow retries it."""


_MISSING_CODES = ("404", "NoSuchKey", "NotFound")
# Error codes S3-compatible servers answer when the request may succeed if repeated.
_TRANSIENT_CODES = frozenset(
    {
        "InternalError", "ServiceUnavailable", "SlowDown", "SlowDownRead", "SlowDownWrite",
        "Throttling", "ThrottlingException", "TooManyRequests", "RequestLimitExceeded",
        "RequestTimeout", "RequestTimeoutException", "BandwidthLimitExceeded",
        "500", "502", "503", "504", "429",
    }
)  # fmt: skip


def exception_chain(e: BaseException) -> Iterator[BaseException]:
    """``e`` and what it wraps (``__cause__``, else ``__context__``), each once."""
    seen: set[int] = set()
    err: BaseException | None = e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def error_kind(e: BaseException) -> type[StorageError]:
    """The :class:`StorageError` to raise for ``e``: :class:`TransientStorageError` where
    repeating the call may cure it (:func:`is_transient`)."""
    return TransientStorageError if is_transient(e) else StorageError


def is_transient(e: BaseException) -> bool:
    """Whether ``e`` (or what it wraps) is a failure that repeating the call may cure: the
    endpoint unreachable or timing out, a connection cut, a 5xx or 429 answer, throttling.
    Access denied, a missing key or bucket, bad credentials or parameters are not."""
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectionError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

    for err in exception_chain(e):
        if isinstance(err, TransientStorageError):
            return True
        if isinstance(err, ClientError):
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(err.response.get("Error", {}).get("Code", ""))
            return code in _TRANSIENT_CODES or (
                isinstance(status, int) and (status >= 500 or status == 429)
            )
        # EndpointConnectionError, ConnectTimeoutError, ProxyConnectionError are
        # ConnectionErrors; ReadTimeoutError is one too, listed for the reader.
        if isinstance(
            err,
            (ConnectionError, ReadTimeoutError, ConnectionClosedError, IncompleteReadError,
             ResponseStreamingError),
        ):  # fmt: skip
            return True
    return False


def _code(e: Exception) -> str | None:
    response = getattr(e, "response", None)
    return str(response.get("Error", {}).get("Code")) if isinstance(response, dict) else None


def access_key_of(client: Any) -> str | None:
    """The access key id an S3 client signs with (not a secret: it names the identity), or
    None when it has none (anonymous, or credentials not resolved)."""
    signer = getattr(client, "_request_signer", None)
    creds = getattr(signer, "_credentials", None)
    key = getattr(creds, "access_key", None)
    return str(key) if key else None


def endpoint_of(client: Any) -> str:
    """The endpoint an S3 client talks to (``AWS`` when it is the default one)."""
    url = getattr(getattr(client, "meta", None), "endpoint_url", None)
    return str(url) if url else "AWS S3"


@contextlib.contextmanager
def s3_errors(operation: str, uri: str, client: Any) -> Iterator[None]:
    """Turn what botocore/boto3 raise into one :class:`StorageError` naming the operation,
    the URI and the endpoint: ``S3 GetObject of s3://b/k at http://minio:9000 failed: ...``;
    a refusal also names the access key id it was made with (the secret never).

    Covers the server's answers (access denied, no such bucket: ``ClientError``) and not
    reaching it at all (``EndpointConnectionError``, timeouts: ``BotoCoreError``); what a
    retry may cure (:func:`is_transient`) raises :class:`TransientStorageError`. Credentials
    are never part of the message: botocore does not put them in its errors.
    """
    try:
        yield
    except StorageError:
        raise
    except Exception as e:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        where = f"S3 {operation} of {uri} at {endpoint_of(client)}"
        kind = error_kind(e)
        if isinstance(e, ClientError):
            error = e.response.get("Error", {})
            code = str(error.get("Code", "?"))
            if code in _MISSING_CODES:
                raise StorageError(f"{uri} does not exist ({where}: {code})") from e
            key = access_key_of(client)
            who = f" (access key id {key})" if key else ""
            raise kind(f"{where} failed: {code}: {error.get('Message') or e}{who}") from e
        if isinstance(e, (BotoCoreError, Boto3Error)):
            raise kind(f"{where} failed: {type(e).__name__}: {e}") from e
        raise


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
    c = _client(client)
    try:
        with s3_errors("HeadObject", uri, c):
            c.head_object(Bucket=loc.bucket, Key=loc.key)
        return True
    except StorageError as e:
        if isinstance(e.__cause__, Exception) and _code(e.__cause__) in _MISSING_CODES:
            return False
        raise


def read_bytes(uri: str, *, client: Any | None = None) -> bytes:
    loc = parse(uri)
    if not loc.is_s3:
        try:
            return Path(loc.key).read_bytes()
        except FileNotFoundError as e:
            raise StorageError(f"{uri} does not exist") from e
    c = _client(client)
    with s3_errors("GetObject", uri, c):
        return bytes(c.get_object(Bucket=loc.bucket, Key=loc.key)["Body"].read())


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
        c = _client(client)
        with s3_errors("PutObject", uri, c):
            c.put_object(Bucket=loc.bucket, Key=loc.key, Body=data)
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
        c = _client(client)
        with s3_errors("upload (PutObject)", uri, c):
            c.upload_file(str(local_path), loc.bucket, loc.key)
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
            c = _client(client)
            with s3_errors("download (GetObject)", uri, c):
                c.download_file(loc.bucket, loc.key, tmp)
        else:
            shutil.copyfile(loc.key, tmp)
        os.replace(tmp, dest)
    except FileNotFoundError as e:
        Path(tmp).unlink(missing_ok=True)
        raise StorageError(f"{uri} does not exist") from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def copy(src_uri: str, dest_uri: str, *, client: Any | None = None) -> str:
    """Copy one object; server-side when both ends are in S3."""
    src, dest = parse(src_uri), parse(dest_uri)
    if src.is_s3 and dest.is_s3:
        c = _client(client)
        with s3_errors(f"CopyObject from {src_uri}", dest_uri, c):
            c.copy({"Bucket": src.bucket, "Key": src.key}, dest.bucket, dest.key)
        return dest_uri
    if not src.is_s3:
        return upload_file(src.key, dest_uri, client=client)
    return str(download_file(src_uri, dest.key, client=client))


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its full URI, size in bytes and last modification time (UTC)."""

    uri: str
    size: int
    modified: datetime


def list_objects(prefix_uri: str, *, client: Any | None = None) -> Iterator[ObjectInfo]:
    """Every object (file) below ``prefix_uri`` with its size and modification time, in key
    order."""
    loc = parse(prefix_uri)
    if not loc.is_s3:
        root = Path(loc.key)
        if root.is_dir():
            for p in sorted(root.rglob("*")):
                if p.is_file():
                    st = p.stat()
                    yield ObjectInfo(
                        str(p), st.st_size, datetime.fromtimestamp(st.st_mtime, tz=UTC)
                    )
        return
    prefix = loc.key + "/" if loc.key else ""
    c = _client(client)
    with s3_errors("ListObjectsV2", prefix_uri, c):
        pages = list(c.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix))
    for page in pages:
        for obj in page.get("Contents", []):
            modified = obj["LastModified"]
            if modified.tzinfo is None:
                modified = modified.replace(tzinfo=UTC)
            yield ObjectInfo(f"s3://{loc.bucket}/{obj['Key']}", int(obj["Size"]), modified)


def list_uris(prefix_uri: str, *, client: Any | None = None) -> Iterator[str]:
    """Every object (file) below ``prefix_uri``, as full URIs, in key order."""
    for obj in list_objects(prefix_uri, client=client):
        yield obj.uri


def delete(uri: str, *, client: Any | None = None) -> None:
    """Delete one object (S3 DeleteObject; a local file). Deleting what is already gone
    succeeds, as S3 does; any other failure raises :class:`StorageError` naming the URI."""
    loc = parse(uri)
    if not loc.is_s3:
        try:
            Path(loc.key).unlink(missing_ok=True)
        except OSError as e:
            raise StorageError(f"cannot delete {uri}: {e}") from e
        return
    c = _client(client)
    with s3_errors("DeleteObject", uri, c):
        c.delete_object(Bucket=loc.bucket, Key=loc.key)


def ensure_bucket(uri: str, *, client: Any | None = None) -> bool:
    """Create the bucket of an S3 URI if it is missing; return True when it was created."""
    loc = parse(uri)
    if not loc.is_s3:
        return False
    from botocore.exceptions import ClientError

    c = _client(client)
    try:
        with s3_errors("HeadBucket", uri, c):
            c.head_bucket(Bucket=loc.bucket)
        return False
    except StorageError as e:
        cause = e.__cause__
        if not isinstance(cause, ClientError) or _code(cause) not in (
            *_MISSING_CODES,
            "NoSuchBucket",
        ):
            raise  # unreachable, or refused (403): not "no such bucket"
    region = c.meta.region_name
    with s3_errors("CreateBucket", uri, c):
        if region and region != "us-east-1":
            c.create_bucket(
                Bucket=loc.bucket, CreateBucketConfiguration={"LocationConstraint": region}
            )
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
