"""Helpers for the trainer tests: a staged MNIST subset and a real 2-rank ``horovodrun`` launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from horovod_airflow.core import layout
from tests.conftest import MNIST_DIR, VENV_BIN
from tests.mnist_subset import write_subset

# Tiny runs: 512 training samples, 256 per rank, 4 steps of 64 per epoch; all 500 test images.
TINY = ["--max-train-samples", "512", "--batch-size", "64", "--log-interval", "0"]
VAL_SAMPLES = 499  # tiny_run's validation count: odd, so 2 ranks get unequal shards


def stage_local(source: Path) -> Path:
    """Write manifest.json into an MNIST-format folder: the folder is then a staged dataset."""
    manifest = layout.build_manifest("mnist", layout.find_source_files(source))
    (source / layout.MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
    return source


def trainer_env(cache_dir: Path, **extra: str) -> dict[str, str]:
    env = os.environ.copy()  # carries PATH/PYTHONPATH (tests/conftest.py) and AWS_* when set
    env["HVA_CACHE_DIR"] = str(cache_dir)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def horovodrun_command(args: list[str], np_: int = 2, gloo: bool = False) -> list[str]:
    return [
        str(VENV_BIN / "horovodrun"),
        *(["--gloo"] if gloo else []),
        "-np",
        str(np_),
        "-H",
        f"localhost:{np_}",
        sys.executable,
        "-m",
        "horovod_airflow.trainer",
        "train",
        *args,
    ]


def run_horovod(
    args: list[str],
    cache_dir: Path,
    np_: int = 2,
    timeout: int = 600,
    gloo: bool = False,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """horovodrun of the trainer's ``train`` with ``args``; ``env`` is added to the ranks'."""
    return subprocess.run(
        horovodrun_command(args, np_, gloo),
        env={**trainer_env(cache_dir), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def events(stdout: str, name: str) -> list[dict[str, Any]]:
    """JSON event lines of the ranks' stdout (horovodrun prefixes them with ``[rank]<stdout>:``)."""
    found = []
    for line in stdout.splitlines():
        _, brace, rest = line.partition("{")
        if not brace:
            continue
        try:
            obj = json.loads(brace + rest)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and obj.get("event") == name:
            found.append(obj)
    return found


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    out, err = proc.stdout[-4000:], proc.stderr[-6000:]
    return f"exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


@pytest.fixture(scope="session")
def staged_subset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real MNIST cut to train 2000 / test 500, staged (manifest.json) in a local folder."""
    root = tmp_path_factory.mktemp("staged")
    return stage_local(write_subset(MNIST_DIR, root / "mnist", train=2000, test=500))


@dataclass
class Run:
    output: Path
    cache: Path
    proc: subprocess.CompletedProcess[str]

    @property
    def metrics(self) -> dict[str, Any]:
        return json.loads((self.output / "metrics.json").read_text())


@pytest.fixture(scope="session")
def tiny_run(staged_subset: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One epoch, 2 ranks, every rank printing its parameter hash after broadcast and step 1.

    It validates on the first ``VAL_SAMPLES`` (odd) test images, so the ranks' shards are
    unequal (249 and 250): an average of per-rank accuracies differs from the exact one.
    """
    root = tmp_path_factory.mktemp("tiny-run")
    args = ["--data", str(staged_subset), "--output", str(root / "out"), "--epochs", "1"]
    args += ["--max-val-samples", str(VAL_SAMPLES)]
    proc = run_horovod([*args, *TINY, "--debug-param-hash"], root / "cache")
    assert proc.returncode == 0, describe(proc)
    return Run(root / "out", root / "cache", proc)
