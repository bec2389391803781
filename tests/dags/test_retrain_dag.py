"""The retraining DAG: parses light, validates its form, and runs end to end for real.

The end-to-end tests run the real DAG with ``dag.test()`` — real Airflow (SQLite metadata),
real ``horovodrun`` with 2 CPU ranks, the real S3 API server on loopback, a real ONNX file
checked by onnxruntime — on a small training subset so they take a minute or two.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from horovod_airflow.core import storage
from horovod_airflow.operators.model_registry.promote import list_refused_candidates, list_versions
from horovod_airflow.operators.pipeline import run_prefix

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "horovod", "onnx", "onnxruntime", "matplotlib", "torchvision")


def test_dagbag_imports_cleanly_without_heavy_modules(airflow_db):
    code = (
        "import sys, json\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        "bag = DagBag(sys.argv[1])\n"
        "print(json.dumps({'errors': {k: str(v) for k, v in bag.import_errors.items()},\n"
        "  'dags': sorted(bag.dags), 'heavy': [m for m in sys.argv[2:] if m in sys.modules]}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "dags"), *HEAVY],
        capture_output=True, text=True, check=True, env=os.environ.copy(), timeout=300,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}
    assert result["dags"] == [
        "horovod_bucket_retention",
        "mnist_horovod_retrain",
        "mnist_serve_latest_model",
    ]
    assert result["heavy"] == [], f"DAG parsing imported {result['heavy']}"


@pytest.fixture(autouse=True)
def _hva_bucket_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """_load_dag sets HVA_BUCKET for the test (the DAG reads it at import and dag.test()
    re-parses it); put the variable back afterwards, so no later test inherits the bucket."""
    monkeypatch.setenv("HVA_BUCKET", os.environ.get("HVA_BUCKET", "horovod-airflow"))


def _load_dag(bucket: str, module: str = "dags.mnist_horovod_retrain"):
    """Import the DAG module fresh with HVA_BUCKET set (settings are read at import)."""
    os.environ["HVA_BUCKET"] = bucket
    import horovod_airflow.operators.settings

    importlib.reload(horovod_airflow.operators.settings)
    mod = importlib.reload(importlib.import_module(module))
    return mod


def _deploy(bucket: str, module: str = "dags.mnist_horovod_retrain"):
    """Import the DAG with this bucket as a deployment would, ready for ``dag.test()``.

    Every test deploys with a bucket of its own into one metadata DB, so the Asset name of
    the published model has a different URI each time. Airflow keeps one active URI per
    asset name; the scheduler's orphanage pass would retire the previous test's URI once no
    DAG declares it, but dag.test() runs no scheduler. Retire it here, so the DAG sync inside
    dag.test() activates this test's URI (else the outlet is refused as inactive)."""
    from airflow.models.asset import AssetActive
    from airflow.utils.session import create_session

    mod = _load_dag(bucket, module)
    # A serving DAG is scheduled on the Asset; a retraining DAG's publish emits it.
    dag = getattr(mod, "serve_dag", None) or mod.retrain_dag
    asset = (
        dag.task_dict["publish"].outlets[0]
        if "publish" in dag.task_dict
        else dag.timetable.asset_condition.objects[0]
    )
    with create_session() as session:
        session.query(AssetActive).filter(
            AssetActive.name == asset.name, AssetActive.uri != asset.uri
        ).delete(synchronize_session=False)
    return mod


def test_dag_shape_schedule_and_form():
    mod = _load_dag("shape-check")
    dag = mod.retrain_dag
    assert dag.dag_id == "mnist_horovod_retrain"
    assert dag.max_active_runs == 1 and dag.catchup is False
    assert dag.doc_md and "gate" in dag.doc_md
    assert [t.task_id for t in dag.topological_sort()] == [
        "stage_dataset", "train", "gate", "export_onnx", "publish", "record_refused"
    ]  # fmt: skip
    publish = dag.get_task("publish")
    assert [o.uri for o in publish.outlets] == ["s3://shape-check/models/mnist_cnn/latest.json"]
    # The trigger form shows each Param by its title, with its description under the field.
    assert len(dag.params) == 9
    for name in dag.params:
        schema = dag.params.get_param(name).schema
        assert schema.get("title") and dag.params.get_param(name).description, name


