"""Publishing a gated run: copy its artifacts to a version named by the run, write the
version's manifest last, then point ``latest.json`` at it, only forward and only over the
champion the gate read."""

from __future__ import annotations

import hashlib
import logging
import re
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from horovod_airflow.core import storage
from horovod_airflow.core.contract import (
    CHECKPOINT_NAME,
    CURVES_NAME,
    LATEST,
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
    elastic_summary,
)
from horovod_airflow.operators.exceptions import ChampionChangedError, PublishRefusedError
from horovod_airflow.operators.model_registry.latest import (
    KEY_HASH_CHARS,
    check_conditional_writes,
    check_version,
    models_prefix,
    read_latest,
    write_latest,
)
from horovod_airflow.operators.model_registry.summaries import (
    render_summary,
    render_training_curves,
    step_series,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunModel:
    """One run's exported model as the registry's writers take it (:func:`publish_model`,
    :func:`~horovod_airflow.operators.model_registry.refused.record_refused`).

    ``run_output`` is the run folder (``metrics.json``, ``checkpoint.pt``), ``onnx_uri`` and
    ``parity_uri`` the export's files, ``dataset`` the staging task's XCom (``uri``,
    ``content_hash``), ``gate`` the gate's decision, ``version`` the version it goes to (named
    by the run, :func:`run_version`) and ``dag_run_id`` the run that made it.
    """

    model_name: str
    version: str
    run_output: str
    onnx_uri: str
    parity_uri: str
    dataset: dict[str, Any]
    gate: dict[str, Any]
    dag_run_id: str


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


def latest_document(manifest: dict[str, Any], manifest_uri: str, prefix: str) -> dict[str, Any]:
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
        "since": manifest["published_at"],  # a publish serves its version from its copy
    }


def publish_model(bucket_uri: str, run: RunModel, *, client: Any | None = None) -> dict[str, Any]:
    """Copy a gated run's artifacts to ``version``, then point ``latest.json`` at it.

    Idempotent per run: ``run.version`` comes from the run (:func:`run_version`), so a retry finds
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
    or ONNX parity did not pass, the version holds another run's model or is older than the
    champion, and :class:`ChampionChangedError` when another publish changed ``latest.json``
    since the gate.
    """
    gate, model_name, version = run.gate, run.model_name, run.version
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
    if (
        current
        and current.get("version") == version
        and current.get("dag_run_id") == run.dag_run_id
    ):
        log.info("%s %s is already published by this run: nothing to do", model_name, version)
        return current

    earlier = earlier_of_this_run(
        prefix, run.run_output, run.dag_run_id, refusing="refusing to publish", client=client
    )
    check_forward(current, version, earlier)
    if earlier is not None and earlier.get("gate") == gate:
        log.info("%s is complete from an earlier try: not copied again", prefix)
        manifest = earlier
    else:
        if earlier is not None:  # copied under another decision (the gate ran again since)
            log.info("%s was copied under an earlier gate decision: recording this one", prefix)
        manifest = copy_version(prefix, run, client=client)

    latest = latest_document(manifest, manifest_uri, prefix)
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


def earlier_of_this_run(
    prefix: str, run_output: str, dag_run_id: str, *, refusing: str, client: Any | None
) -> dict[str, Any] | None:
    """The ``manifest.json`` an earlier try of this run wrote under ``prefix``, or None when
    there is none; :class:`PublishRefusedError` (``refusing``: how its message begins) when
    it holds another run's model."""
    manifest_uri = storage.join(prefix, VERSION_MANIFEST_NAME)
    if not storage.exists(manifest_uri, client=client):
        return None
    earlier = VERSION_MANIFEST.loads(storage.read_text(manifest_uri, client=client), manifest_uri)
    if earlier.get("dag_run_id") != dag_run_id or earlier.get("source_run") != run_output:
        raise PublishRefusedError(
            f"{refusing}: {prefix} already holds the model of run "
            f"{earlier.get('dag_run_id')!r} ({earlier.get('source_run')}), not of "
            f"{dag_run_id!r} ({run_output})"
        )
    return earlier


def copy_version(prefix: str, run: RunModel, *, client: Any | None) -> dict[str, Any]:
    """Copy the run's files under ``prefix``, then write its ``manifest.json`` last (readers
    take a version with a manifest as complete); return the manifest."""
    run_output, dataset, parity_uri = run.run_output, run.dataset, run.parity_uri
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
        ONNX_NAME: run.onnx_uri,
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
        curves = render_training_curves(
            metrics.get("history", []), step_series(metrics, metrics_uri)
        )
        (Path(tmp) / CURVES_NAME).write_bytes(curves)
        local[CURVES_NAME] = Path(tmp) / CURVES_NAME
        (Path(tmp) / SUMMARY_NAME).write_text(
            render_summary(
                model_name=run.model_name,
                version=run.version,
                metrics=metrics,
                gate=run.gate,
                dataset=dataset,
                parity=parity,
                dag_run_id=run.dag_run_id,
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
    manifest = {
        "format": VERSION_MANIFEST.format,
        "model": run.model_name,
        "version": run.version,
        "files": files,
        "dataset": {"uri": dataset.get("uri"), "content_hash": dataset.get("content_hash")},
        "metrics": final,
        "epochs": metrics.get("epochs"),
        "world_size": metrics.get("world_size"),
        "versions": metrics.get("versions", {}),
        **({"elastic": elastic} if (elastic := elastic_summary(metrics)) else {}),
        "preprocessing": preprocessing,  # what the model's ONNX metadata carries
        "gate": run.gate,
        "source_run": run_output,
        "dag_run_id": run.dag_run_id,
        "published_at": published_at,
    }
    storage.write_text(
        storage.join(prefix, VERSION_MANIFEST_NAME), VERSION_MANIFEST.dumps(manifest), client=client
    )
    return manifest
