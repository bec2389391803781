"""Someone hears when nothing ships: mail through a real SMTP server on loopback (aiosmtpd)
when a task fails, when the gate refuses, and when serving has been stale too long (the
refusing gate then fails)."""

from __future__ import annotations

import email
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.message import Message
from typing import Any

import pytest

from horovod_airflow.core import storage
from horovod_airflow.core.contract import GATE, LATEST
from horovod_airflow.operators.alerts import check_staleness, staleness
from horovod_airflow.operators.exceptions import StaleModelError
from tests.conftest import free_port
from tests.dags.test_retrain_dag import SMALL_RUN, _deploy, _states

TO = "ml-oncall@example.test"


class Inbox:
    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.messages.append(email.message_from_bytes(envelope.content))
        return "250 OK"

    def text(self, message: Message) -> str:
        parts = [p.get_payload(decode=True) for p in message.walk() if not p.is_multipart()]
        return b"".join(p for p in parts if isinstance(p, bytes)).decode(errors="replace")


@pytest.fixture
def inbox(monkeypatch: pytest.MonkeyPatch) -> Iterator[Inbox]:
    """aiosmtpd on a free loopback port as Airflow's ``smtp_default``; alerts go to ``TO``."""
    from aiosmtpd.controller import Controller

    box = Inbox()
    port = free_port()
    controller = Controller(box, hostname="127.0.0.1", port=port)
    controller.start()
    conn = {"conn_type": "smtp", "host": "127.0.0.1", "port": port,
            "extra": {"disable_tls": True, "disable_ssl": True, "from_email": "airflow@test",
                      "retry_limit": 1, "timeout": 10}}  # fmt: skip
    monkeypatch.setenv("AIRFLOW_CONN_SMTP_DEFAULT", json.dumps(conn))
    monkeypatch.setenv("HVA_ALERT_EMAILS", TO)
    try:
        yield box
    finally:
        controller.stop()


def _refused_gate(client: Any, bucket: str, run: str) -> None:
    """A gate.json as an earlier refused run of the DAG left it."""
    gate = {"passed": False, "reason": "accuracy 50.0000% < floor 98.0000%",
            "challenger_accuracy": 0.5, "min_accuracy": 0.98, "max_regression": 0.005}  # fmt: skip
    key = f"runs/mnist_horovod_retrain/{run}/gate.json"
    client.put_object(Bucket=bucket, Key=key, Body=GATE.dumps(gate).encode())


def test_a_failed_task_mails_its_error_and_log_link(inbox, s3_server, airflow_db, monkeypatch):
    from airflow.sdk import DagRunState

    dag = _deploy(s3_server.new_bucket("alerts")).retrain_dag
    dag.get_task("stage_dataset").retries = 0
    run = dag.test(run_conf={**SMALL_RUN, "dataset_source": "/no/such/folder"})
    assert run.state == DagRunState.FAILED, _states(run)
    (mail,) = inbox.messages
    assert mail["To"] == TO and "stage_dataset failed" in mail["Subject"], mail["Subject"]
    body = inbox.text(mail)
    assert run.run_id in body and "/no/such/folder" in body, body
    assert "log" in body.lower()
    assert s3_server.env["AWS_SECRET_ACCESS_KEY"] not in body


@pytest.mark.slow
def test_a_refused_gate_mails_and_a_stale_one_fails_loudly(
    inbox, s3_server, airflow_db, monkeypatch
):
    """One refused run before this one, and HVA_STALE_AFTER_RUNS=2: this run's gate refuses
    (a mail with the reason), counts two refusals in a row without a publish, and fails
    (StaleModelError: a second mail, the failure's); export and publish never run."""
    from airflow.sdk import DagRunState

    monkeypatch.setenv("HVA_STALE_AFTER_RUNS", "2")
    bucket = s3_server.new_bucket("stale")
    _refused_gate(s3_server.client(), bucket, "scheduled__earlier")
    dag = _deploy(bucket).retrain_dag
    run = dag.test(run_conf={**SMALL_RUN, "min_accuracy": 0.9999})
    states = _states(run)
    assert run.state == DagRunState.FAILED, states
    assert states["gate"] == "failed", states
    assert states["export_onnx"] == states["publish"] == "upstream_failed", states
    subjects = [m["Subject"] for m in inbox.messages]
    assert any("the gate refused run" in s for s in subjects), subjects
    assert any("task gate failed" in s for s in subjects), subjects
    refused = next(m for m in inbox.messages if "refused" in m["Subject"])
    assert "below the floor" in inbox.text(refused)
    failed = next(m for m in inbox.messages if "task gate failed" in m["Subject"])
    assert "2 runs in a row were refused" in inbox.text(failed)
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]]
    assert not any(k.startswith("models/") for k in keys)


def test_staleness_counts_refusals_since_the_champion_and_its_age(s3_server) -> None:
    client = s3_server.client()
    bucket = s3_server.new_bucket("staleness")
    runs = f"s3://{bucket}/runs/mnist_horovod_retrain"
    assert staleness(runs, None, client=client).refused_runs == 0
    for run in ("r1", "r2", "r3"):
        _refused_gate(client, bucket, run)
    published = datetime.now(UTC) - timedelta(days=40)
    document = {"format": LATEST.format, "model": "mnist_cnn", "version": "v1", "uri": "u",
                "manifest_uri": "m", "onnx_uri": "o", "onnx_sha256": "0" * 64,
                "val_accuracy": 0.99, "published_at": published.isoformat()}  # fmt: skip
    champion = LATEST.loads(json.dumps(document), "latest.json")
    state = staleness(runs, champion, client=client)
    assert state.refused_runs == 3 and state.champion_version == "v1"
    assert state.days is not None and 39.9 < state.days < 40.1
    with pytest.raises(StaleModelError, match="3 runs in a row were refused"):
        check_staleness(state, max_refused_runs=3, max_days=100)
    with pytest.raises(StaleModelError, match=r"no model was published for 40\.0 days"):
        check_staleness(state, max_refused_runs=10, max_days=35)
    check_staleness(state, max_refused_runs=4, max_days=41)  # within both: nothing raised
    # a champion published after those refusals resets the count
    later = {**champion, "published_at": datetime.now(UTC).isoformat()}
    assert staleness(runs, later, client=client).refused_runs == 0
    assert storage.exists(f"{runs}/r1/gate.json", client=client)
