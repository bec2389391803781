"""Models the trainer can build, by name (``--model``). Each returns logits of shape [N, 10].

Add a model by writing its ``nn.Module`` and one ``MODELS`` entry; the training loop, export
and evaluation only see ``build_model(name)``. Input: float32 [N, 1, 28, 28] normalized with
``NORMALIZE_MEAN``/``NORMALIZE_STD`` (the same numbers go into the ONNX metadata).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

# MNIST pixel statistics: the model sees (pixel / 255 - mean) / std.
NORMALIZE_MEAN = 0.1307
NORMALIZE_STD = 0.3081
INPUT_SHAPE = (1, 28, 28)
NUM_CLASSES = 10


def mnist_cnn() -> nn.Module:
    """The demo's CNN: conv 1→32, conv 32→64, maxpool 2, dropout .25, fc 9216→128, dropout .5,
    fc 128→10 — returning logits (the loss is cross-entropy on logits)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class MnistCNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 3, 1)
            self.conv2 = nn.Conv2d(32, 64, 3, 1)
            self.dropout1 = nn.Dropout(0.25)
            self.dropout2 = nn.Dropout(0.5)
            self.fc1 = nn.Linear(9216, 128)
            self.fc2 = nn.Linear(128, NUM_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = F.relu(self.conv1(x))
            x = F.relu(self.conv2(x))
            x = F.max_pool2d(x, 2)
            x = self.dropout1(x)
            x = torch.flatten(x, 1)
            x = F.relu(self.fc1(x))
            x = self.dropout2(x)
            return self.fc2(x)

    return MnistCNN()


MODELS: dict[str, Callable[[], nn.Module]] = {"mnist_cnn": mnist_cnn}


def build_model(name: str) -> nn.Module:
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None
    return factory()
