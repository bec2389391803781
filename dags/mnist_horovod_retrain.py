"""
### Retrain the MNIST CNN with Horovod, gate it, export it to ONNX and publish it for serving

`stage_dataset` → `train` → `gate` → `export_onnx` → `publish` (or, after a refusal,
`record_refused`)

1. **stage_dataset** (`StageDatasetOperator`) uploads the dataset (default: the vendored
   real MNIST) to `s3://<bucket>/datasets/mnist/<content-hash>/` with a `manifest.json`.
   Content-addressed: an unchanged dataset uploads nothing. First its data checks compare it
   with the previous staged dataset (samples per split, class balance, shapes, duplicates;
   the `HVA_DATA_*` thresholds): a dataset beyond them fails this task, uploads nothing, and
   nothing trains.
2. **train** (`HorovodTrainOperator`) runs `horovodrun -np <num_proc> python -m
horovod_airflow.trainer
   train` through the chosen launcher (local subprocess, Docker container, or Kubeflow
   MPIJob). Artifacts go to the run-scoped prefix `s3://<bucket>/runs/<dag_id>/<run_key>/`
   (the run id plus a hash of it: distinct runs never share one); the returned metrics are
   the validation accuracy and loss **allreduced over all ranks** on the whole validation set.
3. **gate** (`ModelGateOperator`) passes only if that accuracy is at least `min_accuracy`
   and not worse than the published model's by more than `max_regression`, both measured on
   the same data: a champion measured on another dataset is re-scored on this run's test
   split (onnxruntime), or the gate refuses and says why. A failing gate skips publish and
   leaves the run's artifacts (and its `gate.json`) for inspection.
4. **export_onnx** (`HorovodExportOperator`) exports the rank-0 checkpoint to one ONNX file
   and checks onnxruntime against PyTorch (same launcher, so Airflow workers need no torch);
   it runs after a refusal too, for `record_refused`.
5. **publish** (`PublishModelOperator`) copies the model, checkpoint, metrics, parity
   report, training curves and a summary to `s3://<bucket>/models/mnist_cnn/<version>/` with
   a sha256 `manifest.json`, then updates `latest.json` — last, so readers never see a
   half-published model. The version is named by the run, so a retry finds its own version
   and publishes nothing twice; `latest.json` is written only if it is still the one the
   gate compared against (a conditional put), else the publish fails without overwriting.
   It emits the `latest.json` Asset with the version, ONNX URI, sha256, accuracy and dataset
   hash as the event's `extra`, which schedules serving-side DAGs.
6. **record_refused** (`RecordRefusedOperator`) runs only after a refusal (it skips itself
   after a pass): it keeps the exported model as a *refused candidate* under
   `s3://<bucket>/models/mnist_cnn/refused/<version>/`, never named by `latest.json`, which an
   admin may promote from the registry page with an override reason (recorded).

Alerts: a failed task, and a refused gate, mail `HVA_ALERT_EMAILS` through the SMTP
connection `HVA_SMTP_CONN_ID`; a refusing gate fails (and so alerts) once
`HVA_STALE_AFTER_RUNS` runs in a row were refused or nothing was published for
`HVA_STALE_AFTER_DAYS` days; a run still going `HVA_RUN_DEADLINE_MINUTES` after it was queued
mails them too (an Airflow deadline alert).

Configuration: the AWS connection `aws_default` (endpoint and credentials; MinIO or AWS) and
the `HVA_*` environment variables of `operators/settings.py` (bucket, default launcher and
ranks, trainer image, GPUs per rank, Docker network); train and export share its
`TRAINER_JOB` settings (connection, image, GPUs, launcher options). The six tasks are the
pipeline's (`horovod_airflow.operators.pipeline.retraining_pipeline`), the same for every
model; MNIST's part is its app (`horovod_airflow.apps.mnist.MNIST`), this file the trigger form.
"""

from __future__ import annotations

from datetime import UTC, datetime

from airflow.sdk import Param, dag

from horovod_airflow.apps.mnist import MNIST
from horovod_airflow.operators import trainer_param_schema
from horovod_airflow.operators.pipeline import (
    retraining_dag_args,
    retraining_params,
    retraining_pipeline,
)
from horovod_airflow.operators.settings import DATASET_SOURCE_PATTERN


@dag(
    dag_id="mnist_horovod_retrain",
    doc_md=__doc__,
    schedule="@weekly",
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    tags=["horovod", "training", "mnist"],
    params=retraining_params(
        min_accuracy=0.98,
        max_regression=0.005,
        # The trainer's options, with the bounds, title and help the trainer declares for them.
        epochs=Param(None, **trainer_param_schema("epochs", nullable=True)),
        batch_size=Param(None, **trainer_param_schema("batch_size", nullable=True)),
        lr=Param(None, **trainer_param_schema("lr", nullable=True)),
        max_train_samples=Param(None, **trainer_param_schema("max_train_samples", nullable=True)),
        dataset_source=Param("vendored", type="string", minLength=1, title="Dataset",
                             pattern=DATASET_SOURCE_PATTERN,
                             description="'vendored' (the bundled real MNIST), an s3:// "
                                         "prefix, or an absolute local folder of "
                                         "MNIST-format IDX files."),
    ),
    **retraining_dag_args(),
)  # fmt: skip
def mnist_horovod_retrain() -> None:
    retraining_pipeline(MNIST)


retrain_dag = mnist_horovod_retrain()
