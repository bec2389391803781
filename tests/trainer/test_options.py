"""Bad option values stop the trainer before any rank works: exit 2 and one message naming them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

BASE = ["--data", "/nonexistent/data", "--output", "/nonexistent/out"]


def trainer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("extra", "option", "allowed"),
    [
        (["--epochs", "0"], "--epochs", "[1, 1000]"),
        (["--epochs", "two"], "--epochs", "invalid int value"),
        (["--batch-size", "0"], "--batch-size", "[1, 65536]"),
        (["--lr", "-0.1"], "--lr", "(0, 10]"),
        (["--lr", "nan"], "--lr", "(0, 10]"),
        (["--lr-scaling", "cubic"], "--lr-scaling", "linear"),
        (["--warmup-epochs", "3", "--epochs", "2"], "--warmup-epochs", "[0, epochs=2]"),
        (["--optimizer", "lamb"], "--optimizer", "adam"),
        (["--max-train-samples", "-5"], "--max-train-samples", ">= 0"),
        (["--backward-passes-per-step", "0"], "--backward-passes-per-step", "[1, 1024]"),
        (["--precision", "fp8"], "--precision", "bf16"),
        (["--channels-last", "maybe"], "--channels-last", "'on'"),
        (["--model", "resnet9000"], "--model", "mnist_cnn"),
        (["--target-accuracy", "0"], "--target-accuracy", "(0, 1]"),
        (["--target-accuracy", "1.5"], "--target-accuracy", "(0, 1]"),
        (["--resume-mismatch", "ignore"], "--resume-mismatch", "'fresh'"),
    ],
)
def test_bad_train_option_exits_2_naming_option_and_range(
    extra: list[str], option: str, allowed: str
) -> None:
    proc = trainer("train", *BASE, *extra)
    assert proc.returncode == 2, proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert option in message and allowed in message, message
    assert "Traceback" not in proc.stderr


def test_missing_required_option_exits_2() -> None:
    proc = trainer("train", "--output", "/tmp/x")
    assert proc.returncode == 2
    assert "--data" in proc.stderr


def test_help_shows_the_horovodrun_launch_command() -> None:
    proc = trainer("train", "--help")
    assert proc.returncode == 0
    assert "horovodrun -np 2 -H localhost:2 python -m trainer train" in proc.stdout
    for option in ("--fp16-allreduce", "--adasum", "--backward-passes-per-step", "--precision"):
        assert option in proc.stdout


def test_doctor_reports_gloo_and_can_start_two_cpu_ranks() -> None:
    proc = trainer("doctor", "--np", "2", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    assert report["gloo_built"] is True
    assert report["horovod"] and report["torch"]


def test_doctor_fails_naming_the_gpu_shortfall() -> None:
    proc = trainer("doctor", "--np", "4096", "--gpus-per-proc", "1")
    assert proc.returncode == 1
    assert "4096 GPUs" in proc.stdout and "cannot start" in proc.stdout


def test_help_explains_resume_and_its_mismatch_choice() -> None:
    proc = trainer("train", "--help")
    text = " ".join(proc.stdout.split())
    assert "same dataset content, world size and training settings" in text
    assert "--resume-mismatch RESUME_MISMATCH" in text and "error|fresh" in text
    assert "default error" in text
