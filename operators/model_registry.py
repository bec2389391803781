"""The model registry in S3: the champion/challenger gate and publishing a model for serving.

Layout (``<bucket>/models/<model_name>/``)::

    <version>/model.onnx, checkpoint.pt, metrics.json, parity.json,
              training_curves.png, summary.md, manifest.json   # manifest written last
    latest.json        # points at the serving version; written last

Every document read or written here follows its schema in ``horovod_airflow.core.contract``
(``LATEST``,
``VERSION_MANIFEST``, ``GATE``, ``METRICS``, ``PARITY``); the version manifest records the
preprocessing the model carries (from ``parity.json``).

A version directory is complete before ``latest.json`` names it, so a reader that follows
``latest.json`` never sees a half-published model, and a failed or gated run never touches
what serving uses. The version is named by the run (:func:`run_version`), so a retried
publish finds its own version instead of adding one. ``latest.json`` is written with a
conditional put on the ETag the gate read: a champion that changed in between fails the
publish (:class:`ChampionChangedError`) and is never overwritten. The gate compares
accuracies measured on the same dataset content, re-scoring the champion when they differ.
Runs in the Airflow worker; needs no torch (re-scoring uses onnxruntime).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import re
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from horovod_airflow.core import layout, storage
from horovod_airflow.core.contract import (
    CHECKPOINT_NAME,
    CURVES_NAME,
    GATE,
    GATE_NAME,
    LATEST,
    LATEST_NAME,
    METRICS,
    METRICS_NAME,
    ONNX_NAME,
    PARITY,
    PARITY_NAME,
    SUMMARY_NAME,
    VERSION_MANIFEST,
    VERSION_MANIFEST_NAME,
    ContractError,
    check_preprocessing,
)
from horovod_airflow.operators.exceptions import ChampionChangedError, PublishRefusedError

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class GateDecision:
    """The outcome of the champion/challenger gate, with both numbers and the reason.

    ``champion_accuracy`` is the number the challenger was compared with: the champion's
    stored accuracy when both were measured on the same dataset content, else its accuracy
    re-scored on the challenger's dataset (``champion_rescored``), else None (refused).
    ``champion_etag`` is the ETag of the ``latest.json`` the gate read; publish writes only
    over that one.
    """

    passed: bool
    reason: str
    challenger_accuracy: float
    min_accuracy: float
    champion_accuracy: float | None
    champion_version: str | None
    max_regression: float
    challenger_dataset_hash: str | None = None
    champion_dataset_hash: str | None = None
    champion_stored_accuracy: float | None = None
    champion_rescored: bool = False
    champion_etag: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def champion_dataset_hash(champion: dict | None) -> str | None:
    """The dataset content hash the champion was measured on (None: not recorded)."""
    if champion is None:
        return None
    value = champion.get("dataset_content_hash")
    return str(value) if value else None


def decide_gate(
    challenger_accuracy: float,
    *,
    min_accuracy: float,
    champion: dict | None,
    max_regression: float,
    challenger_dataset_hash: str | None = None,
    champion_rescored_accuracy: float | None = None,
    champion_etag: str | None = None,
) -> GateDecision:
    """Pass when accuracy >= min_accuracy and is not worse than the champion by > max_regression.

    Accuracies are fractions in [0, 1]. The first model has no champion and is judged by the
    floor alone. The champion's stored accuracy counts only when it was measured on the same
    dataset content (``challenger_dataset_hash``); otherwise the gate uses
    ``champion_rescored_accuracy`` (the champion scored on the challenger's dataset) and,
    without it, refuses: accuracies on different data are not comparable.
    """
    for name, value in (
        ("challenger_accuracy", challenger_accuracy),
        ("min_accuracy", min_accuracy),
        ("max_regression", max_regression),
    ):
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} must be a fraction in [0, 1], got {value!r}")
    stored = None if champion is None else float(champion["val_accuracy"])
    champ_ver = None if champion is None else str(champion.get("version"))
    champ_hash = champion_dataset_hash(champion)
    same_data = champion is None or (
        challenger_dataset_hash is not None and champ_hash == challenger_dataset_hash
    )
    champ_acc: float | None = None
    rescored = False
    if same_data:
        champ_acc = stored
    elif champion_rescored_accuracy is not None:
        champ_acc, rescored = float(champion_rescored_accuracy), True

    def decision(passed: bool, reason: str) -> GateDecision:
        return GateDecision(
            passed=passed,
            reason=reason,
            challenger_accuracy=float(challenger_accuracy),
            min_accuracy=float(min_accuracy),
            champion_accuracy=champ_acc,
            champion_version=champ_ver,
            max_regression=float(max_regression),
            challenger_dataset_hash=challenger_dataset_hash,
            champion_dataset_hash=champ_hash,
            champion_stored_accuracy=stored,
            champion_rescored=rescored,
            champion_etag=champion_etag,
        )

    if challenger_accuracy < min_accuracy:
        return decision(
            False,
            f"accuracy {challenger_accuracy:.4%} is below the floor min_accuracy "
            f"{min_accuracy:.4%}",
        )
    if champion is None or champ_acc is None:
        if champion is not None:
            return decision(
                False,
                f"the champion {champ_ver} was measured on dataset {_short(champ_hash)}, this "
                f"model on {_short(challenger_dataset_hash)}: accuracies on different data are "
                f"not comparable, and the champion was not re-scored on this dataset",
            )
        return decision(
            True, f"accuracy {challenger_accuracy:.4%} >= floor {min_accuracy:.4%}; no champion yet"
        )
    basis = (
        f"re-scored on this run's dataset {_short(challenger_dataset_hash)}; it was measured "
        f"at {stored:.4%} on {_short(champ_hash)}"
        if rescored
        else f"measured on the same dataset {_short(champ_hash)}"
    )
    if challenger_accuracy < champ_acc - max_regression:
        return decision(
            False,
            f"accuracy {challenger_accuracy:.4%} is worse than the champion {champ_ver} "
            f"({champ_acc:.4%}, {basis}) by more than max_regression {max_regression:.4%}",
        )
    return decision(
        True,
        f"accuracy {challenger_accuracy:.4%} >= floor {min_accuracy:.4%}; champion {champ_ver} "
        f"has {champ_acc:.4%}, {basis} (max_regression {max_regression:.4%})",
    )


def _short(content_hash: str | None) -> str:
    return "unknown (not recorded)" if not content_hash else content_hash[:16]


#: The gate's default champion scorer: MNIST test split, onnxruntime
# (horovod_airflow.operators.serving).
DEFAULT_CHAMPION_SCORER = "horovod_airflow.operators.serving:score_published_model"


def resolve_champion_scorer(
    scorer: str | Callable[..., dict[str, Any]] | None,
) -> Callable[..., dict[str, Any]] | None:
    """The function that re-scores a champion on another dataset, or None (no re-scoring).

    ``scorer`` is a callable or its import path ``"package.module:function"`` (a string keeps
    an operator's settings serializable). It is called as ``scorer(published, dataset_uri,
    client=client)`` — ``published`` the champion's ``latest.json``, ``dataset_uri`` the
    staged dataset of this run — and returns a dict with ``accuracy`` (a fraction in [0, 1],
    the champion's on that dataset), like
    :func:`horovod_airflow.operators.serving.score_published_model`.
    Raises ValueError naming a path that does not import or name a callable.
    """
    if scorer is None or callable(scorer):
        return scorer
    if not isinstance(scorer, str) or scorer.count(":") != 1:
        raise ValueError(
            f"champion_scorer must be a callable, None, or 'package.module:function', "
            f"got {scorer!r}"
        )
    import importlib

    module_name, _, attr = scorer.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"champion_scorer {scorer!r} does not import: {e}") from e
    if not callable(func):
        raise ValueError(f"champion_scorer {scorer!r} is not callable")
    return func


def gate_challenger(
    *,
    bucket_uri: str,
    model_name: str,
    metrics: dict[str, Any],
    dataset: dict[str, Any],
    min_accuracy: float,
    max_regression: float,
    metric_key: str = "val_accuracy",
    client: Any | None = None,
    champion_scorer: str | Callable[..., dict[str, Any]] | None = DEFAULT_CHAMPION_SCORER,
) -> GateDecision:
    """The gate task: read the champion, compare like with like, write ``gate.json``.

    ``metrics`` is the train task's XCom (``metric_key``, default ``val_accuracy``, and
    ``output``), ``dataset`` the staging task's (``uri``, ``content_hash``). The champion's
    number is the ``val_accuracy`` its ``latest.json`` records (or its accuracy re-scored on
    this dataset), so ``metric_key`` must name the challenger's accuracy, a fraction in
    [0, 1]. When the champion was measured on other data
    (or its dataset is not recorded), it is re-scored on this dataset first by
    ``champion_scorer`` (see :func:`resolve_champion_scorer`; default: the MNIST scorer,
    onnxruntime on the staged test split); if that fails, or ``champion_scorer`` is None,
    the decision refuses and says why — except where the store did not answer
    (:class:`~horovod_airflow.core.storage.TransientStorageError`, raised: the task fails
    and is retried, since a refusal would skip publishing for a blip).
    """
    champion, etag = read_latest(bucket_uri, model_name, client=client)
    challenger_hash = dataset.get("content_hash")
    rescored = None
    if champion is not None and champion_dataset_hash(champion) != challenger_hash:
        from horovod_airflow.operators.serving import ModelIntegrityError, in_registry

        # the champion is loaded from the registry's own locations, whatever latest.json
        # says: a record pointing elsewhere fails the task (ModelIntegrityError), loudly
        champion = in_registry(bucket_uri, model_name, champion, LATEST_NAME)
        scorer = resolve_champion_scorer(champion_scorer)
        if scorer is None:
            log.warning(
                "no champion_scorer: the champion %s is not re-scored", champion.get("version")
            )
        else:
            try:
                rescored = float(scorer(champion, dataset["uri"], client=client)["accuracy"])
            except storage.TransientStorageError:
                # the store did not answer: no verdict on the champion; fail, so a retry asks
                # again, rather than refuse the challenger and skip this week's publish
                raise
            except (ModelIntegrityError, storage.StorageError, ValueError, KeyError) as e:
                # DatasetError is a ValueError; so is a model the scorer cannot read
                log.warning("cannot re-score the champion %s: %s", champion.get("version"), e)
    decision = decide_gate(
        metrics[metric_key],
        min_accuracy=min_accuracy,
        champion=champion,
        max_regression=max_regression,
        challenger_dataset_hash=challenger_hash,
        champion_rescored_accuracy=rescored,
        champion_etag=etag,
    )
    storage.write_text(
        storage.join(metrics["output"], GATE_NAME),
        GATE.dumps(decision.as_dict()),
        client=client,
    )
    log.info("gate %s: %s", "PASSED" if decision.passed else "FAILED", decision.reason)
    return decision


def asset_event_extra(latest: dict[str, Any]) -> dict[str, Any]:
    """The ``extra`` of the Asset event a publish emits: what a consumer needs, no lookup."""
    return {
        key: latest.get(key)
        for key in (
            "model",
            "version",
            "uri",
            "manifest_uri",
            "onnx_uri",
            "onnx_sha256",
            "val_accuracy",
            "dataset_uri",
            "dataset_content_hash",
            "dag_run_id",
        )
    }


def render_training_curves(history: list[dict[str, Any]]) -> bytes:
    """A PNG of train/val loss and val accuracy per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    ax_loss.plot(epochs, [h["train_loss"] for h in history], "o-", label="train loss")
    ax_loss.plot(epochs, [h["val_loss"] for h in history], "s-", label="val loss")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("cross-entropy")
    ax_loss.set_title("Loss (allreduced over ranks)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_acc.plot(epochs, [100 * h["val_accuracy"] for h in history], "o-", color="tab:green")
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("accuracy (%)")
    ax_acc.set_title("Validation accuracy (whole set)")
    ax_acc.grid(alpha=0.3)
    for ax in (ax_loss, ax_acc):
        ax.set_xticks(epochs)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def render_summary(
    *,
    model_name: str,
    version: str,
    metrics: dict[str, Any],
    gate: dict[str, Any],
    dataset: dict[str, Any],
    parity: dict[str, Any],
    dag_run_id: str,
    published_at: str,
) -> str:
    """A short Markdown summary a person reads next to the model."""
    versions = metrics.get("versions", {})
    champ = gate.get("champion_accuracy")
    champ_txt = (
        "none (first model)" if champ is None else (f"{champ:.4%} ({gate.get('champion_version')})")
    )
    rows = "\n".join(
        f"| {h['epoch']} | {h['train_loss']:.4f} | {h['val_loss']:.4f} | "
        f"{h['val_accuracy']:.4%} | {h.get('samples_per_sec', 0):,.0f} | "
        f"{h.get('epoch_seconds', 0):.1f} |"
        for h in metrics.get("history", [])
    )
    return f"""# {model_name} {version}

Published {published_at} by DAG run `{dag_run_id}`.

## Metrics (allreduced over {metrics.get("world_size")} ranks)
- validation accuracy: **{metrics["val_accuracy"]:.4%}** \
({metrics.get("val_correct")}/{metrics.get("val_samples")})
- validation loss: {metrics.get("val_loss", float("nan")):.4f}
- epochs: {metrics.get("epochs")}; training time: {metrics.get("train_seconds", 0):.1f} s

## Gate
- decision: **{"passed" if gate["passed"] else "failed"}** — {gate["reason"]}
- challenger: {gate["challenger_accuracy"]:.4%}; champion: {champ_txt}; \
floor: {gate["min_accuracy"]:.4%}; max regression: {gate["max_regression"]:.4%}

## ONNX export
- onnxruntime vs PyTorch on {parity.get("samples")} held-out images: max abs diff \
{parity.get("max_abs_diff")}, argmax mismatches {parity.get("argmax_mismatches")} \
(tolerance {parity.get("tolerance")})

## Dataset
- `{dataset.get("uri")}` (content hash `{dataset.get("content_hash")}`)

## Versions
- torch {versions.get("torch")}, torchvision {versions.get("torchvision")}, \
horovod {versions.get("horovod")}, trainer {versions.get("trainer")}

## History
| epoch | train loss | val loss | val accuracy | samples/s | seconds |
| --- | --- | --- | --- | --- | --- |
{rows}
"""


def run_version(dag_id: str, run_id: str, run_after: datetime | None = None) -> str:
    """The version a DAG run publishes: ``v20261202T101500Z-<12 hex>``, the same on every try.

    The stamp is the run's ``run_after`` (stable across retries and clears, so versions sort
    by when their runs were due); the hash is of the exact ``dag_id`` and ``run_id``, so two
    runs never share a version and a retry re-publishes its own.
    """
    if not dag_id or not run_id:
        raise ValueError(f"run_version needs a dag_id and a run_id, got {dag_id!r}, {run_id!r}")
    digest = hashlib.sha256(f"{dag_id}\n{run_id}".encode()).hexdigest()[:KEY_HASH_CHARS]
    if run_after is None:
        return f"v-{digest}"
    return f"{run_after.astimezone(UTC).strftime('v%Y%m%dT%H%M%SZ')}-{digest}"


_DUE = re.compile(r"^v(\d{8}T\d{6}Z)-")


def check_forward(
    current: dict[str, Any] | None, version: str, earlier: dict[str, Any] | None
) -> None:
    """Refuse (:class:`PublishRefusedError`) to move ``latest.json`` from ``current`` back to
    ``version``: an older version than the one serving uses now.

    Versions named by their runs (:func:`run_version`) carry when the run was due and are
    ordered by it; for a version named otherwise, one whose files were copied
    (``earlier``, its manifest) before ``current`` was published is older.
    """
    if current is None or current.get("version") == version:
        return
    now = str(current.get("version"))
    mine, theirs = _DUE.match(version), _DUE.match(now)
    if mine and theirs:
        backwards = mine.group(1) < theirs.group(1)
        why = f"its run was due at {mine.group(1)}, {now}'s at {theirs.group(1)}"
    elif earlier is not None and current.get("published_at"):
        backwards = str(earlier["published_at"]) < str(current["published_at"])
        why = (
            f"it was copied at {earlier['published_at']}, before {now} was published at "
            f"{current['published_at']}"
        )
    else:
        backwards = False
    if backwards:
        raise PublishRefusedError(
            f"refusing to publish {version}: serving uses {now}, which is newer ({why}). "
            "Publishing only moves forward: an older version is never published again over "
            "a newer one"
        )


def _latest_document(manifest: dict[str, Any], manifest_uri: str, prefix: str) -> dict[str, Any]:
    """What ``latest.json`` says about a published version, all of it from its manifest."""
    return {
        "format": LATEST.format,
        "model": manifest["model"],
        "version": manifest["version"],
        "uri": prefix,
        "manifest_uri": manifest_uri,
        "onnx_uri": manifest["files"][ONNX_NAME]["uri"],
        "onnx_sha256": manifest["files"][ONNX_NAME]["sha256"],
        "val_accuracy": manifest["metrics"]["val_accuracy"],
        "dataset_uri": manifest["dataset"].get("uri"),
        "dataset_content_hash": manifest["dataset"].get("content_hash"),
        "dag_run_id": manifest["dag_run_id"],
        "published_at": manifest["published_at"],
    }


def publish_model(
    *,
    bucket_uri: str,
    model_name: str,
    run_output: str,
    onnx_uri: str,
    parity_uri: str,
    dataset: dict[str, Any],
    gate: dict[str, Any],
    dag_run_id: str,
    version: str,
    client: Any | None = None,
) -> dict[str, Any]:
    """Copy a gated run's artifacts to ``version``, then point ``latest.json`` at it.

    Idempotent per run: ``version`` comes from the run (:func:`run_version`), so a retry finds
    its own version. A version whose ``manifest.json`` (written last) exists is complete and
    is not copied again; when ``latest.json`` already names it, the publish is done and
    returns that document unchanged. ``latest.json`` is written only over the one the gate
    read (``gate["champion_etag"]``, :func:`write_latest`).

    Publishing only moves forward (:func:`check_forward`): ``latest.json`` never moves to a
    version older than the one it names (a cleared gate of an older run that passes against
    a newer champion is refused here).
    A version copied under another gate decision (the gate ran again after a
    :class:`ChampionChangedError`) is copied again, so its manifest and summary record the
    decision actually used.

    Returns the ``latest.json`` document. Raises :class:`PublishRefusedError` when the gate
    or ONNX parity did not pass, ``version`` holds another run's model or is older than the
    champion, and :class:`ChampionChangedError` when another publish changed ``latest.json``
    since the gate.
    """
    if not gate.get("passed"):
        raise PublishRefusedError(
            f"refusing to publish: the gate did not pass ({gate.get('reason')})"
        )
    if "champion_etag" not in gate:
        raise PublishRefusedError(
            "refusing to publish: the gate decision records no champion_etag (the latest.json "
            "it compared against); re-run the gate"
        )
    try:
        check_version(version)
    except ValueError as e:
        raise PublishRefusedError(f"refusing to publish: {e}") from e
    prefix = storage.join(models_prefix(bucket_uri, model_name), version)
    manifest_uri = storage.join(prefix, VERSION_MANIFEST_NAME)
    registry = storage.parse(bucket_uri)
    if registry.is_s3:  # before anything is copied: latest.json must be writable safely
        s3 = client if client is not None else storage.s3_client()
        check_conditional_writes(s3, registry.bucket, models_prefix(bucket_uri, model_name))

    current, _ = read_latest(bucket_uri, model_name, client=client)
    if current and current.get("version") == version and current.get("dag_run_id") == dag_run_id:
        log.info("%s %s is already published by this run: nothing to do", model_name, version)
        return current

    earlier = None
    if storage.exists(manifest_uri, client=client):
        earlier = VERSION_MANIFEST.loads(
            storage.read_text(manifest_uri, client=client), manifest_uri
        )
        if earlier.get("dag_run_id") != dag_run_id or earlier.get("source_run") != run_output:
            raise PublishRefusedError(
                f"refusing to publish: {prefix} already holds the model of run "
                f"{earlier.get('dag_run_id')!r} ({earlier.get('source_run')}), not of "
                f"{dag_run_id!r} ({run_output})"
            )
    check_forward(current, version, earlier)
    if earlier is not None and earlier.get("gate") == gate:
        log.info("%s is complete from an earlier try: not copied again", prefix)
        manifest = earlier
    else:
        if earlier is not None:  # copied under another decision (the gate ran again since)
            log.info("%s was copied under an earlier gate decision: recording this one", prefix)
        manifest = _copy_version(
            prefix=prefix,
            model_name=model_name,
            version=version,
            run_output=run_output,
            onnx_uri=onnx_uri,
            parity_uri=parity_uri,
            dataset=dataset,
            gate=gate,
            dag_run_id=dag_run_id,
            client=client,
        )
        storage.write_text(manifest_uri, VERSION_MANIFEST.dumps(manifest), client=client)

    latest = _latest_document(manifest, manifest_uri, prefix)
    # Last, and only over the champion the gate compared against: readers following
    # latest.json only ever see a complete version, and a concurrent publish is never lost.
    try:
        write_latest(
            bucket_uri, model_name, latest, expected_etag=gate["champion_etag"], client=client
        )
    except ChampionChangedError:
        # A PUT that succeeded but whose response was lost is retried by the client and then
        # fails its own condition: it is ours if latest.json names this run's version.
        now, _ = read_latest(bucket_uri, model_name, client=client)
        if now == latest:
            return latest
        raise
    log.info("published %s %s at %s", model_name, version, prefix)
    return latest


def _copy_version(
    *,
    prefix: str,
    model_name: str,
    version: str,
    run_output: str,
    onnx_uri: str,
    parity_uri: str,
    dataset: dict[str, Any],
    gate: dict[str, Any],
    dag_run_id: str,
    client: Any | None,
) -> dict[str, Any]:
    """Copy the run's files under ``prefix`` and return the manifest (not yet written)."""
    published_at = datetime.now(UTC).isoformat(timespec="seconds")
    metrics_uri = storage.join(run_output, METRICS_NAME)
    metrics = METRICS.loads(storage.read_text(metrics_uri, client=client), metrics_uri)
    if "val_accuracy" not in metrics:
        raise ContractError(f"{metrics_uri}: a published model's metrics need 'val_accuracy'")
    parity = PARITY.loads(storage.read_text(parity_uri, client=client), parity_uri)
    if not parity["passed"]:
        raise PublishRefusedError(f"refusing to publish: ONNX parity failed ({parity})")
    preprocessing = check_preprocessing(parity["preprocessing"], f"{parity_uri} preprocessing")
    sources = {
        ONNX_NAME: onnx_uri,
        CHECKPOINT_NAME: metrics.get("artifacts", {}).get("checkpoint")
        or storage.join(run_output, CHECKPOINT_NAME),
        METRICS_NAME: storage.join(run_output, METRICS_NAME),
        PARITY_NAME: parity_uri,
    }
    files: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="hva-publish-") as tmp:
        local: dict[str, Path] = {}
        for name, src in sources.items():
            local[name] = storage.download_file(src, Path(tmp) / name, client=client)
        (Path(tmp) / CURVES_NAME).write_bytes(render_training_curves(metrics.get("history", [])))
        local[CURVES_NAME] = Path(tmp) / CURVES_NAME
        (Path(tmp) / SUMMARY_NAME).write_text(
            render_summary(
                model_name=model_name,
                version=version,
                metrics=metrics,
                gate=gate,
                dataset=dataset,
                parity=parity,
                dag_run_id=dag_run_id,
                published_at=published_at,
            )
        )
        local[SUMMARY_NAME] = Path(tmp) / SUMMARY_NAME
        for name, path in local.items():
            uri = storage.upload_file(path, storage.join(prefix, name), client=client)
            files[name] = {
                "uri": uri,
                "sha256": storage.sha256_file(path),
                "size": path.stat().st_size,
            }
    final = {k: metrics.get(k) for k in ("val_accuracy", "val_loss", "val_correct", "val_samples")}
    return {
        "format": VERSION_MANIFEST.format,
        "model": model_name,
        "version": version,
        "files": files,
        "dataset": {"uri": dataset.get("uri"), "content_hash": dataset.get("content_hash")},
        "metrics": final,
        "epochs": metrics.get("epochs"),
        "world_size": metrics.get("world_size"),
        "versions": metrics.get("versions", {}),
        "preprocessing": preprocessing,  # what the model's ONNX metadata carries
        "gate": gate,
        "source_run": run_output,
        "dag_run_id": dag_run_id,
        "published_at": published_at,
    }
