"""A staged file set: any files, content-addressed, for datasets that are not MNIST-format.

``StageDatasetOperator(files=[...])`` stages the files of a source folder that match the given
names or glob patterns, plus a ``manifest.json``::

    {
      "format": "horovod-airflow/fileset-v1",
      "name": "waveforms",
      "content_hash": "<sha256 over the sorted (file name, sha256) pairs>",
      "files": [{"name": "train_signals.npy", "size": 614528, "sha256": "..."}, ...]
    }

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
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from horovod_airflow.core import storage
from horovod_airflow.core.contract import FILESET_FORMAT
from horovod_airflow.core.layout import MANIFEST_NAME, DatasetError, content_hash, verify_file


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


def build_manifest(name: str, files: Sequence[Path]) -> dict[str, Any]:
    """The manifest of local files: name, size and sha256 of each, and the content hash."""
    if not name or "/" in name:
        raise DatasetError(f"dataset name must be non-empty and without '/', got {name!r}")
    if not files:
        raise DatasetError(f"dataset {name!r}: no files to stage")
    entries = [
        {"name": p.name, "size": p.stat().st_size, "sha256": storage.sha256_file(p)}
        for p in sorted(files, key=lambda p: p.name)
    ]
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
    try:
        m = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{MANIFEST_NAME} is not valid JSON: {e}") from e
    if not isinstance(m, dict) or m.get("format") != FILESET_FORMAT:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise DatasetError(f"{MANIFEST_NAME}: 'format' must be {FILESET_FORMAT!r}, got {got!r}")
    files = m.get("files")
    if not isinstance(files, list) or not files:
        raise DatasetError(f"{MANIFEST_NAME}: 'files' must be a non-empty list")
    for entry in files:
        if not isinstance(entry, dict):
            raise DatasetError(f"{MANIFEST_NAME}: file entry {entry!r} is not an object")
        for field in ("name", "size", "sha256"):
            if field not in entry:
                raise DatasetError(
                    f"{MANIFEST_NAME}: file entry {entry.get('name')!r} lacks {field!r}"
                )
        if "/" in entry["name"] or entry["name"].startswith("."):
            raise DatasetError(f"{MANIFEST_NAME}: file name {entry['name']!r} must be a plain name")
    if content_hash(files) != m.get("content_hash"):
        raise DatasetError(f"{MANIFEST_NAME}: 'content_hash' does not match its file entries")
    return m


def read_manifest(uri: str, *, client: Any | None = None) -> dict[str, Any]:
    """The validated manifest of the file set staged at ``uri``."""
    try:
        text = storage.read_bytes(storage.join(uri, MANIFEST_NAME), client=client)
    except storage.TransientStorageError:
        raise  # not a verdict on the data: the task fails and is retried
    except storage.StorageError as e:
        raise DatasetError(
            f"no {MANIFEST_NAME} at {uri}: the data must be a staged file set "
            f"(s3://bucket/datasets/<name>/<hash16> or a folder with {MANIFEST_NAME}): {e}"
        ) from e
    return parse_manifest(text)


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
