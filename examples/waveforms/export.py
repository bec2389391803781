"""The example's export: ``python -m examples.waveforms.export --checkpoint C --output O``.

What ``HorovodExportOperator`` runs with ``entrypoint=("python", "-m",
"examples.waveforms.export")``. Writes ``<output>/model.onnx`` (one self-contained file,
dynamic batch axis; input ``signal`` float32 ``[batch, 1, length]``, output ``logits``) and
``<output>/parity.json`` (``horovod_airflow.core.contract.PARITY``: ``max_abs_diff``,
``argmax_mismatches``, ``samples``, ``tolerance``, ``passed``, ``preprocessing``,
``onnx_accuracy``, ``torch_accuracy``, ...), and exits non-zero, writing no ``model.onnx``,
when parity fails.

The model carries its preprocessing as the contract says: the checkpoint's
``horovod_airflow.core.contract.preprocessing`` document (the train split's mean and std, the
class names
as ``labels``) is the JSON of the ONNX metadata property
``horovod_airflow.core.contract.PREPROCESSING_KEY``
(``horovod_airflow.core.contract.preprocessing_metadata``), and ``parity.json`` records the same
document,
which publish copies into the version manifest. Serving (:mod:`horovod_airflow.operators.serving`)
reads it
back from the model.

``--data`` (default: the dataset the checkpoint was trained on) and ``--samples`` pick the
test signals. Parity compares PyTorch (on the trainer's input) with onnxruntime fed through
the preprocessing read back from the exported file's metadata
(``horovod_airflow.core.contract.preprocessing_from_metadata`` and ``apply_preprocessing``, as
serving
does), so a wrong preprocessing record fails it too.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from examples.waveforms.data import load_split
from examples.waveforms.model import INPUT_NAME, MODEL_NAME, OUTPUT_NAME, build_model
from examples.waveforms.train import CHECKPOINT_FORMAT, standardize
from horovod_airflow.core import contract, fileset, storage
from horovod_airflow.core.contract import EVENT_EXPORTED, ONNX_NAME, event_line
from horovod_airflow.trainer.export import (
    ParityError,
    parity_figures,
    write_checked_model,
    write_onnx,
)


def metadata_for(state: dict[str, Any], checkpoint: str) -> dict[str, str]:
    """The ONNX ``metadata_props`` of an exported checkpoint: the contract's preprocessing
    entry (the checkpoint's document, checked) and provenance strings."""
    return {
        **contract.preprocessing_metadata(state["preprocessing"]),
        "producer": "examples.waveforms.export",
        "model": MODEL_NAME,
        "checkpoint": checkpoint,
        "epoch": str(state["epoch"]),
        "dataset_content_hash": str(state["dataset"]["content_hash"]),
    }


def export_onnx(model: Any, length: int, path: Path, metadata: dict[str, str]) -> None:
    """The waveform model as ``signal`` ``[batch, 1, length]`` → logits, written and checked
    by the project's :func:`horovod_airflow.trainer.export.write_onnx`."""
    import torch

    example = torch.zeros(2, 1, length)
    write_onnx(model, example, path, metadata, input_name=INPUT_NAME, output_name=OUTPUT_NAME)


def parity(model: Any, path: Path, raw: Any, labels: Any, pre: dict[str, Any]) -> dict[str, Any]:
    """PyTorch on the trainer's input vs onnxruntime on the serving side's (also batch 1).

    The serving side's input is prepared with the preprocessing the exported file carries,
    read back through the contract; the report records that document as ``preprocessing``.
    """
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    carried = contract.preprocessing_from_metadata(
        dict(session.get_modelmeta().custom_metadata_map), str(path)
    )
    served = contract.apply_preprocessing(carried, raw)
    with torch.inference_mode():
        expected = model(standardize(raw, pre)).numpy()
    feed, fetch = carried["input_name"], [carried["output_name"]]
    got = session.run(fetch, {feed: served})[0]
    single = session.run(fetch, {feed: served[:1]})[0]
    return {**parity_figures(expected, got, single, labels), "preprocessing": carried}


def run_export(checkpoint: str, output: str, data_uri: str = "", samples: int = 0) -> dict:
    """Export and check; write ``model.onnx`` (only when parity holds) and ``parity.json``."""
    import torch

    start = time.perf_counter()
    state = torch.load(
        io.BytesIO(storage.read_bytes(checkpoint)), map_location="cpu", weights_only=True
    )
    found = state.get("format") if isinstance(state, dict) else type(state).__name__
    if found != CHECKPOINT_FORMAT:
        raise ValueError(
            f"{checkpoint}: checkpoint format {found!r}; this export reads {CHECKPOINT_FORMAT!r} "
            f"(written by examples.waveforms.train)"
        )
    pre = contract.check_preprocessing(state["preprocessing"], f"{checkpoint} preprocessing")
    model = build_model(len(pre["labels"]))
    model.load_state_dict(state["model"])
    model = model.float().eval()
    data_uri = data_uri or state["dataset"]["uri"]
    with tempfile.TemporaryDirectory(prefix="hva-wf-export-") as tmp:
        _, paths = fileset.fetch_files(data_uri, Path(tmp) / "data")
        raw, labels = load_split(paths, "test")
        if samples:
            raw, labels = raw[:samples], labels[:samples]
        path = Path(tmp) / ONNX_NAME
        export_onnx(model, int(pre["input_shape"][-1]), path, metadata_for(state, checkpoint))
        report = parity(model, path, raw, labels, pre)
        report.update(
            checkpoint=checkpoint,
            dataset=data_uri,
            model_bytes=path.stat().st_size,
            model_uri=storage.join(output, ONNX_NAME),
            export_seconds=round(time.perf_counter() - start, 3),
        )
        write_checked_model(path, report, output, "test signals")
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
    print(event_line(EVENT_EXPORTED, report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
