"""Someone hears when nothing ships: notifiers for a failed task and a refused gate, and the
check that fails loudly when serving has stayed on one model too long.

Runs in the Airflow worker. The notifiers are Airflow's own (``BaseNotifier``): SMTP from the
deployment's settings (:func:`alert_notifiers`), or any provider notifier a DAG passes in
their place (Slack, Teams, PagerDuty: each configured by its Airflow connection).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from horovod_airflow.core import storage
from horovod_airflow.core.contract import GATE, GATE_NAME
from horovod_airflow.operators.exceptions import StaleModelError

if TYPE_CHECKING:
    from airflow.sdk import BaseNotifier
    from airflow.sdk.definitions.deadline import DeadlineAlert

FAILED_SUBJECT = "[horovod-airflow] {{ dag.dag_id }}: task {{ ti.task_id }} failed ({{ run_id }})"
FAILED_BODY = (
    "<p>Task <b>{{ ti.task_id }}</b> of DAG run <b>{{ run_id }}</b> failed"
    "{% if ti.try_number %} (try {{ ti.try_number }}){% endif %}.</p>"
    "<p>{{ exception | e }}</p>"
    '<p>Log: <a href="{{ ti.log_url }}">{{ ti.log_url }}</a></p>'
)
REFUSED_SUBJECT = "[horovod-airflow] {{ dag.dag_id }}: the gate refused run {{ run_id }}"
REFUSED_BODY = (
    "<p>The gate refused the model of run <b>{{ run_id }}</b>; serving stays on "
    "{{ gate.champion_version or 'no model yet' }}.</p>"
    "<p>Reason: {{ gate.reason | e }}</p>"
    "<p>Challenger accuracy: {{ gate.challenger_accuracy }}; floor {{ gate.min_accuracy }}; "
    "champion {{ gate.champion_accuracy }}.</p>"
    '<p>Log: <a href="{{ ti.log_url }}">{{ ti.log_url }}</a></p>'
)


# A deadline callback runs in the triggerer with a small context: the run (``dag_run``, as the
# REST API shows it) and the deadline; no task, no ``dag`` object.
LATE_SUBJECT = (
    "[horovod-airflow] {{ dag_run.dag_id }}: run {{ dag_run.dag_run_id }} is still going "
    "after its deadline"
)
LATE_BODY = (
    "<p>DAG run <b>{{ dag_run.dag_run_id }}</b> of <b>{{ dag_run.dag_id }}</b>, queued at "
    "{{ dag_run.queued_at }}, had not finished by its deadline {{ deadline.deadline_time }} "
    "(state: {{ dag_run.state }}).</p>"
    "<p>A run that takes far longer than usual: a hung rank, a stuck upload, or no free "
    "worker. It fails at its dagrun_timeout (HVA_RUN_TIMEOUT_MINUTES) unless it finishes.</p>"
)


def run_deadline_alerts(
    after: timedelta, emails: Sequence[str], smtp_conn_id: str = "smtp_default"
) -> list[DeadlineAlert]:
    """The DAG's ``deadline=``: an Airflow deadline alert that mails ``emails`` through
    ``smtp_conn_id`` when a run has not finished ``after`` its queueing; none without
    addresses. The scheduler finds the missed deadline and the triggerer sends the mail with
    the same SMTP notifier as :func:`alert_notifiers` (``SmtpNotifier``, awaited)."""
    if not isinstance(after, timedelta) or after <= timedelta(0):
        raise ValueError(f"after must be a positive timedelta, got {after!r}")
    if not emails:
        return []
    from airflow.providers.smtp.notifications.smtp import SmtpNotifier
    from airflow.sdk.definitions.callback import AsyncCallback
    from airflow.sdk.definitions.deadline import DeadlineAlert, DeadlineReference

    callback = AsyncCallback(
        SmtpNotifier,
        kwargs={"to": list(emails), "smtp_conn_id": smtp_conn_id, "subject": LATE_SUBJECT,
                "html_content": LATE_BODY},
    )  # fmt: skip
    return [
        DeadlineAlert(
            reference=DeadlineReference.DAGRUN_QUEUED_AT,
            interval=after,
            callback=callback,
            name="run far longer than usual",
        )
    ]


def alert_notifiers(
    kind: str, emails: Sequence[str], smtp_conn_id: str = "smtp_default"
) -> list[BaseNotifier]:
    """SMTP notifiers for ``kind`` (``"failed"``: a task failed; ``"refused"``: the gate
    refused) to ``emails`` through the Airflow connection ``smtp_conn_id``; none without
    addresses. Templated with the task's context (``gate`` is the decision for a refusal)."""
    if kind not in ("failed", "refused"):
        raise ValueError(f"kind must be 'failed' or 'refused', got {kind!r}")
    if not emails:
        return []
    from airflow.providers.smtp.notifications.smtp import SmtpNotifier

    subject, body = (
        (FAILED_SUBJECT, FAILED_BODY) if kind == "failed" else (REFUSED_SUBJECT, REFUSED_BODY)
    )
    return [
        SmtpNotifier(to=list(emails), smtp_conn_id=smtp_conn_id, subject=subject, html_content=body)
    ]


