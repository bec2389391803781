"""A refused run's candidate: its exported model kept in the registry where serving never
looks, so that an admin can still promote it (with an override recorded with its reason).

A run whose gate refused it is recorded under ``models/<model>/refused/<version>/`` (the
version its run would have published, :func:`~.publish.run_version`): the same files and the
same ``manifest.json`` (:data:`~horovod_airflow.core.contract.VERSION_MANIFEST`, written last)
as a published version, its ``gate`` the refusal (``passed: false`` and the ``gate.json``
reason). Nothing there is ever named by ``latest.json``: serving loads only
``models/<model>/<version>/`` (``horovod_airflow.operators.serving.in_registry``), and
recording a candidate never reads or writes ``latest.json``.

Promoting one (:func:`~.promote.promote_version`, an admin override only: its gate did not
pass) first publishes it: its files are copied to ``models/<model>/<version>/`` and that
version's ``manifest.json`` is written last, then ``latest.json`` moves by compare-and-swap as
for any promotion. Runs in the Airflow worker or API server; needs no torch.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from horovod_airflow.core import storage
from horovod_airflow.core.contract import REFUSED_DIR, VERSION_MANIFEST, VERSION_MANIFEST_NAME
from horovod_airflow.operators.exceptions import PublishRefusedError
from horovod_airflow.operators.model_registry.latest import check_version, models_prefix
from horovod_airflow.operators.model_registry.publish import (
    _DUE,
    RunModel,
    copy_version,
    earlier_of_this_run,
)

log = logging.getLogger(__name__)


def candidate_prefix(bucket_uri: str, model_name: str, version: str) -> str:
    """Where the refused candidate ``version`` of ``model_name`` is kept."""
    return storage.join(models_prefix(bucket_uri, model_name), REFUSED_DIR, check_version(version))


def read_candidate(
    bucket_uri: str, model_name: str, version: str, *, client: Any | None = None
) -> dict[str, Any] | None:
    """The ``manifest.json`` of a refused candidate, or None when there is none (complete)."""
    uri = storage.join(candidate_prefix(bucket_uri, model_name, version), VERSION_MANIFEST_NAME)
    if not storage.exists(uri, client=client):
        return None
    return VERSION_MANIFEST.loads(storage.read_text(uri, client=client), uri)


def list_candidates(
    bucket_uri: str, model_name: str, *, client: Any | None = None
) -> list[dict[str, Any]]:
    """Every refused candidate's manifest of ``model_name``, newest first."""
    prefix = storage.join(models_prefix(bucket_uri, model_name), REFUSED_DIR)
    root = prefix.rstrip("/") + "/"
    found = []
    for uri in storage.list_uris(prefix, client=client):
        parts = uri[len(root) :].split("/")
        if len(parts) == 2 and parts[1] == VERSION_MANIFEST_NAME:
            found.append(VERSION_MANIFEST.loads(storage.read_text(uri, client=client), uri))
    return sorted(found, key=candidate_order, reverse=True)


def candidate_order(manifest: dict[str, Any]) -> tuple[str, str]:
    due = _DUE.match(str(manifest.get("version")))
    return (due.group(1) if due else "", str(manifest.get("published_at")))


def record_refused(
    bucket_uri: str, run: RunModel, *, client: Any | None = None
) -> dict[str, Any] | None:
    """Keep a refused run's exported model as the candidate ``run.version``; return its
    manifest.

    Idempotent per run, as a publish is: a complete candidate of this run and decision is not
    copied again; one recorded under another decision (the gate ran again) is copied again.
    Returns None, recording nothing, when the version is already published (the run passed an
    earlier gate and was published: the registry has its model). Raises
    :class:`PublishRefusedError` for a decision that passed (that run publishes), a failed
    ONNX parity, or a candidate of the version that holds another run's model.
    """
    refusing = "refusing to record a refused candidate"
    if run.gate.get("passed"):
        raise PublishRefusedError(f"{refusing}: the gate passed, so the run publishes")
    try:
        check_version(run.version)
    except ValueError as e:
        raise PublishRefusedError(f"{refusing}: {e}") from e
    models = models_prefix(bucket_uri, run.model_name)
    if storage.exists(storage.join(models, run.version, VERSION_MANIFEST_NAME), client=client):
        log.warning(
            "%s %s is published already: no refused candidate kept", run.model_name, run.version
        )
        return None
    prefix = candidate_prefix(bucket_uri, run.model_name, run.version)
    earlier = earlier_of_this_run(
        prefix, run.run_output, run.dag_run_id, refusing=refusing, client=client
    )
    if earlier is not None and earlier.get("gate") == run.gate:
        log.info("%s is complete from an earlier try: not copied again", prefix)
        return earlier
    manifest = copy_version(prefix, run, client=client)
    log.info(
        "recorded the refused candidate %s %s at %s (not published: %s)",
        run.model_name,
        run.version,
        prefix,
        run.gate.get("reason"),
    )
    return manifest


def publish_candidate(
    bucket_uri: str, model_name: str, candidate: dict[str, Any], *, client: Any | None = None
) -> dict[str, Any]:
    """Copy a refused candidate to ``models/<model>/<version>/`` (its ``manifest.json``
    written last) and return that manifest; ``latest.json`` is the caller's to move.

    A version already published from the same run (a promotion that lost its compare-and-swap
    copied it before) is returned as it is; one holding another run's model is refused
    (:class:`PublishRefusedError`).
    """
    version = check_version(candidate["version"])
    prefix = storage.join(models_prefix(bucket_uri, model_name), version)
    earlier = earlier_of_this_run(
        prefix,
        str(candidate.get("source_run")),
        str(candidate.get("dag_run_id")),
        refusing=f"refusing to publish the refused candidate {version}",
        client=client,
    )
    if earlier is not None:
        return earlier
    files = {}
    for name, entry in candidate["files"].items():
        uri = storage.copy(entry["uri"], storage.join(prefix, name), client=client)
        files[name] = {**entry, "uri": uri}
    manifest = {
        **candidate,
        "files": files,
        "published_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    storage.write_text(
        storage.join(prefix, VERSION_MANIFEST_NAME), VERSION_MANIFEST.dumps(manifest), client=client
    )
    log.info("published the refused candidate %s %s at %s", model_name, version, prefix)
    return manifest
