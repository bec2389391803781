"""ONNX export: one self-contained file, parity with PyTorch, and it runs without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from jsonschema import Draft202012Validator

from horovod_airflow.core.contract import PARITY
from horovod_airflow.trainer.model import NORMALIZE_MEAN, preprocessing
from tests.conftest import REPO
from tests.trainer.conftest import Run, describe

ORT_WITHOUT_TORCH = """
import json, sys
import numpy as np
import onnxruntime as ort
from horovod_airflow.core import contract
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
meta = session.get_modelmeta().custom_metadata_map
pre = contract.preprocessing_from_metadata(meta, sys.argv[1])
rng = np.random.default_rng(0)
shapes = []
for batch in (1, 7):
    raw = rng.integers(0, 256, (batch, 28, 28), dtype=np.uint8)
    x = contract.apply_preprocessing(pre, raw)
    shapes.append(list(session.run([pre["output_name"]], {pre["input_name"]: x})[0].shape))
print(json.dumps({"shapes": shapes, "torch_imported": "torch" in sys.modules, "pre": pre}))
"""


def test_export_parity_and_onnx_runs_without_torch(tiny_run: Run, tmp_path: Path) -> None:
    out = tmp_path / "onnx"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "horovod_airflow.trainer",
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
    parity = PARITY.loads((out / "parity.json").read_text(), "parity.json")
    for name, document in (("parity", parity), ("preprocessing", parity["preprocessing"])):
        schema = json.loads((REPO / "docs" / "contract" / f"{name}.schema.json").read_text())
        assert list(Draft202012Validator(schema).iter_errors(document)) == [], name
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
    # The model carries its preprocessing, the same document parity.json records.
    assert result == {"shapes": [[1, 10], [7, 10]], "torch_imported": False,
                      "pre": preprocessing()}  # fmt: skip
    assert parity["preprocessing"] == preprocessing()
    assert preprocessing()["mean"] == [NORMALIZE_MEAN] and preprocessing()["scale"] == 1 / 255


def test_export_of_missing_checkpoint_fails_clearly(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "horovod_airflow.trainer",
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


def test_parity_feeds_onnx_what_serving_feeds_it(tiny_run: Run, tmp_path: Path) -> None:
    """onnxruntime gets the raw test images prepared by the model's declared preprocessing
    (what serving does); PyTorch gets the trainer's own input. A declared preprocessing that
    differs from the training's fails parity, so it is caught before publishing."""
    from horovod_airflow.core import contract
    from horovod_airflow.trainer import data
    from horovod_airflow.trainer.export import export_onnx, parity
    from horovod_airflow.trainer.model import build_model
    from horovod_airflow.trainer.resume import load_checkpoint

    state = load_checkpoint(str(tiny_run.output / "checkpoint.pt"))
    model = build_model(state["config"]["model"])
    model.load_state_dict(state["model"])
    model = model.float().eval()
    dataset = data.fetch_dataset(state["dataset"]["uri"], str(tiny_run.cache))
    images, labels = data.load_split(dataset, "test", 100)
    raw, raw_labels = data.load_raw_split(dataset, "test", 100)
    assert (raw_labels == labels.numpy()).all()
    path = tmp_path / "model.onnx"
    export_onnx(model, path, contract.preprocessing_metadata(preprocessing()))

    declared = parity(
        model, path, images, labels, contract.apply_preprocessing(preprocessing(), raw)
    )
    assert declared["passed"] is True, declared
    wrong = {**preprocessing(), "std": [1.0]}  # a model that says it wants another scaling
    refused = parity(model, path, images, labels, contract.apply_preprocessing(wrong, raw))
    assert refused["passed"] is False and refused["max_abs_diff"] > refused["tolerance"]
