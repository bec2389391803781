"""
### Retrain the MNIST CNN with Horovod, gate it, export it to ONNX and publish it for serving

`stage_dataset` → `train` → `gate` → `export_onnx` → `publish`

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
   split (onnxruntime), or the gate refuses and says why. A failing gate skips export and
   publish and leaves the run's artifacts (and its `gate.json`) for inspection.
4. **export_onnx** (`HorovodExportOperator`) exports the rank-0 checkpoint to one ONNX file
   and checks onnxruntime against PyTorch (same launcher, so Airflow workers need no torch).
5. **publish** (`PublishModelOperator`) copies the model, checkpoint, metrics, parity
   report, training curves and a summary to `s3://<bucket>/models/mnist_cnn/<version>/` with
   a sha256 `manifest.json`, then updates `latest.json` — last, so readers never see a
   half-published model. The version is named by the run, so a retry finds its own version
   and publishes nothing twice; `latest.json` is written only if it is still the one the
   gate compared against (a conditional put), else the publish fails without overwriting.
   It emits the `latest.json` Asset with the version, ONNX URI, sha256, accuracy and dataset
   hash as the event's `extra`, which schedules serving-side DAGs.

Alerts: a failed task, and a refused gate, mail `HVA_ALERT_EMAILS` through the SMTP
connection `HVA_SMTP_CONN_ID`; a refusing gate fails (and so alerts) once
`HVA_STALE_AFTER_RUNS` runs in a row were refused or nothing was published for
`HVA_STALE_AFTER_DAYS` days; a run still going `HVA_RUN_DEADLINE_MINUTES` after it was queued
mails them too (an Airflow deadline alert).

Configuration: the AWS connection `aws_default` (endpoint and credentials; MinIO or AWS) and
the `HVA_*` environment variables of `operators/settings.py` (bucket, default launcher and
ranks, trainer image, GPUs per rank, Docker network); train and export share its
`TRAINER_JOB` settings (connection, image, GPUs, launcher options).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import Asset, Param, dag

from horovod_airflow.operators import (
    HorovodExportOperator,
    HorovodTrainOperator,
    ModelGateOperator,
    PublishModelOperator,
    StageDatasetOperator,
    safe_key,
    trainer_param_schema,
)
from horovod_airflow.operators.settings import (
    AWS_CONN_ID,
    BUCKET_URI,
    DATA_CHECKS,
    DATASET_SOURCE_PATTERN,
    DATASET_SOURCES,
    DEFAULT_LAUNCHER,
    DEFAULT_NUM_PROC,
    FAILURE_ALERTS,
    LATEST_MODEL_ASSET_NAME,
    LATEST_MODEL_URI,
    MAX_REGRESSION_CEILING,
    MIN_ACCURACY_FLOOR,
    MODEL_NAME,
    REFUSED_ALERTS,
    RUN_DEADLINE_ALERTS,
    RUN_TIMEOUT,
    STALE_AFTER_DAYS,
    STALE_AFTER_RUNS,
    TASK_TIMEOUT,
    TRAINER_JOB,
    gate_param,
)

LATEST_MODEL = Asset(name=LATEST_MODEL_ASSET_NAME, uri=LATEST_MODEL_URI)

RUN_PREFIX = BUCKET_URI + "/runs/{{ dag.dag_id }}/{{ run_id | safe_key }}"


@dag(
    dag_id="mnist_horovod_retrain",
    doc_md=__doc__,
    schedule="@weekly",
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    user_defined_filters={"safe_key": safe_key},
    dagrun_timeout=RUN_TIMEOUT,
    deadline=RUN_DEADLINE_ALERTS,
    default_args={"retries": 1, "retry_delay": timedelta(seconds=30),
                  "execution_timeout": TASK_TIMEOUT,
                  "on_failure_callback": FAILURE_ALERTS},
    tags=["horovod", "training", "mnist"],
    params={
        "num_proc": Param(DEFAULT_NUM_PROC, type="integer", minimum=1, maximum=512,
                          title="Ranks", description="Horovod ranks (processes); one per GPU."),
        # The trainer's options, with the bounds, title and help the trainer declares for them.
        "epochs": Param(None, **trainer_param_schema("epochs", nullable=True)),
        "batch_size": Param(None, **trainer_param_schema("batch_size", nullable=True)),
        "lr": Param(None, **trainer_param_schema("lr", nullable=True)),
        "max_train_samples": Param(None, **trainer_param_schema("max_train_samples",
                                                                nullable=True)),
        "min_accuracy": Param(**gate_param("min_accuracy", 0.98)),
        "max_regression": Param(**gate_param("max_regression", 0.005)),
        "launcher": Param(DEFAULT_LAUNCHER, type="string",
                          enum=["local", "docker", "kubernetes"], title="Launcher",
                          description="Where ranks run: local horovodrun, one GPU container, "
                                      "or a Kubeflow MPIJob."),
        "dataset_source": Param("vendored", type="string", minLength=1, title="Dataset",
                                pattern=DATASET_SOURCE_PATTERN,
                                description="'vendored' (the bundled real MNIST), an s3:// "
                                            "prefix, or an absolute local folder of "
                                            "MNIST-format IDX files."),
    },
)  # fmt: skip
def mnist_horovod_retrain() -> None:
    stage = StageDatasetOperator(
        task_id="stage_dataset",
        source="{{ params.dataset_source }}",
        bucket_uri=BUCKET_URI,
        dataset_name="mnist",
        allowed_sources=DATASET_SOURCES,
        checks=DATA_CHECKS,
        aws_conn_id=AWS_CONN_ID,
    )

    train = HorovodTrainOperator(
        task_id="train",
        launcher="{{ params.launcher }}",
        num_proc="{{ params.num_proc }}",
        data="{{ ti.xcom_pull(task_ids='stage_dataset')['uri'] }}",
        output=RUN_PREFIX,
        trainer_args={
            "epochs": "{{ params.epochs }}",
            "batch_size": "{{ params.batch_size }}",
            "lr": "{{ params.lr }}",
            "max_train_samples": "{{ params.max_train_samples }}",
        },
        **TRAINER_JOB,
    )

    gate = ModelGateOperator(
        task_id="gate",
        bucket_uri=BUCKET_URI,
        model_name=MODEL_NAME,
        metrics=train.output,
        dataset=stage.output,
        min_accuracy="{{ params.min_accuracy }}",
        max_regression="{{ params.max_regression }}",
        min_accuracy_floor=MIN_ACCURACY_FLOOR,
        max_regression_ceiling=MAX_REGRESSION_CEILING,
        aws_conn_id=AWS_CONN_ID,
        on_refused=REFUSED_ALERTS,
        stale_after_runs=STALE_AFTER_RUNS,
        stale_after_days=STALE_AFTER_DAYS,
    )

    export_onnx = HorovodExportOperator(
        task_id="export_onnx",
        launcher="{{ params.launcher }}",
        checkpoint="{{ ti.xcom_pull(task_ids='train')['checkpoint_uri'] }}",
        output=RUN_PREFIX + "/onnx",
        data="{{ ti.xcom_pull(task_ids='stage_dataset')['uri'] }}",
        **TRAINER_JOB,
    )

    publish = PublishModelOperator(
        task_id="publish",
        bucket_uri=BUCKET_URI,
        model_name=MODEL_NAME,
        metrics=train.output,
        exported=export_onnx.output,
        dataset=stage.output,
        decision=gate.output,
        aws_conn_id=AWS_CONN_ID,
        outlets=[LATEST_MODEL],
    )

    stage >> train >> gate >> export_onnx >> publish


retrain_dag = mnist_horovod_retrain()
