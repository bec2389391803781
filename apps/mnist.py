"""MNIST as an app of the retraining pipeline: what is MNIST's and no other model's.

Its programs are the package's built-in trainer (``python -m horovod_airflow.trainer train``
and ``export``: the CNN on MNIST-format IDX files, staged by ``StageDatasetOperator`` without
``files=``). Here is its Airflow side — the app declaration both MNIST DAGs are built from,
the test split of a staged MNIST dataset, the gate's champion scorer and the serving check.
A third model writes a module like this one of its own (see docs/bring-your-own-model.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from horovod_airflow.core import layout, storage
from horovod_airflow.operators.pipeline import ModelApp
from horovod_airflow.operators.serving import (
    SERVED_ACCURACY_TOLERANCE,
    check_served_accuracy,
    score_on_test_split,
)
from horovod_airflow.operators.staging import vendored_mnist

#: The gate re-scores a champion measured on other data with this (``ModelApp.champion_scorer``).
SCORER = "horovod_airflow.apps.mnist:score_published_model"
#: The serving DAG's check of an announced version (``ModelApp.serving_check``).
SERVING_CHECK = "horovod_airflow.apps.mnist:smoke_test_published_model"

#: Its registry name: ``models/mnist_cnn/`` in the deployment's bucket.
MODEL_NAME = "mnist_cnn"

#: MNIST as an app of the pipeline: the built-in trainer and exporter (no entrypoints), the
#: dataset the trigger form names (within the deployment's allowlist, ``HVA_DATASET_SOURCES``),
#: the training options the form offers.
MNIST = ModelApp(
    model_name=MODEL_NAME,
    dataset_name="mnist",
    dataset_source="{{ params.dataset_source }}",
    trainer_args={
        "epochs": "{{ params.epochs }}",
        "batch_size": "{{ params.batch_size }}",
        "lr": "{{ params.lr }}",
        "max_train_samples": "{{ params.max_train_samples }}",
    },
    champion_scorer=SCORER,
    serving_check=SERVING_CHECK,
)


def load_test_images(count: int, folder: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The first ``count`` MNIST test images (uint8 [N, 28, 28]) and labels of ``folder``
    (default: the vendored MNIST, :func:`~horovod_airflow.operators.staging.vendored_mnist`)."""
    files = layout.find_source_files(vendored_mnist() if folder is None else folder)
    images = layout.read_idx(files[("test", "images")])
    labels = layout.read_idx(files[("test", "labels")])
    return images[:count], labels[:count]


def load_staged_test_split(
    dataset_uri: str, workdir: Path, *, client: Any | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The whole test split of a staged MNIST dataset, each file checked against its manifest."""
    manifest = layout.read_staged_manifest(dataset_uri, client=client)
    arrays = []
    for kind in ("images", "labels"):
        entry = layout.entry_for(manifest, "test", kind)
        path = storage.download_file(
            storage.join(dataset_uri, entry["name"]), workdir / entry["name"], client=client
        )
        layout.verify_file(path, entry)
        arrays.append(layout.read_idx(path))
    return arrays[0], arrays[1]


def score_published_model(
    published: dict[str, Any], dataset_uri: str, *, client: Any | None = None
) -> dict[str, Any]:
    """MNIST's champion scorer: the accuracy of a published model on a staged MNIST-format
    dataset's whole test split."""
    return score_on_test_split(published, dataset_uri, load_staged_test_split, client=client)


def smoke_test_published_model(
    bucket_uri: str,
    model_name: str,
    *,
    client: Any | None = None,
    published: dict[str, Any] | None = None,
    tolerance: float = SERVED_ACCURACY_TOLERANCE,
) -> dict[str, Any]:
    """MNIST's serving check: the announced version serves, on the raw test images of the
    dataset it was trained on, the accuracy its training reported (within ``tolerance``),
    through the preprocessing the model declares
    (:func:`horovod_airflow.operators.serving.check_served_accuracy`)."""
    return check_served_accuracy(
        bucket_uri,
        model_name,
        load_test_split=load_staged_test_split,
        client=client,
        published=published,
        tolerance=tolerance,
    )
