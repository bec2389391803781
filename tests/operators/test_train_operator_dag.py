"""HorovodTrainOperator inside real Airflow: ``dag.test()`` runs the Task Runner, renders the
templates (``num_proc`` from params arrives as a string), pushes the XCom dict.

Airflow 3's ``dag.test()`` needs the DAG in a DAG bundle, so each test writes its DAG file
into a temporary folder that is added as a second bundle (next to the project's dags/).
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.operators.helpers import put_eval_set

DAG_TEMPLATE = """
from datetime import datetime

from airflow.sdk import DAG

from operators import HorovodTrainOperator
from tests.operators.helpers import PROGRAM

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1),
         params={{"np": 2, "epochs": 2}}) as dag:
    HorovodTrainOperator(task_id="train", entrypoint=PROGRAM, retries=0, **{kwargs})
"""


def _states(dag_run: Any) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}


def _dag_in_bundle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dag_id: str, kwargs: str
) -> Any:
    folder = tmp_path / "bundle"
    folder.mkdir()
    path = folder / f"{dag_id}.py"
    path.write_text(textwrap.dedent(DAG_TEMPLATE.format(dag_id=dag_id, kwargs=kwargs)))
    bundles = [
        {
            "name": "dags-folder",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {},
        },
        {
            "name": f"hvd-{dag_id}",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {"path": str(folder), "refresh_interval": 0},
        },
    ]
    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps(bundles))
    spec = importlib.util.spec_from_file_location(dag_id, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dag


@pytest.mark.slow
def test_dag_run_renders_templates_and_returns_metrics_as_xcom(
    s3_server, airflow_db, tmp_path, monkeypatch
):
    from airflow.sdk import DagRunState

    s3 = s3_server.client()
    bucket = s3_server.new_bucket()
    data, accuracy = put_eval_set(s3, bucket, "eval")
    kwargs = {
        "num_proc": "{{ params.np }}",
        "data": data,
        "output": f"s3://{bucket}/runs/{{{{ ti.dag_id }}}}",
        "trainer_args": {"epochs": "{{ params.epochs }}"},
    }
    dag = _dag_in_bundle(tmp_path, monkeypatch, "hvd_operator_dag_ok", repr(kwargs))

    run = dag.test()

    assert run.state == DagRunState.SUCCESS, _states(run)
    (ti,) = run.get_task_instances()
    result = ti.xcom_pull(task_ids="train")
    assert result["val_accuracy"] == pytest.approx(accuracy)
    assert result["world_size"] == 2 and result["epochs"] == 2
    assert result["output"] == f"s3://{bucket}/runs/hvd_operator_dag_ok"
    assert s3.head_object(Bucket=bucket, Key="runs/hvd_operator_dag_ok/metrics.json")


@pytest.mark.slow
def test_failing_program_fails_the_task(s3_server, airflow_db, tmp_path, monkeypatch):
    from airflow.sdk import DagRunState

    bucket = s3_server.new_bucket()
    data, _ = put_eval_set(s3_server.client(), bucket, "eval")
    kwargs = {
        "num_proc": 2,
        "data": data,
        "output": f"s3://{bucket}/runs/fail",
        "trainer_args": {"fail_rank": 0, "exit_code": 5},
    }
    dag = _dag_in_bundle(tmp_path, monkeypatch, "hvd_operator_dag_fail", repr(kwargs))

    run = dag.test()

    assert run.state == DagRunState.FAILED
    assert _states(run) == {"train": "failed"}
