"""A run that takes far longer than usual is told about: the retraining DAG's Airflow deadline
alert, for real.

Deadlines are found by the scheduler's loop and their callback runs in the triggerer, neither
of which ``dag.test()`` runs; so this test runs ``airflow standalone`` (scheduler, triggerer,
DAG processor, API server) on the shipped ``dags/`` folder with ``HVA_RUN_DEADLINE_MINUTES=1``
and the loopback SMTP server of ``test_alerts`` as ``smtp_default``. A run of
``mnist_horovod_retrain`` is triggered through the REST API while the DAG is paused (as a new
deployment's DAGs are), so it stays queued and so certainly outlives its one-minute deadline
without training anything; the scheduler marks the deadline missed and the triggerer mails it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.dags.test_alerts import TO, Inbox, inbox  # noqa: F401  (the loopback SMTP fixture)
from tests.standalone import Standalone

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "mnist_horovod_retrain"


@pytest.mark.slow
def test_a_run_past_its_deadline_mails_the_alert_addresses(inbox: Inbox, s3_server, tmp_path):  # noqa: F811
    bucket = s3_server.new_bucket("deadline")
    env = {
        "AIRFLOW_CONN_SMTP_DEFAULT": os.environ["AIRFLOW_CONN_SMTP_DEFAULT"],  # set by inbox
        "HVA_ALERT_EMAILS": TO,
        "HVA_RUN_DEADLINE_MINUTES": "1",
        "HVA_BUCKET": bucket,
        "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
    }
    airflow = Standalone(tmp_path / "home", REPO / "dags", s3_server, tmp_path / "sa.log", env)
    try:
        dag = airflow.wait("the DAG parsed", lambda: airflow.call("GET", f"/api/v2/dags/{DAG_ID}"),
                           300)  # fmt: skip
        assert dag["is_paused"] is True, dag
        run = airflow.call("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None})
        run_id = run["dag_run_id"]
        queued = time.monotonic()
        airflow.wait("the deadline's mail", lambda: inbox.messages, 240)
        waited = time.monotonic() - queued
        state = airflow.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
        tasks = airflow.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances")
    finally:
        airflow.stop()

    (mail,) = inbox.messages
    assert mail["To"] == TO, mail["To"]
    assert mail["Subject"] == (
        f"[horovod-airflow] {DAG_ID}: run {run_id} is still going after its deadline"
    ), mail["Subject"]
    body = inbox.text(mail)
    assert run_id in body and "queued at" in body and "HVA_RUN_TIMEOUT_MINUTES" in body, body
    assert waited >= 55, f"mailed {waited:.0f}s after the trigger: before the deadline"
    assert state == "queued"  # the DAG stayed paused: the run never started, nothing trained
    assert all(t["state"] in (None, "scheduled") for t in tasks["task_instances"]), json.dumps(
        tasks
    )[:2000]
    assert s3_server.env["AWS_SECRET_ACCESS_KEY"] not in body
