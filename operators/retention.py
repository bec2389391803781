"""Retention: which prefixes of a pipeline bucket may go, and deleting them safely.

The bucket layout is :mod:`horovod_airflow.core.layout`'s (``datasets/``, ``runs/``,
``models/``). The policy (:class:`RetentionPolicy`) keeps, always:

- **everything under** ``models/``: every published version, ``latest.json``, the refused
  candidates (``models/<model>/refused/<version>/``, an admin may promote one), and a version
  folder still being copied (its publish in flight, or to be retried). Serving follows
  ``latest.json``; a rollback may point it back at any published version. Retention never
  deletes there.
- **every dataset a published version, a refused candidate or a** ``latest.json`` **names**
  (its manifest's ``dataset``): serving's check predicts that dataset's test split.
- **the last** ``keep_runs`` **run prefixes of each DAG** (``runs/<dag_id>/<run_key>/``, newest
  by their last write), whatever their outcome, and the datasets they record
  (``metrics.json``'s ``dataset``, ``gate.json``'s ``challenger_dataset_hash``).
- **in-flight runs**, and datasets staged within the in-flight window.

*In flight.* A run prefix is *finished* when it carries a terminal marker: its ``gate.json``
refused (publish is then skipped; the export and ``record_refused`` may still run, which an
active run of its DAG covers) or a published version's or refused candidate's manifest names
it as ``source_run``. A run prefix without one is in flight while its newest object is younger than
``in_flight_window`` (the settings require at least the DAG run timeout: a run is over by its
``dagrun_timeout``, so one whose last write is older has ended, failed or timed out), and,
when Airflow is asked (the operator does), while Airflow reports a queued or running run of
its DAG: a cleared old run runs again, so no prefix of that DAG is touched then.

Dataset deletions wait (none in this pass, each dataset reported why) while a kept run does
not record its dataset yet or a DAG has an active run: a run names the dataset it trains on
only when training ends, and an unchanged dataset is not staged again (its prefix keeps its
old time), so an old-looking dataset may be the one a run is reading.

Deleting (:func:`apply_plan`) is safe under concurrency: the plan records each model's
``latest.json`` ETag and the set of published versions; they are read again before the first
deletion and before each dataset's, and if they changed the plan is refused
(:class:`~horovod_airflow.operators.exceptions.RetentionConflictError`);
:func:`apply_retention` then plans again (a few times). Each prefix is listed again just before
it is deleted; one whose objects changed since the plan is left for the next pass. Within a
prefix the files that say it is complete go first (``manifest.json``, ``metrics.json``,
``gate.json``), so a prefix half deleted never passes for a complete one (staging uploads such
a dataset again). A failed delete raises the storage error naming the object and what was
deleted before it.

Runs in the Airflow worker (``BucketRetentionOperator``); needs no torch and no Airflow.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from horovod_airflow.core import layout, storage
from horovod_airflow.core.contract import (
    GATE,
    GATE_NAME,
    LATEST_NAME,
    MANIFEST_NAME,
    METRICS,
    METRICS_NAME,
    REFUSED_DIR,
    VERSION_MANIFEST,
    VERSION_MANIFEST_NAME,
    ContractError,
)
from horovod_airflow.operators.exceptions import RetentionConflictError
from horovod_airflow.operators.model_registry import KEY_HASH_CHARS, read_latest

log = logging.getLogger(__name__)

#: Deleted first in a prefix: the files that say it is complete.
COMPLETION_MARKERS = (MANIFEST_NAME, METRICS_NAME, GATE_NAME)
#: How many times :func:`apply_retention` plans again when the registry changed meanwhile.
REPLANS = 3
#: A run key as ``model_registry.safe_key`` makes it (a readable part, ``-``, 12 hex digits,
#: or the 12 hex digits alone); a staged prefix's name (the content hash's first 16 hex).
RUN_KEY = re.compile(rf"(?:.+-)?[0-9a-f]{{{KEY_HASH_CHARS}}}")
STAGED_KEY = re.compile(rf"[0-9a-f]{{{layout.HASH_PREFIX_CHARS}}}")


@dataclass(frozen=True)
class RetentionPolicy:
    """How many runs of each DAG to keep, and how recent a write makes a run in flight.

    Published versions, ``latest.json`` and the datasets they name are always kept; there is
    no setting for them.
    """

    keep_runs: int = 10
    in_flight_window: timedelta = timedelta(days=2)

    def __post_init__(self) -> None:
        k = self.keep_runs
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 100_000:
            raise ValueError(
                f"keep_runs={k!r}: expected a whole number of runs from 1 to 100000 (the "
                "newest runs of each DAG kept, whatever their outcome)"
            )
        w = self.in_flight_window
        if not isinstance(w, timedelta) or w <= timedelta(0):
            raise ValueError(
                f"in_flight_window={w!r}: expected a positive timedelta (at least the DAG run "
                "timeout: a run written to more recently than this is in flight)"
            )


@dataclass(frozen=True)
class Prefix:
    """One run or dataset prefix: what it holds and what the policy decided for it."""

    uri: str
    kind: str  # "run" or "dataset"
    reason: str
    objects: tuple[storage.ObjectInfo, ...]

    @property
    def size(self) -> int:
        return sum(o.size for o in self.objects)

    def as_dict(self) -> dict[str, Any]:
        return {
            "prefix": self.uri,
            "kind": self.kind,
            "reason": self.reason,
            "objects": len(self.objects),
            "bytes": self.size,
        }


@dataclass(frozen=True)
class RegistryState:
    """What a deletion must not run past: each model's ``latest.json`` ETag (None: none) and
    the manifest URIs of every published version."""

    latest_etags: dict[str, str | None]
    versions: frozenset[str]

    def changes_since(self, earlier: RegistryState) -> list[str]:
        changes = []
        for model in sorted(set(self.latest_etags) | set(earlier.latest_etags)):
            was, now = earlier.latest_etags.get(model), self.latest_etags.get(model)
            if was != now:
                changes.append(f"models/{model}/{LATEST_NAME} ETag {was} → {now}")
        for uri in sorted(self.versions ^ earlier.versions):
            changes.append(f"{uri} {'appeared' if uri in self.versions else 'disappeared'}")
        return changes


@dataclass(frozen=True)
class RetentionPlan:
    """What a pass would delete and keep, and why; made at ``made_at`` over ``registry``."""

    bucket_uri: str
    policy: RetentionPolicy
    made_at: datetime
    registry: RegistryState
    delete: tuple[Prefix, ...]
    keep: tuple[Prefix, ...]
    notes: tuple[str, ...] = ()

    @property
    def delete_bytes(self) -> int:
        return sum(p.size for p in self.delete)

    @property
    def delete_objects(self) -> int:
        return sum(len(p.objects) for p in self.delete)

    def as_dict(self) -> dict[str, Any]:
        return {
            "bucket_uri": self.bucket_uri,
            "keep_runs": self.policy.keep_runs,
            "in_flight_window_s": self.policy.in_flight_window.total_seconds(),
            "made_at": self.made_at.isoformat(timespec="seconds"),
            "delete": [p.as_dict() for p in self.delete],
            "keep": [p.as_dict() for p in self.keep],
            "delete_objects": self.delete_objects,
            "delete_bytes": self.delete_bytes,
            "notes": list(self.notes),
        }


@dataclass
class RetentionResult:
    """What a pass did: ``deleted`` (empty on a dry run) and ``left`` (changed since the
    plan), with the plan it applied."""

    plan: RetentionPlan
    dry_run: bool
    deleted: list[Prefix] = field(default_factory=list)
    left: list[dict[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.plan.as_dict(),
            "dry_run": self.dry_run,
            "deleted": [p.as_dict() for p in self.deleted],
            "deleted_objects": sum(len(p.objects) for p in self.deleted),
            "deleted_bytes": sum(p.size for p in self.deleted),
            "left": self.left,
        }


def _base(uri: str) -> str:
    """A prefix URI as :func:`storage.list_objects` spells the objects below it."""
    return str(storage.parse(uri)).rstrip("/")


def _norm(uri: str | None) -> str | None:
    return _base(uri) if uri else None


def _group(
    objects: Iterable[storage.ObjectInfo], root: str, key: re.Pattern[str]
) -> dict[str, list[storage.ObjectInfo]]:
    """Objects below ``root`` by their prefix two segments deep (``<dag_id>/<run_key>``,
    ``<name>/<hash16>``) whose second segment matches ``key``; any other object (not of the
    layout's shape: ``runs/<run_id>/onnx/...`` written by hand) belongs to no prefix and is
    left out, so never deleted."""
    base = _base(root)
    groups: dict[str, list[storage.ObjectInfo]] = {}
    for obj in objects:
        parts = obj.uri[len(base) + 1 :].split("/")
        if len(parts) > 2 and key.fullmatch(parts[1]):
            groups.setdefault("/".join([base, *parts[:2]]), []).append(obj)
    return groups


def _age(now: datetime, then: datetime) -> str:
    seconds = max(0, int((now - then).total_seconds()))
    if seconds >= 2 * 86400:
        return f"{seconds // 86400} d"
    if seconds >= 2 * 3600:
        return f"{seconds // 3600} h"
    return f"{seconds // 60} min"


def _read(schema: Any, uri: str, client: Any) -> dict[str, Any] | None:
    """A run's JSON file by its schema; None when it is unreadable or breaks its contract
    (the run then has no marker). A store that does not answer raises: nothing is decided."""
    try:
        return dict(schema.loads(storage.read_text(uri, client=client), uri))
    except storage.TransientStorageError:
        raise
    except (storage.StorageError, ContractError) as e:
        log.warning("retention: %s is unreadable, taken as absent: %s", uri, e)
        return None


def registry_state(
    bucket_uri: str, *, client: Any | None = None
) -> tuple[RegistryState, dict[str, dict[str, Any]], list[str]]:
    """The registry's state, each model's ``latest.json`` (by model) and the URIs of the
    published versions' manifests; lists ``models/`` and reads each ``latest.json``."""
    root = layout.models_root(bucket_uri)
    base = _base(root)
    models: set[str] = set()
    manifest_uris: list[str] = []
    for obj in storage.list_objects(root, client=client):
        parts = obj.uri[len(base) + 1 :].split("/")
        models.add(parts[0])
        # a published version's manifest, or a refused candidate's (models/<m>/refused/<v>/)
        candidate = len(parts) == 4 and parts[1] == REFUSED_DIR
        if (len(parts) == 3 or candidate) and parts[-1] == VERSION_MANIFEST_NAME:
            manifest_uris.append(obj.uri)
    etags: dict[str, str | None] = {}
    latest: dict[str, dict[str, Any]] = {}
    for model in sorted(models):
        document, etag = read_latest(bucket_uri, model, client=client)
        etags[model] = etag
        if document is not None:
            latest[model] = document
    return RegistryState(etags, frozenset(manifest_uris)), latest, manifest_uris


def read_registry(
    bucket_uri: str, *, client: Any | None = None
) -> tuple[RegistryState, dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """:func:`registry_state` plus every published version's manifest (by manifest URI). A
    manifest that breaks its contract raises :class:`ContractError`: retention cannot tell
    which dataset it needs, so it stops."""
    state, latest, manifest_uris = registry_state(bucket_uri, client=client)
    manifests = {
        uri: VERSION_MANIFEST.loads(storage.read_text(uri, client=client), uri)
        for uri in manifest_uris
    }
    return state, latest, manifests


class _References:
    """The datasets something kept names, by prefix URI and by content hash."""

    def __init__(self) -> None:
        self.by_uri: dict[str, list[str]] = {}
        self.by_hash: dict[str, list[str]] = {}

    def add(self, uri: Any, content_hash: Any, who: str) -> bool:
        """Record a reference; False when it names no dataset at all."""
        named = False
        if isinstance(uri, str) and uri:
            self.by_uri.setdefault(_base(uri), []).append(who)
            named = True
        if isinstance(content_hash, str) and content_hash:
            short = content_hash[: layout.HASH_PREFIX_CHARS]
            self.by_hash.setdefault(short, []).append(who)
            named = True
        return named

    def of(self, prefix: str) -> list[str]:
        short = prefix.rsplit("/", 1)[-1]
        return self.by_uri.get(prefix, []) + self.by_hash.get(short, [])


def _who(names: list[str]) -> str:
    shown = sorted(set(names))
    more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
    return ", ".join(shown[:3]) + more


def plan_retention(
    bucket_uri: str,
    policy: RetentionPolicy,
    *,
    client: Any | None = None,
    now: datetime | None = None,
    dag_is_active: Callable[[str], bool] | None = None,
    dag_ids: Iterable[str] = (),
) -> RetentionPlan:
    """Decide, for every run and dataset prefix of the bucket, keep or delete, and why.

    ``dag_is_active(dag_id)`` says whether Airflow has a queued or running run of that DAG
    (None: not asked; the in-flight window alone decides); it is asked about every DAG with
    runs under ``runs/`` and about ``dag_ids`` (the DAGs that stage into this bucket: a first
    run stages, and may reuse an old dataset, before it writes a run prefix). Reads only;
    deletes nothing.
    """
    now = now or datetime.now(UTC)
    registry, latest, manifests = read_registry(bucket_uri, client=client)
    refs = _References()
    for model, document in latest.items():
        refs.add(
            document.get("dataset_uri"),
            document.get("dataset_content_hash"),
            f"models/{model}/{LATEST_NAME}",
        )
    # Every file a latest.json or a version manifest points at (serving loads only from the
    # version's own folder, but a record pointing elsewhere keeps what it points at).
    reached: dict[str, str] = {}
    for model, document in latest.items():
        for key in ("uri", "manifest_uri", "onnx_uri"):
            if isinstance(document.get(key), str):
                reached[_base(document[key])] = f"models/{model}/{LATEST_NAME}"
    published: dict[str, str] = {}  # run prefix -> the version it was published as
    for manifest_uri, manifest in manifests.items():
        version = f"{manifest['model']} {manifest['version']}"
        if len(manifest_uri[len(_base(layout.models_root(bucket_uri))) :].split("/")) == 5:
            version += " (refused candidate)"  # models/<m>/refused/<v>/manifest.json
        dataset = manifest.get("dataset") or {}
        refs.add(dataset.get("uri"), dataset.get("content_hash"), f"published {version}")
        if manifest.get("source_run"):
            published[_base(manifest["source_run"])] = version
        for entry in (manifest.get("files") or {}).values():
            if isinstance(entry, dict) and isinstance(entry.get("uri"), str):
                reached[_base(entry["uri"])] = f"published {version}"

    def reached_by(prefix: str) -> list[str]:
        return [
            who for uri, who in reached.items() if uri == prefix or uri.startswith(prefix + "/")
        ]

    delete: list[Prefix] = []
    keep: list[Prefix] = []
    waits: list[str] = []
    runs = _group(storage.list_objects(layout.runs_root(bucket_uri), client=client),
                  layout.runs_root(bucket_uri), RUN_KEY)  # fmt: skip
    by_dag: dict[str, list[tuple[str, list[storage.ObjectInfo]]]] = {}
    for prefix, objects in runs.items():
        by_dag.setdefault(prefix.rsplit("/", 2)[-2], []).append((prefix, objects))
    active_dags: set[str] = set()
    if dag_is_active is not None:
        active_dags = {d for d in sorted({*by_dag, *dag_ids}) if dag_is_active(d)}
    waits += [f"Airflow reports an active run of {d}" for d in sorted(active_dags)]
    for dag_id, dag_runs in sorted(by_dag.items()):
        active = dag_id in active_dags
        dag_runs.sort(key=lambda r: (max(o.modified for o in r[1]), r[0]), reverse=True)
        for rank, (prefix, objects) in enumerate(dag_runs):
            decision = _decide_run(prefix, objects, rank, dag_id, active, published, policy, now,
                                   client)  # fmt: skip
            if reached_by(prefix) and decision.kind != "run-keep":
                reason = f"files in it are named by {_who(reached_by(prefix))}"
                decision = _RunDecision("run-keep", reason, decision.dataset_uri,
                                        decision.dataset_hash)  # fmt: skip
            if decision.kind == "run-keep":
                keep.append(Prefix(prefix, "run", decision.reason, tuple(objects)))
                if not refs.add(decision.dataset_uri, decision.dataset_hash, f"kept run {prefix}"):
                    waits.append(f"the kept run {prefix} does not record its dataset yet")
            else:
                delete.append(Prefix(prefix, "run", decision.reason, tuple(objects)))

    datasets = _group(storage.list_objects(layout.datasets_root(bucket_uri), client=client),
                      layout.datasets_root(bucket_uri), STAGED_KEY)  # fmt: skip
    for prefix, objects in sorted(datasets.items()):
        newest = max(o.modified for o in objects)
        named = refs.of(prefix) + reached_by(prefix)
        if named:
            keep.append(Prefix(prefix, "dataset", f"named by {_who(named)}", tuple(objects)))
        elif now - newest < policy.in_flight_window:
            reason = (f"staged {_age(now, newest)} ago (< in-flight window "
                      f"{_age(now, now - policy.in_flight_window)}): a run may be reading it "
                      "before it records it")  # fmt: skip
            keep.append(Prefix(prefix, "dataset", reason, tuple(objects)))
        elif waits:
            reason = f"dataset deletions wait: {'; '.join(waits[:3])}"
            keep.append(Prefix(prefix, "dataset", reason, tuple(objects)))
        else:
            reason = (f"named by no published version, latest.json or kept run; last staged "
                      f"{_age(now, newest)} ago")  # fmt: skip
            delete.append(Prefix(prefix, "dataset", reason, tuple(objects)))
    notes = tuple(f"dataset deletions wait: {w}" for w in waits)
    return RetentionPlan(bucket_uri, policy, now, registry, tuple(delete), tuple(keep), notes)


@dataclass(frozen=True)
class _RunDecision:
    kind: str  # "run-keep" or "run-delete"
    reason: str
    dataset_uri: str | None = None
    dataset_hash: str | None = None


def _decide_run(
    prefix: str,
    objects: list[storage.ObjectInfo],
    rank: int,
    dag_id: str,
    active: bool,
    published: dict[str, str],
    policy: RetentionPolicy,
    now: datetime,
    client: Any,
) -> _RunDecision:
    names = {o.uri[len(prefix) + 1 :] for o in objects}
    gate = _read(GATE, f"{prefix}/{GATE_NAME}", client) if GATE_NAME in names else None
    metrics = _read(METRICS, f"{prefix}/{METRICS_NAME}", client) if METRICS_NAME in names else None
    dataset = (metrics or {}).get("dataset") or {}
    uri = dataset.get("uri") if isinstance(dataset, dict) else None
    content_hash = (dataset.get("content_hash") if isinstance(dataset, dict) else None) or (
        (gate or {}).get("challenger_dataset_hash")
    )
    newest = max(o.modified for o in objects)
    if prefix in published:
        outcome = f"finished: published as {published[prefix]} (the version holds its own copy)"
        finished = True
    elif gate is not None and gate.get("passed") is False:
        outcome = f"finished: the gate refused it ({gate.get('reason')})"
        finished = True
    else:
        finished = False
        outcome = f"no terminal marker, last written {_age(now, newest)} ago"

    def keep(reason: str) -> _RunDecision:
        return _RunDecision("run-keep", reason, uri, content_hash)

    if active:
        return keep(f"Airflow reports an active run of {dag_id}: none of its runs is touched")
    if rank < policy.keep_runs:
        return keep(f"one of the last {policy.keep_runs} runs of {dag_id} ({outcome})")
    if not finished and now - newest < policy.in_flight_window:
        window = _age(now, now - policy.in_flight_window)
        return keep(f"in flight: {outcome} (< in-flight window {window})")
    if not finished:
        outcome = f"ended without publishing or a refusal (failed or stopped): {outcome}"
    return _RunDecision(
        "run-delete", f"older than the last {policy.keep_runs} runs of {dag_id}; {outcome}"
    )


def _fingerprint(objects: Iterable[storage.ObjectInfo]) -> set[tuple[str, int, datetime]]:
    return {(o.uri, o.size, o.modified) for o in objects}


def _markers_first(prefix: Prefix) -> list[storage.ObjectInfo]:
    def order(o: storage.ObjectInfo) -> tuple[int, str]:
        name = o.uri[len(prefix.uri) + 1 :]
        return (0 if name in COMPLETION_MARKERS else 1, o.uri)

    return sorted(prefix.objects, key=order)


def check_registry(plan: RetentionPlan, *, client: Any | None = None) -> None:
    """Raise :class:`RetentionConflictError` unless ``latest.json`` of every model and the set
    of published versions are what the plan was made over."""
    now, _, _ = registry_state(plan.bucket_uri, client=client)
    changes = now.changes_since(plan.registry)
    if changes:
        raise RetentionConflictError(
            f"the registry of {plan.bucket_uri} changed since the retention plan of "
            f"{plan.made_at.isoformat(timespec='seconds')}: {'; '.join(changes)}. The plan "
            "may delete what the new state needs: it is refused (plan again)"
        )


def apply_plan(plan: RetentionPlan, *, client: Any | None = None) -> RetentionResult:
    """Delete what ``plan`` lists, runs first, then datasets; see the module's safety rules.

    Raises :class:`RetentionConflictError` (before the first deletion, or before a dataset's)
    when the registry changed since the plan, and the storage error of a failed delete,
    naming the object and what was deleted before it.
    """
    result = RetentionResult(plan, dry_run=False)
    check_registry(plan, client=client)
    for prefix in sorted(plan.delete, key=lambda p: (p.kind != "run", p.uri)):
        if prefix.kind == "dataset":
            check_registry(plan, client=client)
        now = list(storage.list_objects(prefix.uri, client=client))
        if _fingerprint(now) != _fingerprint(prefix.objects):
            why = "its objects changed since the plan: left for the next pass"
            log.warning("retention: %s %s", prefix.uri, why)
            result.left.append({"prefix": prefix.uri, "kind": prefix.kind, "reason": why})
            continue
        for obj in _markers_first(prefix):
            try:
                storage.delete(obj.uri, client=client)
            except storage.StorageError as e:
                done = sum(len(p.objects) for p in result.deleted)
                raise type(e)(
                    f"retention: deleting {obj.uri} failed: {e}. Deleted before it: {done} "
                    f"objects of {len(result.deleted)} prefixes (and, in {prefix.uri}, the "
                    f"objects before this one); the rest of the plan was not applied: the "
                    f"next pass continues"
                ) from e
        log.info("retention: deleted %s (%d objects, %d bytes): %s",
                 prefix.uri, len(prefix.objects), prefix.size, prefix.reason)  # fmt: skip
        result.deleted.append(prefix)
    return result


def apply_retention(
    bucket_uri: str,
    policy: RetentionPolicy,
    *,
    dry_run: bool,
    client: Any | None = None,
    dag_is_active: Callable[[str], bool] | None = None,
    dag_ids: Iterable[str] = (),
    replans: int = REPLANS,
    now: datetime | None = None,
) -> RetentionResult:
    """Plan and, unless ``dry_run``, apply; plan again when the registry changed between the
    plan and a deletion, up to ``replans`` times, then raise :class:`RetentionConflictError`.
    ``now``: the time ages are measured at (default: the clock, at each plan).
    """
    for attempt in range(replans + 1):
        plan = plan_retention(bucket_uri, policy, client=client, now=now,
                              dag_is_active=dag_is_active, dag_ids=dag_ids)  # fmt: skip
        log_plan(plan, dry_run=dry_run)
        if dry_run:
            return RetentionResult(plan, dry_run=True)
        try:
            return apply_plan(plan, client=client)
        except RetentionConflictError as e:
            if attempt == replans:
                raise RetentionConflictError(
                    f"{e} — the registry changed during {replans + 1} plans in a row; stopped "
                    "(the next pass tries again)"
                ) from e
            log.warning("retention: %s; planning again", e)
    raise AssertionError("unreachable")


def log_plan(plan: RetentionPlan, *, dry_run: bool) -> None:
    """One line per prefix to delete (with its size) and to keep, with its reason."""
    verb = "would delete" if dry_run else "to delete"
    for p in plan.delete:
        log.info("retention: %s %s %s (%d objects, %d bytes): %s",
                 verb, p.kind, p.uri, len(p.objects), p.size, p.reason)  # fmt: skip
    for p in plan.keep:
        log.info("retention: keep %s %s: %s", p.kind, p.uri, p.reason)
    for note in plan.notes:
        log.info("retention: %s", note)
    log.info("retention: %s %d prefixes, %d objects, %d bytes; keep %d prefixes",
             verb, len(plan.delete), plan.delete_objects, plan.delete_bytes,
             len(plan.keep))  # fmt: skip
