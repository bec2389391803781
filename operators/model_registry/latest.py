"""The registry's ``models/<model_name>/latest.json``: where it is, reading it with its ETag,
and writing it only over the one that was read (a compare-and-swap: a conditional PutObject
on S3, probed once per bucket; an exclusive ``flock`` in a local folder); the key segments
and version names the registry accepts."""

from __future__ import annotations

import contextlib
import hashlib
import re
from pathlib import Path
from typing import Any

from horovod_airflow.core import layout, storage
from horovod_airflow.core.contract import (
    LATEST,
    LATEST_NAME,
)
from horovod_airflow.operators.exceptions import ChampionChangedError, PublishRefusedError

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
#: Characters of the readable part of a key, and of the hash of the exact value after it.
KEY_READABLE_CHARS = 80
KEY_HASH_CHARS = 12


def safe_key(value: str) -> str:
    """One S3 key segment for a run id or conf value: readable, safe and distinct.

    ``manual__2026-12-02T10:00:00+00:00`` → ``manual__2026-12-02T10_00_00_00_00-<12 hex>``:
    the value with unsafe characters replaced (at most 80 of them), then the first 12 hex
    digits of the sha256 of the *exact* value. The readable part alone is not one-to-one
    (``a:b``, ``a+b`` and ``a b`` all read ``a_b``; long ids cut at the same place), the hash
    makes the key so: two runs share a prefix only if their ids are equal (or collide in
    48 bits of sha256). Deterministic, so every try of a run finds the same prefix.
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"cannot make a key segment from {value!r}: need a non-empty string")
    readable = _SAFE.sub("_", value).strip("._-")[:KEY_READABLE_CHARS].rstrip("._-")
    digest = hashlib.sha256(value.encode("utf-8")).hexdigest()[:KEY_HASH_CHARS]
    return f"{readable}-{digest}" if readable else digest


def check_version(version: Any) -> str:
    """``version`` if it is a safe version name (letters, digits, ``.``, ``_``, ``-``; not
    starting or ending with a separator), else ValueError naming it."""
    if (
        not isinstance(version, str)
        or not version
        or _SAFE.search(version)
        or version.strip("._-") != version
    ):
        raise ValueError(
            f"{version!r} is not a safe version name (letters, digits, '.', '_', '-'; "
            "e.g. v20261202T101500Z-1f3c9a0b2d4e)"
        )
    return version


def models_prefix(bucket_uri: str, model_name: str) -> str:
    return storage.join(layout.models_root(bucket_uri), model_name)


def latest_uri(bucket_uri: str, model_name: str) -> str:
    return storage.join(models_prefix(bucket_uri, model_name), LATEST_NAME)


def latest_asset_name(model_name: str) -> str:
    """The name of the Asset of a model's ``latest.json`` (publish's outlet, serving's
    schedule)."""
    return f"{model_name}_latest"


def read_latest(
    bucket_uri: str, model_name: str, *, client: Any | None = None
) -> tuple[dict | None, str | None]:
    """``latest.json`` and its ETag, read in one request; ``(None, None)`` before any publish.

    The ETag is what a later publish conditions its write on (:func:`write_latest`). For a
    local registry folder it is the sha256 of the file's bytes. The document is checked
    against ``horovod_airflow.core.contract.LATEST`` (:class:`ContractError` when it breaks it).
    """
    uri = latest_uri(bucket_uri, model_name)
    loc = storage.parse(uri)
    if not loc.is_s3:
        path = Path(loc.key)
        if not path.is_file():
            return None, None
        data = path.read_bytes()
        return LATEST.loads(data, uri), storage.sha256_bytes(data)
    from botocore.exceptions import ClientError

    s3 = client if client is not None else storage.s3_client()
    try:
        response = s3.get_object(Bucket=loc.bucket, Key=loc.key)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None, None
        raise storage.error_kind(e)(f"cannot read {uri}: {e}") from e
    return LATEST.loads(response["Body"].read(), uri), str(response["ETag"])


def read_champion(bucket_uri: str, model_name: str, *, client: Any | None = None) -> dict | None:
    """The published ``latest.json`` of ``model_name``, or None before the first publish."""
    return read_latest(bucket_uri, model_name, client=client)[0]


#: (endpoint, bucket) whose conditional writes were probed and held, this process.
_CAS_CHECKED: set[tuple[str, str]] = set()


class ConditionalWritesUnsupportedError(PublishRefusedError):
    """The S3 server does not honour If-None-Match / If-Match: two publishers could both
    "win" latest.json, so this registry refuses to publish there."""


def check_conditional_writes(s3: Any, bucket: str, prefix_uri: str) -> None:
    """Probe, once per endpoint and bucket, that the server refuses what a compare-and-swap
    of ``latest.json`` relies on it to refuse; raise
    :class:`ConditionalWritesUnsupportedError` naming what it accepted instead.

    Under ``<prefix>/.cas-probe/<uuid>``: a create with ``If-None-Match: *`` succeeds, the
    same create again is refused (412); a write with ``If-Match`` and a wrong ETag is refused
    (412); ``If-Match`` on a missing key is refused (404 NoSuchKey as AWS and moto answer, or
    412 as SeaweedFS does: a 200 is not a refusal). The probe objects are deleted. Shows the
    server honours the headers; that it does so atomically is the race test's to show.
    """
    import uuid

    from botocore.exceptions import ClientError

    endpoint = storage.endpoint_of(s3)
    if (endpoint, bucket) in _CAS_CHECKED:
        return
    base = storage.parse(storage.join(prefix_uri, ".cas-probe", uuid.uuid4().hex)).key
    created, missing = f"{base}/created", f"{base}/missing"

    def refused(**kwargs: Any) -> str | None:
        """The error code of a refused put, None if the server accepted it."""
        try:
            s3.put_object(Bucket=bucket, Body=b"probe", **kwargs)
        except ClientError as e:
            return str(e.response.get("Error", {}).get("Code"))
        return None

    precondition_failed = ("PreconditionFailed", "412")
    wrong_etag = '"0123456789abcdef0123456789abcdef"'
    accepted: list[str] = []
    try:
        with storage.s3_errors(
            "PutObject (conditional-write probe)", f"s3://{bucket}/{created}", s3
        ):
            s3.put_object(Bucket=bucket, Key=created, Body=b"probe", IfNoneMatch="*")
        if refused(Key=created, IfNoneMatch="*") not in precondition_failed:
            accepted.append("a second create with If-None-Match: * (it must answer 412)")
        if refused(Key=created, IfMatch=wrong_etag) not in precondition_failed:
            accepted.append("a write with If-Match of a wrong ETag (it must answer 412)")
        if refused(Key=missing, IfMatch=wrong_etag) not in (
            *precondition_failed,
            "NoSuchKey",
            "404",
        ):
            accepted.append("a write with If-Match on a missing key (it must answer 404/412)")
    finally:
        for key in (created, missing):
            with contextlib.suppress(ClientError):
                s3.delete_object(Bucket=bucket, Key=key)
    if accepted:
        raise ConditionalWritesUnsupportedError(
            f"refusing to publish to s3://{bucket} at {endpoint}: the server does not honour "
            f"conditional writes, so two publishers could both replace latest.json. It "
            f"accepted {'; and '.join(accepted)}. Use a server that supports If-None-Match / "
            f"If-Match on PutObject (AWS S3, SeaweedFS, a current MinIO)"
        )
    _CAS_CHECKED.add((endpoint, bucket))


def write_latest(
    bucket_uri: str,
    model_name: str,
    document: dict[str, Any],
    *,
    expected_etag: str | None,
    client: Any | None = None,
) -> str:
    """Write ``latest.json`` only if it is still the one whose ETag was read; return the URI.

    ``expected_etag=None`` means "there was no champion": the write succeeds only if no
    ``latest.json`` exists. On S3 this is one conditional PutObject (``If-Match: <etag>`` or
    ``If-None-Match: *``), atomic on the server; a local folder is guarded by an exclusive
    ``flock`` on ``latest.json.lock`` (atomic between processes of one host). Raises
    :class:`ChampionChangedError` when the condition fails; nothing is overwritten then.
    """
    uri = latest_uri(bucket_uri, model_name)
    body = LATEST.dumps(document).encode("utf-8")
    loc = storage.parse(uri)
    if not loc.is_s3:
        import fcntl

        path = Path(loc.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(LATEST_NAME + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            current = storage.sha256_bytes(path.read_bytes()) if path.is_file() else None
            if current != expected_etag:
                raise _champion_changed(uri, expected_etag, current)
            return storage.write_bytes(uri, body)
    from botocore.exceptions import ClientError

    s3 = client if client is not None else storage.s3_client()
    check_conditional_writes(s3, loc.bucket, storage.join(models_prefix(bucket_uri, model_name)))
    condition = {"IfMatch": expected_etag} if expected_etag else {"IfNoneMatch": "*"}
    try:
        s3.put_object(
            Bucket=loc.bucket,
            Key=loc.key,
            Body=body,
            ContentType="application/json",
            **condition,
        )
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code")
        # 412: the condition failed; 409: a concurrent conditional write is in flight (AWS);
        # NoSuchKey: If-Match on a latest.json that was deleted since the gate read it.
        if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey"):
            raise _champion_changed(uri, expected_etag, f"S3 said {code}") from e
        raise storage.error_kind(e)(f"cannot write {uri}: {e}") from e
    return uri


def _champion_changed(uri: str, expected: str | None, found: str | None) -> ChampionChangedError:
    what = "no latest.json (no champion)" if expected is None else f"ETag {expected}"
    return ChampionChangedError(
        f"{uri} changed after the gate read it: the gate compared against {what}, now "
        f"{found or 'it is gone'}. Another publish won; nothing was overwritten. Clear the "
        f"gate (and its downstream tasks) to compare against the new champion."
    )
