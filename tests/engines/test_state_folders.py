"""The engine scripts refuse a state folder in /var/tmp that someone else owns (it would hold
the API socket, the stack's secrets and logs), naming it; their own is used as before."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO

NOBODY = 65534


@pytest.fixture
def foreign_folder() -> Path:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a folder to another user (the engine scripts need root)")
    path = Path(tempfile.mkdtemp(prefix="hva-foreign-", dir="/var/tmp"))
    os.chown(path, NOBODY, NOBODY)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(
    ("script", "variable", "command"),
    [
        ("scripts/engines/podman_engine.sh", "HVA_PODMAN_STATE", "status"),
        ("scripts/engines/compose_stack.sh", "HVA_STACK_STATE", "env"),
    ],
)
def test_a_state_folder_owned_by_another_user_is_refused(
    foreign_folder: Path, script: str, variable: str, command: str
) -> None:
    run = subprocess.run(
        ["bash", str(REPO / script), command],
        env={**os.environ, variable: str(foreign_folder)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode != 0
    assert f"state folder {foreign_folder} is owned by uid {NOBODY}" in run.stderr, run.stderr
    assert list(foreign_folder.iterdir()) == []  # nothing written into it


def test_the_placeholders_of_env_example_are_refused_by_name(tmp_path: Path) -> None:
    """docker/refuse_placeholders.sh, run first by both init jobs: .env.example's values stop
    it naming the variables (not the values); real values pass."""
    from tests.compose.test_compose import read_env_file

    example = read_env_file(REPO / ".env.example")
    script = REPO / "docker" / "refuse_placeholders.sh"
    base = {"PATH": os.environ["PATH"]}
    refused = subprocess.run(["sh", str(script)], env={**base, **example},
                             capture_output=True, text=True)  # fmt: skip
    assert refused.returncode == 1
    placeholders = sorted(k for k, v in example.items() if "change-me" in v)
    assert placeholders and all(k in refused.stderr for k in placeholders), refused.stderr
    assert "change-me-" not in refused.stderr.replace("change-me...", "")  # no value shown
    real = {k: ("x" + os.urandom(8).hex() if "change-me" in v else v) for k, v in example.items()}
    assert subprocess.run(["sh", str(script)], env={**base, **real}).returncode == 0
