"""The engine scripts, run as a user types them, and every image the tests need, from one place.

``run_script("scripts/engines/compose_stack.sh images")`` runs the command line exactly as the
README writes it: from the repository root, by its path (so a script that lost its executable
bit fails here as it would for a user). Exit 2 is the scripts' "this machine cannot provide it"
(not root, a package not installable): the test skips with the script's reason, and in CI
(``CI=true``) that skip is a failure naming it (tests/conftest.py). Any other error fails.

The images are built by ``scripts/engines/compose_stack.sh images`` (the stand-ins, the Airflow
and trainer images) and ``podman_engine.sh image`` (the docker launcher's runtime image), each
cached by a hash of its inputs. ``scripts/prebuild.sh`` runs the same commands before pytest
starts (a cold trainer image takes ~18 min, longer than a test's timeout); the session fixture
``stack_images`` runs them again, which costs seconds when they are current and builds them
when a developer runs pytest alone, whatever order the test files run in.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from scripts.devstack import REPO, VENV_BIN
from tests import readme

UNAVAILABLE_EXIT = 2  # the engine scripts' "this machine cannot provide it"
# A cold build of the trainer image takes ~18 min on 2 cores (scripts/prebuild.sh does it
# before the tests start); a test whose fixture may build it allows for that.
BUILD_TIMEOUT = 3600


def run_script(
    command: str, *, env: dict[str, str] | None = None, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` (``scripts/engines/NAME.sh ARGS``) from the repository root, as typed.

    Skips where this machine cannot run it (not root, or the script exits 2), fails with the
    script's stderr on any other non-zero exit.
    """
    argv = shlex.split(command)
    if not argv[0].startswith("scripts/"):
        raise ValueError(f"run_script runs the repository's scripts, got {command!r}")
    if os.geteuid() != 0:
        pytest.skip(
            f"{command} needs root (network namespaces / rootful podman); uid {os.geteuid()}"
        )
    done = subprocess.run(
        argv,
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", **(env or {})},
        timeout=timeout,
    )
    if done.returncode == UNAVAILABLE_EXIT:
        pytest.skip(f"{command}: {done.stderr.strip()[-800:]}")
    if done.returncode != 0:
        pytest.fail(f"{command} exited {done.returncode}:\n{done.stderr[-4000:]}", pytrace=False)
    return done


def podman_cli_env() -> dict[str, str]:
    """The podman API service running, and what the podman CLI needs beside it
    (``CONTAINERS_CONF``: runc, ulimits; the registries the engine may pull from)."""
    run_script(readme.command("scripts/engines/podman_engine.sh start"))
    exports = run_script("scripts/engines/podman_engine.sh env").stdout.splitlines()
    return dict(line.removeprefix("export ").split("=", 1) for line in exports if "=" in line)


def build_stack_images(state: Path) -> dict[str, str]:
    """Build (or find current) the stand-ins, the Airflow and trainer images and the waveforms
    app's image; return their names as the engine lists them, by role (``trainer``,
    ``airflow``; ``*_inputs``: the content-addressed tags). ``state`` is the
    script's state folder: the settings file it writes there names the images."""
    run_script(
        readme.command("scripts/engines/compose_stack.sh images"),
        env={"HVA_STACK_STATE": str(state)},
        timeout=BUILD_TIMEOUT,
    )
    settings = dict(
        line.split("=", 1)
        for line in (state / "stack.env").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )

    def engine_name(name: str) -> str:  # podman files a name without a registry under localhost/
        return name if "/" in name.split(":")[0] else f"localhost/{name}"

    # The content-addressed tags of exactly these inputs (the names above are moved by any
    # other checkout that builds on this engine); the last line of each wins.
    lines = (state / "image-tags.txt").read_text().splitlines()
    tags = dict(line.split("=", 1) for line in lines if "=" in line)
    return {
        "trainer": engine_name(settings["HVA_TRAINER_IMAGE"]),
        "airflow": engine_name(settings["HVA_AIRFLOW_IMAGE"]),
        "trainer_inputs": tags["trainer"],
        "airflow_inputs": tags["airflow"],
        "waveforms_inputs": engine_name(tags["waveforms"]),  # the example app's image
    }
