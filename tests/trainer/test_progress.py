"""Rank 0's progress reporting: the per-step record stays bounded however long the run, and
a progress event is printed at least every ``interval_s`` (a clock the test advances)."""

from __future__ import annotations

import itertools
import json

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


def test_a_quiet_rank_keeps_the_record_and_a_resize_keeps_the_epoch_continuous(capsys):
    """The elastic loop's use: every rank keeps the record, only rank 0 prints; a world of 2
    ranks (4 steps an epoch) shrinks to 1 (8 steps) half-way through the epoch."""
    progress = Progress(is_primary=True, steps_per_epoch=4, epochs=1, start_epoch=0,
                        interval_s=0)  # fmt: skip
    progress.quiet = True
    progress.step(0, 0, 0.5, 0.1, 128)
    progress.step(0, 1, 0.5, 0.1, 128)
    assert capsys.readouterr().out == ""
    progress.quiet = False  # this rank became rank 0
    progress.resize(8)
    for step in range(4, 8):
        progress.step(0, step, 0.25, 0.05, 64, last=step == 7)
    record = progress.record()
    assert record["epoch"] == [0.25, 0.5, 0.625, 0.75, 0.875, 1.0]
    assert record["lr"] == [0.1, 0.1, 0.05, 0.05, 0.05, 0.05]
    events = _events(capsys.readouterr().out)
    assert [(e["step"], e["of_steps"]) for e in events] == [(5, 8), (6, 8), (7, 8), (8, 8)]
    assert events[-1]["eta_seconds"] in (0, None)


def test_the_elastic_loop_reports_progress_and_keeps_the_step_record(staged_subset, tmp_path):
    """Real horovodrun, 2 ranks, ``--elastic``: progress events from rank 0 alone and the
    per-step record in metrics.json, as the fixed loop writes them."""
    from tests.trainer.conftest import TINY, describe, events, run_horovod

    out = tmp_path / "out"
    args = ["--data", str(staged_subset), "--output", str(out), "--epochs", "1", *TINY]
    proc = run_horovod([*args, "--elastic", "--max-val-samples", "200"], tmp_path / "cache")
    assert proc.returncode == 0, describe(proc)
    metrics = json.loads((out / "metrics.json").read_text())
    steps = STEP_SERIES.check(metrics["steps"], "steps")
    assert steps["step"] == [1, 2, 3, 4] and steps["epoch"] == [0.25, 0.5, 0.75, 1.0]
    assert len(steps["loss"]) == 4 and all(v > 0 for v in steps["loss"])
    progress = events(proc.stdout, "progress")
    assert [e["step"] for e in progress] == [1, 4] and progress[-1]["of_steps"] == 4
    ranks = {line.split("]")[0] for line in proc.stdout.splitlines() if '"progress"' in line}
    assert ranks == {"[0"}, ranks  # rank 0 alone prints
