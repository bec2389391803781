"""Stage a dataset into S3, content-addressed: the first task of the retraining pipeline.

Runs in the Airflow worker; needs no torch. The layout is the trainer's
(:mod:`horovod_airflow.core.layout`), so what is staged here is exactly what the ranks verify.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from horovod_airflow.core import fileset, layout, storage
from horovod_airflow.operators.data_checks import DataChecks, previous_staged, run_checks

log = logging.getLogger(__name__)

#: The real MNIST shipped with the project (CC BY-SA 3.0, see data/mnist/README.md).
VENDORED_MNIST = Path(__file__).resolve().parents[1] / "data" / "mnist"
VENDORED = "vendored"


def vendored_mnist() -> Path:
    """The vendored MNIST folder: ``$HVA_VENDORED_MNIST`` (the Airflow image sets it), else
    ``data/mnist`` of this checkout."""
    path = Path(os.environ.get("HVA_VENDORED_MNIST", VENDORED_MNIST))
    if not path.is_dir():
        raise layout.DatasetError(
            f"the vendored MNIST is not at {path}; set HVA_VENDORED_MNIST or pass a source"
        )
    return path


def _resolve_source(source: str, workdir: Path, client: Any) -> Path:
    """A local folder holding the source files; ``s3://`` sources are downloaded first."""
    if not source or source == VENDORED:
        return vendored_mnist()
    wanted = {n for stem in layout.STEMS.values() for n in (stem, stem + ".gz")}

    def pick(relative: str) -> str | None:
        name = relative.rsplit("/", 1)[-1]
        return name if name in wanted else None

    folder = _local_source(source, workdir, client, pick, "'vendored', an s3:// prefix")
    if source.startswith("s3://") and not folder.is_dir():
        raise layout.DatasetError(
            f"dataset source {source} holds none of the MNIST-format files "
            f"({', '.join(s + '[.gz]' for s in layout.STEMS.values())})"
        )
    return folder


def _local_source(
    source: str,
    workdir: Path,
    client: Any,
    pick: Callable[[str], str | None],
    allowed: str,
) -> Path:
    """``source`` as a local folder: a local path or ``file://`` URI as it is; an ``s3://``
    prefix downloaded into ``workdir/source``, each object whose name below the prefix ``pick``
    keeps, under the name it returns. Any other scheme is refused naming ``allowed``."""
    if source.startswith("s3://"):
        dest = workdir / "source"
        for uri in storage.list_uris(source, client=client):
            name = pick(uri[len(source.rstrip("/")) + 1 :])
            if name is not None:
                storage.download_file(uri, dest / name, client=client)
        return dest
    if "://" in source and not source.startswith("file://"):
        raise layout.DatasetError(f"dataset source {source!r}: use {allowed} or a local folder")
    return Path(storage.parse(source).key)


def _check_and_upload(
    manifest: dict[str, Any],
    by_name: dict[str, Path],
    bucket_uri: str,
    prefix: str,
    checks: DataChecks | None,
    parse: Callable[[bytes], dict[str, Any]],
    client: Any,
) -> tuple[dict[str, Any] | None, list[str]]:
    """Run the data checks (a refusal raises before anything is written), then upload the
    files and, last, the manifest — unless ``prefix`` already holds them all (content-addressed:
    nothing is uploaded twice). Return the checks' report (None: no checks declared) and what
    was uploaded (empty: all there already)."""
    storage.ensure_bucket(bucket_uri, client=client)
    report = None
    if checks is None:
        log.info("data checks: none declared for %s", manifest["name"])
    else:  # against the previous staged dataset of the name
        previous = previous_staged(
            bucket_uri, manifest["name"], exclude=prefix, parse=parse, client=client
        )
        report = run_checks(manifest, previous, checks, by_name, staged_uri=prefix)
    if _already_staged(prefix, manifest, client, parse):
        return report, []
    uploaded = []
    for entry in manifest["files"]:
        path = by_name[entry["name"]]
        storage.upload_file(path, storage.join(prefix, path.name), client=client)
        uploaded.append(path.name)
    storage.write_text(
        storage.join(prefix, layout.MANIFEST_NAME),
        json.dumps(manifest, indent=2, sort_keys=True),
        client=client,
    )
    return report, [*uploaded, layout.MANIFEST_NAME]


def _already_staged(
    prefix: str,
    manifest: dict[str, Any],
    client: Any,
    parse: Callable[[bytes], dict[str, Any]] = layout.parse_manifest,
) -> bool:
    """True when ``prefix`` holds this manifest and every file it lists, at the right size."""
    manifest_uri = storage.join(prefix, layout.MANIFEST_NAME)
    if not storage.exists(manifest_uri, client=client):
        return False
    try:
        staged = parse(storage.read_bytes(manifest_uri, client=client))
    except layout.DatasetError:
        return False
    if staged["content_hash"] != manifest["content_hash"]:
        return False
    sizes = {}
    loc = storage.parse(prefix)
    if loc.is_s3:
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=loc.bucket, Prefix=loc.key + "/"
        ):
            for obj in page.get("Contents", []):
                sizes[obj["Key"].rsplit("/", 1)[-1]] = obj["Size"]
    else:
        for uri in storage.list_uris(prefix):
            sizes[Path(uri).name] = Path(uri).stat().st_size
    return all(sizes.get(e["name"]) == e["size"] for e in manifest["files"])


