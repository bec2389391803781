"""HorovodTrainOperator inside real Airflow: ``dag.test()`` runs the Task Runner, renders the
templates (``num_proc`` from params arrives as a string), pushes the XCom dict.

Airflow 3's ``dag.test()`` needs the DAG in a DAG bundle, so each test writes its DAG file
into a temporary folder that is added as a second bundle (next to the project's dags/).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.operators.helpers import dag_in_bundle, put_eval_set

DAG_TEMPLATE = """
from datetime import datetime

from airflow.sdk import DAG

from horovod_airflow.operators import HorovodTrainOperator
from tests.operators.helpers import PROGRAM

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1),
         params={{"np": 2, "epochs": 2}}) as dag:
    HorovodTrainOperator(task_id="train", entrypoint=PROGRAM, retries=0, **{kwargs})
"""


def _states(dag_run: Any) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}


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
    dag = dag_in_bundle(
        tmp_path, monkeypatch, "hvd_operator_dag_ok",
        DAG_TEMPLATE.format(dag_id="hvd_operator_dag_ok", kwargs=repr(kwargs)),
    )  # fmt: skip

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
    dag = dag_in_bundle(
        tmp_path, monkeypatch, "hvd_operator_dag_fail",
        DAG_TEMPLATE.format(dag_id="hvd_operator_dag_fail", kwargs=repr(kwargs)),
    )  # fmt: skip

    run = dag.test()

    assert run.state == DagRunState.FAILED
    assert _states(run) == {"train": "failed"}