@pytest.mark.parametrize(
    ("conf", "bad"),
    [
        ({"num_proc": 0}, "num_proc"),
        ({"min_accuracy": 1.5}, "min_accuracy"),
        ({"launcher": "slurm"}, "launcher"),
        ({"epochs": "three"}, "epochs"),
        ({"dataset_source": "ftp://somewhere"}, "dataset_source"),
    ],
)
def test_bad_conf_is_rejected_by_the_form(conf, bad):
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    mod = _load_dag("conf-check")
    params = ParamsDict(mod.retrain_dag.params)
    with pytest.raises(ParamValidationError, match=f"param {bad}"):
        for k, v in conf.items():
            params[k] = v  # what a trigger with this conf does, Param by Param
        params.validate()


@pytest.mark.parametrize(
    ("conf", "bad"),
    [
        ({"min_accuracy": 0.5}, "min_accuracy"),  # below the deployment's floor
        ({"max_regression": 1.0}, "max_regression"),  # above its ceiling
        ({"dataset_source": "vendored\n"}, "dataset_source"),  # a trailing newline
        ({"dataset_source": "s3://bucket/x\ny"}, "dataset_source"),
    ],
)
def test_the_deployments_floors_bind_the_form(monkeypatch, conf, bad):
    """HVA_MIN_ACCURACY_FLOOR / HVA_MAX_REGRESSION_CEILING are the form's bounds (its defaults
    stay inside them), and the gate and staging tasks get the same bounds."""
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    monkeypatch.setenv("HVA_MIN_ACCURACY_FLOOR", "0.99")
    monkeypatch.setenv("HVA_MAX_REGRESSION_CEILING", "0.002")
    monkeypatch.setenv("HVA_DATASET_SOURCES", "vendored,s3://bucket/")
    try:
        mod = _load_dag("floors")
        params = ParamsDict(mod.retrain_dag.params)
        params.validate()  # the defaults: inside the bounds (0.98 -> 0.99, 0.005 -> 0.002)
        assert params["min_accuracy"] == 0.99 and params["max_regression"] == 0.002
        with pytest.raises(ParamValidationError, match=f"param {bad}"):
            for k, v in conf.items():
                params[k] = v
            params.validate()
        gate = mod.retrain_dag.get_task("gate")
        assert (gate.min_accuracy_floor, gate.max_regression_ceiling) == (0.99, 0.002)
        stage = mod.retrain_dag.get_task("stage_dataset")
        assert stage.allowed_sources == ("vendored", "s3://bucket/")
    finally:
        monkeypatch.undo()
        _load_dag("floors")  # the settings without the floors again, for the next tests


def test_bad_conf_is_rejected_by_the_airflow_cli(airflow_db):
    """`airflow dags test` (the real CLI) refuses a conf that violates a Param."""
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "airflow"), "dags", "test", "mnist_horovod_retrain",
         "--conf", json.dumps({"num_proc": 0})],
        capture_output=True, text=True, env=os.environ.copy(), timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "num_proc" in proc.stdout + proc.stderr


_TASK_ERRORS: dict[tuple[str, str], str] = {}


@pytest.fixture(autouse=True)
def _record_task_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """dag.test() logs no task's exception where a test sees it: keep each failed task's
    traceback (by run and task) so an assertion on a run's state can say why it failed."""
    import traceback

    from airflow.sdk.execution_time import supervisor

    real = supervisor.run_task_in_process

    def recording(ti, task):
        result = real(ti=ti, task=task)
        if result.error is not None:
            _TASK_ERRORS[(ti.run_id, ti.task_id)] = "".join(
                traceback.format_exception(result.error)
            )
        return result

    monkeypatch.setattr(supervisor, "run_task_in_process", recording)


class _States(dict):
    """Task states; its repr adds each failed task's traceback."""

    def __init__(self, states: dict[str, str], errors: dict[str, str]) -> None:
        super().__init__(states)
        self.errors = errors

    def __repr__(self) -> str:
        tails = "".join(f"\n--- {task} ---\n{text[-4000:]}" for task, text in self.errors.items())
        return dict.__repr__(self) + tails


def _states(dag_run) -> _States:
    states = {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}
    errors = {
        task: text for (run_id, task), text in _TASK_ERRORS.items() if run_id == dag_run.run_id
    }
    return _States(states, errors)


