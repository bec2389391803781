"""The start-up savings (``horovod_airflow.core.startup_savings``) do what they say, and the one
that reaches into Horovod's launcher fails here first when the pinned Horovod changes under it.
What each saves is measured by ``python -m bench.startup_savings``, not here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from horovod_airflow.core.startup_savings import (
    HOROVODRUN_WITHOUT_GLOO_PROBE,
    INTERPRETER_FINGERPRINT,
    VERIFIED_HOROVOD,
)
from tests.conftest import REPO

# horovodrun on one local rank that does not import torch: only horovodrun's own probe does.
JOB = ["--gloo", "-np", "1", "-H", "localhost:1", sys.executable, "-c", "print('rank ran')"]


def _without_torch(tmp_path: Path) -> dict[str, str]:
    """An environment in which ``import torch`` fails: what the Gloo probe needs is missing."""
    blocker = tmp_path / "no-torch" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch blocked by the test')\n")
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    return {"PATH": path, "PYTHONPATH": f"{blocker.parent}:{REPO}", "HOME": str(tmp_path)}


def test_the_installed_horovod_is_the_one_the_gloo_saving_was_checked_against():
    import horovod

    assert horovod.__version__ == VERIFIED_HOROVOD, (
        f"Horovod {horovod.__version__} is installed; HOROVODRUN_WITHOUT_GLOO_PROBE was checked "
        f"against {VERIFIED_HOROVOD}. Check that horovod.runner.launch still has gloo_built() "
        "and run_commandline() with the same meaning, then change VERIFIED_HOROVOD"
    )


def test_horovodrun_probes_gloo_through_torch_and_the_saving_skips_only_that(tmp_path):
    env = _without_torch(tmp_path)
    horovodrun = shutil.which("horovodrun", path=env["PATH"])
    assert horovodrun, "horovodrun is not installed in this venv (bash scripts/setup.sh)"
    plain = subprocess.run([horovodrun, *JOB], env=env, capture_output=True, text=True, timeout=120)
    # Pinned Horovod's own probe imports torch: without torch horovodrun refuses --gloo. If this
    # starts passing, the probe changed and the saving has nothing left to skip.
    assert plain.returncode != 0 and "rank ran" not in plain.stdout, plain.stdout + plain.stderr
    assert "gloo" in (plain.stdout + plain.stderr).lower()
    saved = subprocess.run(
        [sys.executable, "-c", HOROVODRUN_WITHOUT_GLOO_PROBE, *JOB],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert saved.returncode == 0, saved.stdout + saved.stderr
    assert "rank ran" in saved.stdout


def test_exit_without_teardown_runs_the_exit_handlers_flushes_and_keeps_the_code():
    program = (
        "import atexit, sys\n"
        "from horovod_airflow.core.startup_savings import exit_without_teardown\n"
        "atexit.register(lambda: print('exit handler ran'))\n"
        "sys.stdout.write('unflushed output')\n"
        "exit_without_teardown(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert done.returncode == 3
    assert done.stdout == "unflushed outputexit handler ran\n"


def test_the_trainer_command_exits_with_its_code_through_the_saving(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "horovod_airflow.trainer", "export", "--checkpoint",
         str(tmp_path / "missing.pt"), "--output", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0 and "missing.pt" in done.stderr + done.stdout


def test_the_fingerprint_names_the_interpreter_and_both_packages_without_importing_torch(tmp_path):
    env = _without_torch(tmp_path)
    env["PYTHONPATH"] = str(REPO)  # torch importable, but the fingerprint must not import it
    program = f"import sys\n{INTERPRETER_FINGERPRINT}\nassert 'torch' not in sys.modules\n"
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["python"] == str(Path(sys.executable).resolve())
    assert found["horovod"][0] == VERIFIED_HOROVOD and found["torch"][1].endswith("__init__.py")
