"""Every command README.md and docs/ show is run as written, or says why it cannot run here.

``RUN_BY`` places each documented command: a test that runs it through ``tests.readme`` (which
fails when no page shows it any more), ``scripts/cold_ci.sh`` (the two front-door commands, in
a fresh clone), ``cold_ci.sh`` itself (run by hand before a stop), a setting the commands after
it need, or a place this machine cannot be (a GPU host with Docker). A documented command
missing from ``RUN_BY`` fails here, so a new one cannot land untested, and a ``RUN_BY`` entry
no page shows any more fails too.

The cheap commands run here: the trainer's train / export / doctor lines (on a small staged
MNIST subset) and the Airflow UI block (``airflow standalone`` until its REST API lists the
DAGs). The engine scripts' lines run in the engine and stack tests' fixtures.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import readme
from tests.conftest import REPO, S3Server
from tests.trainer.conftest import stage_local

COLD_CI = "scripts/cold_ci.sh, in a fresh clone"
UI_TEST = "test_the_airflow_ui_block_serves_the_dags"
TRAINER_TEST = "test_the_trainer_commands_train_and_export"
GPU_HOST = (
    "a GPU host with Docker: the same compose file runs here through "
    "scripts/engines/compose_stack.sh (tests/stack)"
)
BY_HAND = (
    "run by hand before a stop: it is CI itself in a fresh clone (25-60 min); its runs' "
    "figures are recorded in docs/testing.md"
)
SETTING = "a setting the next commands need: tests.readme.run puts the venv first on PATH"
UI_HOME = (
    "export AIRFLOW_HOME=$PWD/.runs/standalone AIRFLOW__CORE__DAGS_FOLDER=$PWD/dags "
    "AIRFLOW__CORE__LOAD_EXAMPLES=False PYTHONPATH=$PWD PATH=$PWD/.venv/bin:$PATH"
)
UI_CONN = """export AIRFLOW_CONN_AWS_DEFAULT='{"conn_type":"aws","login":"KEY","password":"SECRET",
  "extra":{"endpoint_url":"http://127.0.0.1:9000","region_name":"us-east-1"}}'"""
TRAIN = (
    "horovodrun -np 2 -H localhost:2 python -m horovod_airflow.trainer train "
    "--data <staged URI> --output <URI>"
)
EXPORT = (
    "python -m horovod_airflow.trainer export --checkpoint <URI>/checkpoint.pt "
    "--output <URI>/onnx [--data <staged URI>]"
)
DOCTOR = "python -m horovod_airflow.trainer doctor --np 2 [--gpus-per-proc 1] [--json]"
PODMAN_ENV = 'eval "$(scripts/engines/podman_engine.sh env)"'
KIT = "scripts/gpu/kit.sh"
CHECK_CPU = "scripts/gpu/check.sh --cpu --out <DIR>"
RUN_BY: dict[str, str] = {
    "scripts/run_pipeline.sh": f"{COLD_CI}, after .ci/run",
    "scripts/test.sh": f"{COLD_CI}: .ci/run runs it",
    "scripts/setup.sh": "scripts/test.sh and scripts/run_pipeline.sh run it first",
    "export PATH=$PWD/.venv/bin:$PATH": SETTING,
    "scripts/cold_ci.sh --cold": BY_HAND,
    "scripts/cold_ci.sh --caches DIR --order shuffle": BY_HAND,
    # The Airflow UI block
    UI_HOME: UI_TEST,
    UI_CONN: UI_TEST,
    "airflow standalone": UI_TEST,
    # A GPU host with Docker Engine and the NVIDIA Container Toolkit
    "cp .env.example .env": GPU_HOST,
    "docker compose up --build": GPU_HOST,
    # The stack on podman
    "scripts/engines/compose_stack.sh images": "tests/engine_scripts.py (stack_images fixture)",
    "scripts/engines/compose_stack.sh up": "tests/stack/conftest.py (stack fixture)",
    "scripts/engines/compose_stack.sh env": "tests/stack/test_compose_stack.py",
    "scripts/engines/compose_stack.sh smoke": "tests/stack/test_compose_stack.py",
    "scripts/engines/compose_stack.sh down": "tests/stack/test_compose_stack.py (restart)",
    "scripts/engines/compose_stack.sh down --volumes": "tests/stack/conftest.py (stack fixture)",
    "scripts/stack_secrets.sh secrets": "tests/compose/test_compose.py (secrets_dir fixture)",
    # The trainer
    TRAIN: TRAINER_TEST,
    EXPORT: TRAINER_TEST,
    DOCTOR: "tests/trainer/test_options.py (doctor tests)",
    # The GPU check: its kit and its CPU rehearsal (the device call itself is no shell command)
    KIT: "tests/test_gpu_kit.py (the kit fixture)",
    CHECK_CPU: "test_check_cpu_runs_every_step_of_the_device_check",
    # Real engines on one machine
    "scripts/engines/podman_engine.sh start": "tests/engine_scripts.py (podman_cli_env)",
    "scripts/engines/podman_engine.sh image": "tests/engines/conftest.py (podman_engine)",
    PODMAN_ENV: "test_the_podman_env_line_points_docker_at_podman",
    "scripts/engines/netns_hosts.sh up": "tests/engines/conftest.py (simulated_hosts)",
    "scripts/engines/netns_hosts.sh env": "tests/engines/conftest.py (simulated_hosts)",
    "scripts/engines/netns_hosts.sh down": "tests/engines/conftest.py (simulated_hosts)",
}


