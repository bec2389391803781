"""Deployment settings of the retraining pipeline, read once from the environment.

The DAG files import these so that the DAG and its serving-side consumer agree on the bucket,
the model name and the Asset URI without touching the metadata DB at parse time.

| variable | default | meaning |
| --- | --- | --- |
| ``HVA_AWS_CONN_ID`` | ``aws_default`` | Airflow AWS connection (endpoint + credentials) |
| ``HVA_RANK_AWS_CONN_ID`` | unset: the one above | the training ranks' narrower connection |
| ``HVA_BUCKET`` | ``horovod-airflow`` | bucket for datasets, runs and published models |
| ``HVA_LAUNCHER`` | ``local`` | default launcher in the trigger form |
| ``HVA_TRAINER_IMAGE`` | ``horovod-airflow/trainer:latest`` | image for docker/kubernetes |
| ``HVA_NUM_PROC`` | ``2`` | default ranks in the trigger form |
| ``HVA_GPUS_PER_PROC`` | ``0`` | GPUs each rank requests (docker/kubernetes launchers) |
| ``HVA_DOCKER_NETWORK`` | unset | network of the training containers (compose: ``training``) |
| ``HVA_JOB_TIMEOUT_MINUTES`` | ``360`` | deadline of each Horovod job task (train, export) |
| ``HVA_TASK_TIMEOUT_MINUTES`` | ``30`` | deadline of every other task (stage, gate, publish) |
| ``HVA_RUN_TIMEOUT_MINUTES`` | ``720`` | ``dagrun_timeout`` of the shipped DAGs |
| ``HVA_MIN_ACCURACY_FLOOR`` | ``0`` | the lowest ``min_accuracy`` a run may ask the gate for |
| ``HVA_MAX_REGRESSION_CEILING`` | ``1`` | the highest ``max_regression`` a run may ask for |
| ``HVA_DATASET_SOURCES`` | unset: any | the sources a run may stage: values or ``.../`` prefixes |
| ``HVA_ALERT_EMAILS`` | unset: none | mailed when a task fails or the gate refuses (a,b) |
| ``HVA_SMTP_CONN_ID`` | ``smtp_default`` | the Airflow SMTP connection those mails go through |
| ``HVA_STALE_AFTER_RUNS`` | ``4`` | refused runs in a row after which the gate fails |
| ``HVA_STALE_AFTER_DAYS`` | ``35`` | days without a publish after which a refusing gate fails |
| ``HVA_RETENTION_KEEP_RUNS`` | ``10`` | run prefixes kept per DAG, newest first (1 to 100000) |
| ``HVA_RETENTION_IN_FLIGHT_MINUTES`` | ``2880`` | a run written this recently is in flight |
| ``HVA_RETENTION_DRY_RUN`` | ``true`` | the maintenance DAG's default: list, do not delete |
| ``HVA_DATA_MAX_SAMPLE_DROP`` | ``0.5`` | share of a split's samples a new dataset may lose |
| ``HVA_DATA_MAX_CLASS_SHARE_CHANGE`` | ``0.05`` | how far a class's share may move (5 points) |
| ``HVA_DATA_MAX_DUPLICATE_FRACTION`` | ``0.05`` | share of a split's samples that may repeat |
| ``HVA_RUN_DEADLINE_MINUTES`` | ``180`` | a run still going this long after it was queued alerts |

The floor, ceiling and sources bind the trigger form (the Params' bounds) and the operators
(a conf past them fails the task without retry): whoever may trigger a run may not lower the
deployment's bar or stage from elsewhere. ``.env.example`` (the compose stack) sets them.

A task's deadline is its ``execution_timeout``; a job task's is also the launchers' deadline
and the MPIJob/TrainJob ``activeDeadlineSeconds``. The run's keeps a hung run from holding
``max_active_runs=1`` (and so every later scheduled run) forever.

``TRAINER_JOB`` bundles the settings the DAG's train and export tasks share.

The ``HVA_DATA_*`` settings are the staging's data checks (``DATA_CHECKS``,
:mod:`horovod_airflow.operators.data_checks`): a dataset that changed more than they allow
against the previous staged one fails the staging task, and nothing trains. The run deadline
is an Airflow deadline alert (``RUN_DEADLINE_ALERTS``): it mails ``HVA_ALERT_EMAILS`` while the
run goes on; ``HVA_RUN_TIMEOUT_MINUTES`` is the later limit that fails it.

The retention settings are the policy of the maintenance DAG (``dags/bucket_retention.py``,
:mod:`horovod_airflow.operators.retention`): published versions, ``latest.json`` and the
datasets they name are always kept; these say how many runs are kept and when a run counts
as in flight. The in-flight window is at least ``HVA_RUN_TIMEOUT_MINUTES`` (a run is over by
its ``dagrun_timeout``; a shorter window fails the import). Dry-run is the default, so a new
deployment first reads what would go.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from horovod_airflow.operators.alerts import alert_notifiers, run_deadline_alerts
from horovod_airflow.operators.data_checks import DataChecks
from horovod_airflow.operators.job import HorovodJobSettings
from horovod_airflow.operators.launchers.docker import DockerOptions


def minutes(name: str, default: int) -> timedelta:
    """``$name`` as a duration in whole minutes (1 to 10080, a week); ValueError naming it."""
    raw = os.environ.get(name, "").strip() or str(default)
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= 7 * 24 * 60:
        raise ValueError(
            f"{name}={raw!r}: expected whole minutes from 1 to 10080 (a week); default {default}"
        )
    return timedelta(minutes=value)


def fraction(name: str, default: float) -> float:
    """``$name`` as a fraction in [0, 1]; ValueError naming it."""
    raw = os.environ.get(name, "").strip() or str(default)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={raw!r}: expected a fraction from 0 to 1; default {default}")
    return value


def whole(name: str, default: int, low: int, high: int) -> int:
    """``$name`` as a whole number from ``low`` to ``high``; ValueError naming it."""
    raw = os.environ.get(name, "").strip() or str(default)
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ValueError(
            f"{name}={raw!r}: expected a whole number from {low} to {high}; default {default}"
        )
    return value


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def flag(name: str, default: bool) -> bool:
    """``$name`` as a yes/no setting (true/false, 1/0, yes/no, on/off); ValueError naming it."""
    raw = os.environ.get(name, "").strip() or str(default).lower()
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    allowed = ", ".join(_TRUE + _FALSE)
    raise ValueError(f"{name}={raw!r}: expected one of {allowed}; default {str(default).lower()}")


AWS_CONN_ID = os.environ.get("HVA_AWS_CONN_ID", "aws_default")
#: The ranks' own identity (``rank_aws_conn_id``): datasets and runs only, no ``models/``.
RANK_AWS_CONN_ID = os.environ.get("HVA_RANK_AWS_CONN_ID") or None
BUCKET = os.environ.get("HVA_BUCKET", "horovod-airflow")
BUCKET_URI = f"s3://{BUCKET}"
DEFAULT_LAUNCHER = os.environ.get("HVA_LAUNCHER", "local")
TRAINER_IMAGE = os.environ.get("HVA_TRAINER_IMAGE", "horovod-airflow/trainer:latest")
DEFAULT_NUM_PROC = int(os.environ.get("HVA_NUM_PROC", "2"))
GPUS_PER_PROC = int(os.environ.get("HVA_GPUS_PER_PROC", "0"))
DOCKER_NETWORK = os.environ.get("HVA_DOCKER_NETWORK") or None
#: Every task of the shipped DAGs has a deadline: a hung collective or a stuck S3 call fails
#: the task (and the run) instead of holding the weekly schedule forever.
JOB_TIMEOUT = minutes("HVA_JOB_TIMEOUT_MINUTES", 360)
TASK_TIMEOUT = minutes("HVA_TASK_TIMEOUT_MINUTES", 30)
RUN_TIMEOUT = minutes("HVA_RUN_TIMEOUT_MINUTES", 720)
#: What a run's conf may not go past (the trigger form's bounds, and the operators').
MIN_ACCURACY_FLOOR = fraction("HVA_MIN_ACCURACY_FLOOR", 0.0)
MAX_REGRESSION_CEILING = fraction("HVA_MAX_REGRESSION_CEILING", 1.0)
DATASET_SOURCES = tuple(
    s.strip() for s in os.environ.get("HVA_DATASET_SOURCES", "").split(",") if s.strip()
)
#: Who hears when nothing ships (operators/alerts.py): mail on a failed task and a refused
#: gate, and the gate fails once serving has been stale this long.
ALERT_EMAILS = tuple(
    e.strip() for e in os.environ.get("HVA_ALERT_EMAILS", "").split(",") if e.strip()
)
SMTP_CONN_ID = os.environ.get("HVA_SMTP_CONN_ID", "smtp_default")
STALE_AFTER_RUNS = whole("HVA_STALE_AFTER_RUNS", 4, 1, 1000)
STALE_AFTER_DAYS = whole("HVA_STALE_AFTER_DAYS", 35, 1, 3660)
#: ``on_failure_callback`` of every task, and the gate's ``on_refused``: empty lists without
#: addresses (the DAG then alerts only through Airflow's own UI and states).
FAILURE_ALERTS = alert_notifiers("failed", ALERT_EMAILS, SMTP_CONN_ID)
REFUSED_ALERTS = alert_notifiers("refused", ALERT_EMAILS, SMTP_CONN_ID)
#: The retention policy of the maintenance DAG (horovod_airflow.operators.retention).
RETENTION_KEEP_RUNS = whole("HVA_RETENTION_KEEP_RUNS", 10, 1, 100_000)
RETENTION_IN_FLIGHT = minutes("HVA_RETENTION_IN_FLIGHT_MINUTES", 2880)
if RETENTION_IN_FLIGHT < RUN_TIMEOUT:
    # A run is over by its dagrun_timeout: a shorter window could call a running one finished.
    raise ValueError(
        f"HVA_RETENTION_IN_FLIGHT_MINUTES={RETENTION_IN_FLIGHT.total_seconds() / 60:.0f}: "
        f"expected at least HVA_RUN_TIMEOUT_MINUTES ({RUN_TIMEOUT.total_seconds() / 60:.0f}), "
        "the longest a DAG run can be in flight; default 2880"
    )
RETENTION_DRY_RUN = flag("HVA_RETENTION_DRY_RUN", True)
#: The staging's data checks (StageDatasetOperator(checks=DATA_CHECKS)).
DATA_CHECKS = DataChecks(
    max_sample_drop=fraction("HVA_DATA_MAX_SAMPLE_DROP", 0.5),
    max_class_share_change=fraction("HVA_DATA_MAX_CLASS_SHARE_CHANGE", 0.05),
    max_duplicate_fraction=fraction("HVA_DATA_MAX_DUPLICATE_FRACTION", 0.05),
)
#: A run that takes far longer than usual is told about before its dagrun_timeout fails it:
#: the DAG's ``deadline=`` (empty without HVA_ALERT_EMAILS).
RUN_DEADLINE = minutes("HVA_RUN_DEADLINE_MINUTES", 180)
if RUN_DEADLINE >= RUN_TIMEOUT:
    raise ValueError(
        f"HVA_RUN_DEADLINE_MINUTES={RUN_DEADLINE.total_seconds() / 60:.0f}: expected less than "
        f"HVA_RUN_TIMEOUT_MINUTES ({RUN_TIMEOUT.total_seconds() / 60:.0f}), which fails the run "
        "(the alert must come first); default 180"
    )
RUN_DEADLINE_ALERTS = run_deadline_alerts(RUN_DEADLINE, ALERT_EMAILS, SMTP_CONN_ID)
#: What the pipeline's Horovod jobs (train and export) share, for whichever launcher the
#: trigger form picks: ``HorovodTrainOperator(..., **TRAINER_JOB)``. The docker options are
#: used when the launcher renders to ``"docker"``, unused otherwise (see the launcher options
#: rule of ``horovod_airflow.operators.job.HorovodJobOperatorBase``).
TRAINER_JOB: HorovodJobSettings = {
    "execution_timeout": JOB_TIMEOUT,
    "aws_conn_id": AWS_CONN_ID,
    "rank_aws_conn_id": RANK_AWS_CONN_ID,
    "image": TRAINER_IMAGE,
    "gpus_per_proc": GPUS_PER_PROC,
    "docker": DockerOptions(network_mode=DOCKER_NETWORK),
}


_GATE_PARAMS = {
    "min_accuracy": ("Minimum accuracy", "Gate floor: allreduced validation accuracy (0-1)."),
    "max_regression": (
        "Allowed regression",
        "Gate: how much worse than the published model a new one may be (accuracy fraction).",
    ),
}


def gate_param(name: str, default: float) -> dict[str, Any]:
    """``Param(**gate_param("min_accuracy", 0.98))``: a gate setting's Param, bounded by this
    deployment (``min_accuracy`` from HVA_MIN_ACCURACY_FLOOR up, ``max_regression`` up to
    HVA_MAX_REGRESSION_CEILING), its default moved inside the bounds."""
    title, description = _GATE_PARAMS[name]
    low, high = (
        (MIN_ACCURACY_FLOOR, 1.0) if name == "min_accuracy" else (0.0, MAX_REGRESSION_CEILING)
    )
    bounded = ""
    if (low, high) != (0.0, 1.0):
        bounded = f" This deployment allows {low} to {high}."
    return {
        "default": min(max(default, low), high),
        "type": "number",
        "minimum": low,
        "maximum": high,
        "title": title,
        "description": description + bounded,
    }


#: The trigger form's dataset_source: 'vendored', an s3:// prefix or an absolute path, one
#: line (the lookahead refuses a newline anywhere: JSON Schema's ``$`` in Python's re also
#: matches before a trailing one, so "vendored\n" would pass the form and fail later).
DATASET_SOURCE_PATTERN = r"^(?![\s\S]*[\r\n])(vendored|s3://[a-z0-9.\-]{3,63}(/.*)?|/.+)$"
