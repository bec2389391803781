"""The serving side's view of a published model: fetch, verify, predict (onnxruntime, no torch).

Model-agnostic: a model's own data format comes in as its test-split loader (MNIST's is in
:mod:`horovod_airflow.apps.mnist`, the example's in ``examples/waveforms/serving.py``). Also
used by the gate to re-score the champion on a challenger's dataset, so that the two
accuracies it compares were measured on the same data.

The input normalization is never a constant here: the model carries it (the ONNX metadata
property ``horovod_airflow.core.contract.PREPROCESSING_KEY``), the version manifest records the
same
document, and a model without it is refused
(:class:`horovod_airflow.core.contract.ContractError`).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from horovod_airflow.core import contract, storage
from horovod_airflow.core.contract import (
    LATEST_NAME,
    ONNX_NAME,
    VERSION_MANIFEST,
    VERSION_MANIFEST_NAME,
)
from horovod_airflow.operators.model_registry import check_version, models_prefix, read_champion

log = logging.getLogger(__name__)

_BATCH = 1000


class ModelIntegrityError(RuntimeError):
    """A published file does not match the sha256 its version manifest records, or a record
    names a model outside the registry."""


def in_registry(
    bucket_uri: str, model_name: str, claimed: dict[str, Any], source: str
) -> dict[str, Any]:
    """``claimed`` (an Asset event's ``extra``, or ``latest.json``) with every location taken
    from the registry, not from the claim: version ``v`` of ``model_name`` lives at
    ``<bucket_uri>/models/<model_name>/<v>/`` (its ``manifest.json`` and ``model.onnx`` there).

    Whoever can post an Asset event or write a record must not choose what serving loads: a
    claim that names another model, a version name that is not one, or a ``uri`` /
    ``manifest_uri`` / ``onnx_uri`` elsewhere (another bucket, a worker-local path) raises
    :class:`ModelIntegrityError` naming it. The sha256 check against the registry's manifest
    follows in :func:`open_published_model`.
    """
    version = claimed.get("version")
    try:
        check_version(version)
    except ValueError as e:
        raise ModelIntegrityError(f"the {source} names no valid version: {e}") from e
    if claimed.get("model") not in (None, model_name):
        raise ModelIntegrityError(
            f"the {source} names model {claimed.get('model')!r}, this registry serves "
            f"{model_name!r} ({models_prefix(bucket_uri, model_name)})"
        )
    prefix = storage.join(models_prefix(bucket_uri, model_name), str(version))
    where = {
        "uri": prefix,
        "manifest_uri": storage.join(prefix, VERSION_MANIFEST_NAME),
        "onnx_uri": storage.join(prefix, ONNX_NAME),
    }
    for key, want in where.items():
        got = claimed.get(key)
        if got is not None and _location(got) != _location(want):
            raise ModelIntegrityError(
                f"the {source} names {key} {got!r}, but version {version} of {model_name} is "
                f"published at {want!r}: refusing to load a model from outside the registry"
            )
    return {**claimed, **where}


def _location(uri: Any) -> str:
    try:
        return str(storage.parse(str(uri)))
    except ValueError:
        return f"<not a location: {uri!r}>"


def open_published_model(
    published: dict[str, Any], workdir: Path, *, client: Any | None = None
) -> Any:
    """An onnxruntime session of a published model, after checking its sha256.

    ``published`` is a ``latest.json`` document or the ``extra`` of its Asset event (both
    name ``manifest_uri``, ``onnx_uri`` and ``onnx_sha256``). The downloaded file must match
    the version manifest and, when given, the document's own ``onnx_sha256``; the model must
    carry its preprocessing (:func:`model_preprocessing`), equal to the one the manifest
    records.
    """
    import onnxruntime as ort

    manifest_uri = published["manifest_uri"]
    manifest = VERSION_MANIFEST.loads(storage.read_text(manifest_uri, client=client), manifest_uri)
    expected = manifest["files"][ONNX_NAME]["sha256"]
    path = storage.download_file(published["onnx_uri"], workdir / ONNX_NAME, client=client)
    actual = storage.sha256_file(path)
    claimed = published.get("onnx_sha256", expected)
    if actual != expected or claimed != expected:
        raise ModelIntegrityError(
            f"{published['onnx_uri']}: sha256 {actual}, manifest {published['manifest_uri']} "
            f"says {expected}, the published record says {claimed}"
        )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    carried = model_preprocessing(session, published["onnx_uri"])
    recorded = manifest.get("preprocessing")
    if recorded is not None and recorded != carried:
        raise ModelIntegrityError(
            f"{published['onnx_uri']} carries preprocessing {carried}, but {manifest_uri} "
            f"records {recorded}"
        )
    return session


def model_preprocessing(session: Any, source: str) -> dict[str, Any]:
    """The preprocessing an onnxruntime session's model carries; ContractError if none."""
    meta = dict(session.get_modelmeta().custom_metadata_map)
    return contract.preprocessing_from_metadata(meta, source)


def predict(session: Any, raw: np.ndarray) -> np.ndarray:
    """Predicted class indices of raw samples (e.g. uint8 images), preprocessed as the model says.

    Raises :class:`horovod_airflow.core.contract.ContractError` when the model carries no
    preprocessing.
    """
    pre = model_preprocessing(session, "the served model")
    out = []
    for start in range(0, len(raw), _BATCH):
        x = contract.apply_preprocessing(pre, raw[start : start + _BATCH])
        logits = session.run([pre["output_name"]], {pre["input_name"]: x})[0]
        out.append(logits.argmax(axis=1))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def score_on_test_split(
    published: dict[str, Any],
    dataset_uri: str,
    load_test_split: Callable[..., tuple[np.ndarray, np.ndarray]],
    *,
    client: Any | None = None,
) -> dict[str, Any]:
    """Accuracy of a published model on the test split of a staged dataset, whatever the
    model: ``load_test_split(dataset_uri, workdir, client=client)`` returns the raw inputs
    and labels (its own data format); the model's recorded preprocessing prepares them
    (:func:`predict`). A model's ``champion_scorer`` is this with its loader."""
    with tempfile.TemporaryDirectory(prefix="hva-score-") as tmp:
        session = open_published_model(published, Path(tmp), client=client)
        raw, labels = load_test_split(dataset_uri, Path(tmp), client=client)
    correct = int((predict(session, raw) == labels).sum())
    result = {
        "version": published.get("version"),
        "dataset_uri": dataset_uri,
        "accuracy": correct / len(labels),
        "correct": correct,
        "samples": len(labels),
    }
    log.info("re-scored %s on %s: %s", published.get("version"), dataset_uri, result)
    return result


def published_from_events(events: Any, asset: Any) -> dict[str, Any] | None:
    """The ``extra`` of the newest triggering event of ``asset`` that names a model, or None.

    ``events`` is the task context's ``triggering_asset_events``; a manual run has none.
    An event without ``onnx_uri`` (emitted by hand, or by an older publish) is skipped.
    """
    try:
        candidates = list(events[asset]) if events else []
    except KeyError:
        candidates = []
    candidates.sort(key=lambda e: str(getattr(e, "timestamp", "")))
    for event in reversed(candidates):
        extra = dict(getattr(event, "extra", None) or {})
        if extra.get("onnx_uri") and extra.get("manifest_uri") and extra.get("version"):
            return extra
    return None


def published_or_latest(
    bucket_uri: str,
    model_name: str,
    published: dict[str, Any] | None,
    *,
    client: Any | None = None,
) -> tuple[dict[str, Any], str]:
    """(the published model a serving run checks, where it was named): the version that
    ``published`` (the triggering Asset event's ``extra``) names, else the one ``latest.json``
    names now (a manual run), its locations from the registry (:func:`in_registry`); no
    ``latest.json`` raises FileNotFoundError."""
    if published is not None:
        return in_registry(bucket_uri, model_name, published, "asset event"), "asset event"
    champion = read_champion(bucket_uri, model_name, client=client)
    if champion is None:
        raise FileNotFoundError(f"no published {model_name} in {bucket_uri} (no latest.json)")
    return in_registry(bucket_uri, model_name, champion, LATEST_NAME), LATEST_NAME


#: How far the accuracy a published model serves may be from what its training reported on the
#: same test samples: 0.2 points (ONNX and PyTorch round differently; a model that serves
#: differently from how it was measured is not the model that passed the gate).
SERVED_ACCURACY_TOLERANCE = 0.002


class ServingCheckError(RuntimeError):
    """The published model does not serve what its training reported."""


def check_served_accuracy(
    bucket_uri: str,
    model_name: str,
    *,
    load_test_split: Callable[..., tuple[np.ndarray, np.ndarray]],
    client: Any | None = None,
    published: dict[str, Any] | None = None,
    tolerance: float = SERVED_ACCURACY_TOLERANCE,
) -> dict[str, Any]:
    """Check that a published model serves what its training reported, whatever the model.

    ``published`` names the version (the ``extra`` of the Asset event that triggered the
    serving run); None: the version ``latest.json`` names now (a manual run). The model is
    read from the registry and checked against its manifest's sha256
    (:func:`open_published_model`); then it predicts the raw test samples of the dataset its
    manifest records — ``load_test_split(dataset_uri, workdir, client=client)``, the model's
    own data format — (the first ``val_samples``, the ones the training evaluated), prepared
    only by the preprocessing the model itself declares (:func:`predict`). That accuracy
    must equal the training's reported ``val_accuracy`` within ``tolerance`` (a fraction),
    or :class:`ServingCheckError` says both numbers.
    """
    published, source = published_or_latest(bucket_uri, model_name, published, client=client)
    manifest_uri = published["manifest_uri"]
    manifest = VERSION_MANIFEST.loads(storage.read_text(manifest_uri, client=client), manifest_uri)
    recorded = manifest["metrics"].get("val_accuracy")
    samples = manifest["metrics"].get("val_samples")
    dataset_uri = manifest["dataset"].get("uri")
    if recorded is None or not dataset_uri:
        raise ServingCheckError(
            f"{manifest_uri} records no val_accuracy or no dataset: the served accuracy cannot "
            "be checked against the training's"
        )
    with tempfile.TemporaryDirectory(prefix="hva-serve-") as tmp:
        session = open_published_model(published, Path(tmp), client=client)
        actual = storage.sha256_file(Path(tmp) / ONNX_NAME)
        raw, labels = load_test_split(dataset_uri, Path(tmp), client=client)
    if samples:
        raw, labels = raw[:samples], labels[:samples]
    predictions = predict(session, raw)
    correct = int((predictions == labels).sum())
    served = correct / len(labels)
    log.info(
        "%s %s (from the %s) serves %.4f (%d/%d) on %s through its own preprocessing; its "
        "training reported %.4f",
        model_name,
        published["version"],
        source,
        served,
        correct,
        len(labels),
        dataset_uri,
        recorded,
    )
    if abs(served - float(recorded)) > tolerance:
        raise ServingCheckError(
            f"{model_name} {published['version']} serves accuracy {served:.4f} ({correct}/"
            f"{len(labels)}) on the test split of {dataset_uri}, prepared by its own declared "
            f"preprocessing, but its training reported {float(recorded):.4f} on the same samples "
            f"(tolerance {tolerance}): it does not serve the model that passed the gate"
        )
    return {
        "version": published["version"],
        "source": source,
        "onnx_sha256": actual,
        "dataset_uri": dataset_uri,
        "samples": len(labels),
        "correct": correct,
        "served_accuracy": served,
        "reported_accuracy": float(recorded),
    }
