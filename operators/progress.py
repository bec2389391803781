"""Live training progress on the Airflow side: the trainer's ``progress`` events (step, epoch,
samples/s, ETA; see ``horovod_airflow.core.contract.EVENT_PROGRESS``) as a readable task-log
line and in Airflow 3.3's task state store, under :data:`PROGRESS_STATE_KEY`, which the task
instance page shows while the task runs.

Every launcher that holds a worker while its job runs (local, docker, kubernetes without
``deferrable``) passes each output line through :class:`ProgressReporter` as it arrives. A
deferred kubernetes wait holds no worker: its output, and so its progress, is read when the
task resumes after the trigger fired, and the task state then shows the job's last progress.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from horovod_airflow.core.contract import EVENT_PROGRESS, parse_event

#: The task state store key holding the latest progress of this task instance's job.
PROGRESS_STATE_KEY = "horovod_progress"


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "?"
    seconds = round(seconds)
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def describe(event: Mapping[str, Any]) -> str:
    """``progress: epoch 1/3, step 120/1404 (8.5%), 912 samples/s, ETA 1m24s, loss 0.4123``."""
    step, of_steps = event.get("step"), event.get("of_steps")
    share = f" ({100 * step / of_steps:.1f}%)" if step and of_steps else ""
    rate = event.get("samples_per_sec")
    rate_text = f"{rate:,.0f} samples/s" if isinstance(rate, int | float) else "? samples/s"
    loss = event.get("loss")
    loss_text = f", loss {loss:.4f}" if isinstance(loss, int | float) else ""
    return (
        f"progress: epoch {event.get('epoch')}/{event.get('of_epochs')}, step {step}/{of_steps}"
        f"{share}, {rate_text}, ETA {_duration(event.get('eta_seconds'))}{loss_text}"
    )


class ProgressReporter:
    """Watches a job's output lines for progress events: logs each as a readable line and
    records the latest in the task state store (``store``: ``context["task_state_store"]``;
    None: the log line only). A store that refuses is one warning, never a failed task."""

    def __init__(self, store: Any = None, log: Any = None) -> None:
        self.store = store
        self.log = log
        self.latest: dict[str, Any] | None = None
        self._warned = False

    def __call__(self, line: str) -> None:
        event = parse_event(line, EVENT_PROGRESS)
        if event is None:
            return
        fields = {k: v for k, v in event.items() if k != "event"}
        fields["updated_at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        self.latest = fields
        if self.log is not None:
            self.log.info("%s", describe(fields))
        if self.store is None:
            return
        try:
            self.store.set(PROGRESS_STATE_KEY, fields)
        except Exception as e:
            if not self._warned and self.log is not None:
                self.log.warning("could not record progress in the task state store: %s", e)
            self._warned = True
