"""The local launcher remembers a doctor pass, keyed by what the doctor would find.

A fake interpreter stands in for python: it answers the fingerprint script (``-c``) from a
file the test can change and counts how often the doctor itself (``-m horovod_airflow.trainer
doctor``) ran.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from horovod_airflow.core.startup_savings import HOROVODRUN_WITHOUT_GLOO_PROBE
from horovod_airflow.operators.exceptions import HorovodPreflightError
from horovod_airflow.operators.launchers.base import JobSpec
from horovod_airflow.operators.launchers.local import PREFLIGHT_CACHE_VAR, LocalLauncher

FAKE_PYTHON = """#!/bin/sh
dir=$(dirname "$0")
if [ "$1" = "-c" ]; then cat "$dir/fingerprint"; exit 0; fi
echo "doctor ran: $*" >> "$dir/doctor.calls"
echo "2 rank(s) x 0 GPU(s): can start"
exit "$(cat "$dir/doctor.rc")"
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    (python.parent / "fingerprint").write_text('{"torch": "2.14.1", "horovod": "0.28.1"}\n')
    (python.parent / "doctor.rc").write_text("0")
    monkeypatch.setenv(PREFLIGHT_CACHE_VAR, str(tmp_path / "cache"))
    return python


def _calls(fake: Path) -> int:
    calls = fake.parent / "doctor.calls"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def _preflight(fake: Path, env: dict[str, str] | None = None) -> None:
    spec = JobSpec(
        name="t",
        argv=["horovodrun"],
        env=env or {},
        num_proc=1,
        preflight_argv=[str(fake), "-m", "horovod_airflow.trainer", "doctor", "--np", "1"],
    )
    LocalLauncher().preflight(spec, logging.getLogger("test"))


def test_a_pass_is_remembered_and_any_key_change_runs_the_doctor_again(fake, tmp_path):
    _preflight(fake)
    _preflight(fake)
    assert _calls(fake) == 1  # the second job skipped the doctor
    assert len(list((tmp_path / "cache").glob("*.pass"))) == 1
    _preflight(fake, env={"CUDA_VISIBLE_DEVICES": "1"})  # other devices
    assert _calls(fake) == 2
    _preflight(fake, env={"HOROVOD_CYCLE_TIME": "5"})  # Horovod's own settings
    assert _calls(fake) == 3
    (fake.parent / "fingerprint").write_text('{"torch": "2.14.1", "horovod": "rebuilt"}\n')
    _preflight(fake)  # a reinstalled horovod: a new fingerprint
    assert _calls(fake) == 4
    _preflight(fake)
    assert _calls(fake) == 4


def test_a_failing_doctor_is_never_remembered(fake, tmp_path):
    (fake.parent / "doctor.rc").write_text("3")
    for _ in range(2):
        with pytest.raises(HorovodPreflightError, match="exited 3"):
            _preflight(fake)
    assert _calls(fake) == 2
    assert not list((tmp_path / "cache").glob("*.pass"))


def test_the_cache_can_be_turned_off(fake, monkeypatch):
    monkeypatch.setenv(PREFLIGHT_CACHE_VAR, "off")
    _preflight(fake)
    _preflight(fake)
    assert _calls(fake) == 2


def test_no_fingerprint_no_cache(fake, tmp_path):
    (fake.parent / "fingerprint").write_text("not json\n")
    _preflight(fake)
    _preflight(fake)
    assert _calls(fake) == 2
    assert not (tmp_path / "cache").exists()


def _verified_launch(tmp_path: Path, doctor_lines: list[str], shebang: str | None = None,
                     controller: str = "gloo") -> list[str]:  # fmt: skip
    """What the local launcher would start after a doctor that printed ``doctor_lines``."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(f"#!/bin/sh\nexec /bin/cat {bin_dir / 'doctor.out'}\n")
    python.chmod(0o755)
    horovodrun = bin_dir / "horovodrun"
    horovodrun.write_text(f"#!{shebang or python}\nimport sys\n")
    horovodrun.chmod(0o755)
    lines = [line.replace("{horovodrun}", str(horovodrun)) for line in doctor_lines]
    (bin_dir / "doctor.out").write_text("\n".join(lines) + "\n")
    env = {"PATH": str(bin_dir), PREFLIGHT_CACHE_VAR: "off"}
    spec = JobSpec(
        name="t",
        argv=["prog"],  # the launcher runs horovodrun -np 2 -H localhost:2 around it
        env=env,
        num_proc=2,
        preflight_argv=["python", "-m", "horovod_airflow.trainer", "doctor", "--np", "2"],
        controller=controller,
    )
    launcher = LocalLauncher()
    launcher.preflight(spec, logging.getLogger("test"))
    return launcher.launch_argv(spec, {**env, "PATH": str(bin_dir)})


DOCTOR_OK = ["gloo_built: True", "horovodrun: {horovodrun}", "2 rank(s) x 0 GPU(s): can start"]


def test_a_doctor_verified_gloo_spares_horovodrun_its_probe(tmp_path, monkeypatch):
    monkeypatch.setenv(PREFLIGHT_CACHE_VAR, "off")
    argv = _verified_launch(tmp_path, DOCTOR_OK)
    python = str(tmp_path / "venv" / "bin" / "python")
    assert argv[:3] == [python, "-c", HOROVODRUN_WITHOUT_GLOO_PROBE]
    assert argv[3:7] == ["--gloo", "-np", "2", "-H"] and argv[-1] == "prog"


@pytest.mark.parametrize(
    ("lines", "shebang", "controller"),
    [
        (["gloo_built: False", "horovodrun: {horovodrun}"], None, "gloo"),  # no Gloo
        (["gloo_built: True", "horovodrun: /elsewhere/horovodrun"], None, "gloo"),  # other one
        (DOCTOR_OK, "/usr/bin/python3", "gloo"),  # horovodrun runs in another interpreter
        (DOCTOR_OK, None, "auto"),  # horovodrun chooses the controller itself
        (DOCTOR_OK, None, "mpi"),
    ],
)
def test_horovodrun_runs_as_is_unless_the_doctor_verified_that_very_one(
    tmp_path, monkeypatch, lines, shebang, controller
):
    monkeypatch.setenv(PREFLIGHT_CACHE_VAR, "off")
    argv = _verified_launch(tmp_path, lines, shebang, controller)
    assert argv[0] == "horovodrun"


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args: object) -> None:
        self.lines.append(msg % args if args else msg)

    warning = error = info


@pytest.mark.slow
def test_the_real_doctor_and_horovodrun_start_two_ranks_without_the_probe(tmp_path, monkeypatch):
    """The real doctor, then 2 real ranks through horovodrun's entry point without its probe."""
    import sys

    monkeypatch.setenv(PREFLIGHT_CACHE_VAR, str(tmp_path / "cache"))
    program = [sys.executable, "-c", "import horovod.torch as hvd; hvd.init(); "
               "print('RANK', hvd.rank(), 'OF', hvd.size(), flush=True)"]  # fmt: skip
    spec = JobSpec(
        name="t",
        argv=program,
        num_proc=2,
        preflight_argv=[sys.executable, "-m", "horovod_airflow.trainer", "doctor", "--np", "2"],
    )
    log = _Log()
    launcher = LocalLauncher()
    launcher.preflight(spec, log)
    result = launcher.run(spec, log)
    text = "\n".join(log.lines)
    assert result.exit_code == 0, text
    assert "without its Gloo probe" in text
    assert "RANK 0 OF 2" in text and "RANK 1 OF 2" in text