def _cli_run_states(dag_id: str, conf: str) -> dict[str, str]:
    """Task states of the latest run of ``dag_id`` with ``conf``, from the metadata DB."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        runs = [r for r in session.query(DagRun).filter(DagRun.dag_id == dag_id)
                if r.conf == json.loads(conf)]  # fmt: skip
        assert runs, f"no run of {dag_id} with conf {conf}"
        run = max(runs, key=lambda r: r.start_date)
        assert str(run.state) == "success", run.state
        return {ti.task_id: str(ti.state) for ti in run.get_task_instances(session=session)}


def _get(client, bucket: str, key: str) -> bytes:
    return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def _keys(client, bucket: str, prefix: str = "") -> dict[str, str]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = f"{o['ETag']}@{o['LastModified'].isoformat()}"
    return out


SMALL_RUN = {"num_proc": 2, "epochs": 1, "max_train_samples": 3000}
#: The task states of a run whose gate passed: everything ran but the refused branch.
PUBLISHED_RUN = {
    **dict.fromkeys(("stage_dataset", "train", "gate", "export_onnx", "publish"), "success"),
    "record_refused": "skipped",
}


@pytest.mark.slow
def test_pipeline_publishes_then_a_gated_run_changes_nothing(
    s3_server, airflow_db, monkeypatch, capfd
):
    """The ranks run as their own identity (``hva_ranks``: no right under ``models/``), and
    the run still publishes: publish runs on the worker. After the successful run neither
    identity's secret is in any log, task output, XCom or rendered field."""
    from airflow.sdk import DagRunState

    client = s3_server.client()
    bucket = s3_server.new_bucket("pipeline", ranks=True)
    monkeypatch.setenv("HVA_RANK_AWS_CONN_ID", "hva_ranks")
    dag = _deploy(bucket).retrain_dag
    assert dag.get_task("train").rank_aws_conn_id == "hva_ranks"

    # 1. A passing run publishes a model.
    run = dag.test(run_conf={**SMALL_RUN, "min_accuracy": 0.5})
    states = _states(run)
    assert run.state == DagRunState.SUCCESS, states
    assert states == PUBLISHED_RUN, states

    keys = _keys(client, bucket)
    datasets = sorted(k for k in keys if k.startswith("datasets/mnist/"))
    assert any(k.endswith("/manifest.json") for k in datasets)
    run_keys = [k for k in keys if k.startswith("runs/mnist_horovod_retrain/")]
    for name in ("metrics.json", "checkpoint.pt", "gate.json", "onnx/model.onnx",
                 "onnx/parity.json"):  # fmt: skip
        assert any(k.endswith("/" + name) for k in run_keys), name
    latest = json.loads(_get(client, bucket, "models/mnist_cnn/latest.json"))
    version = latest["version"]
    for name in ("model.onnx", "checkpoint.pt", "metrics.json", "parity.json", "manifest.json",
                 "training_curves.png", "summary.md"):  # fmt: skip
        assert f"models/mnist_cnn/{version}/{name}" in keys, name
    metrics = json.loads(_get(client, bucket, f"models/mnist_cnn/{version}/metrics.json"))
    assert metrics["world_size"] == 2
    assert metrics["val_samples"] == 10000  # the whole validation set, no padded duplicates
    assert latest["val_accuracy"] == metrics["val_accuracy"] >= 0.5

    # The ONNX file from S3 runs in onnxruntime (no torch) on the raw test images, prepared
    # only by the preprocessing the model declares, and scores what the allreduced training
    # reported on the same split (within 0.2 points: ONNX fp32 against the trained precision).
    onnx_bytes = _get(client, bucket, f"models/mnist_cnn/{version}/model.onnx")
    code = (
        "import sys, onnxruntime as ort\n"
        "from horovod_airflow.apps.mnist import load_test_images\n"
        "from horovod_airflow.operators.serving import predict\n"
        "s = ort.InferenceSession(sys.stdin.buffer.read())\n"
        "x, y = load_test_images(int(sys.argv[1]))\n"
        "p = predict(s, x)\n"
        "assert 'torch' not in sys.modules\n"
        "print((p == y).mean())\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(metrics["val_samples"])],
                         input=onnx_bytes, capture_output=True, check=True,
                         env=os.environ.copy(), timeout=120)  # fmt: skip
    assert float(out.stdout.decode().strip()) == pytest.approx(metrics["val_accuracy"], abs=0.002)
    output = capfd.readouterr()
    _assert_no_secret_left(run, output.out + output.err, s3_server)

    # 2. A run whose gate cannot pass, triggered through the real Airflow CLI with a conf:
    #    publish skipped, latest.json untouched, the dataset not uploaded again; its exported
    #    model kept as a refused candidate (models/<model>/refused/<version>/), nothing else.
    latest_before = _get(client, bucket, "models/mnist_cnn/latest.json")
    conf = json.dumps({**SMALL_RUN, "min_accuracy": 0.9999})
    cli = subprocess.run(
        [str(Path(sys.executable).parent / "airflow"), "dags", "test", "mnist_horovod_retrain",
         "--conf", conf],
        capture_output=True, text=True, env={**os.environ, "HVA_BUCKET": bucket}, timeout=1200,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stdout[-3000:] + cli.stderr[-3000:]
    states2 = _cli_run_states("mnist_horovod_retrain", conf)
    assert states2 == {
        "stage_dataset": "success", "train": "success", "gate": "success",
        "export_onnx": "success", "publish": "skipped", "record_refused": "success",
    }, states2  # fmt: skip
    latest_after = _get(client, bucket, "models/mnist_cnn/latest.json")
    assert latest_after == latest_before
    keys2 = _keys(client, bucket)
    assert {k: v for k, v in keys2.items() if k.startswith("datasets/")} == {
        k: keys[k] for k in datasets
    }
    gates = [k for k in keys2 if k.endswith("/gate.json") and k not in keys]
    assert len(gates) == 1
    gate = json.loads(_get(client, bucket, gates[0]))
    assert gate["passed"] is False and "below the floor" in gate["reason"]
    assert gate["min_accuracy"] == 0.9999
    new_models = sorted(k for k in keys2 if k.startswith("models/") and k not in keys)
    (candidate,) = list_refused_candidates(f"s3://{bucket}", "mnist_cnn", client=client)
    prefix = f"models/mnist_cnn/refused/{candidate['version']}/"
    assert new_models == sorted(
        prefix + n for n in ("model.onnx", "checkpoint.pt", "metrics.json", "parity.json",
                             "manifest.json", "training_curves.png", "summary.md")
    )  # fmt: skip
    assert candidate["gate"] == gate and candidate["source_run"] + "/gate.json" == (
        f"s3://{bucket}/{gates[0]}"
    )
    assert [v["version"] for v in list_versions(f"s3://{bucket}", "mnist_cnn", client=client)] == [
        version
    ]  # the candidate is no published version
    # Its ONNX file is the run's export (the sha256 its manifest records) and runs in
    # onnxruntime on the test split, scoring what the run measured.
    candidate_onnx = _get(client, bucket, prefix + "model.onnx")
    assert storage.sha256_bytes(candidate_onnx) == candidate["files"]["model.onnx"]["sha256"]
    out = subprocess.run([sys.executable, "-c", code, str(metrics["val_samples"])],
                         input=candidate_onnx, capture_output=True, check=True,
                         env=os.environ.copy(), timeout=120)  # fmt: skip
    assert float(out.stdout.decode().strip()) == pytest.approx(
        candidate["metrics"]["val_accuracy"], abs=0.002
    )

    # 3. The serving-side consumer verifies and runs the published model.
    serve = _deploy(bucket, "dags.serve_latest_model").serve_dag
    srun = serve.test()
    assert srun.state == DagRunState.SUCCESS, _states(srun)
    (ti,) = srun.get_task_instances()
    assert ti.state == "success"
    served = ti.xcom_pull(task_ids="smoke_test_latest")
    assert served["version"] == version and served["samples"] == metrics["val_samples"]
    assert served["served_accuracy"] == pytest.approx(latest["val_accuracy"], abs=0.002)


def test_colliding_run_ids_get_distinct_run_prefixes():
    """Run ids that read alike (a REST-supplied id vs the UI's) never share a runs/ prefix."""
    mod = _load_dag("prefix-check")
    env = mod.retrain_dag.get_template_env()
    ids = ["manual__2026-12-02T10:00:00+00:00", "manual__2026-12-02T10_00_00_00_00",
           "a:b", "a+b", "a b", "r" * 300 + "1", "r" * 300 + "2"]  # fmt: skip
    prefixes = [env.from_string(run_prefix()).render(dag=mod.retrain_dag, run_id=r) for r in ids]
    assert len(set(prefixes)) == len(ids), prefixes
    assert all(p.startswith("s3://prefix-check/runs/mnist_horovod_retrain/") for p in prefixes)
    assert prefixes[0].endswith("/manual__2026-12-02T10_00_00_00_00-" + prefixes[0][-12:])


def test_an_unreachable_s3_fails_naming_endpoint_and_operation_and_leaks_no_secret(
    s3_server, airflow_db, monkeypatch, capfd
):
    """aws_default points at a port nobody listens on: the first task that touches S3 fails
    with the endpoint and the S3 operation in its error, and the secret appears in no log
    file, task output, XCom or rendered field."""
    from airflow.sdk import DagRunState

    from tests.conftest import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    conn = json.loads(s3_server.airflow_conn_uri_json())
    conn["extra"] = {**conn["extra"], "endpoint_url": dead,
                     "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"},
                                       "connect_timeout": 2}}  # fmt: skip
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps(conn))
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    dag = _deploy("unreachable-bucket").retrain_dag
    dag.get_task("stage_dataset").retries = 0  # one try is enough to read its error

    run = dag.test(run_conf=SMALL_RUN)
    states = _states(run)
    assert run.state == DagRunState.FAILED, states
    assert states["stage_dataset"] == "failed", states
    output = capfd.readouterr()
    text = output.out + output.err
    assert f"S3 HeadBucket of s3://unreachable-bucket at {dead} failed" in text, text[-3000:]
    assert "EndpointConnectionError" in text
    _assert_no_secret_left(run, text, s3_server, succeeded=False)