def notify(notifiers: Sequence[Any], context: Any, **extra: Any) -> None:
    """Call each notifier with the task's context (and ``extra`` in it). A notifier that
    fails is logged, not raised: the alert must not change the task's outcome."""
    import logging

    log = logging.getLogger(__name__)
    for notifier in notifiers:
        try:
            notifier({**context, **extra})
        except Exception:
            log.exception("notifier %s failed", type(notifier).__name__)


@dataclass(frozen=True)
class Staleness:
    """How long serving has stayed on one model: refused runs since it was published (this
    one included) and days since then (None before any publish)."""

    refused_runs: int
    days: float | None
    champion_version: str | None
    since: datetime | None


def _gates(runs_prefix: str, client: Any | None) -> list[tuple[datetime, dict[str, Any]]]:
    """Every ``gate.json`` under ``runs_prefix``, with when it was written."""
    loc = storage.parse(runs_prefix)
    found: list[tuple[datetime, dict[str, Any]]] = []
    if not loc.is_s3:
        for path in Path(loc.key).rglob(GATE_NAME):
            when = datetime.fromtimestamp(path.stat().st_mtime, UTC)
            found.append((when, GATE.loads(path.read_text(), str(path))))
        return found
    c = client if client is not None else storage.s3_client()
    prefix = loc.key.rstrip("/") + "/"
    with storage.s3_errors("ListObjectsV2", runs_prefix, c):
        pages = list(c.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix))
    for page in pages:
        for obj in page.get("Contents", []):
            if obj["Key"].endswith("/" + GATE_NAME):
                uri = f"s3://{loc.bucket}/{obj['Key']}"
                gate = GATE.loads(storage.read_text(uri, client=c), uri)
                found.append((obj["LastModified"], gate))
    return found


def staleness(
    runs_prefix: str, champion: dict[str, Any] | None, *, client: Any | None = None,
    now: datetime | None = None,
) -> Staleness:  # fmt: skip
    """Refused gates under ``runs_prefix`` (one DAG's run folders) since ``champion``
    (``latest.json``) was published, and the days since then."""
    now = now or datetime.now(UTC)
    since = None
    if champion is not None and champion.get("published_at"):
        since = datetime.fromisoformat(str(champion["published_at"]))
        if since.tzinfo is None:
            since = since.replace(tzinfo=UTC)
    refused = [
        when for when, gate in _gates(runs_prefix, client)
        if not gate["passed"] and (since is None or when > since)
    ]  # fmt: skip
    start = since or (min(refused) if refused else None)
    days = (now - start) / timedelta(days=1) if start is not None else None
    version = champion.get("version") if champion else None
    return Staleness(len(refused), days, version, since)


def check_staleness(state: Staleness, *, max_refused_runs: int, max_days: float) -> None:
    """Raise :class:`StaleModelError` when ``max_refused_runs`` runs in a row were refused or
    nothing was published for ``max_days`` days, naming which and since when."""
    serving = (
        f"serving is on {state.champion_version}, published {state.since:%Y-%m-%d %H:%M} UTC"
        if state.champion_version and state.since
        else "nothing was ever published"
    )
    if state.refused_runs >= max_refused_runs:
        raise StaleModelError(
            f"{state.refused_runs} runs in a row were refused by the gate (the limit is "
            f"{max_refused_runs}): {serving}. Look at their gate.json reasons: the data, the "
            f"recipe or the bar may need a person (HVA_STALE_AFTER_RUNS)"
        )
    if state.days is not None and state.days >= max_days:
        raise StaleModelError(
            f"no model was published for {state.days:.1f} days (the limit is {max_days:g}): "
            f"{serving} (HVA_STALE_AFTER_DAYS)"
        )
