"""The example's model: a small 1-D CNN over one channel of ``LENGTH`` samples (torch).

Input ``signal`` float32 ``[batch, 1, length]``, already standardized:
``(raw * scale - mean) / std`` with the train split's mean and std (see :mod:`.train`);
output ``logits`` float32 ``[batch, len(CLASSES)]``. Global average pooling makes it accept
any length, but it is trained and exported for ``LENGTH``.
"""

from __future__ import annotations

from typing import Any

from examples.waveforms.data import CLASSES

MODEL_NAME = "waveform_cnn1d"


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