def _assert_no_secret_left(run, printed: str, s3_server, *, succeeded: bool = True) -> None:
    """Neither identity's secret is in ``printed`` (the tasks' output), a log file under
    AIRFLOW_HOME, the run's XComs or its rendered template fields (which a run that
    ``succeeded`` must have: else the check proves nothing)."""
    from airflow.models.renderedtifields import RenderedTaskInstanceFields
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    secrets = [s3_server.env["AWS_SECRET_ACCESS_KEY"]]
    if s3_server.ranks is not None:
        secrets.append(s3_server.ranks.secret_key)
    logs = [p.read_text(errors="replace") for p in Path(os.environ["AIRFLOW_HOME"]).rglob("*.log")]
    with create_session() as session:
        xcoms = session.scalars(select(XComModel).where(XComModel.run_id == run.run_id)).all()
        rendered = session.scalars(
            select(RenderedTaskInstanceFields).where(
                RenderedTaskInstanceFields.run_id == run.run_id
            )
        ).all()
        stored = json.dumps([x.value for x in xcoms], default=str) + json.dumps(
            [r.rendered_fields for r in rendered], default=str
        )
    assert not succeeded or (xcoms and rendered)  # the run's records were found
    for secret in secrets:
        assert secret not in printed
        assert not any(secret in log for log in logs)
        assert secret not in stored


