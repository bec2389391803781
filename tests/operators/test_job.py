"""What the Horovod operators share: job names distinct per task instance, label-safe labels."""

from __future__ import annotations

import re

import pytest

from operators.job import job_labels, job_name


@pytest.mark.parametrize(
    "run_ids",
    [
        ["a:b", "a+b", "a b", "a_b"],
        ["manual__2026-12-02T10:00:00+00:00", "manual__2026-12-02T10_00_00_00_00"],
        ["x" * 300 + "1", "x" * 300 + "2"],
    ],
)
def test_job_names_of_colliding_run_ids_are_distinct_dns_names(run_ids):
    names = [job_name("dag", "train", r) for r in run_ids]
    assert len(set(names)) == len(run_ids), names
    for name in names:
        assert len(name) <= 52 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name


def test_job_name_is_per_task_instance_not_per_try():
    """Every try of one task instance gets the same name, so a retry finds the earlier try's
    job; mapped instances, tasks, runs and DAGs get their own."""
    name = job_name("d", "train", "r")
    assert name == job_name("d", "train", "r") == job_name("d", "train", "r", -1)
    others = [job_name("d", "train", "r", 0), job_name("d", "train", "r", 1),
              job_name("d", "export", "r"), job_name("d", "train", "r2"),
              job_name("d2", "train", "r")]  # fmt: skip
    assert len({name, *others}) == 6
    assert job_name("d", "Train_Step", "r").startswith("hvd-train-step-")


LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


@pytest.mark.parametrize(
    ("run_id", "task_id"),
    [
        ("manual__2026-12-04T18:49:33.123456+00:00", "train"),
        ("scheduled__2026-12-04", "t" * 200),
        ("__odd run id: with spaces/slashes__", "group.train_step"),
    ],
)
def test_job_labels_are_label_safe_and_keep_the_try(run_id, task_id):
    labels = job_labels("mnist_horovod_retrain", task_id, run_id, 3, map_index=2)
    assert set(labels) == {"dag_id", "task_id", "run_id", "map_index", "try_number"}
    assert labels["try_number"] == "3" and labels["map_index"] == "2"
    for key, value in labels.items():
        assert len(value) <= 63 and LABEL_VALUE.fullmatch(value), (key, value)
    other = job_labels("mnist_horovod_retrain", task_id, run_id + "x", 3, map_index=2)
    assert other["run_id"] != labels["run_id"]  # a hash keeps unsafe run ids apart
    assert "map_index" not in job_labels("d", "t", "r", 1)
