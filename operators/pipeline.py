"""The retraining pipeline, written once for every model: stage → train → gate → export →
publish, or, when the gate refuses, record_refused (the model kept as a refused candidate that
an admin may promote; ``latest.json`` untouched).

A model is an app: it declares what is its own in a :class:`ModelApp` — its registry name,
its dataset and where that comes from, its training and export programs, how a champion is
re-scored — and everything else (the run prefix, the deployment's timeouts, floors, alerts and
launcher settings, the order of the tasks and what each passes the next) is the pipeline's, so
two models cannot drift apart. A DAG file is then the app and the DAG's own schedule and form::

    from horovod_airflow.operators.pipeline import (
        ModelApp, retraining_dag_args, retraining_params, retraining_pipeline)

    APP = ModelApp(model_name="my_model", dataset_name="my_data", dataset_source="/data/my",
                   dataset_files=["*.npy"], train_entrypoint=["python", "-m", "my.train"],
                   export_entrypoint=["python", "-m", "my.export"],
                   champion_scorer="my.serving:score_published_model")

    @dag(dag_id="my_model_retrain", schedule="@weekly", start_date=...,
         params=retraining_params(), **retraining_dag_args())
    def my_model_retrain():
        retraining_pipeline(APP)

    my_model_retrain()

Runs at DAG parse time: it only builds operators (no storage, no network).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

from airflow.sdk import Asset, Param, get_current_context, task

from horovod_airflow.core.layout import RUNS_DIR
from horovod_airflow.core.train_config import param_schema
from horovod_airflow.operators import settings
from horovod_airflow.operators.data_checks import DataChecks
from horovod_airflow.operators.export import HorovodExportOperator
from horovod_airflow.operators.gate import ModelGateOperator
from horovod_airflow.operators.import_path import check_import_path, import_callable
from horovod_airflow.operators.job import HorovodJobSettings
from horovod_airflow.operators.launchers.local_options import ElasticOptions
from horovod_airflow.operators.model_registry import (
    latest_asset_name,
    latest_uri,
    safe_key,
)
from horovod_airflow.operators.publish import PublishModelOperator, RecordRefusedOperator
from horovod_airflow.operators.stage import StageDatasetOperator
from horovod_airflow.operators.train import HorovodTrainOperator


def run_prefix() -> str:
    """Where a run writes (templated): one prefix per DAG run under the deployment's bucket,
    the run id made one key segment plus its hash (``safe_key``)."""
    return f"{settings.BUCKET_URI}/{RUNS_DIR}/" + "{{ dag.dag_id }}/{{ run_id | safe_key }}"


#: The launchers the trigger form offers.
LAUNCHERS = ("local", "docker", "kubernetes")
_STAGED = "{{ ti.xcom_pull(task_ids='stage_dataset')['uri'] }}"


@dataclass(frozen=True)
class ModelApp:
    """What one model brings to the retraining pipeline; the rest is the pipeline's.

    :param model_name: its registry name: ``models/<model_name>/`` in the bucket.
    :param dataset_name: its staged datasets' name: ``datasets/<dataset_name>/<hash16>/``.
    :param dataset_source: what ``stage_dataset`` stages (templated: e.g.
        ``"{{ params.dataset_source }}"``).
    :param dataset_files: the file patterns of a file set (``StageDatasetOperator(files=)``);
        None: the four MNIST-format IDX files.
    :param allowed_sources: the sources a run may stage; None: the deployment's allowlist
        (``HVA_DATASET_SOURCES``, read when the DAG is built; unset: any); empty: any.
    :param train_entrypoint: its training program; None: ``python -m horovod_airflow.trainer
        train``.
    :param export_entrypoint: its export program; None: ``python -m horovod_airflow.trainer
        export``.
    :param trainer_args: extra options of the training program (values templated).
    :param champion_scorer: ``module:function`` that re-scores a champion measured on other
        data (``ModelGateOperator(champion_scorer=)``); None: the gate refuses instead.
    :param serving_check: ``module:function`` that the serving-side DAG runs
        (:func:`serving_pipeline`) on the version a publish announced, called as
        ``f(bucket_uri, model_name, *, client, published, **params)`` — ``published`` the
        Asset event's ``extra`` (None: a manual run, the current ``latest.json``), ``params``
        the serving DAG's form — returning what it found (its XCom) or raising; None: the app
        has no serving DAG.
    :param data_checks: what staging checks against the previous staged dataset of the name
        (``StageDatasetOperator(checks=)``); None: the deployment's thresholds
        (``settings.DATA_CHECKS``, ``HVA_DATA_*``).
    :param image: the image its train and export run in with the docker and kubernetes
        launchers: one that holds its programs, usually built ``FROM`` the project's trainer
        image (see ``examples/waveforms/Dockerfile``); None: the deployment's trainer image
        (``HVA_TRAINER_IMAGE``), which holds the project's own trainer only.
    """

    model_name: str
    dataset_name: str
    dataset_source: str
    dataset_files: Sequence[str] | None = None
    allowed_sources: Sequence[str] | None = None
    train_entrypoint: Sequence[str] | None = None
    export_entrypoint: Sequence[str] | None = None
    trainer_args: Mapping[str, Any] = field(default_factory=dict)
    champion_scorer: str | None = None
    data_checks: DataChecks | None = None
    serving_check: str | None = None
    image: str | None = None

    def __post_init__(self) -> None:
        for name in ("model_name", "dataset_name", "dataset_source"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"ModelApp.{name} must be a non-empty string, got {value!r}")
        if self.image is not None and (not isinstance(self.image, str) or not self.image.strip()):
            raise ValueError(
                f"ModelApp.image must be an image name, or None for the deployment's trainer "
                f"image; got {self.image!r}"
            )
        if self.dataset_files is not None and (
            isinstance(self.dataset_files, str) or not self.dataset_files
        ):
            raise ValueError(
                "ModelApp.dataset_files must be a non-empty list of file patterns, or None "
                f"for MNIST-format IDX files; got {self.dataset_files!r}"
            )
        for name in ("champion_scorer", "serving_check"):
            if getattr(self, name) is not None:
                check_import_path(getattr(self, name), f"ModelApp.{name}")

    @property
    def latest_uri(self) -> str:
        """The serving pointer that ``publish`` writes last."""
        return latest_uri(settings.BUCKET_URI, self.model_name)

    @property
    def latest_asset(self) -> Asset:
        """The Asset ``publish`` emits an event of and serving-side DAGs are scheduled on."""
        return Asset(name=latest_asset_name(self.model_name), uri=self.latest_uri)


class RetrainingTasks(NamedTuple):
    """The pipeline's tasks, in order (each task's ``.output`` is its XCom)."""

    stage: StageDatasetOperator
    train: HorovodTrainOperator
    gate: ModelGateOperator
    export_onnx: HorovodExportOperator
    publish: PublishModelOperator
    record_refused: RecordRefusedOperator


#: The form's field of an elastic pipeline: the trainer's ``--elastic-commit-every``.
ELASTIC_COMMIT_PARAM = "elastic_commit_every"


def retraining_pipeline(
    app: ModelApp,
    *,
    job: HorovodJobSettings | None = None,
    elastic: ElasticOptions | None = None,
) -> RetrainingTasks:
    """Create the six tasks of ``app``'s retraining in the DAG being defined, chained.

    ``stage → train → gate → export_onnx → publish | record_refused``: a gate that passes lets
    ``publish`` run (``record_refused`` skips itself); one that refuses skips ``publish`` (so
    the refusal shows in the run as it always did: ``publish`` skipped, ``gate.json`` in the
    run folder) and lets the export run for ``record_refused``, which keeps the model as a
    refused candidate (never named by ``latest.json``; an admin may promote it with a recorded
    override reason).

    Train and export run through the launcher the trigger form picks (``params.launcher``)
    with the ranks it asks for (``params.num_proc``) and the deployment's job settings
    (``settings.TRAINER_JOB``: connections, image, GPUs, docker network, timeout; the app's
    ``image`` instead of the deployment's where it names one), the gate
    with the form's thresholds inside the deployment's floors; see ``retraining_params``.

    :param job: this DAG's own job settings (:class:`HorovodJobSettings`), over the
        deployment's and the app's image: e.g. ``local=LocalOptions(hosts=[...])`` to train on
        several hosts, ``kubernetes=KubernetesOptions(...)``.
    :param elastic: train elastic (``HorovodTrainOperator(elastic=)``; the export is not): on a
        launcher and topology that can (several hosts, an MPIJob; docs/elastic.md), with a
        training program that takes ``--elastic`` (the project's trainer does). The form must
        then have ``retraining_params(elastic=True)``'s ``elastic_commit_every``, passed to
        the trainer; a form with it and no ``elastic`` is refused too, as a field that would
        do nothing.
    """
    unknown = sorted(set(job or {}) - set(HorovodJobSettings.__annotations__))
    if unknown:
        raise ValueError(
            f"retraining_pipeline(job=): {', '.join(unknown)} is not a job setting; allowed: "
            f"{', '.join(HorovodJobSettings.__annotations__)}"
        )
    stage = StageDatasetOperator(
        task_id="stage_dataset",
        source=app.dataset_source,
        files=list(app.dataset_files) if app.dataset_files is not None else None,
        bucket_uri=settings.BUCKET_URI,
        dataset_name=app.dataset_name,
        allowed_sources=(
            settings.DATASET_SOURCES if app.allowed_sources is None else tuple(app.allowed_sources)
        ),
        checks=settings.DATA_CHECKS if app.data_checks is None else app.data_checks,
        aws_conn_id=settings.AWS_CONN_ID,
    )
    # What train and export (launched ranks) and publish and record_refused (registry
    # writers) each share, written once so that the two of a pair cannot drift apart.
    launched: dict[str, Any] = dict(launcher="{{ params.launcher }}", data=_STAGED)
    launched.update(settings.TRAINER_JOB)
    if app.image is not None:
        launched["image"] = app.image
    launched.update(job or {})
    registry: dict[str, Any] = dict(
        bucket_uri=settings.BUCKET_URI,
        model_name=app.model_name,
        dataset=stage.output,
        aws_conn_id=settings.AWS_CONN_ID,
    )
    trainer_args = dict(app.trainer_args)
    if elastic is not None:
        trainer_args[ELASTIC_COMMIT_PARAM] = "{{ params." + ELASTIC_COMMIT_PARAM + " }}"
    train = HorovodTrainOperator(
        task_id="train",
        num_proc="{{ params.num_proc }}",
        output=run_prefix(),
        trainer_args=trainer_args,
        elastic=elastic,
        **_entrypoint(app.train_entrypoint),
        **launched,
    )
    asks = train.has_dag() and ELASTIC_COMMIT_PARAM in train.dag.params
    if (elastic is not None) != asks:
        raise ValueError(
            "retraining_pipeline(elastic=...) and retraining_params(elastic=True) go together: "
            + (
                "the form has no elastic_commit_every for the elastic training"
                if elastic is not None
                else "the form's elastic_commit_every would do nothing without elastic="
            )
        )
    gate = ModelGateOperator(
        task_id="gate",
        metrics=train.output,
        min_accuracy="{{ params.min_accuracy }}",
        max_regression="{{ params.max_regression }}",
        champion_scorer=app.champion_scorer,
        min_accuracy_floor=settings.MIN_ACCURACY_FLOOR,
        max_regression_ceiling=settings.MAX_REGRESSION_CEILING,
        on_refused=settings.REFUSED_ALERTS,
        stale_after_runs=settings.STALE_AFTER_RUNS,
        stale_after_days=settings.STALE_AFTER_DAYS,
        refused_branch=["record_refused"],
        **registry,
    )
    export_onnx = HorovodExportOperator(
        task_id="export_onnx",
        checkpoint="{{ ti.xcom_pull(task_ids='train')['checkpoint_uri'] }}",
        output=run_prefix() + "/onnx",
        **_entrypoint(app.export_entrypoint),
        **launched,
    )
    exported = dict(metrics=train.output, exported=export_onnx.output, **registry)
    publish = PublishModelOperator(
        task_id="publish", decision=gate.output, outlets=[app.latest_asset], **exported
    )
    record_refused = RecordRefusedOperator(task_id="record_refused", **exported)
    stage >> train >> gate >> export_onnx >> [publish, record_refused]
    return RetrainingTasks(stage, train, gate, export_onnx, publish, record_refused)


def _entrypoint(entrypoint: Sequence[str] | None) -> dict[str, Any]:
    return {} if entrypoint is None else {"entrypoint": list(entrypoint)}


def retraining_params(
    *,
    num_proc: int | None = None,
    max_num_proc: int = 512,
    min_accuracy: float = 0.98,
    max_regression: float = 0.005,
    elastic: bool = False,
    **app_params: Param,
) -> dict[str, Param]:
    """The trigger form every retraining DAG has — ranks, launcher and the gate's thresholds
    (bounded by the deployment's floors) — then the app's own Params (``app_params``, e.g. its
    training options) after them. ``num_proc``'s default is the deployment's
    (``HVA_NUM_PROC``). ``elastic=True``, for ``retraining_pipeline(elastic=...)``: also
    ``elastic_commit_every``, with the bounds, title and help the trainer declares (empty: its
    default)."""
    common = {
        "num_proc": Param(settings.DEFAULT_NUM_PROC if num_proc is None else num_proc,
                          type="integer", minimum=1, maximum=max_num_proc,
                          title="Ranks", description="Horovod ranks (processes); one per GPU."),
        "min_accuracy": Param(**settings.gate_param("min_accuracy", min_accuracy)),
        "max_regression": Param(**settings.gate_param("max_regression", max_regression)),
        "launcher": Param(settings.DEFAULT_LAUNCHER, type="string", enum=list(LAUNCHERS),
                          title="Launcher",
                          description="Where ranks run: local horovodrun, one GPU container, "
                                      "or a Kubeflow MPIJob."),
    }  # fmt: skip
    if elastic:
        common[ELASTIC_COMMIT_PARAM] = Param(
            None, **param_schema(ELASTIC_COMMIT_PARAM, nullable=True)
        )
    clash = common.keys() & app_params.keys()
    if clash:
        raise ValueError(
            f"retraining_params: {', '.join(sorted(clash))} is the pipeline's own Param; set "
            "it with the keyword of the same name"
        )
    return {**common, **app_params}


def retraining_dag_args() -> dict[str, Any]:
    """The ``@dag`` arguments every retraining DAG shares: one run at a time, no catch-up,
    native rendering of templated settings, the run prefix's ``safe_key`` filter, the
    deployment's run and task timeouts, one retry, the failure alerts on every task, and the
    deadline alert of a run that takes far longer than it should (``HVA_RUN_DEADLINE_MINUTES``)."""
    return {
        "catchup": False,
        "max_active_runs": 1,
        "render_template_as_native_obj": True,
        "user_defined_filters": {"safe_key": safe_key},
        "dagrun_timeout": settings.RUN_TIMEOUT,
        "deadline": settings.RUN_DEADLINE_ALERTS,
        "default_args": {
            "retries": 1,
            "retry_delay": timedelta(seconds=30),
            "execution_timeout": settings.TASK_TIMEOUT,
            "on_failure_callback": settings.FAILURE_ALERTS,
        },
    }


def serving_pipeline(app: ModelApp) -> Any:
    """Create the serving-side task of ``app`` in the DAG being defined: ``smoke_test_latest``
    runs ``app.serving_check`` on the version the triggering Asset event names (a manual run:
    the one ``latest.json`` names now), with the DAG's params as keywords; its result is the
    task's XCom. The DAG's ``@dag`` arguments: :func:`serving_dag_args`."""
    if app.serving_check is None:
        raise ValueError(f"ModelApp {app.model_name!r} declares no serving_check")
    check_path, model_name, asset = app.serving_check, app.model_name, app.latest_asset

    @task(task_id="smoke_test_latest")
    def smoke_test_latest() -> Any:
        """The announced version serves as its app's check requires, or the task fails."""
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        from horovod_airflow.operators.serving import published_from_events

        context = get_current_context()
        check = import_callable(check_path, "ModelApp.serving_check")
        return check(
            settings.BUCKET_URI,
            model_name,
            client=S3Hook(aws_conn_id=settings.AWS_CONN_ID).get_conn(),
            published=published_from_events(context["triggering_asset_events"], asset),
            **dict(context["params"]),
        )

    return smoke_test_latest()


def serving_dag_args(app: ModelApp) -> dict[str, Any]:
    """The ``@dag`` arguments of ``app``'s serving-side DAG: scheduled on the app's
    ``latest_asset`` (each publish of its retraining DAG starts a run), one run at a time, no
    catch-up, the deployment's run and task timeouts."""
    return {
        "schedule": [app.latest_asset],
        "catchup": False,
        "max_active_runs": 1,
        "dagrun_timeout": settings.RUN_TIMEOUT,
        "default_args": {"execution_timeout": settings.TASK_TIMEOUT},
    }
