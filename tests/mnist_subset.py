"""Cut a small, real MNIST-format dataset from the vendored files (for fast tests)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

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