def stage_dataset(
    source: str,
    bucket_uri: str,
    *,
    name: str = "mnist",
    client: Any | None = None,
    checks: DataChecks | None = None,
) -> dict[str, Any]:
    """Upload an MNIST-format dataset to ``<bucket_uri>/datasets/<name>/<hash16>/``.

    ``source`` is ``"vendored"`` (or empty) for the project's real MNIST, an ``s3://`` prefix,
    or a local folder. Creates the bucket if missing. Idempotent: when the content-addressed
    prefix already holds the same manifest and files, nothing is uploaded. The manifest is
    written last, so a staged prefix with a manifest is always complete.

    With ``checks``, the dataset is first compared with the previous staged dataset of the
    name (:mod:`horovod_airflow.operators.data_checks`); a change beyond them raises
    :class:`~horovod_airflow.operators.data_checks.DataCheckError` and uploads nothing.

    Returns ``{"uri", "name", "content_hash", "splits", "uploaded", "checks"}`` (uploaded:
    file names; checks: the checks' report, None without checks).
    """
    client = client if client is not None else storage.s3_client()
    with tempfile.TemporaryDirectory(prefix="hva-stage-") as tmp:
        folder = _resolve_source(source, Path(tmp), client)
        files = layout.find_source_files(folder)
        manifest = layout.build_manifest(name, files)
        prefix = layout.staged_prefix(bucket_uri, manifest)
        by_name = {p.name: p for p in files.values()}
        report, uploaded = _check_and_upload(
            manifest, by_name, bucket_uri, prefix, checks, layout.parse_manifest, client
        )
        log.info("dataset %s (%s) at %s: uploaded %s", name, manifest["splits"], prefix, uploaded)
    return {
        "uri": prefix,
        "name": name,
        "content_hash": manifest["content_hash"],
        "splits": manifest["splits"],
        "uploaded": uploaded,
        "checks": report,
    }


def _resolve_files_source(source: str, patterns: Sequence[str], workdir: Path, client: Any) -> Path:
    """A local folder holding the files that match ``patterns``; ``s3://`` is downloaded first."""
    if not source or source == VENDORED:
        raise layout.DatasetError(
            f"dataset source {source!r}: 'vendored' is the bundled MNIST; staging files needs "
            "an s3:// prefix or a local folder"
        )

    def pick(relative: str) -> str | None:
        return relative if "/" not in relative and fileset.matches(relative, patterns) else None

    folder = _local_source(source, workdir, client, pick, "an s3:// prefix")
    if source.startswith("s3://"):
        folder.mkdir(parents=True, exist_ok=True)  # none matched: the file set says so later
    return folder


def stage_files(
    source: str,
    bucket_uri: str,
    *,
    name: str,
    patterns: Sequence[str],
    client: Any | None = None,
    checks: DataChecks | None = None,
) -> dict[str, Any]:
    """Upload any files to ``<bucket_uri>/datasets/<name>/<hash16>/`` with a file-set manifest.

    The files are those directly in ``source`` (an ``s3://`` prefix or a local folder) whose
    names match ``patterns`` (file names or glob patterns, e.g. ``["*.npy"]``); each pattern
    must match at least one file. The manifest (:mod:`horovod_airflow.core.fileset`, written
    last) records
    each file's size and sha256 and the content hash that names the prefix. Idempotent, like
    :func:`stage_dataset`: an already staged file set uploads nothing. With ``checks``, the
    file set is first compared with the previous one of the name, as in :func:`stage_dataset`
    (its ``.npy`` files' samples, shapes, dtypes and duplicates; the classes of
    ``checks.class_labels``; ``checks.check``).

    Returns ``{"uri", "name", "content_hash", "files", "uploaded", "checks"}`` (files: the
    staged names).
    """
    patterns = fileset.check_patterns(patterns)
    client = client if client is not None else storage.s3_client()
    with tempfile.TemporaryDirectory(prefix="hva-stage-") as tmp:
        folder = _resolve_files_source(source, patterns, Path(tmp), client)
        files = fileset.find_files(folder, patterns)
        labels = checks.class_labels if checks is not None else ()
        manifest = fileset.build_manifest(name, files, class_labels=labels)
        prefix = layout.staged_prefix(bucket_uri, manifest)
        by_name = {p.name: p for p in files}
        report, uploaded = _check_and_upload(
            manifest, by_name, bucket_uri, prefix, checks, fileset.parse_manifest, client
        )
        log.info("file set %s at %s: uploaded %s", name, prefix, uploaded)
    return {
        "uri": prefix,
        "name": name,
        "content_hash": manifest["content_hash"],
        "files": [e["name"] for e in manifest["files"]],
        "uploaded": uploaded,
        "checks": report,
    }
