"""The serving side's view of a published model: fetch, verify, predict (onnxruntime, no torch)."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from operators.model_registry import read_champion
from operators.staging import VENDORED_MNIST
from trainer import layout, storage

log = logging.getLogger(__name__)

# Fallbacks for models exported without normalization metadata.
_DEFAULT_MEAN, _DEFAULT_STD = 0.1307, 0.3081


class ModelIntegrityError(RuntimeError):
    """A published file does not match the sha256 its version manifest records."""


def load_test_images(count: int, folder: Path = VENDORED_MNIST) -> tuple[np.ndarray, np.ndarray]:
    """The first ``count`` MNIST test images (uint8 [N, 28, 28]) and labels."""
    files = layout.find_source_files(folder)
    images = layout.read_idx(files[("test", "images")])
    labels = layout.read_idx(files[("test", "labels")])
    return images[:count], labels[:count]


def smoke_test_published_model(
    bucket_uri: str, model_name: str, *, client: Any | None = None, sample_count: int = 8
) -> dict[str, Any]:
    """Download the model ``latest.json`` names, check its sha256, predict a few digits."""
    import onnxruntime as ort

    latest = read_champion(bucket_uri, model_name, client=client)
    if latest is None:
        raise FileNotFoundError(f"no published {model_name} in {bucket_uri} (no latest.json)")
    manifest = json.loads(storage.read_text(latest["manifest_uri"], client=client))
    expected = manifest["files"]["model.onnx"]["sha256"]
    with tempfile.TemporaryDirectory(prefix="hva-serve-") as tmp:
        path = storage.download_file(latest["onnx_uri"], Path(tmp) / "model.onnx", client=client)
        actual = storage.sha256_file(path)
        if actual != expected:
            raise ModelIntegrityError(
                f"{latest['onnx_uri']}: sha256 {actual}, manifest {latest['manifest_uri']} "
                f"says {expected}"
            )
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    meta = session.get_modelmeta().custom_metadata_map
    mean = float(meta.get("normalize_mean", _DEFAULT_MEAN))
    std = float(meta.get("normalize_std", _DEFAULT_STD))
    images, labels = load_test_images(sample_count)
    x = ((images.astype(np.float32) / 255.0 - mean) / std)[:, None, :, :]
    logits = session.run(None, {session.get_inputs()[0].name: x})[0]
    predictions = logits.argmax(axis=1)
    correct = int((predictions == labels).sum())
    log.info(
        "%s %s: predictions %s, labels %s (%d/%d correct)",
        model_name,
        latest["version"],
        predictions.tolist(),
        labels.tolist(),
        correct,
        len(labels),
    )
    return {
        "version": latest["version"],
        "onnx_sha256": actual,
        "predictions": predictions.tolist(),
        "labels": labels.tolist(),
        "correct": correct,
    }
