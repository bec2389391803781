"""A worker killed with SIGKILL while its container trains: the next try re-attaches.

Real everything: ``airflow standalone`` (scheduler with the LocalExecutor, API server, DAG
processor) in a home of its own, the docker launcher on podman's Docker API, the session's S3
server. The task's worker processes (the supervisor and the task) are SIGKILLed while the
container holds; the scheduler finds the task's heartbeat gone and schedules try 2, which reads
the container id try 1 recorded in Airflow's task state store and waits for that container. The
run succeeds with one container in all.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import S3Server
from tests.engines.conftest import JOB_LABEL, PodmanEngine, read_json
from tests.standalone import Standalone

pytestmark = [pytest.mark.engine, pytest.mark.slow]

HOLD_S = 100  # how long the probe's ranks hold: the kill, its detection and try 2 fit in it

DAG = """
from datetime import UTC, datetime, timedelta

from airflow.sdk import DAG

from horovod_airflow.operators import HorovodTrainOperator
from horovod_airflow.operators.launchers.docker import DockerOptions

with DAG({dag_id!r}, schedule=None, start_date=datetime(2026, 1, 1, tzinfo=UTC),
         is_paused_upon_creation=False) as dag:
    HorovodTrainOperator(
        task_id="train",
        launcher="docker",
        image={image!r},
        docker=DockerOptions(docker_url={docker_url!r}, mounts={mounts!r},
                             network_mode="host", shm_size=None, cleanup="delete"),
        env={env!r},
        entrypoint=("python", "-m", "tests.engines.hvd_probe"),
        trainer_args={{"hold_seconds": {hold}}},
        num_proc=2,
        data="s3://unused/data",
        output={output!r},
        retries=1,
        retry_delay=timedelta(seconds=1),
        execution_timeout=timedelta(minutes=10),
    )
"""


def _task_workers(standalone: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The processes that run a task under this ``airflow standalone``: the LocalExecutor's
    busy worker (the task's supervisor, titled ``airflow worker -- LocalExecutor: <task>``)
    and the task process it forked (``airflow worker -- <ti id>``); idle workers are not."""
    found = []
    for p in psutil.Process(standalone.pid).children(recursive=True):
        try:  # setproctitle pads the title: strip it before matching
            title = " ".join(p.cmdline()).strip(" \x00")
        except psutil.Error:
            continue
        if title.startswith("airflow worker --") and "<idle>" not in title:
            found.append(p)
    return found


def test_a_retry_after_the_worker_is_killed_reattaches_to_the_recorded_container(
    podman_engine: PodmanEngine, s3_server: S3Server, tmp_path: Path
) -> None:
    dag_id = f"killed_{uuid.uuid4().hex[:8]}"
    bucket = s3_server.new_bucket("killed")
    output = f"s3://{bucket}/runs/{dag_id}"
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / f"{dag_id}.py").write_text(
        DAG.format(
            dag_id=dag_id, image=podman_engine.image, docker_url=podman_engine.docker_url,
            mounts=podman_engine.mounts, env=podman_engine.env, hold=HOLD_S, output=output,
        )
    )  # fmt: skip
    client = podman_engine.client()
    mine_label = [JOB_LABEL, f"dag_id={dag_id}"]  # the containers of this test's DAG
    since = int(time.time()) - 1
    airflow = Standalone(tmp_path / "home", dags, s3_server, tmp_path / "standalone.log")
    try:
        airflow.wait("the DAG parsed", lambda: airflow.call("GET", f"/api/v2/dags/{dag_id}"), 300)
        run = airflow.call("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None})
        run_id = run["dag_run_id"]
        ti_path = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/train"

        def holding() -> list[dict[str, Any]]:
            mine = client.containers(filters={"label": mine_label, "status": "running"})
            if not mine:
                return []
            logs = client.logs(mine[0]["Id"]).decode(errors="replace")
            return mine if "holding" in logs else []

        (container,) = airflow.wait("try 1's container holding", holding, 400)
        workers = _task_workers(airflow.proc)
        titles = [" ".join(p.cmdline()).strip(" \x00") for p in workers]
        assert len(workers) == 2, f"not the task's supervisor and task process: {titles}"
        for p in workers:  # the worker dies outright: no on_kill, no clean-up
            p.kill()
        psutil.wait_procs(workers, timeout=10)

        def finished() -> dict[str, Any] | None:
            state = airflow.call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")["state"]
            return airflow.call("GET", ti_path) if state in ("success", "failed") else None

        ti = airflow.wait("the run to finish", finished, HOLD_S + 300)
        run_state = airflow.call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")["state"]
        airflow_logs = {
            n: airflow.call("GET", f"{ti_path}/logs/{n}?full_content=true") for n in (1, 2)
        }
        try_2_log = json.dumps(airflow_logs[2])
    finally:
        airflow.stop()

    assert run_state == "success", airflow.log_tail()
    assert ti["state"] == "success" and ti["try_number"] == 2, ti
    assert "re-attaching to it instead of starting a second one" in try_2_log, try_2_log[-3000:]
    assert container["Id"][:12] in try_2_log
    # The engine's own record: one container of this DAG was ever created (podman's events).
    events = subprocess.run(
        ["podman", "events", "--stream=false", "--since", str(since), "--format", "json",
         "--filter", "event=create", "--filter", f"label=dag_id={dag_id}"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert len(events) == 1, events  # one container in all
    try_1_log = json.dumps(airflow_logs[1])
    assert f"created container {container['Names'][0].lstrip('/')}" in try_1_log
    assert "created container" not in try_2_log
    metrics = read_json(s3_server, f"{output}/metrics.json")
    assert metrics["world_size"] == 2
    assert client.containers(all=True, filters={"id": container["Id"]}) == []  # cleaned up
