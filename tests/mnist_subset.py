"""Cut a small, real MNIST-format dataset from the vendored files (for fast tests)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path
from typing import Any

from horovod_airflow.core.layout import STEMS


def _slice_idx(src: Path, dest: Path, count: int) -> None:
    with gzip.open(src, "rb") as f:
        magic = f.read(4)
        ndim = magic[3]
        dims = list(struct.unpack(f">{ndim}I", f.read(4 * ndim)))
        per_item = 1
        for d in dims[1:]:
            per_item *= d
        if count > dims[0]:
            raise ValueError(f"{src.name} has {dims[0]} items, asked for {count}")
        body = f.read(count * per_item)
    dims[0] = count
    with gzip.open(dest, "wb", compresslevel=1) as out:
        out.write(magic + struct.pack(f">{ndim}I", *dims) + body)


def write_subset(source: Path, dest: Path, *, train: int, test: int) -> Path:
    """Write the first ``train``/``test`` items of each split as .gz IDX files into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for (split, _kind), stem in STEMS.items():
        _slice_idx(source / f"{stem}.gz", dest / f"{stem}.gz", train if split == "train" else test)
    return dest


def read_split(source: Path, split: str) -> tuple[Any, Any]:
    """The images and labels of one split of an MNIST-format folder, as numpy arrays."""
    from horovod_airflow.core import layout

    files = layout.find_source_files(source)
    return layout.read_idx(files[(split, "images")]), layout.read_idx(files[(split, "labels")])


def _write_idx(dest: Path, array: Any) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(dest, "wb", compresslevel=1) as out:
        out.write(header + array.astype("uint8").tobytes())


def write_dataset(dest: Path, splits: dict[str, tuple[Any, Any]]) -> Path:
    """Write MNIST-format .gz IDX files from ``{split: (images, labels)}`` into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for (split, kind), stem in STEMS.items():
        images, labels = splits[split]
        _write_idx(dest / f"{stem}.gz", images if kind == "images" else labels)
    return dest
