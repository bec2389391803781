"""The example's names and programs, read by its DAGs (torch-free, imported at DAG parse time):
``WAVEFORMS``, the model as an app of the retraining pipeline.

The bucket is the project's (``HVA_BUCKET``, :mod:`horovod_airflow.operators.settings`): the
example publishes
``models/waveform_cnn/`` next to ``models/mnist_cnn/`` without touching it.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from horovod_airflow.operators.pipeline import ModelApp
from horovod_airflow.operators.settings import DATA_CHECKS as DEPLOYMENT_DATA_CHECKS

#: The shipped dataset folder (``python -m examples.waveforms.data --out DIR`` rewrites it).
DATASET_DIR = Path(__file__).resolve().parent / "dataset"
#: DATASET_DIR as the StageDatasetOperator ``source`` (a local folder on the Airflow worker).
DATASET_SOURCE = str(DATASET_DIR)
DATASET_NAME = "waveforms"
#: The files of DATASET_DIR that are staged (StageDatasetOperator ``files=``).
DATASET_FILES = ["*.npy"]
#: The staging's data checks: the deployment's thresholds (HVA_DATA_*), the label files whose
#: class balance is compared, and the example's own check (every split loads, all finite).
DATA_CHECKS = replace(
    DEPLOYMENT_DATA_CHECKS,
    class_labels=("train_labels.npy", "test_labels.npy"),
    check="examples.waveforms.data:check_dataset",
)
MODEL_NAME = "waveform_cnn"
#: The example's programs, run by HorovodTrainOperator / HorovodExportOperator (``entrypoint=``).
TRAIN_ENTRYPOINT = ("python", "-m", "examples.waveforms.train")
EXPORT_ENTRYPOINT = ("python", "-m", "examples.waveforms.export")
#: Re-scores a champion on another dataset for the gate (ModelGateOperator ``champion_scorer=``).
CHAMPION_SCORER = "examples.waveforms.serving:score_published_model"
#: What waveforms_serve_latest_model runs on an announced version (its form's params as keywords).
SERVING_CHECK = "examples.waveforms.serving:serving_check"
#: The image train and export run in with the docker and kubernetes launchers: this folder's
#: ``Dockerfile``, built ``FROM`` the project's trainer image (``HVA_WAVEFORMS_IMAGE``).
IMAGE = os.environ.get("HVA_WAVEFORMS_IMAGE", "horovod-airflow/waveforms:latest")

#: The model as an app of the retraining pipeline (horovod_airflow.operators.pipeline).
WAVEFORMS = ModelApp(
    model_name=MODEL_NAME,
    dataset_name=DATASET_NAME,
    dataset_source=DATASET_SOURCE,
    dataset_files=DATASET_FILES,
    train_entrypoint=TRAIN_ENTRYPOINT,
    export_entrypoint=EXPORT_ENTRYPOINT,
    trainer_args={"epochs": "{{ params.epochs }}"},
    champion_scorer=CHAMPION_SCORER,
    data_checks=DATA_CHECKS,
    serving_check=SERVING_CHECK,
    image=IMAGE,
)
#: The serving pointer publish writes last, and its Asset (waveforms_serve_latest_model's schedule).
LATEST_MODEL_URI = WAVEFORMS.latest_uri
LATEST_MODEL_ASSET_NAME = WAVEFORMS.latest_asset.name
