"""The two forms of the vendored MNIST that the benchmarks feed: the demo's and ours.

Runs in the benchmark driver, before any rank starts (so that no two ranks write the same
files).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.report import MNIST_DIR
from horovod_airflow.core import layout


def prepare_torchvision_root(dest: Path, source: Path = MNIST_DIR) -> Path:
    """Lay out ``dest/MNIST/raw/`` from the vendored ``.gz`` files, as torchvision expects.

    The vendored files are re-gzipped (their ``.gz`` md5 differs from torchvision's list), so
    ``download=True`` would try the network; torchvision's ``extract_archive`` decompresses
    them exactly as its downloader would have.
    """
    from torchvision.datasets.utils import extract_archive

    raw = dest / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name in layout.STEMS.values():
        gz = source / f"{name}.gz"
        if not gz.is_file():
            raise FileNotFoundError(f"{gz} is missing; the demo needs the four MNIST .gz files")
        if not (raw / name).is_file():
            extract_archive(str(gz), str(raw))
    return dest


def stage_local_dataset(dest: Path, source: Path = MNIST_DIR) -> Path:
    """A staged dataset folder (``--data`` for our trainer): the ``.gz`` files + manifest.json.

    The files are symlinked, not copied; the manifest is the one
    ``horovod_airflow.operators.staging.stage_dataset`` would upload
    (``horovod_airflow.core.layout.build_manifest``), so
    the trainer verifies them as usual.
    """
    dest.mkdir(parents=True, exist_ok=True)
    files = layout.find_source_files(source)
    for path in files.values():
        link = dest / path.name
        if not link.exists():
            os.symlink(path.resolve(), link)
    manifest = layout.build_manifest("mnist", files)
    (dest / layout.MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
    return dest
