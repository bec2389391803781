"""The local launcher remembers a doctor pass, keyed by what the doctor would find.

A fake interpreter stands in for python: it answers the fingerprint script (``-c``) from a
file the test can change and counts how often the doctor itself (``-m trainer doctor``) ran.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from operators.exceptions import HorovodPreflightError
from operators.launchers.base import JobSpec
from operators.launchers.local import PREFLIGHT_CACHE_VAR, LocalLauncher

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
        preflight_argv=[str(fake), "-m", "trainer", "doctor", "--np", "1"],
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
