"""Promote / roll back: move ``latest.json`` by hand to another published version, the one
exception to forward-only publishing, and what the registry page and the CLI read (the
published versions, the moves made by hand, the refused runs).

A move is a compare-and-swap of ``latest.json`` (:func:`~.latest.write_latest`, the same
conditional write a publish uses) over the document that was read, so a publish or another
move in between makes it fail (:class:`ChampionChangedError`) and nothing is overwritten.
Who may move it is the caller's to check (the page asks Airflow's auth manager, see
``horovod_airflow.operators.registry_plugin``); what may be moved to is checked here:

- the version must be published and complete (its ``manifest.json``, written last, exists)
  and carry its preprocessing (a ``model-v1`` version cannot be served): never overridable;
- a version whose gate did not pass, or whose accuracy is below the deployment's floor
  (``HVA_MIN_ACCURACY_FLOOR``), needs an admin override with its reason, recorded;
- a refused run's candidate (:mod:`.refused`, ``models/<model>/refused/<version>/``) is
  promoted the same way (its gate did not pass: always an admin override); it is published to
  ``models/<model>/<version>/`` first, then ``latest.json`` moves.

Each move is recorded as a :data:`~horovod_airflow.core.contract.PROMOTION` document under
``models/<model>/history/`` and in the new ``latest.json`` (``promotion``, ``since``); the
caller emits the Asset event serving follows (:func:`~.publish.asset_event_extra` of the
returned document). Runs in the Airflow worker or API server; needs no torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from horovod_airflow.core import layout, storage
from horovod_airflow.core.contract import (
    GATE,
    GATE_NAME,
    HISTORY_DIR,
    LATEST,
    ONNX_NAME,
    PROMOTION,
    REFUSED_DIR,
    VERSION_MANIFEST,
    VERSION_MANIFEST_NAME,
)
from horovod_airflow.operators.exceptions import PublishRefusedError
from horovod_airflow.operators.model_registry.latest import (
    check_version,
    models_prefix,
    read_latest,
    write_latest,
)
from horovod_airflow.operators.model_registry.publish import _DUE, latest_document
from horovod_airflow.operators.model_registry.refused import (
    list_candidates,
    publish_candidate,
    read_candidate,
)

log = logging.getLogger(__name__)


class PromotionRefusedError(PublishRefusedError):
    """A promotion or roll back that the rules refuse; ``latest.json`` is unchanged."""


def version_prefix(bucket_uri: str, model_name: str, version: str) -> str:
    return storage.join(models_prefix(bucket_uri, model_name), check_version(version))


def read_version(
    bucket_uri: str, model_name: str, version: str, *, client: Any | None = None
) -> dict[str, Any] | None:
    """The ``manifest.json`` of a published version, or None when it is not (completely)
    published."""
    uri = storage.join(version_prefix(bucket_uri, model_name, version), VERSION_MANIFEST_NAME)
    if not storage.exists(uri, client=client):
        return None
    return VERSION_MANIFEST.loads(storage.read_text(uri, client=client), uri)


def list_models(bucket_uri: str, *, client: Any | None = None) -> list[str]:
    """The models that have at least one published version or refused candidate, by name."""
    root = layout.models_root(bucket_uri).rstrip("/") + "/"
    names = set()
    for uri in storage.list_uris(layout.models_root(bucket_uri), client=client):
        parts = uri[len(root) :].split("/") if uri.startswith(root) else []
        published = len(parts) == 3 and parts[1] != REFUSED_DIR
        candidate = len(parts) == 4 and parts[1] == REFUSED_DIR
        if (published or candidate) and parts[-1] == VERSION_MANIFEST_NAME:
            names.add(parts[0])
    return sorted(names)


def list_versions(
    bucket_uri: str, model_name: str, *, client: Any | None = None
) -> list[dict[str, Any]]:
    """Every published version's manifest, newest first (by when its run was due, then when
    it was published)."""
    prefix = models_prefix(bucket_uri, model_name)
    root = prefix.rstrip("/") + "/"
    found = []
    for uri in storage.list_uris(prefix, client=client):
        parts = uri[len(root) :].split("/")
        if len(parts) == 2 and parts[1] == VERSION_MANIFEST_NAME and parts[0] != REFUSED_DIR:
            found.append(VERSION_MANIFEST.loads(storage.read_text(uri, client=client), uri))
    return sorted(found, key=_order, reverse=True)


def list_refused_candidates(
    bucket_uri: str, model_name: str, *, client: Any | None = None
) -> list[dict[str, Any]]:
    """The refused runs' candidates (:mod:`.refused`) that are not published, newest first."""
    published = {m["version"] for m in list_versions(bucket_uri, model_name, client=client)}
    return [
        c
        for c in list_candidates(bucket_uri, model_name, client=client)
        if c["version"] not in published
    ]


