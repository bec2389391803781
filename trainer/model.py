"""Models the trainer can build, by name (``--model``). Each returns logits of shape [N, 10].

Add a model by writing its ``nn.Module`` and one ``MODELS`` entry; the training loop, export
and evaluation only see ``build_model(name)``. Input: float32 [N, 1, 28, 28] normalized with
``NORMALIZE_MEAN``/``NORMALIZE_STD``; :func:`preprocessing` describes that input in the
contract's terms, and the export stores it in the ONNX file, so serving never repeats these
numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from horovod_airflow.core import contract

if TYPE_CHECKING:
    from torch import nn

# MNIST pixel statistics: the model sees (pixel / 255 - mean) / std.
NORMALIZE_MEAN = 0.1307
NORMALIZE_STD = 0.3081
INPUT_SHAPE = (1, 28, 28)
NUM_CLASSES = 10
INPUT_NAME, OUTPUT_NAME = "image", "logits"


def preprocessing() -> dict[str, Any]:
    """The input every model here expects, as the contract's preprocessing document."""
    return contract.preprocessing(
        input_name=INPUT_NAME,
        input_shape=INPUT_SHAPE,
        dtype="float32",
        channel_axis=0,
        scale=1 / 255,
        mean=[NORMALIZE_MEAN],
        std=[NORMALIZE_STD],
        output_name=OUTPUT_NAME,
        labels=[str(digit) for digit in range(NUM_CLASSES)],
    )


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


def mnist_bn() -> nn.Module:
    """A small BatchNorm CNN: three conv-BN-ReLU blocks, each followed by a 2x2 max-pool
    (28 → 14 → 7 → 3), then one linear layer on the 3×3×64 features — returning logits.

    3.9 M multiply-adds per image and 45 k parameters, against the demo CNN's 12 M and 1.2 M;
    BatchNorm lets it train at a high learning rate, so one epoch is enough. Each rank's
    BatchNorm statistics are averaged over the ranks at the end of every epoch
    (``horovod_airflow.trainer.train.average_buffers``).
    """
    import torch
    from torch import nn

    def block(c_in: int, c_out: int, kernel: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )

    class MnistBN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(block(1, 24, 5), block(24, 48, 3), block(48, 64, 3))
            self.classifier = nn.Linear(64 * 3 * 3, NUM_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.classifier(torch.flatten(self.features(x), 1))

    return MnistBN()


MODELS: dict[str, Callable[[], nn.Module]] = {"mnist_cnn": mnist_cnn, "mnist_bn": mnist_bn}


def build_model(name: str) -> nn.Module:
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None
    return factory()
