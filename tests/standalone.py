"""``airflow standalone`` (scheduler with the LocalExecutor, triggerer, API server, DAG
processor) in a home of its own, and a client of its REST API: for the tests that need what
``dag.test()`` does not run (the scheduler's heartbeat checks, its deadline loop, the
triggerer)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, S3Server

HEARTBEAT_TIMEOUT_S = 15  # the scheduler's task_instance_heartbeat_timeout under it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Standalone:
    """``airflow standalone`` in its own home, and a client of its REST API. Its environment
    is this process's without any ``AIRFLOW*`` variable, plus its own home, the S3 server as
    ``aws_default``, and ``extra_env``."""

    def __init__(
        self,
        home: Path,
        dags: Path,
        s3: S3Server,
        log: Path,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.home, self.log_path = home, log
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        env.update(
            AIRFLOW_HOME=str(home),
            AIRFLOW__CORE__DAGS_FOLDER=str(dags),
            AIRFLOW__CORE__LOAD_EXAMPLES="False",
            AIRFLOW__CORE__EXECUTOR="LocalExecutor",
            AIRFLOW__CORE__PARALLELISM="2",  # two worker processes, not 32
            AIRFLOW__API__PORT=str(self.port),
            AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"{self.base}/execution/",
            AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT=str(HEARTBEAT_TIMEOUT_S),
            AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL="3",
            AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="5",
            AIRFLOW_CONN_AWS_DEFAULT=s3.airflow_conn_uri_json(),
            PYTHONPATH=str(REPO),
        )
        env.update(extra_env or {})  # the test's own settings (AIRFLOW_* included)
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin" / "airflow"),
             "standalone"],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        self._token: str | None = None

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        self._log.close()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def call(self, method: str, path: str, body: Any = None) -> Any:
        if self._token is None:
            password = json.loads(
                (self.home / "simple_auth_manager_passwords.json.generated").read_text()
            )["admin"]
            answer = self._request(
                "POST", "/auth/token", {"username": "admin", "password": password}
            )
            self._token = answer["access_token"]
        return self._request(method, path, body, token=self._token)

    def _request(self, method: str, path: str, body: Any, token: str | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base + path, data=data, method=method, headers=headers
        )
        with urllib.request.urlopen(request, timeout=15) as response:
            return json.loads(response.read() or b"null")

    def wait(self, what: str, check: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"airflow standalone exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                last = check()
                if last:
                    return last
            except (OSError, KeyError, ValueError, urllib.error.URLError) as e:
                last = repr(e)
            time.sleep(2)
        pytest.fail(f"{what}: not within {timeout:.0f}s (last: {last!r:.300}):\n{self.log_tail()}")
