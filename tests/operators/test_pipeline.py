"""The one retraining pipeline: what an app may declare, and what it may not."""

from __future__ import annotations

import copy

import pytest
from airflow.sdk import DAG, Param

from horovod_airflow.operators import settings
from horovod_airflow.operators.launchers.local_options import ElasticOptions, LocalOptions
from horovod_airflow.operators.pipeline import (
    ModelApp,
    retraining_dag_args,
    retraining_params,
    retraining_pipeline,
    run_prefix,
)
from tests.operators.helpers import context

APP = ModelApp(model_name="m", dataset_name="d", dataset_source="/data/d", dataset_files=["*.npy"])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model_name": ""}, "ModelApp.model_name must be a non-empty string"),
        ({"dataset_source": "  "}, "ModelApp.dataset_source must be a non-empty string"),
        ({"dataset_files": "*.npy"}, "ModelApp.dataset_files must be a non-empty list"),
        ({"dataset_files": []}, "ModelApp.dataset_files must be a non-empty list"),
        ({"image": " "}, "ModelApp.image must be an image name, or None"),
    ],
)
def test_an_app_with_a_bad_field_is_refused_naming_it(fields, message):
    given = {"model_name": "m", "dataset_name": "d", "dataset_source": "/data/d"} | fields
    with pytest.raises(ValueError, match=message):
        ModelApp(**given)


def test_the_app_names_its_serving_pointer_and_asset():
    assert APP.latest_uri == f"{settings.BUCKET_URI}/models/m/latest.json"
    assert (APP.latest_asset.name, APP.latest_asset.uri) == ("m_latest", APP.latest_uri)


def test_the_form_is_the_pipelines_then_the_apps():
    params = retraining_params(num_proc=3, epochs=Param(5, type="integer"))
    assert list(params) == ["num_proc", "min_accuracy", "max_regression", "launcher", "epochs"]
    assert params["num_proc"].value == 3
    with pytest.raises(ValueError, match="launcher is the pipeline's own Param"):
        retraining_params(launcher=Param("local", type="string"))


def test_the_pipeline_builds_the_apps_tasks_in_the_dag_being_defined():
    with DAG("app_dag", schedule=None, params=retraining_params(), **retraining_dag_args()) as dag:
        tasks = retraining_pipeline(
            ModelApp(
                model_name="m",
                dataset_name="d",
                dataset_source="/data/d",
                dataset_files=["*.npy"],
                train_entrypoint=["python", "-m", "my.train"],
                export_entrypoint=["python", "-m", "my.export"],
                trainer_args={"epochs": 3},
                champion_scorer=None,
            )
        )
    assert list(dag.task_dict) == [t.task_id for t in tasks]
    assert tasks.stage.files == ["*.npy"] and tasks.stage.dataset_name == "d"
    assert tasks.train.entrypoint == ("python", "-m", "my.train")
    assert tasks.train.output_uri == run_prefix()
    assert tasks.export_onnx.entrypoint == ("python", "-m", "my.export")
    assert tasks.export_onnx.output_uri == run_prefix() + "/onnx"
    assert tasks.gate.model_name == "m" and tasks.gate.champion_scorer is None
    assert [o.uri for o in tasks.publish.outlets] == [f"{settings.BUCKET_URI}/models/m/latest.json"]


HOSTS = ["10.9.0.1:1", "10.9.0.2:1", "10.9.0.3:1"]


class _StagedTI:
    """The task instance a rendering train task sees: try 1, and stage_dataset's XCom."""

    try_number = 1

    def xcom_pull(self, task_ids: str) -> dict[str, str]:
        assert task_ids == "stage_dataset"
        return {"uri": "s3://b/datasets/d/0123456789abcdef"}


def _elastic_dag(form_elastic: bool = True, elastic: ElasticOptions | None = None):
    with DAG(
        "elastic_app_dag",
        schedule=None,
        params=retraining_params(elastic=form_elastic),
        **retraining_dag_args(),
    ) as dag:
        tasks = retraining_pipeline(
            APP,
            job={
                "local": LocalOptions(hosts=HOSTS, network_interface="eth9"),
                "aws_conn_id": None,  # no connection to read while rendering here
            },
            elastic=elastic,
        )
    return dag, tasks


def test_an_elastic_pipeline_asks_the_commit_interval_on_its_form_and_trains_elastic():
    """The form's field is the trainer's own declaration (bounds, title, help); the value a run
    gives reaches the trainer's command line, and an empty one leaves the trainer's default."""
    from airflow.sdk.definitions.param import ParamValidationError

    from horovod_airflow.core.train_config import param_schema

    dag, tasks = _elastic_dag(elastic=ElasticOptions(min_np=2, max_np="{{ params.num_proc }}"))
    field = dag.params.get_param("elastic_commit_every")
    declared = param_schema("elastic_commit_every", nullable=True)
    assert field.description == declared.pop("description")  # Param keeps it beside the schema
    assert field.schema == declared
    assert field.resolve(None) is None and field.resolve(7) == 7
    with pytest.raises(ParamValidationError):
        field.resolve(0)
    assert tasks.train.elastic is not None and not hasattr(tasks.export_onnx, "elastic")
    for task in (tasks.train, tasks.export_onnx):  # the DAG's job settings reach both
        assert task.options("local").hosts == HOSTS and task.aws_conn_id is None

    for given, expected in ((7, ["--elastic-commit-every", "7"]), (None, [])):
        train = copy.deepcopy(tasks.train)  # rendering replaces its templated fields
        ctx = {**context(), "ti": _StagedTI(), "dag": dag, "params": {
            **{k: dag.params[k] for k in dag.params}, "num_proc": 3, "launcher": "local",
            "elastic_commit_every": given}}  # fmt: skip
        train.render_template_fields(ctx)
        spec = train.build_spec(ctx)
        assert spec.elastic is not None and (spec.elastic.min_np, spec.elastic.max_np) == (2, 3)
        assert "--elastic" in spec.argv
        at = [i for i, a in enumerate(spec.argv) if a == "--elastic-commit-every"]
        assert [spec.argv[j] for i in at for j in (i, i + 1)] == expected, spec.argv


@pytest.mark.parametrize(
    ("form_elastic", "elastic", "message"),
    [
        (False, ElasticOptions(min_np=2, max_np=3), "the form has no elastic_commit_every"),
        (True, None, "elastic_commit_every would do nothing without elastic="),
    ],
)
def test_elastic_training_and_its_form_field_go_together(form_elastic, elastic, message):
    with pytest.raises(ValueError, match=message):
        _elastic_dag(form_elastic, elastic)


def test_a_job_setting_the_pipeline_does_not_know_is_refused_naming_the_allowed():
    with (
        pytest.raises(ValueError, match=r"num_procs is not a job setting; allowed: .*local"),
        DAG("bad_job", schedule=None, params=retraining_params(), **retraining_dag_args()),
    ):
        retraining_pipeline(APP, job={"num_procs": 3})  # type: ignore[typeddict-unknown-key]
