"""The staged dataset layout, shared by the DAG's staging task and the trainer.

A staged dataset is a folder (S3 prefix or local path) of MNIST-format IDX files
(``*-idx3-ubyte`` images, ``*-idx1-ubyte`` labels, optionally gzip-compressed) plus a
``manifest.json``::

    {
      "format": "horovod-airflow/dataset-v2",
      "name": "mnist",
      "content_hash": "<sha256 over the sorted (file name, sha256) pairs>",
      "files": [
        {"name": "train-images-idx3-ubyte.gz", "split": "train", "kind": "images",
         "size": 9912422, "sha256": "...", "samples": 60000, "shape": [60000, 28, 28],
         "dtype": "uint8", "duplicates": 0},
        {"name": "train-labels-idx1-ubyte.gz", "split": "train", "kind": "labels", ...,
         "dtype": "uint8", "classes": {"0": 5923, "1": 6742, ...}},
        ...
      ],
      "splits": {"train": 60000, "test": 10000}
    }

``dtype``, ``duplicates`` (samples whose values repeat an earlier sample of the same file) and
``classes`` (samples per label) are v2's: they are what the next staging's data checks
(``horovod_airflow.operators.data_checks``) compare against. A ``horovod-airflow/dataset-v1``
manifest (staged before them) lacks them and is still read.

The content hash names the staged prefix (``datasets/<name>/<content_hash[:16]>/``), so an
unchanged dataset is never uploaded twice and a trained model can say exactly which data it
saw. Importable without torch and without Airflow. The file names and formats of both sides
live in :mod:`horovod_airflow.core.contract`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from horovod_airflow.core.contract import DATASET_FORMAT, LEGACY_DATASET_FORMAT, MANIFEST_NAME
from horovod_airflow.core.storage import (
    StorageError,
    TransientStorageError,
    join,
    read_bytes,
    sha256_file,
)

FORMAT = DATASET_FORMAT
#: The dataset manifest formats this release reads (v1: staged before the data checks).
READABLE_FORMATS = (DATASET_FORMAT, LEGACY_DATASET_FORMAT)
SPLITS = ("train", "test")
# The four files of an MNIST-format dataset, by (split, kind); the names torchvision uses.
STEMS = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}
_IDX_DIMS = {"images": 3, "labels": 1}
_UBYTE = 0x08


class DatasetError(ValueError):
    """A dataset source or a staged dataset is malformed (missing files, bad headers)."""


class DatasetIntegrityError(DatasetError):
    """A staged file does not match its manifest entry (size or sha256)."""


def _open(path: str | os.PathLike[str]) -> Any:
    return gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")


def idx_shape(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """Read the header of an unsigned-byte IDX file (plain or .gz) and return its shape."""
    try:
        with _open(path) as f:
            head = f.read(4)
            if len(head) != 4 or head[0] != 0 or head[1] != 0:
                raise DatasetError(f"{path}: not an IDX file (bad magic {head!r})")
            if head[2] != _UBYTE:
                raise DatasetError(f"{path}: IDX element type 0x{head[2]:02x}, only ubyte (0x08)")
            ndim = head[3]
            dims = struct.unpack(f">{ndim}I", f.read(4 * ndim))
    except (OSError, EOFError, struct.error) as e:
        raise DatasetError(f"{path}: unreadable IDX file: {e}") from e
    return tuple(int(d) for d in dims)


def read_idx(path: str | os.PathLike[str]) -> Any:
    """An unsigned-byte IDX file (plain or .gz) as a numpy uint8 array of its shape."""
    import numpy as np

    shape = idx_shape(path)
    with _open(path) as f:
        raw = f.read()
    count = 1
    for d in shape:
        count *= d
    offset = 4 + 4 * len(shape)
    if len(raw) - offset != count:
        raise DatasetError(f"{path}: header says {shape}, body has {len(raw) - offset} bytes")
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(shape)


def array_statistics(array: Any, *, labels: bool = False) -> dict[str, Any]:
    """What the data checks compare of one array of samples (axis 0): ``samples``, ``shape``,
    ``dtype``; ``duplicates`` (samples equal to an earlier one, for samples of 1 value or
    more per axis beyond 0); with ``labels``, ``classes`` (samples per label value) of a 1-D
    integer array, else DatasetError."""
    import hashlib

    import numpy as np

    shape = [int(d) for d in array.shape]
    if not shape:
        raise DatasetError(f"a 0-dimensional array (dtype {array.dtype}) holds no samples")
    stats: dict[str, Any] = {"samples": shape[0], "shape": shape, "dtype": str(array.dtype)}
    if len(shape) >= 2:
        rows = np.ascontiguousarray(array.reshape(shape[0], -1))
        seen = {hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in rows}
        stats["duplicates"] = shape[0] - len(seen)
    if labels:
        if len(shape) != 1 or not np.issubdtype(array.dtype, np.integer):
            raise DatasetError(
                f"class labels must be a 1-D integer array, got shape {shape} dtype {array.dtype}"
            )
        values, counts = np.unique(array, return_counts=True)
        stats["classes"] = {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)}
    return stats


def find_source_files(folder: str | os.PathLike[str]) -> dict[tuple[str, str], Path]:
    """Locate the four MNIST-format files in a local folder (plain or .gz names)."""
    root = Path(folder)
    if not root.is_dir():
        raise DatasetError(f"dataset source {folder} is not a folder")
    found: dict[tuple[str, str], Path] = {}
    missing = []
    for key, stem in STEMS.items():
        for name in (stem + ".gz", stem):
            if (root / name).is_file():
                found[key] = root / name
                break
        else:
            missing.append(stem + "[.gz]")
    if missing:
        raise DatasetError(
            f"dataset source {folder} lacks {', '.join(missing)}; "
            f"an MNIST-format source holds {', '.join(s + '[.gz]' for s in STEMS.values())}"
        )
    return found


def content_hash(entries: list[dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for e in sorted(entries, key=lambda e: e["name"]):
        h.update(f"{e['name']}\0{e['sha256']}\n".encode())
    return h.hexdigest()


def build_manifest(name: str, files: dict[tuple[str, str], Path]) -> dict[str, Any]:
    """Describe local MNIST-format files: sizes, sha256, shapes; checks images match labels."""
    if not name or "/" in name:
        raise DatasetError(f"dataset name must be non-empty and without '/', got {name!r}")
    entries = []
    splits: dict[str, int] = {}
    for (split, kind), path in sorted(files.items()):
        shape = idx_shape(path)
        if len(shape) != _IDX_DIMS[kind]:
            raise DatasetError(
                f"{path}: {kind} file must have {_IDX_DIMS[kind]} dimension(s), has shape {shape}"
            )
        entries.append(
            {
                "name": path.name,
                "split": split,
                "kind": kind,
                "size": path.stat().st_size,
                "sha256": sha256_file(path),
                **array_statistics(read_idx(path), labels=kind == "labels"),
            }
        )
        if split in splits and splits[split] != shape[0]:
            raise DatasetError(
                f"split {split!r}: {splits[split]} labels/images but {path.name} has {shape[0]}"
            )
        splits[split] = shape[0]
    return {
        "format": FORMAT,
        "name": name,
        "content_hash": content_hash(entries),
        "files": entries,
        "splits": splits,
    }


def parse_manifest(text: str | bytes) -> dict[str, Any]:
    """Load and validate a dataset manifest; raise DatasetError naming the bad field."""
    return check_manifest(
        text,
        readable=READABLE_FORMATS,
        entry_fields=("name", "split", "kind", "size", "sha256", "samples"),
    )


def check_manifest(
    text: str | bytes, *, readable: tuple[str, ...], entry_fields: tuple[str, ...]
) -> dict[str, Any]:
    """What every staged manifest (a dataset's, a file set's) must be: JSON with a ``format``
    of ``readable``, a non-empty ``files`` list of objects with ``entry_fields`` and plain
    names, and the ``content_hash`` of those entries. Raise DatasetError naming the bad field."""
    try:
        m = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{MANIFEST_NAME} is not valid JSON: {e}") from e
    if not isinstance(m, dict) or m.get("format") not in readable:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise DatasetError(
            f"{MANIFEST_NAME}: 'format' must be one of {', '.join(readable)}, got {got!r} "
            "(restage the data with this release)"
        )
    files = m.get("files")
    if not isinstance(files, list) or not files:
        raise DatasetError(f"{MANIFEST_NAME}: 'files' must be a non-empty list")
    for entry in files:
        if not isinstance(entry, dict):
            raise DatasetError(f"{MANIFEST_NAME}: file entry {entry!r} is not an object")
        for field in entry_fields:
            if field not in entry:
                raise DatasetError(
                    f"{MANIFEST_NAME}: file entry {entry.get('name')!r} lacks {field!r}"
                )
        if "/" in entry["name"] or entry["name"].startswith("."):
            raise DatasetError(f"{MANIFEST_NAME}: file name {entry['name']!r} must be a plain name")
    if content_hash(files) != m.get("content_hash"):
        raise DatasetError(f"{MANIFEST_NAME}: 'content_hash' does not match its file entries")
    return m


def read_staged_manifest(
    uri: str,
    *,
    parse: Callable[[str | bytes], dict[str, Any]] = parse_manifest,
    what: str = "dataset",
    client: Any | None = None,
) -> dict[str, Any]:
    """The manifest staged at ``uri``, validated by ``parse``. A missing one is a DatasetError
    (the data is not a staged ``what``); a transient storage error stays one (the task is
    retried: it is no verdict on the data)."""
    try:
        text = read_bytes(join(uri, MANIFEST_NAME), client=client)
    except TransientStorageError:
        raise
    except StorageError as e:
        raise DatasetError(
            f"no {MANIFEST_NAME} at {uri}: the data must be a staged {what} "
            f"(s3://bucket/datasets/<name>/<hash16> or a folder with {MANIFEST_NAME}): {e}"
        ) from e
    return parse(text)


def entry_for(manifest: dict[str, Any], split: str, kind: str) -> dict[str, Any]:
    for e in manifest["files"]:
        if e["split"] == split and e["kind"] == kind:
            return e
    raise DatasetError(f"manifest of {manifest.get('name')!r} has no {split} {kind} file")


def verify_file(path: str | os.PathLike[str], entry: dict[str, Any]) -> None:
    """Raise DatasetIntegrityError unless the file's size and sha256 match the manifest."""
    p = Path(path)
    if not p.is_file():
        raise DatasetIntegrityError(f"{entry['name']}: missing at {p}")
    size = p.stat().st_size
    if size != entry["size"]:
        raise DatasetIntegrityError(
            f"{entry['name']}: size {size} bytes, manifest says {entry['size']}"
        )
    digest = sha256_file(p)
    if digest != entry["sha256"]:
        raise DatasetIntegrityError(
            f"{entry['name']}: sha256 {digest}, manifest says {entry['sha256']} "
            "(the staged file is corrupted or was changed after staging)"
        )


