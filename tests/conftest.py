"""Shared fixtures: a real S3 API server on loopback, an isolated Airflow home, the project paths.

Airflow reads its configuration from the environment when first imported, so the Airflow
settings are made here, at import time, before any test module imports ``airflow``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.devstack import (  # noqa: F401  (S3Server, free_port: imported by tests)
    REPO,
    VENV_BIN,
    S3Server,
    airflow_env,
    embedded_s3,
    free_port,
    migrate_airflow_db,
    moto_server,
    venv_and_repo_on_path,
)

MNIST_DIR = REPO / "data" / "mnist"

# --- Airflow: an isolated home with SQLite metadata, our DAGs folder, no examples ----------
_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="hva-airflow-home-"))
for _key, _value in airflow_env(_AIRFLOW_HOME).items():
    os.environ.setdefault(_key, _value)
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "False")
# Each DAG-run test imports the DAG with its own bucket, so the Asset URI of `publish` changes
# between tests seconds apart. Airflow skips re-writing a serialized DAG written less than
# min_serialized_dag_update_interval (30 s) ago, and dag.test() then runs the new DAG against
# the previous test's stored copy (whose outlet names the previous bucket): always re-write.
os.environ.setdefault("AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL", "0")
# Remembered doctor passes of the local launcher: the suite's own, never the user's.
os.environ["HVA_PREFLIGHT_CACHE"] = str(_AIRFLOW_HOME / "preflight-cache")
# Ranks and helper processes must find the venv's horovodrun and python first, and the repo
# root is on the path of every process a test starts (python -m horovod_airflow.trainer ...).
venv_and_repo_on_path()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3 server (SeaweedFS) on 127.0.0.1 that checks credentials: the process's AWS
    environment and ``aws_default`` are the worker's identity, ``hva_ranks`` the ranks' (its
    rights only in buckets made with ``new_bucket(..., ranks=True)``)."""
    with embedded_s3("seaweedfs", tmp_path_factory.mktemp("seaweedfs")) as srv:
        yield srv


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[S3Server]:
    """Moto's S3 server, for the one kind of test that needs what a real server refuses: a
    request altered after signing. Checks no credential; the environment is left alone."""
    with moto_server() as srv:
        yield srv


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """Migrate the isolated SQLite metadata DB once per session; return AIRFLOW_HOME."""
    migrate_airflow_db()
    return Path(os.environ["AIRFLOW_HOME"])


@pytest.fixture(scope="session")
def stack_images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The compose stack's images (stand-ins, Airflow, trainer), built where missing or stale.

    ``scripts/prebuild.sh`` builds them before pytest starts; here they are found current in
    seconds, or built (a cold trainer image: ~18 min) when pytest runs alone, so no test
    depends on another having run first.
    """
    from tests.engine_scripts import build_stack_images

    return build_stack_images(tmp_path_factory.mktemp("stack-images"))


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
