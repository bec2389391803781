"""What the Horovod operators share: job names that stay distinct per run and try."""

from __future__ import annotations

import re

import pytest

from operators.job import job_name


@pytest.mark.parametrize(
    "run_ids",
    [
        ["a:b", "a+b", "a b", "a_b"],
        ["manual__2026-12-02T10:00:00+00:00", "manual__2026-12-02T10_00_00_00_00"],
        ["x" * 300 + "1", "x" * 300 + "2"],
    ],
)
def test_job_names_of_colliding_run_ids_are_distinct_dns_names(run_ids):
    names = [job_name("dag", "train", r, 1) for r in run_ids]
    assert len(set(names)) == len(run_ids), names
    for name in names:
        assert len(name) <= 52 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name


def test_job_name_is_per_try_and_deterministic():
    assert job_name("d", "train", "r", 1) == job_name("d", "train", "r", 1)
    assert job_name("d", "train", "r", 1) != job_name("d", "train", "r", 2)
    assert job_name("d", "Train_Step", "r", 1).startswith("hvd-train-step-")