def _rank_processes(marker: str) -> list:
    """Live trainer processes whose command line names ``marker`` (the test's bucket)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.info["status"] != psutil.STATUS_ZOMBIE and marker in cmd and "trainer" in cmd:
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.mark.slow
def test_a_rank_killed_mid_epoch_fails_the_try_and_the_retry_resumes_to_the_same_model(
    s3_server, airflow_db, capfd
):
    """kill -9 of rank 1 in epoch 2 of a real DAG run: the train try fails with the ranks'
    tail, Airflow's retry resumes from the epoch-1 checkpoint, and the model equals an
    uninterrupted run's (same conf, same seed); no process is left behind."""
    import signal
    import threading
    import time
    from datetime import timedelta

    from airflow.sdk import DagRunState

    client = s3_server.client()
    bucket = s3_server.new_bucket("killed")
    conf = {"num_proc": 2, "epochs": 2, "max_train_samples": 12000, "min_accuracy": 0.5}
    killed: dict[str, object] = {}

    def kill_rank_1_after_the_first_checkpoint() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            keys = _keys(client, bucket, "runs/")
            if any(k.endswith("/checkpoint.pt") for k in keys):
                for p in _rank_processes(f"s3://{bucket}/"):
                    try:
                        if p.environ().get("HOROVOD_RANK") == "1" and "train" in p.cmdline():
                            p.send_signal(signal.SIGKILL)
                            killed["pid"] = p.pid
                            return
                    except Exception:
                        continue
            time.sleep(0.1)

    watcher = threading.Thread(target=kill_rank_1_after_the_first_checkpoint, daemon=True)
    watcher.start()
    dag = _deploy(bucket).retrain_dag
    dag.get_task("train").retry_delay = timedelta(seconds=1)
    run = dag.test(run_conf=conf)
    watcher.join(5)
    text = capfd.readouterr().out
    states = _states(run)
    assert killed.get("pid"), "rank 1 was never killed"
    assert run.state == DagRunState.SUCCESS, states
    (train,) = [ti for ti in run.get_task_instances() if ti.task_id == "train"]
    assert train.try_number == 2, train.try_number
    # Try 1 failed naming the dead rank, with the ranks' last lines; try 2 resumed.
    assert "HorovodTrainingError" in text, text[-4000:]
    assert "[1]<stderr>" in text or "[0]<stderr>" in text
    assert "resuming from" in text and "after epoch 1" in text
    assert _rank_processes(f"s3://{bucket}/") == []

    run_keys = _keys(client, bucket, "runs/mnist_horovod_retrain/")
    (resumed_metrics,) = [k for k in run_keys if k.endswith("/metrics.json")]
    resumed = json.loads(_get(client, bucket, resumed_metrics))

    # The same conf again, uninterrupted: a new run, so a fresh run prefix.
    again = dag.test(run_conf=conf)
    assert again.state == DagRunState.SUCCESS, _states(again)
    (fresh_metrics,) = [
        k for k in _keys(client, bucket, "runs/mnist_horovod_retrain/")
        if k.endswith("/metrics.json") and k != resumed_metrics
    ]  # fmt: skip
    fresh = json.loads(_get(client, bucket, fresh_metrics))
    for key in ("val_accuracy", "val_correct", "val_loss", "epochs", "param_hash"):
        assert resumed[key] == fresh[key], (key, resumed[key], fresh[key])
    strip = ("samples_per_sec", "epoch_seconds")
    assert [{k: v for k, v in h.items() if k not in strip} for h in resumed["history"]] == [
        {k: v for k, v in h.items() if k not in strip} for h in fresh["history"]
    ]
    assert _rank_processes(f"s3://{bucket}/") == []


