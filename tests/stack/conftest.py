"""The production compose stack, up for real on podman: images, services, a user's DAG runs.

The fixtures run the script a user runs (``scripts/engines/compose_stack.sh``) with a state
folder, project name and ports of the suite's own, so a stack the user has up is untouched.
The images come from the session fixture ``stack_images`` (tests/engine_scripts.py): the user's
images, cached by a hash of their inputs, built before pytest by ``scripts/prebuild.sh``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from tests import readme
from tests.conftest import REPO, free_port
from tests.engine_scripts import podman_cli_env, run_script

PROJECT = "hva-stack-test"
# The stack's start takes a few minutes (the images are built by the stack_images fixture).
UP_TIMEOUT = 1200
#: The task states of a retraining run whose gate passed: every task succeeded but the
#: refused branch (record_refused), which skipped itself.
PUBLISHED_RUN = {
    **dict.fromkeys(("stage_dataset", "train", "gate", "export_onnx", "publish"), "success"),
    "record_refused": "skipped",
}


def load_stack_smoke() -> ModuleType:
    """scripts/engines/stack_smoke.py: the checks ``compose_stack.sh smoke`` runs."""
    path = REPO / "scripts" / "engines" / "stack_smoke.py"
    spec = importlib.util.spec_from_file_location("stack_smoke", path)
    assert spec is not None and spec.loader is not None
    if "stack_smoke" in sys.modules:
        return sys.modules["stack_smoke"]
    module = importlib.util.module_from_spec(spec)
    sys.modules["stack_smoke"] = module  # its dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def compose_stack(command: str, env: dict[str, str], timeout: float) -> str:
    """``scripts/engines/compose_stack.sh COMMAND`` as a user types it; skip (fail in CI)
    where the engine cannot run here."""
    return run_script(
        f"scripts/engines/compose_stack.sh {command}", env=env, timeout=timeout
    ).stdout


def project_containers() -> list[str]:
    """Names of the test stack's containers, in any state."""
    out = subprocess.run(
        ["podman", "ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}",
         "--format", "{{.Names}}"], capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return out.split()


_cli_env = functools.cache(podman_cli_env)


@dataclass
class Stack:
    """A running stack: its settings file (secrets included) and endpoints."""

    settings: dict[str, str]
    airflow_url: str
    state: Path
    script_env: dict[str, str]

    def podman(self, *args: str) -> str:
        """The podman CLI with the engine's settings (runc, ulimits: a ``run`` or ``exec``
        needs them); raises naming stderr when it fails."""
        run = subprocess.run(
            ["podman", *args],
            capture_output=True,
            text=True,
            env={**os.environ, **podman_cli_env()},
        )
        if run.returncode != 0:
            raise AssertionError(f"podman {' '.join(args[:2])} failed: {run.stderr[-2000:]}")
        return run.stdout

    def containers(self) -> list[str]:
        return project_containers()


@pytest.fixture(scope="package")
def stack(
    tmp_path_factory: pytest.TempPathFactory, stack_images: dict[str, str]
) -> Iterator[Stack]:
    """Images built (or found current), the stack up; afterwards `down --volumes` must leave
    nothing.

    Package-scoped: the stack's services are down again before the rest of the suite runs.
    """
    state = tmp_path_factory.mktemp("stack")
    engine = REPO / "scripts" / "engines" / "podman_engine.sh"
    was_serving = (
        subprocess.run(["bash", str(engine), "status"], capture_output=True).returncode == 0
    )
    env = {
        "HVA_STACK_STATE": str(state),
        "HVA_STACK_PROJECT": PROJECT,
        "HVA_STACK_AIRFLOW_PORT": str(free_port()),
        "HVA_STACK_S3_PORT": str(free_port()),
        # This checkout's images, by the tags no other checkout on the engine moves (another
        # one's `images` re-points the plain names at its own build).
        "HVA_STACK_AIRFLOW_IMAGE": stack_images["airflow_inputs"],
        "HVA_STACK_TRAINER_IMAGE": stack_images["trainer_inputs"],
        # A variable of the caller's shell that the compose file also reads: the settings
        # file must win (other tests in the session leave HVA_BUCKET set).
        "HVA_BUCKET": "a-shell-bucket-the-stack-must-not-use",
    }
    smoke = load_stack_smoke()
    try:
        compose_stack("up", env, UP_TIMEOUT)
        settings = smoke.read_env_file(state / "stack.env")
        yield Stack(
            settings=settings,
            airflow_url=f"http://127.0.0.1:{settings['AIRFLOW_PORT']}",
            state=state,
            script_env=env,
        )
    finally:
        if (state / "stack.env").exists():
            for name in project_containers():
                logs = subprocess.run(["podman", "logs", "--tail", "15", name],
                                      capture_output=True, text=True)  # fmt: skip
                (state / f"{name}.log").write_text(logs.stdout + logs.stderr)
            down = readme.command("scripts/engines/compose_stack.sh down --volumes")
            compose_stack(down.split(maxsplit=1)[1], env, 300)
            left = project_containers()
            volumes = json.loads(
                subprocess.run(["podman", "volume", "ls", "--format", "json"],
                               capture_output=True, text=True, check=True).stdout or "[]"
            )  # fmt: skip
            ours = [v["Name"] for v in volumes if v["Name"].startswith(f"{PROJECT}_")]
            network = [
                n for n in (f"{PROJECT}_default", f"{PROJECT}-training")
                if subprocess.run(["podman", "network", "exists", n]).returncode == 0
            ]  # fmt: skip
            if not was_serving:  # leave a Docker API service the user started running
                subprocess.run(["bash", str(engine), "stop"], capture_output=True)
            assert not left and not ours and not network, (
                f"`down --volumes` left containers {left}, volumes {ours}, networks {network}"
            )
