"""ModelGateOperator: its settings, and a pass and a fail in real DAG runs on the S3 server."""

from __future__ import annotations

import json
import uuid

import pytest
from airflow.sdk.exceptions import AirflowFailException

from horovod_airflow.core import storage
from horovod_airflow.core.contract import GATE, LATEST
from horovod_airflow.operators import HorovodConfigError, ModelGateOperator
from tests.operators.helpers import dag_in_bundle, undocumented_template_fields

DATASET = {"uri": "s3://data/datasets/mnist/abc", "content_hash": "abc"}


def gate_op(**kwargs) -> ModelGateOperator:
    base = {
        "task_id": "gate",
        "bucket_uri": "s3://bucket",
        "model_name": "mnist_cnn",
        "metrics": {"val_accuracy": 0.99, "output": "s3://bucket/runs/r"},
        "dataset": DATASET,
        "min_accuracy": 0.98,
        "max_regression": 0.005,
        "champion_scorer": "horovod_airflow.apps.mnist:score_published_model",
    }
    return ModelGateOperator(**{**base, **kwargs})


def test_template_fields_are_the_settings_a_run_varies_and_are_documented():
    assert set(ModelGateOperator.template_fields) == {
        "bucket_uri", "model_name", "metrics", "dataset", "min_accuracy", "max_regression",
    }  # fmt: skip
    assert undocumented_template_fields(ModelGateOperator) == []


def test_init_builds_no_hook_and_takes_templates_and_upstream_xcoms():
    from airflow.sdk import DAG, task

    with DAG("gate_init", schedule=None):

        @task
        def train() -> dict:
            return {}

        op = gate_op(
            metrics=train(),
            dataset="{{ ti.xcom_pull(task_ids='stage_dataset') }}",
            min_accuracy="{{ params.floor }}",
            max_regression="{{ params.margin }}",
            model_name="{{ params.model }}",
            aws_conn_id="no_such_connection",  # not looked up while a DAG file parses
        )
    assert "s3_hook" not in op.__dict__
    assert op.upstream_task_ids == {"train"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_uri": ""}, "bucket_uri must be a URI"),
        ({"model_name": "mnist/cnn"}, "model_name must be a name"),
        ({"model_name": ""}, "model_name must be a name"),
        ({"min_accuracy": 1.5}, r"min_accuracy must be a fraction in \[0, 1\]"),
        ({"min_accuracy": "high"}, r"min_accuracy must be a fraction in \[0, 1\]"),
        ({"max_regression": -0.1}, r"max_regression must be a fraction in \[0, 1\]"),
        ({"max_regression": True}, r"max_regression must be a fraction in \[0, 1\]"),
        ({"metric_key": ""}, "metric_key must be a non-empty string"),
        ({"metrics": {"output": "s3://b/r"}}, r"metrics lacks \['val_accuracy'\]"),
        ({"metric_key": "top1"}, r"metrics lacks \['top1'\]"),
        ({"metrics": "s3://b/runs/r"}, "metrics must be a dict"),
        ({"dataset": {"content_hash": "abc"}}, r"dataset lacks \['uri'\]"),
    ],
)
def test_bad_settings_are_named_at_parse_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gate_op(**kwargs)


def test_a_setting_that_renders_bad_fails_naming_it_without_retry():
    op = gate_op(min_accuracy="{{ params.floor }}", aws_conn_id=None)
    op.min_accuracy = "1.7"  # what "{{ params.floor }}" renders to with floor=1.7
    with pytest.raises(HorovodConfigError, match=r"gate: min_accuracy must be a fraction") as e:
        op.execute({})
    assert isinstance(e.value, AirflowFailException)  # no retry can fix a setting
    op = gate_op(aws_conn_id=None)
    op.metrics = "{'val_accuracy': 0.99}"  # a dict template rendered as text
    with pytest.raises(HorovodConfigError, match="metrics must be a dict"):
        op.execute({})


# --- real DAG runs: the gate, then two tasks it must skip or let run ----------------------


