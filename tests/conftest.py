"""Shared fixtures: a real S3 API server on loopback, an isolated Airflow home, the project paths.

Airflow reads its configuration from the environment when first imported, so the Airflow
settings are made here, at import time, before any test module imports ``airflow``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
MNIST_DIR = REPO / "data" / "mnist"

# --- Airflow: an isolated home with SQLite metadata, our DAGs folder, no examples ----------
_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="hva-airflow-home-"))
os.environ.setdefault("AIRFLOW_HOME", str(_AIRFLOW_HOME))
os.environ.setdefault(
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"sqlite:///{_AIRFLOW_HOME / 'airflow.db'}"
)
os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", str(REPO / "dags"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "False")
# Each DAG-run test imports the DAG with its own bucket, so the Asset URI of `publish` changes
# between tests seconds apart. Airflow skips re-writing a serialized DAG written less than
# min_serialized_dag_update_interval (30 s) ago, and dag.test() then runs the new DAG against
# the previous test's stored copy (whose outlet names the previous bucket): always re-write.
os.environ.setdefault("AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL", "0")
# Remembered doctor passes of the local launcher: the suite's own, never the user's.
os.environ["HVA_PREFLIGHT_CACHE"] = str(_AIRFLOW_HOME / "preflight-cache")
# Ranks and helper processes must find the venv's horovodrun and python first.
os.environ["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
# The repo root on the path of every process a test starts (python -m trainer ...).
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class S3Server:
    """A moto S3 server on loopback, with the standard AWS environment pointing at it."""

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
        """Create a bucket with a unique name (tests share one server) and return its name."""
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


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A real S3 API (moto's server) on 127.0.0.1; sets the AWS env and aws_default connection."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "hva-test-key",
        "AWS_SECRET_ACCESS_KEY": "hva-test-secret-do-not-log",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    saved = {k: os.environ.get(k) for k in [*env, "AIRFLOW_CONN_AWS_DEFAULT"]}
    os.environ.update(env)
    srv = S3Server(endpoint=env["AWS_ENDPOINT_URL"], env=env)
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


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """Migrate the isolated SQLite metadata DB once per session; return AIRFLOW_HOME."""
    subprocess.run(
        [str(VENV_BIN / "airflow"), "db", "migrate"],
        check=True,
        capture_output=True,
        env=os.environ.copy(),
        timeout=600,
    )
    return Path(os.environ["AIRFLOW_HOME"])


@pytest.fixture
def mnist_subset(tmp_path: Path) -> Path:
    """A small MNIST-format folder cut from the vendored real MNIST (train 2000, test 500)."""
    from tests.mnist_subset import write_subset

    return write_subset(MNIST_DIR, tmp_path / "mnist-subset", train=2000, test=500)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_AIRFLOW_HOME, ignore_errors=True)


# --- In CI a missing component fails the test that needs it: no silent skips --------------
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Where ``CI=true``, a test that would skip fails instead, naming what was missing.

    Outside CI (a developer's laptop without podman or hadolint) it skips with the reason.
    Deselection (``-m "not slow"``) is not a skip and is unaffected.
    """
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (
            f"CI=true: this test would have skipped, and in CI a missing component is a "
            f"failure: {reason}"
        )
