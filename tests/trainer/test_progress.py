"""Rank 0's progress reporting: the per-step record stays bounded however long the run, and
a progress event is printed at least every ``interval_s`` (a clock the test advances)."""

from __future__ import annotations

import itertools

import pytest

from horovod_airflow.core.contract import EVENT_PROGRESS, MAX_STEP_POINTS, STEP_SERIES, parse_event
from horovod_airflow.trainer.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _events(out: str) -> list[dict]:
    return [e for e in (parse_event(line, EVENT_PROGRESS) for line in out.splitlines()) if e]


def test_a_long_run_keeps_a_bounded_record_ending_at_its_last_step(capsys):
    steps_per_epoch, epochs = 25_001, 10  # 250,010 steps
    clock = Clock()
    progress = Progress(is_primary=True, steps_per_epoch=steps_per_epoch, epochs=epochs,
                        start_epoch=0, interval_s=30, clock=clock)  # fmt: skip
    for epoch in range(epochs):
        for step in range(steps_per_epoch):
            clock.now += 0.01
            progress.step(epoch, step, 1.0 / (1 + step), 0.1, 64,
                          last=step == steps_per_epoch - 1)  # fmt: skip
    record = STEP_SERIES.check(progress.record(), "steps")
    assert len(record["step"]) <= MAX_STEP_POINTS
    assert record["step"][-1] == steps_per_epoch * epochs and record["epoch"][-1] == epochs
    assert record["every"] == -(-steps_per_epoch * epochs // MAX_STEP_POINTS)
    events = _events(capsys.readouterr().out)
    gaps = [b["step"] - a["step"] for a, b in itertools.pairwise(events)]
    assert max(gaps) * 0.01 <= 30 + 0.01  # never more than interval_s between two events
    assert events[-1]["step"] == events[-1]["of_steps"] and events[-1]["eta_seconds"] == 0
    assert events[-1]["samples_per_sec"] == pytest.approx(64 / 0.01)


def test_only_rank_0_reports(capsys):
    progress = Progress(is_primary=False, steps_per_epoch=4, epochs=1, start_epoch=0,
                        interval_s=1)  # fmt: skip
    for step in range(4):
        progress.step(0, step, 0.5, 0.1, 64, last=step == 3)
    assert capsys.readouterr().out == "" and progress.record()["step"] == []


def test_a_resumed_try_says_where_its_record_starts(capsys):
    progress = Progress(is_primary=True, steps_per_epoch=4, epochs=3, start_epoch=2,
                        interval_s=1)  # fmt: skip
    for step in range(4):
        progress.step(2, step, 0.5, 0.1, 64, last=step == 3)
    record = progress.record()
    assert record["from_epoch"] == 2 and record["step"] == [9, 10, 11, 12]
    assert _events(capsys.readouterr().out)[0]["step"] == 9