GATE_DAG = """
from datetime import UTC, datetime

from airflow.sdk import DAG, Param, task

from horovod_airflow.operators import ModelGateOperator

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=UTC),
         params={{"floor": Param(0.5, type="number")}}) as dag:

    @task
    def train() -> dict:
        return {{"val_accuracy": {accuracy!r}, "output": {run!r}}}

    @task
    def export_onnx() -> str:
        return "exported"

    @task
    def publish() -> str:
        return "published"

    gate = ModelGateOperator(
        task_id="gate",
        bucket_uri={bucket_uri!r},
        model_name="mnist_cnn",
        metrics=train(),
        dataset={dataset!r},
        min_accuracy="{{{{ params.floor }}}}",
        max_regression=0.01,
    )
    gate >> export_onnx() >> publish()
"""


def _gate_dag(tmp_path, monkeypatch, bucket: str, *, accuracy: float):
    """train → gate → export_onnx → publish, the floor templated from the run's params."""
    dag_id = f"gate_{uuid.uuid4().hex[:8]}"
    run = f"s3://{bucket}/runs/{dag_id}"
    source = GATE_DAG.format(dag_id=dag_id, accuracy=accuracy, run=run,
                             bucket_uri=f"s3://{bucket}", dataset=DATASET)  # fmt: skip
    return dag_in_bundle(tmp_path, monkeypatch, dag_id, source), run


def _champion(client, bucket: str, accuracy: float) -> bytes:
    """A published champion's latest.json, measured on the same dataset as the challenger."""
    doc = {"model": "mnist_cnn", "version": "v-champion", "uri": "s3://x/v-champion",
           "manifest_uri": "s3://x/v-champion/manifest.json",
           "onnx_uri": "s3://x/v-champion/model.onnx", "onnx_sha256": "0" * 64,
           "val_accuracy": accuracy, "dataset_content_hash": "abc"}  # fmt: skip
    body = LATEST.dumps(doc).encode()
    client.put_object(Bucket=bucket, Key="models/mnist_cnn/latest.json", Body=body)
    return body


def _xcoms(run) -> dict[tuple[str, str], object]:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.scalars(select(XComModel).where(XComModel.run_id == run.run_id)).all()
        return {(x.task_id, x.key): XComModel.deserialize_value(x) for x in rows}


def test_a_failed_gate_skips_export_and_publish_and_leaves_latest_untouched(
    s3_server, airflow_db, tmp_path, monkeypatch
):
    client = s3_server.client()
    bucket = s3_server.new_bucket("gate")
    before = _champion(client, bucket, 0.99)
    etag = client.head_object(Bucket=bucket, Key="models/mnist_cnn/latest.json")["ETag"]
    # Above the floor, but 4 points worse than the champion (max_regression 0.01).
    dag, run_output = _gate_dag(tmp_path, monkeypatch, bucket, accuracy=0.95)

    run = dag.test(run_conf={"floor": 0.9})
    states = {ti.task_id: str(ti.state) for ti in run.get_task_instances()}
    assert states == {
        "train": "success", "gate": "success", "export_onnx": "skipped", "publish": "skipped",
    }, states  # fmt: skip

    gate_uri = f"{run_output}/gate.json"
    gate = GATE.loads(storage.read_text(gate_uri, client=client), gate_uri)
    assert gate["passed"] is False
    assert "worse than the champion v-champion" in gate["reason"]
    assert gate["min_accuracy"] == 0.9  # the rendered template, not the Param's default
    assert gate["champion_etag"] == etag
    latest = client.get_object(Bucket=bucket, Key="models/mnist_cnn/latest.json")
    assert latest["Body"].read() == before and latest["ETag"] == etag

    xcoms = _xcoms(run)
    assert ("gate", "return_value") not in xcoms  # as @task.short_circuit: no decision XCom
    # The skip record that keeps a cleared export or publish skipped, as ShortCircuit's does.
    assert sorted(xcoms[("gate", "skipmixin_key")]["skipped"]) == ["export_onnx", "publish"]


