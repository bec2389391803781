"""A staged file set: any files, content-addressed, for datasets that are not MNIST-format.

``StageDatasetOperator(files=[...])`` stages the files of a source folder that match the given
names or glob patterns, plus a ``manifest.json``::

    {
      "format": "horovod-airflow/fileset-v2",
      "name": "waveforms",
      "content_hash": "<sha256 over the sorted (file name, sha256) pairs>",
      "files": [{"name": "train_signals.npy", "size": 614528, "sha256": "...",
                 "samples": 1200, "shape": [1200, 128], "dtype": "float32", "duplicates": 0},
                {"name": "train_labels.npy", ..., "classes": {"0": 300, "1": 300, ...}}, ...]
    }

Each ``.npy`` file that numpy reads without unpickling also records its ``samples`` (axis
0), ``shape``, ``dtype`` and ``duplicates``, and a file declared as class labels its
``classes`` (:func:`horovod_airflow.core.layout.array_statistics`): what the next staging's
data checks compare. A ``horovod-airflow/fileset-v1`` manifest (staged before them) has only
name, size and sha256, and is still read. The manifest lives
at ``<bucket>/datasets/<name>/<content_hash[:16]>/``
(:func:`horovod_airflow.core.layout.staged_prefix`),
so an unchanged file set is never uploaded twice. The format string is
:data:`horovod_airflow.core.contract.FILESET_FORMAT`. The content hash is computed as for an
MNIST-format dataset (:func:`horovod_airflow.core.layout.content_hash`). What the files hold is
the
training program's business: it reads the manifest, fetches the files it needs with
:func:`fetch_files` (each checked against its size and sha256) and parses them itself.
Importable without torch and without Airflow (the Airflow worker stages, the ranks fetch).
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from horovod_airflow.core import storage
from horovod_airflow.core.contract import FILESET_FORMAT, LEGACY_FILESET_FORMAT
from horovod_airflow.core.layout import (
    MANIFEST_NAME,
    DatasetError,
    array_statistics,
    check_manifest,
    content_hash,
    read_staged_manifest,
    verify_file,
)

#: The file-set manifest formats this release reads (v1: staged before the data checks).
READABLE_FORMATS = (FILESET_FORMAT, LEGACY_FILESET_FORMAT)
NPY_SUFFIX = ".npy"


def check_patterns(patterns: Any) -> list[str]:
    """Validate a list of file names or glob patterns (``*.npy``); raise ValueError naming it."""
    if isinstance(patterns, str) or not isinstance(patterns, Sequence) or not patterns:
        raise ValueError(
            f"files must be a non-empty list of file names or glob patterns like ['*.npy'], "
            f"got {patterns!r}"
        )
    out = []
    for p in patterns:
        if not isinstance(p, str) or not p or "/" in p or p.startswith("."):
            raise ValueError(
                f"files entry {p!r} must be a plain file name or glob pattern (no '/', not "
                f"starting with '.'): the files of one folder are staged"
            )
        if p == MANIFEST_NAME:
            raise ValueError(f"files entry {p!r}: {MANIFEST_NAME} is written by the staging")
        out.append(p)
    return out


def matches(name: str, patterns: Sequence[str]) -> bool:
    """True when a plain file name matches one of the patterns (never the manifest itself)."""
    return name != MANIFEST_NAME and any(fnmatch.fnmatchcase(name, p) for p in patterns)


def find_files(folder: str | os.PathLike[str], patterns: Sequence[str]) -> list[Path]:
    """The files directly in ``folder`` that match ``patterns``, sorted; each pattern must match."""
    root = Path(folder)
    if not root.is_dir():
        raise DatasetError(f"dataset source {folder} is not a folder")
    names = sorted(p.name for p in root.iterdir() if p.is_file())
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        raise DatasetError(
            f"dataset source {folder}: no file matches {unmatched}; it holds {names or 'nothing'}"
        )
    return [root / n for n in names if matches(n, patterns)]


def npy_statistics(path: Path, *, labels: bool = False) -> dict[str, Any]:
    """The statistics of a ``.npy`` file (see the module's docstring). A file numpy cannot
    read without unpickling gets none (``{}``: the data checks then do not compare it), unless
    it is declared as labels: DatasetError naming it, as for labels that are not 1-D
    integers."""
    import numpy as np

    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        if labels:
            raise DatasetError(
                f"{path.name}: declared as class labels, but not a .npy array numpy reads "
                f"without pickle: {e}"
            ) from e
        return {}
    try:
        return array_statistics(array, labels=labels)
    except DatasetError as e:
        raise DatasetError(f"{path.name}: {e}") from e


def build_manifest(
    name: str, files: Sequence[Path], *, class_labels: Sequence[str] = ()
) -> dict[str, Any]:
    """The manifest of local files: name, size and sha256 of each, the statistics of each
    ``.npy`` file (with ``classes`` for those named in ``class_labels``), and the content
    hash."""
    if not name or "/" in name:
        raise DatasetError(f"dataset name must be non-empty and without '/', got {name!r}")
    if not files:
        raise DatasetError(f"dataset {name!r}: no files to stage")
    names = {p.name for p in files}
    missing = [n for n in class_labels if n not in names]
    if missing:
        raise DatasetError(
            f"dataset {name!r}: class_labels {missing} are not among its files {sorted(names)}"
        )
    entries = []
    for p in sorted(files, key=lambda p: p.name):
        entry: dict[str, Any] = {
            "name": p.name,
            "size": p.stat().st_size,
            "sha256": storage.sha256_file(p),
        }
        if p.name.endswith(NPY_SUFFIX) or p.name in class_labels:
            entry.update(npy_statistics(p, labels=p.name in class_labels))
        entries.append(entry)
    if len({e["name"] for e in entries}) != len(entries):
        raise DatasetError(f"dataset {name!r}: two files share a name")
    return {
        "format": FILESET_FORMAT,
        "name": name,
        "content_hash": content_hash(entries),
        "files": entries,
    }


def parse_manifest(text: str | bytes) -> dict[str, Any]:
    """Load and validate a file-set manifest; raise DatasetError naming the bad field."""
    return check_manifest(text, readable=READABLE_FORMATS, entry_fields=("name", "size", "sha256"))


def read_manifest(uri: str, *, client: Any | None = None) -> dict[str, Any]:
    """The validated manifest of the file set staged at ``uri``."""
    return read_staged_manifest(uri, parse=parse_manifest, what="file set", client=client)


def fetch_files(
    uri: str, dest: str | os.PathLike[str], *, client: Any | None = None
) -> tuple[dict[str, Any], dict[str, Path]]:
    """Download every file of the file set at ``uri`` into ``dest``, each verified.

    Returns the manifest and ``{file name: local path}``. A local ``uri`` is verified in
    place, not copied. Raises :class:`horovod_airflow.core.layout.DatasetIntegrityError` when a
    file's
    size or sha256 differs from its manifest entry.
    """
    manifest = read_manifest(uri, client=client)
    remote = storage.parse(uri).is_s3
    paths: dict[str, Path] = {}
    for entry in manifest["files"]:
        src = storage.join(uri, entry["name"])
        if remote:
            local = storage.download_file(src, Path(dest) / entry["name"], client=client)
        else:
            local = Path(storage.parse(src).key)
        verify_file(local, entry)
        paths[entry["name"]] = local
    return manifest, paths
