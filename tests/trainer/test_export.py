"""ONNX export: one self-contained file, parity with PyTorch, and it runs without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.trainer.conftest import Run, describe

ORT_WITHOUT_TORCH = """
import json, sys
import numpy as np
import onnxruntime as ort
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
meta = session.get_modelmeta().custom_metadata_map
rng = np.random.default_rng(0)
shapes = []
for batch in (1, 7):
    x = ((rng.random((batch, 1, 28, 28)) - float(meta["normalize_mean"]))
         / float(meta["normalize_std"])).astype(np.float32)
    shapes.append(list(session.run(["logits"], {"image": x})[0].shape))
print(json.dumps({"shapes": shapes, "torch_imported": "torch" in sys.modules}))
"""


def test_export_parity_and_onnx_runs_without_torch(tiny_run: Run, tmp_path: Path) -> None:
    out = tmp_path / "onnx"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "export",
            "--checkpoint",
            str(tiny_run.output / "checkpoint.pt"),
            "--output",
            str(out),
            "--samples",
            "200",
            "--cache-dir",
            str(tiny_run.cache),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, describe(proc)
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "parity.json"]  # no sidecar
    parity = json.loads((out / "parity.json").read_text())
    assert parity["passed"] is True
    assert parity["samples"] == 200
    assert parity["max_abs_diff"] <= parity["tolerance"] == 1e-4
    assert parity["argmax_mismatches"] == 0
    assert parity["export_seconds"] > 0

    run = subprocess.run(
        [sys.executable, "-c", ORT_WITHOUT_TORCH, str(out / "model.onnx")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"shapes": [[1, 10], [7, 10]], "torch_imported": False}


def test_export_of_missing_checkpoint_fails_clearly(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "export",
            "--checkpoint",
            str(tmp_path / "nope.pt"),
            "--output",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert "nope.pt does not exist" in proc.stderr
