"""The embedded development stack: a real S3 API server (moto) on loopback, the Airflow
``aws_default`` connection pointing at it, and an isolated SQLite Airflow home.

One home for what ``scripts/run_pipeline.py`` (the README's main job) and the test suite
(``tests/conftest.py``) both set up; neither is the product, which reaches S3 and Airflow
through its deployment's own connections. Import it as ``scripts.devstack`` with the repo
root on ``sys.path``. Nothing here imports Airflow: its settings must be in the environment
before the first ``import airflow``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
S3_REGION = "us-east-1"


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` right now."""
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def airflow_env(home: Path) -> dict[str, str]:
    """Airflow settings for an isolated home: SQLite metadata in it, our DAGs, no examples."""
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }


def venv_and_repo_on_path() -> None:
    """This venv's bin first on ``PATH`` (horovodrun, python, airflow) and the repo root on
    ``PYTHONPATH``, for this process and every one it starts (``python -m horovod_airflow.trainer
    ...``)."""
    os.environ["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )


@dataclass
class S3Server:
    """An S3 API server: its endpoint and the standard AWS environment pointing at it."""

    endpoint: str
    env: dict[str, str]

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name=self.env["AWS_DEFAULT_REGION"],
        )

    def new_bucket(self, prefix: str = "test") -> str:
        """Create a bucket with a unique name (users share one server) and return its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return name

    def airflow_conn_uri_json(self) -> str:
        """The ``AIRFLOW_CONN_AWS_DEFAULT`` value for this server (JSON connection format)."""
        return json.dumps(
            {
                "conn_type": "aws",
                "login": self.env["AWS_ACCESS_KEY_ID"],
                "password": self.env["AWS_SECRET_ACCESS_KEY"],
                "extra": {
                    "endpoint_url": self.endpoint,
                    "region_name": self.env["AWS_DEFAULT_REGION"],
                },
            }
        )


@contextlib.contextmanager
def embedded_s3(access_key: str, secret_key: str) -> Iterator[S3Server]:
    """Moto's S3 server on a free loopback port, for the duration of the ``with``.

    Meanwhile the process environment holds the AWS variables (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``) and
    ``AIRFLOW_CONN_AWS_DEFAULT`` for it; on exit the server stops and they are put back.
    """
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per S3 request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    srv = S3Server(
        endpoint=endpoint,
        env={
            "AWS_ACCESS_KEY_ID": access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key,
            "AWS_DEFAULT_REGION": S3_REGION,
            "AWS_ENDPOINT_URL": endpoint,
        },
    )
    saved = {k: os.environ.get(k) for k in [*srv.env, "AIRFLOW_CONN_AWS_DEFAULT"]}
    os.environ.update(srv.env)
    os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = srv.airflow_conn_uri_json()
    try:
        yield srv
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class DbMigrate:
    """``airflow db migrate`` of the environment's metadata DB, run in the background
    (it takes seconds: other set-up can go meanwhile); :meth:`wait` raises on failure."""

    def __init__(self) -> None:
        self.argv = [str(VENV_BIN / "airflow"), "db", "migrate"]
        # A file, not a pipe: nothing has to drain it. Closed by wait().
        self._output = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen(
            self.argv, stdout=self._output, stderr=subprocess.STDOUT, env=os.environ.copy()
        )

    def wait(self, timeout: float = 600) -> None:
        """Wait for the migration; raise ``CalledProcessError`` with its output if it failed."""
        try:
            code = self._proc.wait(timeout=timeout)
            self._output.seek(0)
            output = self._output.read()
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._output.close()
        if code != 0:
            raise subprocess.CalledProcessError(code, self.argv, output=output)


def migrate_airflow_db(timeout: float = 600) -> None:
    """``airflow db migrate`` of the environment's metadata DB, to the end."""
    DbMigrate().wait(timeout)
