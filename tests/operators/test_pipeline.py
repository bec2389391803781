"""The one retraining pipeline: what an app may declare, and what it may not."""

from __future__ import annotations

import pytest
from airflow.sdk import DAG, Param

from horovod_airflow.operators import settings
from horovod_airflow.operators.pipeline import (
    ModelApp,
    retraining_dag_args,
    retraining_params,
    retraining_pipeline,
    run_prefix,
)

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