@pytest.mark.slow
def test_a_train_whose_result_read_failed_is_returned_by_the_retry_and_the_run_publishes(
    s3_server, airflow_db, monkeypatch, capfd
):
    """Try 1's training completes, then reading its metrics.json meets a store that answers
    503 SlowDown: the retry policy retries the task (a transient failure), and try 2 returns
    that same training, trains nothing, and the run goes on to publish it."""
    from datetime import timedelta

    from airflow.sdk import DagRunState

    from horovod_airflow.operators.retry import HorovodRetryPolicy
    from tests.s3_faults import faulty_s3

    client = s3_server.client()
    bucket = s3_server.new_bucket("reread")
    faults = {"left": 1}  # one attempt per call (AWS_MAX_ATTEMPTS below): one read fails

    def metrics_read_throttled_once(method: str, path: str) -> tuple[int, str] | None:
        if method == "GET" and path.split("?")[0].endswith("/metrics.json") and faults["left"]:
            faults["left"] -= 1
            return 503, "SlowDown"
        return None

    with faulty_s3(s3_server.endpoint, metrics_read_throttled_once) as proxy:
        conn = json.loads(s3_server.airflow_conn_uri_json())
        conn["extra"] = {**conn["extra"], "endpoint_url": proxy.endpoint}
        monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps(conn))
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries would hide it
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        dag = _deploy(bucket).retrain_dag
        train_task = dag.get_task("train")
        train_task.retry_delay = timedelta(seconds=1)
        train_task.retry_policy = HorovodRetryPolicy(backoff=timedelta(seconds=1))
        run = dag.test(run_conf={**SMALL_RUN, "min_accuracy": 0.5})
    text = capfd.readouterr().out
    states = _states(run)
    assert [a for a in proxy.answered if a[2] == 503], "the metrics read was never throttled"
    assert run.state == DagRunState.SUCCESS, states
    assert states == PUBLISHED_RUN, states
    (train,) = [ti for ti in run.get_task_instances() if ti.task_id == "train"]
    assert train.try_number == 2, proxy.answered
    assert text.count("launching 2 ranks") == 1, "try 2 trained again"
    assert "an earlier try completed this training" in text
    latest = json.loads(_get(client, bucket, "models/mnist_cnn/latest.json"))
    (metrics_key,) = [k for k in _keys(client, bucket, "runs/") if k.endswith("/metrics.json")]
    metrics = json.loads(_get(client, bucket, metrics_key))
    assert latest["val_accuracy"] == metrics["val_accuracy"]  # the model try 1 trained