def test_every_readme_command_is_placed() -> None:
    shown = {c.text: c.where for c in readme.commands()}
    placed = {readme.canonical(text) for text in RUN_BY}
    unplaced = {text: line for text, line in shown.items() if text not in placed}
    assert not unplaced, (
        "documented commands that no test, script or reason covers (add each to RUN_BY and run it "
        f"as written): {unplaced}"
    )
    gone = sorted(placed - set(shown))
    assert not gone, f"RUN_BY entries no page shows any more: {gone}"


def test_commands_are_read_as_a_shell_reads_them(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "text\n```bash\n"
        "run --flag value   # a comment with 'quotes\n"
        "export A='x # not a comment\n  y' B=1 \\\n  C=2   # set\n"
        "\n```\n```python\nnot_a_command()\n```\n"
    )
    found = readme.commands(doc)
    assert [c.text for c in found] == [
        "run --flag value",
        "export 'A=x # not a comment\n  y' B=1 C=2",
    ]
    assert [c.where for c in found] == [f"{doc}:3", f"{doc}:4"]
    assert readme.command("run  --flag value", doc) == "run --flag value"
    assert readme.command("export A='x # not a comment\n  y' B=1 C=2", doc).endswith("C=2")
    with pytest.raises(AssertionError, match="no page shows the command 'run --flag other'"):
        readme.command("run --flag other", doc)


@pytest.mark.slow
def test_the_trainer_commands_train_and_export(mnist_subset: Path, tmp_path: Path) -> None:
    """The README's train line on 2 ranks, then its export line, on a staged MNIST subset."""
    data, out = stage_local(mnist_subset), tmp_path / "run"
    env = {"HVA_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    train = readme.run(
        TRAIN,
        fill={"<staged URI>": str(data), "<URI>": str(out)},
        env=env,
    )
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and 0.5 < metrics["val_accuracy"] <= 1.0
    export = readme.run(
        EXPORT,
        fill={"[--data <staged URI>]": f"--data {data}", "<URI>": str(out)},
        env=env,
    )
    assert export.returncode == 0, export.stdout[-3000:] + export.stderr[-3000:]
    parity = json.loads((out / "onnx" / "parity.json").read_text())
    assert parity["argmax_mismatches"] == 0, parity


@pytest.mark.engine
def test_the_podman_env_line_points_docker_at_podman() -> None:
    """``eval "$(scripts/engines/podman_engine.sh env)"``, then the Docker SDK a user (and the
    DockerHook) reaches podman with."""
    from tests.engine_scripts import podman_cli_env

    podman_cli_env()  # the service answering (installs podman where it can, skips where not)
    done = readme.run(
        PODMAN_ENV,
        then="python -c 'import docker; "
        'print(docker.from_env().version()["Components"][0]["Name"])\'',
    )
    assert done.returncode == 0, done.stderr
    assert "Podman Engine" in done.stdout, done.stdout


def _airflow_free_env() -> dict[str, str]:
    """This process's environment without the suite's Airflow settings (its SQLite home)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}


@pytest.mark.slow
def test_the_airflow_ui_block_serves_the_dags(s3_server: S3Server, tmp_path: Path) -> None:
    """The README's Airflow UI block as written (its AIRFLOW_HOME and connection filled in):
    ``airflow standalone`` serves the REST API on :8080 and lists both DAGs, none broken."""
    home = tmp_path / "standalone"
    conn = readme.command(UI_CONN)
    script = "\n".join(
        [
            readme.command(UI_HOME).replace("$PWD/.runs/standalone", str(home)),
            conn.replace("KEY", s3_server.env["AWS_ACCESS_KEY_ID"])
            .replace("SECRET", s3_server.env["AWS_SECRET_ACCESS_KEY"])
            .replace("http://127.0.0.1:9000", s3_server.endpoint),
            "exec " + readme.command("airflow standalone"),
        ]
    )
    with port_free(8080), open(tmp_path / "standalone.log", "w") as log:
        proc = subprocess.Popen(
            ["bash", "-c", script], cwd=REPO, env=_airflow_free_env(), start_new_session=True,
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            dags = _wait_for_dags(home, proc, tmp_path / "standalone.log", timeout=300)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert {"mnist_horovod_retrain", "mnist_serve_latest_model"} <= set(dags), dags
    assert not any(d["has_import_errors"] for d in dags.values()), dags


@contextlib.contextmanager
def port_free(port: int) -> Iterator[None]:
    """Fail up front, naming it, when the README's port is taken on this machine."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            pytest.fail(f"port {port} (the README's UI port) is in use on this machine")
    yield


def _wait_for_dags(home: Path, proc: subprocess.Popen[Any], log: Path, timeout: float) -> dict:
    """Log in as the admin standalone created, then list the DAGs once both are parsed."""
    deadline = time.monotonic() + timeout
    base = "http://127.0.0.1:8080"
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"airflow standalone exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        passwords = home / "simple_auth_manager_passwords.json.generated"
        try:
            password = json.loads(passwords.read_text())["admin"]
            request = urllib.request.Request(
                f"{base}/auth/token",
                data=json.dumps({"username": "admin", "password": password}).encode(),
                headers={"Content-Type": "application/json"},
            )
            token = json.loads(urllib.request.urlopen(request, timeout=10).read())["access_token"]
            listing = urllib.request.Request(
                f"{base}/api/v2/dags?limit=100", headers={"Authorization": f"Bearer {token}"}
            )
            body = json.loads(urllib.request.urlopen(listing, timeout=10).read())
            dags = {d["dag_id"]: d for d in body["dags"]}
            if {"mnist_horovod_retrain", "mnist_serve_latest_model"} <= set(dags):
                return dags
            last = f"DAGs so far: {sorted(dags)}"
        except (OSError, KeyError, ValueError) as exc:
            last = repr(exc)
        time.sleep(3)
    pytest.fail(f"no DAG listing within {timeout}s ({last}):\n{log.read_text()[-4000:]}")
