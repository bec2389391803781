"""The example's export: ``python -m examples.waveforms.export --checkpoint C --output O``.

What ``HorovodExportOperator`` runs with ``entrypoint=("python", "-m",
"examples.waveforms.export")``. Writes ``<output>/model.onnx`` (one self-contained file,
dynamic batch axis; input ``signal`` float32 ``[batch, 1, length]``, output ``logits``) and
``<output>/parity.json`` (``max_abs_diff``, ``argmax_mismatches``, ``samples``,
``tolerance``, ``passed``, ``onnx_accuracy``, ``torch_accuracy``), and exits non-zero,
writing no ``model.onnx``, when parity fails.

``--data`` (default: the dataset the checkpoint was trained on) and ``--samples`` pick the
test signals. Parity compares PyTorch (the trainer's own standardization) with onnxruntime
fed through the preprocessing read back from the exported file's metadata
(:mod:`examples.waveforms.preprocessing`, as :mod:`examples.waveforms.serving` does), so a
wrong preprocessing record fails it too.
The metadata: ``horovod_airflow.preprocessing`` (JSON: ``input_name``, ``input_shape``,
``dtype``, ``scale``, ``mean``, ``std``) and ``horovod_airflow.labels`` (JSON class names).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from examples.waveforms.data import load_split
from examples.waveforms.model import MODEL_NAME, build_model
from examples.waveforms.preprocessing import (
    LABELS_KEY,
    PREPROCESSING_KEY,
    preprocess,
    preprocessing_spec,
)
from examples.waveforms.train import CHECKPOINT_FORMAT, standardize
from trainer import fileset, storage
from trainer.layout import ONNX_NAME, PARITY_NAME

TOLERANCE = 1e-4
INPUT_NAME, OUTPUT_NAME = "signal", "logits"


class ParityError(RuntimeError):
    """onnxruntime and PyTorch disagree beyond the tolerance."""


def metadata_for(state: dict[str, Any], checkpoint: str) -> dict[str, str]:
    """The ONNX ``metadata_props`` of an exported checkpoint (strings; JSON where structured)."""
    pre = state["preprocessing"]
    spec = {
        "input_name": INPUT_NAME,
        "input_shape": ["batch", 1, int(state["length"])],
        "dtype": "float32",
        "scale": float(pre["scale"]),
        "mean": float(pre["mean"]),
        "std": float(pre["std"]),
    }
    return {
        PREPROCESSING_KEY: json.dumps(spec),
        LABELS_KEY: json.dumps(list(state["classes"])),
        "model": MODEL_NAME,
        "checkpoint": checkpoint,
        "epoch": str(state["epoch"]),
        "dataset_content_hash": str(state["dataset"]["content_hash"]),
    }


def export_onnx(model: Any, length: int, path: Path, metadata: dict[str, str]) -> None:
    """Write ``model`` (eval mode) as one ONNX file with a dynamic batch axis, checked."""
    import onnx
    import torch

    torch.onnx.export(
        model,
        (torch.zeros(2, 1, length),),
        str(path),
        dynamo=True,
        external_data=False,
        input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME],
        dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
    )
    proto = onnx.load(str(path))
    for key, value in metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(path))


def parity(model: Any, path: Path, raw: Any, labels: Any, pre: dict[str, Any]) -> dict[str, Any]:
    """PyTorch on the trainer's input vs onnxruntime on the serving side's (also batch 1)."""
    import numpy as np
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    spec = preprocessing_spec(session.get_modelmeta().custom_metadata_map)
    served = preprocess(raw, spec)
    with torch.inference_mode():
        expected = model(standardize(raw, pre)).numpy()
    got = session.run([OUTPUT_NAME], {spec["input_name"]: served})[0]
    single = session.run([OUTPUT_NAME], {spec["input_name"]: served[:1]})[0]
    diff = float(max(np.abs(got - expected).max(), np.abs(single - expected[:1]).max()))
    mismatches = int((got.argmax(1) != expected.argmax(1)).sum())
    return {
        "max_abs_diff": diff,
        "argmax_mismatches": mismatches,
        "samples": len(raw),
        "tolerance": TOLERANCE,
        "passed": diff <= TOLERANCE and mismatches == 0,
        "onnx_accuracy": float((got.argmax(1) == labels).mean()),
        "torch_accuracy": float((expected.argmax(1) == labels).mean()),
    }


def run_export(checkpoint: str, output: str, data_uri: str = "", samples: int = 0) -> dict:
    import torch

    state = torch.load(
        io.BytesIO(storage.read_bytes(checkpoint)), map_location="cpu", weights_only=True
    )
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{checkpoint} is not a {CHECKPOINT_FORMAT} checkpoint")
    model = build_model(len(state["classes"]))
    model.load_state_dict(state["model"])
    model = model.float().eval()
    data_uri = data_uri or state["dataset"]["uri"]
    with tempfile.TemporaryDirectory(prefix="hva-wf-export-") as tmp:
        _, paths = fileset.fetch_files(data_uri, Path(tmp) / "data")
        raw, labels = load_split(paths, "test")
        if samples:
            raw, labels = raw[:samples], labels[:samples]
        path = Path(tmp) / ONNX_NAME
        export_onnx(model, int(state["length"]), path, metadata_for(state, checkpoint))
        report = parity(model, path, raw, labels, state["preprocessing"])
        report.update(
            checkpoint=checkpoint, dataset=data_uri, model_uri=storage.join(output, ONNX_NAME)
        )
        storage.write_text(storage.join(output, PARITY_NAME), json.dumps(report, indent=2))
        if not report["passed"]:
            raise ParityError(
                f"ONNX parity failed on {report['samples']} test signals: max |diff| "
                f"{report['max_abs_diff']:.3g} (tolerance {TOLERANCE}), "
                f"{report['argmax_mismatches']} argmax mismatches; model.onnx not written"
            )
        storage.upload_file(path, report["model_uri"])
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m examples.waveforms.export",
        description="Export an example checkpoint to ONNX and check onnxruntime against PyTorch.",
    )
    p.add_argument("--checkpoint", required=True, help="URI of checkpoint.pt")
    p.add_argument("--output", required=True, help="URI for model.onnx and parity.json")
    p.add_argument("--data", default="", help="staged file set for parity (default: trained on)")
    p.add_argument("--samples", type=int, default=0, help="test signals to compare (0: all)")
    args = p.parse_args(argv)
    if args.samples < 0:
        p.error(f"--samples must be >= 0, got {args.samples}")
    try:
        report = run_export(args.checkpoint, args.output, args.data, args.samples)
    except (ParityError, ValueError, OSError, storage.StorageError) as e:
        print(f"examples.waveforms.export: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"event": "exported", **report}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
