"""Export a checkpoint to one self-contained ONNX file and prove it computes what PyTorch does.

``python -m horovod_airflow.trainer export --checkpoint URI --output URI [--data URI] [--samples
N]`` writes
``<output>/model.onnx`` (dynamic batch axis, weights embedded — no ``.onnx.data`` sidecar)
and ``<output>/parity.json`` (``horovod_airflow.core.contract.PARITY``). Parity: onnxruntime and
PyTorch
(float32, eval mode) on held-out test images; the export fails — exit 1, no ``model.onnx``
written — when any logit differs by more than ``TOLERANCE`` or any predicted class differs.

The model input is ``image``: float32 ``[batch, 1, 28, 28]``, ``(pixel / 255 - mean) / std``
with mean/std from ``horovod_airflow.trainer.model``; the output is ``logits`` ``[batch, 10]``. The
model
carries that preprocessing (``horovod_airflow.trainer.model.preprocessing()``) as the JSON of its
ONNX
metadata property ``horovod_airflow.core.contract.PREPROCESSING_KEY``, and ``parity.json``
records it too,
so serving reads it from the model instead of repeating the numbers.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from horovod_airflow.core import contract, storage
from horovod_airflow.core.contract import ONNX_NAME, PARITY, PARITY_NAME
from horovod_airflow.core.train_config import TrainConfig
from horovod_airflow.trainer import data
from horovod_airflow.trainer.model import (
    INPUT_NAME,
    INPUT_SHAPE,
    OUTPUT_NAME,
    build_model,
    preprocessing,
)
from horovod_airflow.trainer.resume import load_checkpoint

TOLERANCE = 1e-4


class ParityError(RuntimeError):
    """onnxruntime and PyTorch disagree beyond the tolerance."""


def write_onnx(
    model: Any,
    example: Any,
    path: Path,
    metadata: dict[str, str],
    *,
    input_name: str,
    output_name: str,
) -> None:
    """Write ``model`` (eval mode) as one self-contained ONNX file (no ``.onnx.data``
    sidecar) whose first axis is a dynamic batch, with ``metadata`` as its
    ``metadata_props``; check it with onnx's full checker. ``example`` is one input batch of
    at least 2 samples (its shape past the batch axis is the model's). Any model's export
    program can use it (``examples/waveforms/export.py`` does)."""
    import onnx
    import torch

    torch.onnx.export(
        model,
        (example,),
        str(path),
        dynamo=True,
        external_data=False,
        input_names=[input_name],
        output_names=[output_name],
        dynamic_shapes=({0: torch.export.Dim("batch")},),  # by position: any forward()
    )
    proto = onnx.load(str(path))
    for key, value in metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(path))


def export_onnx(model: Any, path: Path, metadata: dict[str, str]) -> None:
    """The MNIST model as ``image`` ``[batch, 1, 28, 28]`` → ``logits`` (:func:`write_onnx`)."""
    import torch

    example = torch.zeros(2, *INPUT_SHAPE)
    write_onnx(model, example, path, metadata, input_name=INPUT_NAME, output_name=OUTPUT_NAME)


def parity(
    model: Any, onnx_path: Path, images: Any, labels: Any, served: Any = None
) -> dict[str, Any]:
    """Compare onnxruntime with PyTorch float32; also run batch size 1.

    PyTorch gets ``images`` as the trainer prepared them; onnxruntime gets ``served`` (the
    same samples, raw, prepared by the preprocessing the model declares: what serving feeds
    it), or ``images`` when None. So a declared preprocessing that differs from the training's
    fails parity here, before anything is published.
    """
    import numpy as np
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    with torch.inference_mode():
        expected = model(images).float().numpy()
    fed = images.numpy() if served is None else np.asarray(served)
    got = session.run([OUTPUT_NAME], {INPUT_NAME: fed})[0]
    single = session.run([OUTPUT_NAME], {INPUT_NAME: fed[:1]})[0]
    return parity_figures(expected, got, single, labels.numpy())


def parity_figures(expected: Any, got: Any, single: Any, labels: Any) -> dict[str, Any]:
    """The parity report's figures from PyTorch's logits (``expected``), onnxruntime's on the
    whole batch (``got``) and on its first sample alone (``single``), and the true labels (all
    numpy arrays): it passes when no logit differs by more than :data:`TOLERANCE` and no
    predicted class differs."""
    import numpy as np

    diff = float(max(np.abs(got - expected).max(), np.abs(single - expected[:1]).max()))
    mismatches = int((got.argmax(1) != expected.argmax(1)).sum())
    return {
        "max_abs_diff": diff,
        "argmax_mismatches": mismatches,
        "samples": len(expected),
        "tolerance": TOLERANCE,
        "passed": diff <= TOLERANCE and mismatches == 0,
        "onnx_accuracy": float((got.argmax(1) == labels).mean()),
        "torch_accuracy": float((expected.argmax(1) == labels).mean()),
    }


def write_checked_model(path: Path, report: dict[str, Any], output: str, samples: str) -> None:
    """``parity.json`` into ``output`` always, then ``model.onnx`` (``path``) to
    ``report["model_uri"]`` only when the report passed; else :class:`ParityError` naming the
    figures (``samples``: what the compared samples are, e.g. "test images")."""
    storage.write_text(storage.join(output, PARITY_NAME), PARITY.dumps(report))
    if not report["passed"]:
        raise ParityError(
            f"ONNX parity failed on {report['samples']} {samples}: max |diff| "
            f"{report['max_abs_diff']:.3g} (tolerance {TOLERANCE}), "
            f"{report['argmax_mismatches']} argmax mismatches; model.onnx not written"
        )
    storage.upload_file(path, report["model_uri"])


def run_export(
    checkpoint: str, output: str, data_uri: str = "", samples: int = 1000, cache_dir: str = ""
) -> dict[str, Any]:
    """Export and check; write ``model.onnx`` (only when parity holds) and ``parity.json``."""
    import torch

    start = time.perf_counter()
    state = load_checkpoint(checkpoint)
    config = TrainConfig.from_dict(state["config"])
    model = build_model(config.model)
    model.load_state_dict(state["model"])
    model = model.float().eval()

    dataset = data.fetch_dataset(data_uri or state["dataset"]["uri"], cache_dir)
    images, labels = data.load_split(dataset, "test", samples)
    torch.manual_seed(0)
    pre = preprocessing()
    metadata = {
        **contract.preprocessing_metadata(pre),
        "producer": "horovod-airflow trainer",
        "model": config.model,
        "checkpoint": checkpoint,
        "epoch": str(state["epoch"]),
        "dataset_content_hash": str(state["dataset"]["content_hash"]),
    }
    with tempfile.TemporaryDirectory(prefix="hva-export-") as tmp:
        path = Path(tmp) / ONNX_NAME
        export_onnx(model, path, metadata)
        extra = sorted(p.name for p in Path(tmp).iterdir() if p.name != ONNX_NAME)
        if extra:
            raise RuntimeError(f"ONNX export wrote side files {extra}; expected one file")
        raw, _ = data.load_raw_split(dataset, "test", samples)
        report = parity(model, path, images, labels, contract.apply_preprocessing(pre, raw))
        report.update(
            checkpoint=checkpoint,
            dataset=dataset.uri,
            model_bytes=path.stat().st_size,
            model_uri=storage.join(output, ONNX_NAME),
            # load + export + parity check, the exporter's own time (bench/pipeline_overhead)
            export_seconds=round(time.perf_counter() - start, 3),
            preprocessing=pre,
        )
        write_checked_model(path, report, output, "test images")
    return report