def _order(manifest: dict[str, Any]) -> tuple[str, str]:
    due = _DUE.match(str(manifest.get("version")))
    return (due.group(1) if due else "", str(manifest.get("published_at")))


def read_history(
    bucket_uri: str, model_name: str, *, client: Any | None = None
) -> list[dict[str, Any]]:
    """The moves of ``latest.json`` made by hand (PROMOTION documents), newest first."""
    prefix = storage.join(models_prefix(bucket_uri, model_name), HISTORY_DIR)
    records = [
        PROMOTION.loads(storage.read_text(uri, client=client), uri)
        for uri in storage.list_uris(prefix, client=client)
        if uri.endswith(".json")
    ]
    return sorted(records, key=lambda r: str(r["at"]), reverse=True)


@dataclass(frozen=True)
class RefusedRun:
    """A run whose gate refused it: its folder, when the gate decided, and the decision."""

    run_uri: str
    decided_at: datetime
    gate: dict[str, Any] = field(default_factory=dict)


def refused_runs(bucket_uri: str, *, client: Any | None = None) -> list[RefusedRun]:
    """Every run under the bucket's ``runs/`` whose ``gate.json`` refused it, newest first."""
    found = []
    for obj in storage.list_objects(layout.runs_root(bucket_uri), client=client):
        if obj.uri.endswith("/" + GATE_NAME):
            gate = GATE.loads(storage.read_text(obj.uri, client=client), obj.uri)
            if not gate["passed"]:
                found.append(RefusedRun(obj.uri.rsplit("/", 1)[0], obj.modified, gate))
    return sorted(found, key=lambda r: r.decided_at, reverse=True)


def promotion_checks(manifest: dict[str, Any], *, min_accuracy_floor: float) -> list[str]:
    """What an admin override must answer for before ``latest.json`` may name ``manifest``'s
    version: its gate did not pass, its accuracy is below the deployment's floor."""
    problems = []
    gate = manifest.get("gate") or {}
    if not gate.get("passed"):
        problems.append(f"its gate did not pass ({gate.get('reason', 'no gate decision')})")
    accuracy = manifest["metrics"].get("val_accuracy")
    if not isinstance(accuracy, int | float) or accuracy < min_accuracy_floor:
        problems.append(
            f"its accuracy {accuracy!r} is below the deployment floor {min_accuracy_floor:.4%} "
            "(HVA_MIN_ACCURACY_FLOOR)"
        )
    return problems


