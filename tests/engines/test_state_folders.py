"""The engine scripts refuse a state folder in /var/tmp that someone else owns (it would hold
the API socket, the stack's secrets and logs), naming it; their own is used as before.
(The stack's refusal of .env.example's placeholders: tests/compose, docker/hva_config.py.)"""

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