# --- the pipeline bucket's top-level prefixes (docs/design.md, "Pipeline bucket layout") -------
#: ``datasets/<name>/<hash16>/``: a staged dataset or file set, ``manifest.json`` written last.
DATASETS_DIR = "datasets"
#: ``runs/<dag_id>/<run_key>/``: one DAG run's outputs (``checkpoint.pt``, ``metrics.json``,
#: ``gate.json``, ``onnx/``); ``run_key`` is ``model_registry.safe_key(run_id)``.
RUNS_DIR = "runs"
#: ``models/<model>/<version>/`` (``manifest.json`` written last) and
#: ``models/<model>/latest.json``: the registry (``operators/model_registry/``).
MODELS_DIR = "models"
#: How many characters of the content hash name a staged prefix.
HASH_PREFIX_CHARS = 16


def datasets_root(bucket_uri: str) -> str:
    """``<bucket_uri>/datasets``: every staged dataset is one level below a name under it."""
    return f"{bucket_uri.rstrip('/')}/{DATASETS_DIR}"


def runs_root(bucket_uri: str) -> str:
    """``<bucket_uri>/runs``: every run prefix is ``<dag_id>/<run_key>`` under it."""
    return f"{bucket_uri.rstrip('/')}/{RUNS_DIR}"


def models_root(bucket_uri: str) -> str:
    """``<bucket_uri>/models``: the registry, one folder per model name."""
    return f"{bucket_uri.rstrip('/')}/{MODELS_DIR}"


def staged_prefix(bucket_uri: str, manifest: dict[str, Any]) -> str:
    """Where a dataset is staged: ``<bucket_uri>/datasets/<name>/<hash16>``."""
    short = manifest["content_hash"][:HASH_PREFIX_CHARS]
    return f"{datasets_root(bucket_uri)}/{manifest['name']}/{short}"
