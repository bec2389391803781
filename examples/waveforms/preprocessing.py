"""The example's preprocessing, as the exported model records it (numpy only; no torch, no Airflow).

The ``PREPROCESSING_KEY`` entry of the ONNX model's ``metadata_props`` is a JSON object
``{"input_name", "input_shape", "dtype", "scale", "mean", "std"}``; the model's input is
``((raw * scale - mean) / std).astype(dtype)`` reshaped to ``input_shape`` (``"batch"`` the
dynamic axis): raw signals ``[N, length]`` become ``[N, 1, length]``. ``LABELS_KEY`` holds
the class names (a JSON list). Shared by the export (which writes and checks it, in the
ranks' environment) and the serving side (which reads it, on the Airflow worker).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

PREPROCESSING_KEY = "horovod_airflow.preprocessing"
LABELS_KEY = "horovod_airflow.labels"
_FIELDS = ("input_name", "input_shape", "dtype", "scale", "mean", "std")


def preprocessing_spec(metadata: dict[str, str]) -> dict[str, Any]:
    """The preprocessing a model's metadata describes; ValueError naming what is missing."""
    if PREPROCESSING_KEY not in metadata:
        raise ValueError(
            f"the model's ONNX metadata has no {PREPROCESSING_KEY!r} (keys: {sorted(metadata)}): "
            "it was not exported by examples.waveforms.export"
        )
    try:
        spec = json.loads(metadata[PREPROCESSING_KEY])
    except json.JSONDecodeError as e:
        raise ValueError(f"{PREPROCESSING_KEY} is not JSON: {e}") from e
    missing = [f for f in _FIELDS if not isinstance(spec, dict) or f not in spec]
    if missing:
        raise ValueError(f"{PREPROCESSING_KEY} lacks {missing}; it needs {list(_FIELDS)}")
    if not float(spec["std"]) > 0:
        raise ValueError(f"{PREPROCESSING_KEY}: std must be > 0, got {spec['std']!r}")
    return dict(spec)


def preprocess(raw: Any, spec: dict[str, Any]) -> Any:
    """Raw signals ``[N, length]`` → the model's input ``[N, 1, length]`` as ``spec`` says."""
    x = np.asarray(raw, dtype=np.float64)
    length = spec["input_shape"][-1]
    if x.ndim != 2 or (isinstance(length, int) and x.shape[1] != length):
        raise ValueError(f"signals must be [N, {length}], got {list(x.shape)}")
    x = (x * float(spec["scale"]) - float(spec["mean"])) / float(spec["std"])
    return x.astype(spec["dtype"]).reshape(x.shape[0], *spec["input_shape"][1:])