def test_a_refusing_gate_leaves_its_refused_branch_and_what_it_needs_to_run(
    s3_server, airflow_db, tmp_path, monkeypatch
):
    """The pipeline's wiring: gate → export_onnx → [publish, record_refused] with
    ``refused_branch=["record_refused"]``: a refusal skips publish only."""
    client = s3_server.client()
    bucket = s3_server.new_bucket("gate")
    _champion(client, bucket, 0.99)
    dag_id = f"gate_{uuid.uuid4().hex[:8]}"
    run = f"s3://{bucket}/runs/{dag_id}"
    source = GATE_DAG.format(dag_id=dag_id, accuracy=0.95, run=run, bucket_uri=f"s3://{bucket}",
                             dataset=DATASET)  # fmt: skip
    source = source.replace("        max_regression=0.01,\n", "        max_regression=0.01,\n"
                            "        refused_branch=['record_refused'],\n")  # fmt: skip
    source = source.replace(
        "    gate >> export_onnx() >> publish()",
        "    @task\n    def record_refused() -> str:\n        return 'recorded'\n\n"
        "    gate >> export_onnx() >> [publish(), record_refused()]",
    )
    dag = dag_in_bundle(tmp_path, monkeypatch, dag_id, source)
    assert dag.get_task("gate").refused_branch == ("record_refused",)

    states = {ti.task_id: str(ti.state) for ti in dag.test(run_conf={"floor": 0.9})
              .get_task_instances()}  # fmt: skip
    assert states == {
        "train": "success", "gate": "success", "export_onnx": "success", "publish": "skipped",
        "record_refused": "success",
    }, states  # fmt: skip


def test_refused_branch_is_a_list_of_task_ids():
    with pytest.raises(ValueError, match="refused_branch must be a list of task ids"):
        ModelGateOperator(task_id="gate", bucket_uri="s3://b", model_name="m",
                          metrics={"val_accuracy": 1.0, "output": "s3://b/r"},
                          dataset={"uri": "s3://b/d"}, min_accuracy=0.5,
                          refused_branch="record_refused")  # fmt: skip


def test_a_passed_gate_returns_its_decision_and_lets_the_chain_run(
    s3_server, airflow_db, tmp_path, monkeypatch
):
    client = s3_server.client()
    bucket = s3_server.new_bucket("gate")
    _champion(client, bucket, 0.99)
    etag = client.head_object(Bucket=bucket, Key="models/mnist_cnn/latest.json")["ETag"]
    dag, run_output = _gate_dag(
        tmp_path, monkeypatch, bucket, accuracy=0.985
    )  # within max_regression 0.01

    run = dag.test(run_conf={"floor": 0.9})
    states = {ti.task_id: str(ti.state) for ti in run.get_task_instances()}
    assert set(states.values()) == {"success"}, states

    decision = _xcoms(run)[("gate", "return_value")]
    gate_json = json.loads(storage.read_text(f"{run_output}/gate.json", client=client))
    assert gate_json == {"format": GATE.format, **decision}
    assert decision["passed"] is True and decision["champion_version"] == "v-champion"
    assert decision["challenger_accuracy"] == 0.985 and decision["champion_accuracy"] == 0.99
    assert decision["min_accuracy"] == 0.9 and decision["champion_etag"] == etag


def test_the_first_model_is_judged_by_the_floor_alone(s3_server):
    client = s3_server.client()
    bucket = s3_server.new_bucket("gate")
    run = f"s3://{bucket}/runs/first"
    op = gate_op(
        bucket_uri=f"s3://{bucket}",
        metrics={"top1": 0.97, "val_accuracy": 0.1, "output": run},
        metric_key="top1",
        min_accuracy=0.95,
        aws_conn_id=None,
    )
    decision = op.execute({})
    assert decision is not None and decision["passed"] is True
    assert decision["challenger_accuracy"] == 0.97  # metric_key's value, not val_accuracy
    assert decision["champion_etag"] is None and "no champion yet" in decision["reason"]
    gate_json = json.loads(storage.read_text(f"{run}/gate.json", client=client))
    assert gate_json == {"format": GATE.format, **decision}
    assert not storage.exists(f"s3://{bucket}/models/mnist_cnn/latest.json", client=client)


