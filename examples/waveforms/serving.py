"""The example's serving side (onnxruntime and numpy, no torch): predict, score, check.

The exported model says how to prepare its input and names its classes, in the contract's
preprocessing document in its ONNX metadata, so serving needs nothing but the ONNX file and
keeps no constant of its own: fetching and verifying a published model
(:func:`horovod_airflow.operators.serving.open_published_model`: sha256 against the version
manifest, the
carried preprocessing equal to the manifest's) and predicting raw signals ``[N, length]``
(:func:`horovod_airflow.operators.serving.predict`) are the project's, the same as for MNIST.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from examples.waveforms.data import SERVING_SEED, generate, load_split
from horovod_airflow.core import fileset, storage
from horovod_airflow.core.contract import ONNX_NAME
from horovod_airflow.operators.serving import (
    model_preprocessing,
    open_published_model,
    predict,
    published_or_latest,
    score_on_test_split,
)

log = logging.getLogger(__name__)


class ServingCheckError(RuntimeError):
    """A published model failed the serving check (accuracy below the floor)."""


def score_published_model(
    published: dict[str, Any], dataset_uri: str, *, client: Any | None = None
) -> dict[str, Any]:
    """Accuracy of a published waveform model on the test split of a staged file set.

    The gate's ``champion_scorer`` for this model (``examples.waveforms.serving:
    score_published_model``): same signature and result as
    :func:`horovod_airflow.apps.mnist.score_published_model`. A model or data it cannot read
    raises
    ValueError (``horovod_airflow.core.contract.ContractError``,
    ``horovod_airflow.core.layout.DatasetError``), which
    the gate reports as its reason to refuse.
    """
    return score_on_test_split(published, dataset_uri, load_staged_test_split, client=client)


def load_staged_test_split(
    dataset_uri: str, workdir: Path, *, client: Any | None = None
) -> tuple[Any, Any]:
    """The raw test signals and labels of a staged waveform file set (each file's sha256
    checked against its manifest)."""
    _, paths = fileset.fetch_files(dataset_uri, workdir / "data", client=client)
    return load_split(paths, "test")


def serving_check(
    bucket_uri: str,
    model_name: str,
    *,
    client: Any | None = None,
    published: dict[str, Any] | None = None,
    sample_count: int = 64,
    min_accuracy: float = 0.5,
) -> dict[str, Any]:
    """Fetch a published model (sha256-checked), predict fresh waveforms, check the accuracy.

    The samples are drawn anew (``SERVING_SEED``: not in the staged data). ``published``:
    the triggering Asset event's ``extra``; None: what ``latest.json`` names now. Raises
    :class:`ServingCheckError` when fewer than ``min_accuracy`` of them are right. The serving
    DAG passes its form's values (JSON numbers) as ``sample_count`` and ``min_accuracy``.
    """
    sample_count, min_accuracy = int(sample_count), float(min_accuracy)
    published, source = published_or_latest(bucket_uri, model_name, published, client=client)
    with tempfile.TemporaryDirectory(prefix="hva-wf-serve-") as tmp:
        session = open_published_model(published, Path(tmp), client=client)
        onnx_sha256 = storage.sha256_file(Path(tmp) / ONNX_NAME)
    classes = model_preprocessing(session, published["onnx_uri"])["labels"]
    signals, labels = generate(sample_count, SERVING_SEED)
    predictions = predict(session, signals)
    accuracy = float((predictions == labels).mean())
    result = {
        "version": published["version"],
        "source": source,
        "onnx_sha256": onnx_sha256,
        "predictions": [classes[i] for i in predictions.tolist()],
        "labels": [classes[i] for i in labels.tolist()],
        "accuracy": accuracy,
        "samples": sample_count,
    }
    log.info("%s %s (from the %s): accuracy %.4f on %d fresh waveforms",
             model_name, published["version"], source, accuracy, sample_count)  # fmt: skip
    if accuracy < min_accuracy:
        raise ServingCheckError(
            f"{model_name} {published['version']}: accuracy {accuracy:.4f} on {sample_count} "
            f"fresh waveforms is below min_accuracy {min_accuracy}"
        )
    return result
