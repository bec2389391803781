"""What rank 0 reports while it trains: a progress event on stdout at least every
``--progress-seconds`` (step, epoch, samples/s, ETA, loss, lr), and the bounded per-step record
of loss and learning rate that ``metrics.json`` keeps under ``steps`` (the training curves).

Only rank 0 reports; the loss is rank 0's own batch loss (averaged over the steps since the
last record), read without a collective, so reporting never changes what the ranks compute
or adds a synchronisation between them. The recorded losses stay on the device until an event
is printed or the record is written: one device sync per event (at most one a second), not one
per step.
"""

from __future__ import annotations

import math
import time
from typing import Any

from horovod_airflow.core.contract import (
    EVENT_PROGRESS,
    MAX_STEP_POINTS,
    STEP_SERIES,
    event_line,
)


def record_every(total_steps: int, max_points: int = MAX_STEP_POINTS) -> int:
    """Keep one step in this many, so that a run of ``total_steps`` keeps ≤ ``max_points``."""
    return max(1, math.ceil(total_steps / max_points))


class Progress:
    """Rank 0's progress of one try: call :meth:`step` after each optimizer step.

    ``steps_per_epoch`` optimizer steps an epoch, ``epochs`` in all; ``start_epoch``: the
    epochs a resumed try skips. ``is_primary`` False (the other ranks): nothing is printed or
    kept, and :meth:`step` costs nothing. The elastic loop keeps a record on every rank (any
    of them may be rank 0 when the run ends), sets ``quiet`` on all but rank 0, and calls
    :meth:`resize` when the world size changes its steps per epoch.
    """

    def __init__(
        self,
        *,
        is_primary: bool,
        steps_per_epoch: int,
        epochs: int,
        start_epoch: int,
        interval_s: float,
        clock: Any = time.monotonic,
    ) -> None:
        self.is_primary = is_primary
        self.steps_per_epoch = steps_per_epoch
        self.epochs = epochs
        self.of_steps = steps_per_epoch * epochs
        self.every = record_every(self.of_steps)
        self.start_epoch = start_epoch
        self.interval_s = interval_s
        self._clock = clock
        self._started: float | None = None
        self.quiet = False  # keep the record, print no event
        self._taken = 0  # steps this process has taken
        self._samples = 0
        self._last_print: float | None = None
        self._window: Any = 0.0  # sum of batch losses since the last record (a tensor)
        self._window_n = 0
        self._event_loss: Any = 0.0
        self._event_n = 0
        self.series: dict[str, list[Any]] = {"step": [], "epoch": [], "loss": [], "lr": []}
        self._pending: list[tuple[Any, int]] = []  # (loss sum, steps) not yet read

    def resize(self, steps_per_epoch: int) -> None:
        """The world changed: an epoch is now ``steps_per_epoch`` steps. Steps are counted in
        the world's own steps from here; the record's ``epoch`` stays continuous."""
        self.steps_per_epoch = steps_per_epoch
        self.of_steps = steps_per_epoch * self.epochs

    def step(
        self, epoch: int, step: int, loss: Any, lr: float, samples: int, *, last: bool = False
    ) -> None:
        """After optimizer step ``step`` (0-based in epoch ``epoch``, 0-based) whose mean batch
        loss is ``loss`` (a tensor: read only when recorded) over ``samples`` global samples.
        ``last``: the epoch's last step (an event is printed)."""
        if not self.is_primary:
            return
        now = self._clock()
        if self._started is None:
            self._started = now
        self._samples += samples
        self._taken += 1
        done = epoch * self.steps_per_epoch + step + 1  # 1-based over the run
        detached = loss.detach() if hasattr(loss, "detach") else loss
        self._window = self._window + detached
        self._window_n += 1
        self._event_loss = self._event_loss + detached
        self._event_n += 1
        if done % self.every == 0 or done == self.of_steps:
            self.series["step"].append(done)
            self.series["epoch"].append(round(done / self.steps_per_epoch, 6))
            self._pending.append((self._window, self._window_n))
            self.series["lr"].append(float(lr))
            self._window, self._window_n = 0.0, 0
        due = self._last_print is None or now - self._last_print >= self.interval_s
        if (due or last) and not self.quiet:
            self._print(now, done, epoch, lr)

    def _flush(self) -> None:
        """Read the pending recorded losses off the device, in one transfer."""
        if not self._pending:
            return
        sums = [s for s, _n in self._pending]
        if all(hasattr(s, "detach") for s in sums):
            import torch

            values = torch.stack([s.double() for s in sums]).tolist()
        else:
            values = [float(s) for s in sums]
        counts = [n for _s, n in self._pending]
        self.series["loss"].extend(v / n for v, n in zip(values, counts, strict=True))
        self._pending = []

    def _print(self, now: float, done: int, epoch: int, lr: float) -> None:
        assert self._started is not None
        self._flush()
        elapsed = now - self._started
        # The first step's time is not known (the clock starts after it): rates count the
        # steps after it, once there are any.
        rate_steps = max(0, self._taken - 1)
        step_s = elapsed / rate_steps if rate_steps and elapsed > 0 else None
        samples_per_step = self._samples / self._taken if self._taken else 0.0
        fields = {
            "step": done,
            "of_steps": self.of_steps,
            "epoch": epoch + 1,
            "of_epochs": self.epochs,
            "samples_per_sec": (samples_per_step / step_s) if step_s else None,
            "eta_seconds": max(0, self.of_steps - done) * step_s if step_s is not None else None,
            "loss": float(self._event_loss) / self._event_n if self._event_n else None,
            "lr": float(lr),
        }
        self._event_loss, self._event_n = 0.0, 0
        self._last_print = now
        print(event_line(EVENT_PROGRESS, fields), flush=True)

    def record(self) -> dict[str, Any]:
        """The ``steps`` entry of metrics.json (:data:`STEP_SERIES`)."""
        self._flush()
        doc: dict[str, Any] = {"every": self.every, **self.series}
        if self.start_epoch:
            doc["from_epoch"] = self.start_epoch
        return STEP_SERIES.stamp(doc)