def test_a_store_that_does_not_answer_while_rescoring_fails_the_gate_to_be_retried(
    s3_server, monkeypatch
):
    """A champion measured on other data must be re-scored; if the store answers 503 SlowDown
    meanwhile, the gate task fails (Airflow retries it). It does not refuse the challenger and
    skip publishing over a blip, and records no decision."""
    from scripts.devstack import S3Server
    from tests.s3_faults import faulty_s3

    client = s3_server.client()
    bucket = s3_server.new_bucket("gate")
    doc = {"model": "mnist_cnn", "version": "v-champion",
           "uri": f"s3://{bucket}/models/mnist_cnn/v-champion",
           "manifest_uri": f"s3://{bucket}/models/mnist_cnn/v-champion/manifest.json",
           "onnx_uri": f"s3://{bucket}/models/mnist_cnn/v-champion/model.onnx",
           "onnx_sha256": "0" * 64, "val_accuracy": 0.99,
           "dataset_content_hash": "measured-on-other-data"}  # fmt: skip
    client.put_object(Bucket=bucket, Key="models/mnist_cnn/latest.json", Body=LATEST.dumps(doc))
    run = f"s3://{bucket}/runs/blip"

    def slow_down(method: str, path: str) -> tuple[int, str] | None:
        # latest.json reads fine; everything the re-scoring reads answers "slow down"
        return None if path.endswith("/latest.json") or method != "GET" else (503, "SlowDown")

    with faulty_s3(s3_server.endpoint, slow_down) as proxy:
        flaky = S3Server(endpoint=proxy.endpoint, env=s3_server.env)
        monkeypatch.setenv("AIRFLOW_CONN_AWS_FLAKY", flaky.airflow_conn_uri_json())
        op = gate_op(
            bucket_uri=f"s3://{bucket}",
            metrics={"val_accuracy": 0.99, "output": run},
            aws_conn_id="aws_flaky",
        )
        with pytest.raises(storage.TransientStorageError, match="SlowDown"):
            op.execute({})
    assert proxy.answered, "the re-scoring never reached the store"
    assert not storage.exists(f"{run}/gate.json", client=client)  # no decision was made


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"min_accuracy": 0.5}, "min_accuracy 0.5 is below this deployment's floor 0.9"),
        ({"max_regression": 0.5}, "max_regression 0.5 is above this deployment's ceiling 0.02"),
    ],
)
def test_a_run_cannot_lower_the_deployments_bar(s3_server, settings, message):
    """Floors bind what a trigger may ask for: rendered past them, the gate fails without a
    retry and records no decision."""
    client = s3_server.client()
    bucket = s3_server.new_bucket("gate")
    run = f"s3://{bucket}/runs/lowered"
    op = gate_op(
        bucket_uri=f"s3://{bucket}", metrics={"val_accuracy": 0.99, "output": run},
        min_accuracy="{{ params.min_accuracy }}", max_regression="{{ params.max_regression }}",
        min_accuracy_floor=0.9, max_regression_ceiling=0.02, aws_conn_id=None,
    )  # fmt: skip
    ctx = {"params": {"min_accuracy": 0.95, "max_regression": 0.01, **settings}}
    op.render_template_fields(ctx)
    with pytest.raises(HorovodConfigError, match=message) as err:
        op.execute(ctx)
    assert isinstance(err.value, AirflowFailException)
    assert not storage.exists(f"{run}/gate.json", client=client)
    with pytest.raises(ValueError, match="below this deployment's floor"):
        gate_op(min_accuracy=0.5, min_accuracy_floor=0.9)  # a literal: at parse time
