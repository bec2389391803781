"""The example's model: a small 1-D CNN over one channel of ``LENGTH`` samples (torch, imported
only by :func:`build_model`), and the preprocessing it expects.

Input ``signal`` float32 ``[batch, 1, length]``, already standardized:
``(raw * scale - mean) / std`` with the train split's mean and std (:func:`preprocessing_of`,
the contract's preprocessing document, which the export puts into the ONNX model);
output ``logits`` float32 ``[batch, len(CLASSES)]``. Global average pooling makes it accept
any length, but it is trained and exported for ``LENGTH``.
"""

from __future__ import annotations

from typing import Any

from examples.waveforms.data import CLASSES
from horovod_airflow.core import contract

MODEL_NAME = "waveform_cnn1d"
INPUT_NAME, OUTPUT_NAME = "signal", "logits"


def preprocessing_of(train_signals: Any) -> dict[str, Any]:
    """The model's preprocessing (``horovod_airflow.core.contract.preprocessing``) for raw
    signals
    ``[N, length]``: ``x = (raw - mean) / std`` with the mean and std of ``train_signals``,
    one channel of ``length`` samples, the labels ``CLASSES``. ValueError when they are
    constant (std 0) or not ``[N, length]``."""
    if getattr(train_signals, "ndim", 0) != 2 or not train_signals.size:
        raise ValueError(
            f"train signals must be a non-empty [N, length] array, got shape "
            f"{list(getattr(train_signals, 'shape', []))}"
        )
    mean = float(train_signals.astype("float64").mean())
    std = float(train_signals.astype("float64").std())
    if not std > 0:
        raise ValueError("the train signals are constant (std 0): cannot standardize")
    return contract.preprocessing(
        input_name=INPUT_NAME,
        input_shape=(1, int(train_signals.shape[1])),
        dtype="float32",
        channel_axis=0,
        scale=1.0,
        mean=[mean],
        std=[std],
        output_name=OUTPUT_NAME,
        labels=CLASSES,
    )


def build_model(num_classes: int = len(CLASSES)) -> Any:
    import torch
    from torch import nn

    class WaveformCNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv1d(1, 16, kernel_size=7, padding=3),
                nn.ReLU(),
                nn.MaxPool1d(2),
                nn.Conv1d(16, 32, kernel_size=5, padding=2),
                nn.ReLU(),
                nn.MaxPool1d(2),
                nn.Conv1d(32, 32, kernel_size=3, padding=1),
                nn.ReLU(),
            )
            self.head = nn.Linear(32, num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.features(x).mean(dim=-1))  # global average over time

    return WaveformCNN()
