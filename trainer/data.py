"""Bring a staged dataset onto this node once, verify it, and load it as normalized tensors.

``fetch_dataset`` runs on one process per node (local rank 0; the others wait — see
``horovod_airflow.trainer.train``): it reads ``manifest.json`` at the dataset URI, downloads each
file into a
per-node cache ``<cache>/datasets/<content_hash16>/`` (skipped when a cached copy already
verifies), checks size and sha256 against the manifest (``DatasetIntegrityError`` otherwise)
and decompresses ``.gz`` files next to them. A local ``--data`` folder is verified in place.

``load_split`` reads the IDX files with torchvision's MNIST reader (a small numpy reader when
torchvision is absent) into one float32 tensor ``[N, 1, 28, 28]`` normalized like the model
expects, plus int64 labels: training then slices batches out of memory, no per-sample work.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from horovod_airflow.core import layout, storage
from horovod_airflow.core.layout import DatasetError, DatasetIntegrityError

if TYPE_CHECKING:
    import torch

CACHE_ENV = "HVA_CACHE_DIR"


def default_cache_root(cache_dir: str = "") -> Path:
    """``--cache-dir``, else ``$HVA_CACHE_DIR``, else ``~/.cache/horovod-airflow``."""
    root = cache_dir or os.environ.get(CACHE_ENV) or "~/.cache/horovod-airflow"
    return Path(root).expanduser()


@dataclass(frozen=True)
class LocalDataset:
    """A verified dataset on this node: the manifest and the plain IDX file of each split/kind."""

    uri: str
    manifest: dict[str, Any]
    files: dict[tuple[str, str], Path]  # (split, kind) -> decompressed IDX file

    @property
    def content_hash(self) -> str:
        return str(self.manifest["content_hash"])


def read_manifest(uri: str) -> dict[str, Any]:
    """The validated dataset manifest staged at ``uri`` (``--data``)."""
    return layout.read_staged_manifest(uri)


def _decompress(src: Path, dest: Path) -> None:
    """Write the gunzipped ``src`` at ``dest`` atomically."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out, gzip.open(src, "rb") as f:
            shutil.copyfileobj(f, out, storage.CHUNK)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _plain_size(entry: dict[str, Any]) -> int:
    """Bytes of the decompressed IDX file the manifest describes (header + ubyte body)."""
    shape = entry.get("shape") or [entry["samples"]]
    body = 1
    for d in shape:
        body *= int(d)
    return 4 + 4 * len(shape) + body


def fetch_dataset(uri: str, cache_dir: str = "") -> LocalDataset:
    """Download (if remote), verify and decompress the staged dataset; return local paths.

    Call on one process per node; ``dataset_paths`` gives the others the same answer without
    touching the network.
    """
    manifest = read_manifest(uri)
    cache = default_cache_root(cache_dir) / "datasets" / manifest["content_hash"][:16]
    cache.mkdir(parents=True, exist_ok=True)
    remote = storage.parse(uri).is_s3
    files: dict[tuple[str, str], Path] = {}
    for split, kind in layout.STEMS:
        entry = layout.entry_for(manifest, split, kind)
        if remote:
            local = cache / entry["name"]
            try:
                layout.verify_file(local, entry)  # a verified copy from an earlier run
            except DatasetIntegrityError:
                storage.download_file(storage.join(uri, entry["name"]), local)
                try:
                    layout.verify_file(local, entry)
                except DatasetIntegrityError as e:
                    local.unlink(missing_ok=True)
                    raise DatasetIntegrityError(f"{uri}: {e}") from None
        else:
            local = Path(storage.parse(storage.join(uri, entry["name"])).key)
            try:
                layout.verify_file(local, entry)
            except DatasetIntegrityError as e:
                raise DatasetIntegrityError(f"{uri}: {e}") from None
        if entry["name"].endswith(".gz"):
            plain = cache / entry["name"][: -len(".gz")]
            if not plain.is_file() or plain.stat().st_size != _plain_size(entry):
                _decompress(local, plain)
            local = plain
        files[(split, kind)] = local
    (cache / layout.MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
    return LocalDataset(uri=uri, manifest=manifest, files=files)


def dataset_paths(uri: str, manifest: dict[str, Any], cache_dir: str = "") -> LocalDataset:
    """The paths ``fetch_dataset`` produced on this node (for the ranks that waited)."""
    cache = default_cache_root(cache_dir) / "datasets" / manifest["content_hash"][:16]
    remote = storage.parse(uri).is_s3
    files = {}
    for split, kind in layout.STEMS:
        name = layout.entry_for(manifest, split, kind)["name"]
        if name.endswith(".gz"):
            files[(split, kind)] = cache / name[: -len(".gz")]
        elif remote:
            files[(split, kind)] = cache / name
        else:
            files[(split, kind)] = Path(storage.parse(storage.join(uri, name)).key)
    return LocalDataset(uri=uri, manifest=manifest, files=files)


def _read_idx(path: Path) -> torch.Tensor:
    import torch

    try:
        from torchvision.datasets.mnist import read_sn3_pascalvincent_tensor

        return read_sn3_pascalvincent_tensor(str(path), strict=True)
    except ImportError:
        return torch.from_numpy(layout.read_idx(path).copy())


def load_raw_split(dataset: LocalDataset, split: str, limit: int = 0) -> tuple[Any, Any]:
    """The split as stored: uint8 images [N, H, W] and labels [N] (numpy); first ``limit``.
    What serving reads, before the preprocessing a model declares."""
    images = layout.read_idx(dataset.files[(split, "images")])
    labels = layout.read_idx(dataset.files[(split, "labels")])
    if limit:
        images, labels = images[:limit], labels[:limit]
    return images, labels


def load_split(
    dataset: LocalDataset, split: str, limit: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images as float32 [N, 1, 28, 28] (normalized) and labels as int64 [N]; first ``limit``."""
    from horovod_airflow.trainer.model import NORMALIZE_MEAN, NORMALIZE_STD

    try:
        images = _read_idx(dataset.files[(split, "images")])
        labels = _read_idx(dataset.files[(split, "labels")])
    except (AssertionError, RuntimeError, ValueError) as e:
        raise DatasetError(f"{dataset.uri}: cannot read the {split} split: {e}") from e
    if images.dim() != 3 or labels.dim() != 1 or images.shape[0] != labels.shape[0]:
        raise DatasetError(
            f"{dataset.uri}: {split} split has images {tuple(images.shape)} and labels "
            f"{tuple(labels.shape)}; expected [N, H, W] and [N]"
        )
    if limit:
        images, labels = images[:limit], labels[:limit]
    x = images.unsqueeze(1).float().div_(255.0).sub_(NORMALIZE_MEAN).div_(NORMALIZE_STD)
    return x, labels.long()
