"""The example's training program under real horovodrun (2 ranks): its contract, its resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.waveforms.settings import DATASET_DIR, DATASET_FILES
from horovod_airflow.core import contract
from horovod_airflow.operators.staging import stage_files

HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")


def _train(data: str, output: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-m",
         "examples.waveforms.train", "--data", data, "--output", str(output), *args],
        capture_output=True, text=True, env=os.environ.copy(), timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_two_ranks_write_exact_metrics_and_a_resume_continues_the_run(tmp_path):
    data = stage_files(str(DATASET_DIR), str(tmp_path / "bucket"), name="waveforms",
                       patterns=DATASET_FILES)["uri"]  # fmt: skip
    out = tmp_path / "run"
    first = _train(data, out, "--epochs", "2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    epochs = [json.loads(line.split(":", 1)[1]) for line in first.stdout.splitlines()
              if '"event": "epoch"' in line]  # fmt: skip
    assert [e["epoch"] for e in epochs] == [1, 2]  # printed by rank 0 only, once per epoch
    metrics = contract.METRICS.loads((out / "metrics.json").read_text(), "metrics.json")
    assert metrics["world_size"] == 2 and metrics["val_samples"] == 400
    assert contract.check_preprocessing(metrics["preprocessing"], "metrics")["input_shape"] == [
        1, 128
    ]  # fmt: skip
    assert metrics["val_accuracy"] == metrics["val_correct"] / 400
    assert metrics["history"] == [{k: v for k, v in e.items() if k not in ("event", "of_epochs")}
                                  for e in epochs]  # fmt: skip

    resumed = _train(data, out, "--epochs", "3", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "after epoch 2" in resumed.stdout
    after = json.loads((out / "metrics.json").read_text())
    assert after["epochs"] == 3 and after["history"][:2] == metrics["history"]

    # A checkpoint of another world size is refused, naming why.
    one = subprocess.run(
        [HOROVODRUN, "--gloo", "-np", "1", "-H", "localhost:1", sys.executable, "-m",
         "examples.waveforms.train", "--data", data, "--output", str(out), "--epochs", "4",
         "--resume"],
        capture_output=True, text=True, env=os.environ.copy(), timeout=600,
    )  # fmt: skip
    assert one.returncode != 0
    assert "world_size: checkpoint 2, this run 1" in one.stdout + one.stderr


def test_data_that_is_not_a_file_set_is_refused_naming_the_format(tmp_path, mnist_subset):
    from horovod_airflow.operators.staging import stage_dataset

    mnist = stage_dataset(str(mnist_subset), str(tmp_path / "bucket"), name="mnist")["uri"]
    proc = subprocess.run(
        [sys.executable, "-m", "examples.waveforms.train", "--data", mnist, "--output",
         str(tmp_path / "run")],
        capture_output=True, text=True, env=os.environ.copy(), timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "'format' must be one of horovod-airflow/fileset-v2" in proc.stderr
