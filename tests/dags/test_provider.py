"""The package as an Airflow provider, for real: the ``airflow providers list`` CLI knows it
with its version; one ``dag.test()`` run of the retraining DAG leaves the extra links of its
train and publish tasks (the XCom Airflow's UI reads them from) pointing at the run folder and
the registry page, and the train task's progress in Airflow's own task state store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import horovod_airflow
from horovod_airflow.operators.links import REGISTRY_PAGE_PATH
from horovod_airflow.operators.progress import PROGRESS_STATE_KEY
from tests.dags.test_retrain_dag import SMALL_RUN, _cli_run_states, _deploy, _states


def test_airflow_providers_list_shows_the_provider_with_its_version(airflow_db):
    airflow = str(Path(sys.executable).parent / "airflow")
    out = subprocess.run([airflow, "providers", "list", "-o", "json"], capture_output=True,
                         text=True, timeout=300, check=True)  # fmt: skip
    providers = {p["package_name"]: p for p in json.loads(out.stdout)}
    assert providers["horovod-airflow"]["version"] == horovod_airflow.__version__
    links = subprocess.run([airflow, "providers", "links"], capture_output=True, text=True,
                           timeout=300, check=True).stdout  # fmt: skip
    assert "horovod_airflow.operators.links.RunFolderLink" in links
    assert "horovod_airflow.operators.links.RegistryLink" in links


@pytest.mark.slow
def test_a_dag_run_leaves_extra_links_and_progress_in_the_task_state(s3_server, airflow_db):
    from airflow.models.task_state_store import TaskStateStoreModel
    from airflow.sdk import DagRunState
    from airflow.utils.session import create_session

    bucket = s3_server.new_bucket("links")
    dag = _deploy(bucket).retrain_dag
    run = dag.test(run_conf={**SMALL_RUN, "min_accuracy": 0.5})
    assert run.state == DagRunState.SUCCESS, _states(run)
    tis = {ti.task_id: ti for ti in run.get_task_instances()}

    train = tis["train"]
    output = train.xcom_pull(task_ids="train")["output"]
    assert output.startswith(f"s3://{bucket}/runs/")
    key = output[len(f"s3://{bucket}/") :]
    run_link = train.xcom_pull(task_ids="train", key="_link_RunFolderLink")
    assert run_link == f"{s3_server.endpoint}/{bucket}/{key}/metrics.json"

    publish = tis["publish"]
    registry_link = publish.xcom_pull(task_ids="publish", key="_link_RegistryLink")
    assert registry_link == REGISTRY_PAGE_PATH == "/plugin/model-registry"

    with create_session() as session:
        row = (
            session.query(TaskStateStoreModel)
            .filter_by(
                dag_id=dag.dag_id, run_id=run.run_id, task_id="train", key=PROGRESS_STATE_KEY
            )
            .one()
        )
        progress = json.loads(row.value)
    assert progress["step"] == progress["of_steps"] > 0
    assert progress["epoch"] == progress["of_epochs"] == SMALL_RUN["epochs"]
    assert progress["eta_seconds"] == 0 and progress["samples_per_sec"] > 0


@pytest.mark.slow
def test_train_and_publish_emit_dataset_and_model_lineage_through_openlineage(
    s3_server, airflow_db, tmp_path
):
    """The OpenLineage provider's real listener, enabled with its file transport in a fresh
    ``airflow dags test`` process, records what train and publish read and wrote."""
    pytest.importorskip("airflow.providers.openlineage", reason="the [openlineage] extra")
    bucket = s3_server.new_bucket("lineage")
    _deploy(bucket)
    events_file = tmp_path / "openlineage.jsonl"
    transport = {"type": "file", "log_file_path": str(events_file), "append": True}
    conf = json.dumps({**SMALL_RUN, "min_accuracy": 0.5, "max_train_samples": 2000})
    env = {
        **os.environ,
        "HVA_BUCKET": bucket,
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(transport),
    }
    airflow = str(Path(sys.executable).parent / "airflow")
    cli = subprocess.run([airflow, "dags", "test", "mnist_horovod_retrain", "--conf", conf],
                         capture_output=True, text=True, env=env, timeout=1200)  # fmt: skip
    assert cli.returncode == 0, cli.stdout[-3000:] + cli.stderr[-3000:]
    assert _cli_run_states("mnist_horovod_retrain", conf)["publish"] == "success"

    complete: dict[str, dict] = {}
    for line in events_file.read_text().splitlines():
        event = json.loads(line)
        task = event["job"]["name"].rpartition(".")[2]
        if event.get("eventType") == "COMPLETE" and task in ("train", "publish"):
            complete[task] = event
    namespace = f"s3://{bucket}"

    def names(event: dict, side: str) -> set[tuple[str, str]]:
        return {(d["namespace"], d["name"]) for d in event[side]}

    train_in, train_out = names(complete["train"], "inputs"), names(complete["train"], "outputs")
    ((ns, data),) = train_in
    assert ns == namespace and data.startswith("datasets/mnist/")
    ((ns, run_folder),) = train_out
    assert ns == namespace and run_folder.startswith("runs/mnist_horovod_retrain/")
    latest = json.loads(s3_server.client().get_object(
        Bucket=bucket, Key="models/mnist_cnn/latest.json")["Body"].read())  # fmt: skip
    assert names(complete["publish"], "inputs") == {(namespace, run_folder), (namespace, data)}
    assert names(complete["publish"], "outputs") == {
        (namespace, latest["uri"][len(namespace) + 1 :])
    }