def promote_version(
    *,
    bucket_uri: str,
    model_name: str,
    version: str,
    actor: str,
    reason: str,
    min_accuracy_floor: float,
    admin: bool = False,
    override_reason: str | None = None,
    client: Any | None = None,
    now: datetime | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Point ``latest.json`` of ``model_name`` at the published ``version`` by compare-and-swap.

    ``actor`` (who) and ``reason`` (why) are required and recorded. A version that fails
    :func:`promotion_checks` is refused unless ``admin`` and ``override_reason`` are given.
    Returns ``(latest.json written, its PROMOTION record)``; when ``latest.json`` already
    names ``version`` nothing is written and the record is None. Raises
    :class:`PromotionRefusedError` (nothing changed) or :class:`ChampionChangedError` when
    ``latest.json`` changed between the read and the write (nothing overwritten).
    """
    try:
        check_version(version)
    except ValueError as e:
        raise PromotionRefusedError(f"refusing to promote: {e}") from e
    if not str(actor or "").strip() or not str(reason or "").strip():
        raise PromotionRefusedError(
            "refusing to promote: say who (actor) and why (reason); both are recorded"
        )
    manifest = read_version(bucket_uri, model_name, version, client=client)
    candidate = None
    if manifest is None:
        manifest = candidate = read_candidate(bucket_uri, model_name, version, client=client)
    if manifest is None:
        known = [m["version"] for m in list_versions(bucket_uri, model_name, client=client)]
        refused = [m["version"] for m in list_candidates(bucket_uri, model_name, client=client)]
        raise PromotionRefusedError(
            f"refusing to promote {model_name} {version}: it is neither a published version "
            f"nor a refused candidate (no {VERSION_MANIFEST_NAME}); published: "
            f"{', '.join(known) or 'none'}; refused candidates: {', '.join(refused) or 'none'}"
        )
    if "preprocessing" not in manifest or ONNX_NAME not in manifest["files"]:
        raise PromotionRefusedError(
            f"refusing to promote {model_name} {version}: its manifest ({manifest['format']}) "
            "records no preprocessing or no ONNX file, so serving cannot load it"
        )
    current, etag = read_latest(bucket_uri, model_name, client=client)
    if current is not None and current.get("version") == version:
        log.info("%s latest.json already names %s: nothing to do", model_name, version)
        return current, None
    problems = promotion_checks(manifest, min_accuracy_floor=min_accuracy_floor)
    override = bool(problems)
    if problems and not (admin and str(override_reason or "").strip()):
        who = "an admin override with its reason" if not admin else "an override reason"
        raise PromotionRefusedError(
            f"refusing to promote {model_name} {version}: {'; '.join(problems)}. That needs "
            f"{who}; latest.json is unchanged"
        )
    at = (now or datetime.now(UTC)).isoformat(timespec="seconds")
    previous = current.get("version") if current else None
    previous_manifest = (
        read_version(bucket_uri, model_name, str(previous), client=client) if previous else None
    )
    older = previous_manifest is not None and _order(manifest) < _order(previous_manifest)
    record: dict[str, Any] = {
        "model": model_name,
        "version": version,
        "previous_version": previous,
        "action": "rollback" if older else "promote",
        "actor": str(actor),
        "reason": str(reason),
        "override": override,
        "at": at,
        "checks": problems,
    }
    if override:
        record["override_reason"] = str(override_reason)
    record = PROMOTION.stamp(record)
    if candidate is not None:  # a refused run's model: published first, latest.json last
        try:
            manifest = publish_candidate(bucket_uri, model_name, candidate, client=client)
        except PublishRefusedError as e:
            raise PromotionRefusedError(f"refusing to promote {model_name} {version}: {e}") from e
    prefix = version_prefix(bucket_uri, model_name, version)
    latest = LATEST.stamp(
        {
            **latest_document(manifest, storage.join(prefix, VERSION_MANIFEST_NAME), prefix),
            "since": at,
            "promotion": {k: v for k, v in record.items() if k != "format"},
        }
    )
    write_latest(bucket_uri, model_name, latest, expected_etag=etag, client=client)
    stamp = at.replace(":", "").replace("+", "p")
    record_uri = storage.join(
        models_prefix(bucket_uri, model_name), HISTORY_DIR, f"{stamp}-{version}.json"
    )
    storage.write_text(record_uri, PROMOTION.dumps(record), client=client)
    log.info(
        "%s: latest.json %s -> %s by %s (%s)%s",
        model_name,
        previous,
        version,
        actor,
        reason,
        f"; admin override: {override_reason}" if override else "",
    )
    return latest, record


def emit_latest_event(model_name: str, latest_uri: str, extra: dict[str, Any]) -> Any:
    """Record the Asset event of ``latest.json`` (``<model>_latest``) that serving follows,
    with ``extra`` (:func:`~.publish.asset_event_extra`), in Airflow's metadata database, as
    the REST API's ``POST /assets/events`` does. Needs the API server's or a CLI's database
    access (not a task's). Raises :class:`LookupError` when no DAG declares the Asset."""
    asset = find_latest_asset(model_name, latest_uri)
    from airflow.assets.manager import asset_manager
    from airflow.models.asset import AssetModel
    from airflow.utils.session import create_session

    with create_session() as session:
        model = session.get(AssetModel, asset)
        if model is None:
            raise LookupError(f"the Asset of {latest_uri} (id {asset}) is gone")
        return asset_manager.register_asset_change(
            asset=model, extra=extra, source_is_api=True, session=session
        )


def find_latest_asset(model_name: str, latest_uri: str) -> int:
    """The id of the ``<model>_latest`` Asset, checked before ``latest.json`` is moved so a
    move never happens that serving cannot hear of. :class:`LookupError` when none."""
    from airflow.models.asset import AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from horovod_airflow.operators.model_registry.latest import latest_asset_name

    name = latest_asset_name(model_name)
    with create_session() as session:
        found = session.scalar(
            select(AssetModel.id).where(AssetModel.name == name, AssetModel.uri == latest_uri)
        )
    if found is None:
        raise LookupError(
            f"no Asset {name!r} ({latest_uri}) in Airflow: no parsed DAG declares it, so a "
            "move of latest.json would reach no serving DAG; refusing to move it"
        )
    return int(found)
