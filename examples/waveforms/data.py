"""The example's dataset: noisy waveforms of four kinds, generated deterministically (numpy only).

Each sample is ``LENGTH`` float32 values: ``offset + amplitude * wave(frequency * t + phase) +
noise`` with a random frequency (1.5-5 cycles per window), phase, amplitude (0.5-2), a DC
offset (1-3, so the raw values are not centred: the model needs the preprocessing) and
Gaussian noise (sigma 0.3). The label says which wave: ``CLASSES``.

Format (a folder of ``.npy`` files, staged as a file set):

- ``train_signals.npy``, ``test_signals.npy``: float32 ``[N, LENGTH]``, raw values
- ``train_labels.npy``, ``test_labels.npy``: int64 ``[N]``, class indices into ``CLASSES``

``python -m examples.waveforms.data --out DIR`` writes the four files (the shipped
``dataset/`` folder is exactly that output).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

CLASSES = ("sine", "square", "sawtooth", "triangle")
LENGTH = 128
TRAIN_SAMPLES, TEST_SAMPLES = 1200, 400
TRAIN_SEED, TEST_SEED = 1, 2
#: The seed of the fresh samples the serving check predicts (never in the staged data).
SERVING_SEED = 3
SPLITS = ("train", "test")


def file_name(split: str, kind: str) -> str:
    """``train_signals.npy``, ``test_labels.npy``, ...; raises ValueError on another split/kind."""
    if split not in SPLITS or kind not in ("signals", "labels"):
        raise ValueError(f"split must be one of {SPLITS} and kind signals|labels: {split}/{kind}")
    return f"{split}_{kind}.npy"


def generate(n: int, seed: int, length: int = LENGTH) -> tuple[Any, Any]:
    """``n`` waveforms (float32 ``[n, length]``) and their labels (int64 ``[n]``), balanced."""
    if n < 1 or length < 8:
        raise ValueError(f"need n >= 1 and length >= 8, got n={n}, length={length}")
    rng = np.random.default_rng(seed)
    labels = np.arange(n, dtype=np.int64) % len(CLASSES)
    rng.shuffle(labels)
    t = np.arange(length, dtype=np.float64) / length
    freq = rng.uniform(1.5, 5.0, n)
    phase = rng.uniform(0.0, 1.0, n)
    amplitude = rng.uniform(0.5, 2.0, n)
    offset = rng.uniform(1.0, 3.0, n)
    u = (freq[:, None] * t[None, :] + phase[:, None]) % 1.0  # position in the cycle, [0, 1)
    waves = np.stack(
        [
            np.sin(2 * np.pi * u),  # sine
            np.where(u < 0.5, 1.0, -1.0),  # square
            2.0 * u - 1.0,  # sawtooth
            4.0 * np.abs(u - 0.5) - 1.0,  # triangle
        ]
    )
    wave = waves[labels, np.arange(n)]
    noise = rng.normal(0.0, 0.3, (n, length))
    signals = offset[:, None] + amplitude[:, None] * wave + noise
    return signals.astype(np.float32), labels


def write_dataset(out: str | Path) -> list[Path]:
    """Write the four ``.npy`` files of the example dataset into ``out``; return their paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for split, n, seed in (("train", TRAIN_SAMPLES, TRAIN_SEED), ("test", TEST_SAMPLES, TEST_SEED)):
        signals, labels = generate(n, seed)
        for kind, array in (("signals", signals), ("labels", labels)):
            path = folder / file_name(split, kind)
            np.save(path, array, allow_pickle=False)
            written.append(path)
    return written


def load_split(paths: dict[str, Path], split: str) -> tuple[Any, Any]:
    """Signals and labels of ``split`` from ``{file name: path}``, checked; DatasetError else."""
    from horovod_airflow.core.layout import DatasetError

    try:
        signals = np.load(paths[file_name(split, "signals")], allow_pickle=False)
        labels = np.load(paths[file_name(split, "labels")], allow_pickle=False)
    except KeyError as e:
        raise DatasetError(
            f"the waveforms dataset lacks {e.args[0]}; it holds {sorted(paths)}"
        ) from None
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot read the {split} split: {e}") from e
    if signals.ndim != 2 or signals.dtype != np.float32:
        raise DatasetError(
            f"{file_name(split, 'signals')} must be float32 [N, length], "
            f"got {signals.dtype} {list(signals.shape)}"
        )
    if labels.shape != (signals.shape[0],) or labels.dtype.kind not in "iu":
        raise DatasetError(
            f"{file_name(split, 'labels')} must be integers [{signals.shape[0]}], "
            f"got {labels.dtype} {list(labels.shape)}"
        )
    if labels.size and (labels.min() < 0 or labels.max() >= len(CLASSES)):
        raise DatasetError(
            f"{file_name(split, 'labels')}: labels must be in [0, {len(CLASSES)}), "
            f"got [{labels.min()}, {labels.max()}]"
        )
    return signals, labels.astype(np.int64)


def check_dataset(
    manifest: dict[str, Any], previous: dict[str, Any] | None, files: dict[str, Path]
) -> list[str]:
    """The example's own data check, run by the staging before anything is uploaded
    (``DataChecks(check="examples.waveforms.data:check_dataset")``): each split loads as the
    training program will load it, and holds only finite values. Returns the problems found."""
    from horovod_airflow.core.layout import DatasetError

    problems = []
    for split in SPLITS:
        try:
            signals, _ = load_split(files, split)
        except DatasetError as e:
            problems.append(str(e))
            continue
        bad = int((~np.isfinite(signals)).any(axis=1).sum())
        if bad:
            problems.append(f"{file_name(split, 'signals')}: {bad} samples hold NaN or inf")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.waveforms.data",
        description="Write the example's waveform dataset (four .npy files) into a folder.",
    )
    parser.add_argument("--out", required=True, help="folder to write the .npy files into")
    args = parser.parse_args(argv)
    for path in write_dataset(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
