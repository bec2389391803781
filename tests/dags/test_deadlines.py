"""Every task of every shipped DAG has a deadline, and so has every run of them.

A hung collective (a rank stuck in an allreduce), a stuck S3 call or a job nobody deletes
would otherwise hold the run, and with ``max_active_runs=1`` every later scheduled run, for
good. The deadlines come from the deployment's settings (``HVA_*_TIMEOUT_MINUTES``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIPPED = [REPO / "dags", REPO / "examples" / "waveforms" / "dags"]

# Parses the DAG folders in a fresh interpreter (the settings are read at import) and prints,
# per DAG, its run deadline, each task's deadline, class and whether it runs a Horovod job, its
# deadline alerts and its staging's data checks.
PARSE = """
import dataclasses, json, sys
from airflow.dag_processing.dagbag import DagBag
from horovod_airflow.operators import StageDatasetOperator
from horovod_airflow.operators.job import HorovodJobOperatorBase

out = {"errors": {}, "dags": {}}
for folder in sys.argv[1:]:
    bag = DagBag(folder)
    out["errors"].update({k: str(v) for k, v in bag.import_errors.items()})
    for dag_id, dag in bag.dags.items():
        seconds = lambda t: t.total_seconds() if t is not None else None
        out["dags"][dag_id] = {
            "run": seconds(dag.dagrun_timeout),
            "tasks": {
                t.task_id: {"timeout": seconds(t.execution_timeout),
                            "job": isinstance(t, HorovodJobOperatorBase)}
                for t in dag.tasks
            },
            "alerts": [[type(a.reference).__name__, seconds(a.interval), a.callback.path,
                        a.callback.kwargs.get("to")] for a in dag.deadline or []],
            "checks": {t.task_id: t.checks and dataclasses.asdict(t.checks)
                       for t in dag.tasks if isinstance(t, StageDatasetOperator)},
        }
print(json.dumps(out))
"""


def parse_shipped(**env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PARSE, *map(str, SHIPPED)],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_task_and_run_of_every_shipped_dag_has_a_deadline(airflow_db) -> None:
    from horovod_airflow.operators.settings import JOB_TIMEOUT, RUN_TIMEOUT, TASK_TIMEOUT

    parsed = parse_shipped()
    assert parsed["errors"] == {}
    assert set(parsed["dags"]) == {
        "mnist_horovod_retrain", "mnist_serve_latest_model", "horovod_bucket_retention",
        "waveforms_horovod_retrain", "waveforms_serve_latest_model",
    }  # fmt: skip
    jobs = []
    for dag_id, dag in parsed["dags"].items():
        assert dag["run"] == RUN_TIMEOUT.total_seconds(), dag_id
        for task_id, task in dag["tasks"].items():
            want = JOB_TIMEOUT if task["job"] else TASK_TIMEOUT
            assert task["timeout"] == want.total_seconds(), (dag_id, task_id, task)
            if task["job"]:
                jobs.append(f"{dag_id}.{task_id}")
        assert dag["alerts"] == [], dag_id  # no HVA_ALERT_EMAILS: nobody to tell
    # both retrain DAGs run train and export as Horovod jobs with the shared TRAINER_JOB
    assert sorted(jobs) == [
        "mnist_horovod_retrain.export_onnx", "mnist_horovod_retrain.train",
        "waveforms_horovod_retrain.export_onnx", "waveforms_horovod_retrain.train",
    ]  # fmt: skip


def test_a_deployment_sets_the_deadlines(airflow_db) -> None:
    parsed = parse_shipped(
        HVA_JOB_TIMEOUT_MINUTES="90", HVA_TASK_TIMEOUT_MINUTES="5", HVA_RUN_TIMEOUT_MINUTES="240"
    )
    retrain = parsed["dags"]["mnist_horovod_retrain"]
    assert retrain["run"] == timedelta(minutes=240).total_seconds()
    assert retrain["tasks"]["train"]["timeout"] == timedelta(minutes=90).total_seconds()
    assert retrain["tasks"]["gate"]["timeout"] == timedelta(minutes=5).total_seconds()


@pytest.mark.parametrize("value", ["abc", "0", "-5", "20000"])
def test_a_bad_deadline_setting_is_named(value: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import horovod_airflow.operators.settings"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "HVA_JOB_TIMEOUT_MINUTES": value},
    )  # fmt: skip
    assert done.returncode != 0
    assert f"HVA_JOB_TIMEOUT_MINUTES={value!r}: expected whole minutes from 1 to 10080" in (
        done.stderr
    )


def test_a_deployment_sets_the_run_deadline_alert_and_the_data_checks(airflow_db) -> None:
    parsed = parse_shipped(
        HVA_ALERT_EMAILS="ml@example.test", HVA_RUN_DEADLINE_MINUTES="45",
        HVA_DATA_MAX_SAMPLE_DROP="0.2", HVA_DATA_MAX_CLASS_SHARE_CHANGE="0.1",
    )  # fmt: skip
    notifier = "airflow.providers.smtp.notifications.smtp.SmtpNotifier"
    alert = ["DagRunQueuedAtDeadline", 45 * 60.0, notifier, ["ml@example.test"]]
    dags = parsed["dags"]
    for dag_id in ("mnist_horovod_retrain", "waveforms_horovod_retrain"):
        assert dags[dag_id]["alerts"] == [alert], dag_id
        checks = dags[dag_id]["checks"]["stage_dataset"]
        assert (checks["max_sample_drop"], checks["max_class_share_change"]) == (0.2, 0.1)
        assert checks["max_duplicate_fraction"] == 0.05  # the default
    assert dags["mnist_horovod_retrain"]["checks"]["stage_dataset"]["class_labels"] == []
    waveforms = dags["waveforms_horovod_retrain"]["checks"]["stage_dataset"]
    assert waveforms["class_labels"] == ["train_labels.npy", "test_labels.npy"]
    assert waveforms["check"] == "examples.waveforms.data:check_dataset"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HVA_RUN_DEADLINE_MINUTES": "0"}, "HVA_RUN_DEADLINE_MINUTES='0': expected whole minutes"),
        ({"HVA_RUN_DEADLINE_MINUTES": "720"},
         "HVA_RUN_DEADLINE_MINUTES=720: expected less than HVA_RUN_TIMEOUT_MINUTES (720)"),
        ({"HVA_DATA_MAX_SAMPLE_DROP": "1.5"},
         "HVA_DATA_MAX_SAMPLE_DROP='1.5': expected a fraction from 0 to 1; default 0.5"),
        ({"HVA_DATA_MAX_DUPLICATE_FRACTION": "x"},
         "HVA_DATA_MAX_DUPLICATE_FRACTION='x': expected a fraction from 0 to 1; default 0.05"),
    ],
)  # fmt: skip
def test_a_bad_alert_or_data_check_setting_is_named(env: dict[str, str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import horovod_airflow.operators.settings"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )  # fmt: skip
    assert done.returncode != 0
    assert message in done.stderr, done.stderr[-2000:]
