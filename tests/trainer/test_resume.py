"""``--resume`` continues the same run, or refuses: real 2-rank runs and the comparison rules."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from horovod_airflow.core.contract import EXIT_REFUSED
from horovod_airflow.core.train_config import TrainConfig
from horovod_airflow.trainer.resume import load_checkpoint, resume_mismatches, run_identity
from horovod_airflow.trainer.runtime import Runtime
from tests.trainer.conftest import describe, horovodrun_command, run_horovod, trainer_env

# The trainer's defaults (cosine schedule with warmup, Adam, batch 64) on 1000 samples per rank,
# 16 steps an epoch; the demo's CNN because its dropout draws from each rank's RNG.
RECIPE = ["--model", "mnist_cnn", "--max-train-samples", "2000", "--max-val-samples", "300"]
RECIPE += ["--log-interval", "0", "--epochs", "2"]
FINAL = ("val_accuracy", "val_correct", "val_loss", "val_samples", "epochs", "param_hash")


def final(metrics: dict) -> dict:
    per_epoch = [
        {k: h[k] for k in ("epoch", "train_loss", "val_loss", "val_accuracy")}
        for h in metrics["history"]
    ]
    return {**{k: metrics[k] for k in FINAL}, "history": per_epoch}


@pytest.fixture(scope="module")
def interrupted(staged_subset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted 2-epoch run, and a copy of its checkpoint as it was after epoch 1.

    The copy is what a run killed during epoch 2 leaves behind (``checkpoint.pt`` is replaced
    atomically, so the copy is whole).
    """
    root = tmp_path_factory.mktemp("resume")
    out, cache = root / "uninterrupted", root / "cache"
    proc = subprocess.Popen(
        horovodrun_command(["--data", str(staged_subset), "--output", str(out), *RECIPE]),
        env=trainer_env(cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    epoch_1 = root / "epoch1" / "checkpoint.pt"
    epoch_1.parent.mkdir()
    while proc.poll() is None and not epoch_1.exists():
        if (out / "checkpoint.pt").exists():
            shutil.copy(out / "checkpoint.pt", epoch_1)
        time.sleep(0.02)
    stdout, stderr = proc.communicate(timeout=600)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert proc.returncode == 0, describe(done)
    assert epoch_1.exists(), "never saw the epoch-1 checkpoint"
    assert load_checkpoint(str(epoch_1))["epoch"] == 1, "copied the checkpoint too late"
    return {
        "data": staged_subset,
        "cache": cache,
        "root": root,
        "epoch_1": epoch_1,
        "metrics": json.loads((out / "metrics.json").read_text()),
    }


def resume_into(
    interrupted: dict, name: str, *flags: str
) -> tuple[Path, subprocess.CompletedProcess]:
    out = interrupted["root"] / name
    out.mkdir()
    shutil.copy(interrupted["epoch_1"], out / "checkpoint.pt")
    args = ["--data", str(interrupted["data"]), "--output", str(out), *RECIPE, *flags]
    return out, run_horovod([*args, "--resume"], interrupted["cache"])


@pytest.mark.slow
def test_resumed_run_ends_equal_to_the_uninterrupted_run(interrupted: dict) -> None:
    out, proc = resume_into(interrupted, "resumed")
    assert proc.returncode == 0, describe(proc)
    assert "resuming from" in proc.stderr and "after epoch 1" in proc.stderr
    resumed = json.loads((out / "metrics.json").read_text())
    assert final(resumed) == final(interrupted["metrics"])
    saved = load_checkpoint(str(interrupted["epoch_1"]))
    assert len(saved["rng_states"]) == 2  # one per rank
    assert not (saved["rng_states"][0]["torch"] == saved["rng_states"][1]["torch"]).all()
    identity = saved["identity"]
    assert identity["world_size"] == 2 and identity["steps_per_epoch"] == 16
    manifest = json.loads((interrupted["data"] / "manifest.json").read_text())
    assert identity["dataset_content_hash"] == manifest["content_hash"]
    assert identity["model"] == "mnist_cnn" and identity["lr_schedule"] == "cosine"


@pytest.mark.slow
def test_mismatched_checkpoint_stops_every_rank_naming_each_field(interrupted: dict) -> None:
    out, proc = resume_into(interrupted, "mismatch", "--batch-size", "32", "--lr", "0.001")
    assert proc.returncode != 0
    # Each rank refuses with the contract's EXIT_REFUSED, which horovodrun reports for the
    # first one: the operator fails the task without retrying (a retry meets the same file).
    assert f"Exit code: {EXIT_REFUSED}" in proc.stdout + proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "ResumeMismatchError" in line]
    assert {line.partition("]")[0] for line in errors} == {"[0", "[1"}, proc.stderr  # both ranks
    assert "batch_size: checkpoint 64, now 32" in errors[0]
    assert "lr: checkpoint 0.003, now 0.001" in errors[0]
    assert "steps_per_epoch: checkpoint 16, now 32" in errors[0]
    assert "--resume-mismatch fresh" in errors[0]
    assert "epoch 1 " not in proc.stderr  # stopped before training
    assert not (out / "metrics.json").exists()
    assert (out / "checkpoint.pt").read_bytes() == interrupted["epoch_1"].read_bytes()


@pytest.mark.slow
def test_resume_mismatch_fresh_trains_from_scratch(interrupted: dict) -> None:
    out, proc = resume_into(interrupted, "fresh", "--seed", "7", "--resume-mismatch", "fresh")
    assert proc.returncode == 0, describe(proc)
    assert "seed: checkpoint 42, now 7" in proc.stderr
    assert "--resume-mismatch fresh: training from scratch" in proc.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == [1, 2]
    assert metrics["history"][0] != interrupted["metrics"]["history"][0]
    assert load_checkpoint(str(out / "checkpoint.pt"))["identity"]["seed"] == 7


def runtime(size: int = 2, precision: str = "fp32") -> Runtime:
    return Runtime(0, size, 0, size, "cpu", 1, precision, False)


def identity(config: TrainConfig, **changes: object) -> dict:
    return {**run_identity(config, runtime(), "abc", 10), **changes}


def test_identity_holds_every_result_field_and_no_location() -> None:
    config = TrainConfig(data="/d", output="/o", resume=True, cache_dir="/c", log_interval=3)
    found = run_identity(config, runtime(), "abc", 10)
    assert found["dataset_content_hash"] == "abc" and found["world_size"] == 2
    assert found["resolved_precision"] == "fp32" and found["device_type"] == "cpu"
    for field in ("data", "output", "resume", "resume_mismatch", "cache_dir", "log_interval"):
        assert field not in found
    for field in ("model", "batch_size", "lr", "lr_scaling", "lr_schedule", "warmup_epochs"):
        assert field in found
    for field in ("optimizer", "epochs", "seed", "precision", "adasum", "fp16_allreduce"):
        assert field in found


def test_mismatches_name_each_field_with_both_values() -> None:
    config = TrainConfig(data="/d", output="/o")
    saved = identity(config, dataset_content_hash="old", world_size=4, optimizer="sgd")
    lines = resume_mismatches(saved, identity(config), config, 2, done_epochs=1)
    assert lines == [
        "dataset_content_hash: checkpoint 'old', now 'abc'",
        "world_size: checkpoint 4, now 2",
        "optimizer: checkpoint 'sgd', now 'adam'",
    ]
    assert resume_mismatches(identity(config), identity(config), config, 2, 1) == []


def test_a_checkpoint_recording_nothing_mismatches_on_every_field() -> None:
    config = TrainConfig(data="/d", output="/o")
    lines = resume_mismatches({}, identity(config), config, 2, done_epochs=1)
    assert len(lines) == len(identity(config))
    assert lines[0] == "dataset_content_hash: checkpoint '<not recorded>', now 'abc'"


@pytest.mark.parametrize(
    ("schedule", "warmup", "allowed"),
    [("constant", 0.0, True), ("constant", 0.5, True), ("cosine", 0.0, False)],
)
def test_epochs_may_change_only_when_every_step_taken_had_the_same_lr(
    schedule: str, warmup: float, allowed: bool
) -> None:
    config = TrainConfig(
        data="/d", output="/o", epochs=3, lr_schedule=schedule, warmup_epochs=warmup
    )
    saved = identity(config, epochs=1)
    lines = resume_mismatches(saved, identity(config), config, 2, done_epochs=1)
    assert lines == ([] if allowed else ["epochs: checkpoint 1, now 3"])
