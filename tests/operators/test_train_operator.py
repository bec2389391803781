"""HorovodTrainOperator / HorovodExportOperator: validation, templating, results, no torch."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from airflow.exceptions import AirflowException
from airflow.sdk.exceptions import AirflowFailException

from horovod_airflow.core.contract import METRICS, PARITY
from horovod_airflow.operators import (
    HorovodConfigError,
    HorovodExportOperator,
    HorovodLaunchError,
    HorovodOperatorError,
    HorovodPreflightError,
    HorovodTimeoutError,
    HorovodTrainingError,
    HorovodTrainOperator,
    TrainingCompletedError,
)
from horovod_airflow.operators.command import RANK_ENV_WRAPPER, Host
from horovod_airflow.operators.launchers.local import check_slots
from horovod_airflow.trainer.model import preprocessing
from tests.operators.fakes import TaskLog
from tests.operators.helpers import PROGRAM, context

REPO = Path(__file__).resolve().parents[2]


def train_op(**kwargs) -> HorovodTrainOperator:
    base = {"task_id": "train", "data": "s3://b/data", "output": "s3://b/out", "num_proc": 2}
    return HorovodTrainOperator(**{**base, **kwargs})


def test_template_fields():
    assert set(HorovodTrainOperator.template_fields) == {
        "launcher",
        "data",
        "output_uri",
        "trainer_args",
        "env",
        "image",
        "num_proc",
        "elastic",  # its min_np and max_np (ElasticOptions.template_fields)
    }
    assert {"checkpoint", "output_uri", "data", "export_args", "env", "image"} <= set(
        HorovodExportOperator.template_fields
    )


def test_templates_render_and_num_proc_is_validated_after_rendering():
    op = train_op(
        num_proc="{{ params.np }}",
        data="s3://b/{{ params.ds }}",
        output="s3://b/runs/{{ run_id }}",
        trainer_args={"epochs": "{{ params.epochs }}"},
        env={"RUN": "{{ run_id }}"},
        entrypoint=PROGRAM,
        aws_conn_id=None,
        preflight=False,
    )
    ctx = {**context(run_id="r1"), "params": {"np": 2, "ds": "datasets/x", "epochs": 3}}
    op.render_template_fields(ctx)
    assert (op.data, op.output_uri, op.env) == (
        "s3://b/datasets/x",
        "s3://b/runs/r1",
        {"RUN": "r1"},
    )
    spec = op.build_spec(ctx)
    assert spec.num_proc == 2
    program = [*PROGRAM, "--data", "s3://b/datasets/x", "--output", "s3://b/runs/r1",
               "--epochs", "3"]  # fmt: skip
    assert list(spec.argv) == program  # what to run; the launcher builds how
    command = op.make_launcher().command(spec)
    assert command[:6] == ["horovodrun", "--gloo", "-np", "2", "-H", "localhost:2"]
    assert command[6:10] == list(RANK_ENV_WRAPPER)
    assert command[10:] == program

    op.num_proc = "two"  # what a bad template renders to
    with pytest.raises(ValueError, match="num_proc must be an integer ≥ 1, got 'two'"):
        op.build_spec(ctx)


def test_the_controller_reaches_every_launcher():
    """`controller` is horovodrun's flag on the worker and in the job spec the container and
    MPIJob launchers build their horovodrun command from."""
    ctx = context(run_id="r1")
    op = train_op(controller="mpi", entrypoint=PROGRAM, aws_conn_id=None, preflight=False)
    local = op.build_spec(ctx)
    assert op.make_launcher().command(local)[:2] == ["horovodrun", "--mpi"]
    assert local.controller == "mpi"
    op = train_op(launcher="docker", image="hva/trainer:1", controller="auto", aws_conn_id=None)
    docker = op.build_spec(ctx)
    assert docker.controller == "auto" and docker.argv[0] != "horovodrun"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_proc": 0}, "num_proc must be an integer ≥ 1"),
        ({"num_proc": 1.5}, "num_proc must be an integer"),
        ({"launcher": "slurm"}, "launcher must be one of local, docker, kubernetes; got 'slurm'"),
        ({"launcher": "docker"}, "image is required when launcher='docker'"),
        ({"gpus_per_proc": -1}, "gpus_per_proc must be an integer ≥ 0"),
        ({"data": ""}, "data must be a dataset URI"),
        ({"output": None}, "output must be an output URI"),
        ({"entrypoint": "python train.py"}, "entrypoint must be a non-empty list"),
        (
            {"trainer_args": {"--x": 1}},
            "trainer_args: '--x' is not an option of `python -m horovod_airflow.trainer",
        ),
        ({"hosts": "a:0"}, "hosts is an option of launcher 'local' only: pass local=LocalOpt"),
        ({"timeout": -5}, "timeout: removed; set Airflow's execution_timeout"),
        (
            {"cleanup": "sometimes"},
            "cleanup is an option of launcher 'docker' and 'kubernetes' only: pass "
            "docker=DockerOptions(cleanup=...) or kubernetes=KubernetesOptions(cleanup=...)",
        ),
        ({"env": {"BAD NAME": "x"}}, "env: 'BAD NAME' is not a valid environment variable"),
        ({"ssh_port": 70000}, "ssh_port is an option of launcher 'local' only"),
        (
            {"docker": {"mounts": []}},
            "docker must be a DockerOptions (from horovod_airflow.operators.launchers",
        ),
        ({"image": "hva/trainer:1"}, "image='hva/trainer:1': only used by launcher 'docker' and"),
        ({"metric_key": ""}, "metric_key must be a non-empty string"),
        ({"controller": "nccl"}, "controller must be one of ['auto', 'gloo', 'mpi'], got 'nccl'"),
    ],
)
def test_bad_arguments_are_named_at_parse_time(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        train_op(**kwargs)


def test_a_misspelt_trainer_option_fails_at_parse_time_even_with_templated_values():
    """The keys of ``trainer_args`` are checked against ``trainer train``'s declared options
    when the operator is built (its values may be templates; its keys never are)."""
    with pytest.raises(ValueError, match=r"trainer_args: 'epoch' is not an option .*epochs"):
        train_op(trainer_args={"epoch": "{{ params.epochs }}"})
    with pytest.raises(ValueError, match="'output' is set by the operator itself"):
        train_op(trainer_args={"output": "s3://b/elsewhere"})
    train_op(trainer_args={"epochs": "{{ params.epochs }}", "lr": 0.01})  # known keys pass
    train_op(entrypoint=["python", "mine.py"], trainer_args={"epoch": 2})  # not our trainer


def test_export_on_kubernetes_needs_an_image():
    with pytest.raises(ValueError, match="image is required when launcher='kubernetes'"):
        HorovodExportOperator(
            task_id="e", checkpoint="s3://b/c.pt", output="s3://b/o", launcher="kubernetes"
        )


def test_exceptions_are_typed_airflow_exceptions_with_tail():
    for cls in (HorovodLaunchError, HorovodTrainingError, HorovodPreflightError):
        assert issubclass(cls, HorovodOperatorError)
    assert issubclass(HorovodTimeoutError, HorovodOperatorError)
    assert issubclass(HorovodOperatorError, AirflowException)
    err = HorovodTrainingError("boom", exit_code=3, log_tail=["a", "b"])
    assert err.exit_code == 3 and err.log_tail == ["a", "b"] and str(err).endswith("a\nb")


@pytest.mark.parametrize(
    ("num_proc", "hosts", "gpus", "cpus", "gpu_count", "message"),
    [
        (4, [Host("a", 2)], 0, 8, 0, "num_proc=4 but hosts 'a:2' offer only 2 slots"),
        (2, [Host("localhost", 2)], 1, 8, 1, "needs 2 GPUs, but this machine has 1"),
        (
            3,
            [Host("localhost", 3)],
            0,
            2,
            0,
            r"num_proc=3 CPU ranks on localhost but os.cpu_count\(\)=2",
        ),
    ],
)
def test_preflight_slot_checks_name_the_numbers(num_proc, hosts, gpus, cpus, gpu_count, message):
    with pytest.raises(HorovodPreflightError, match=message):
        check_slots(num_proc, hosts, gpus, cpu_count=cpus, gpu_count=gpu_count)
    check_slots(2, [Host("localhost", 2)], 0, cpu_count=2, gpu_count=0)  # fits: no error


def test_preflight_refuses_more_ranks_than_cores_before_launching(tmp_path):
    import os

    op = train_op(
        num_proc=(os.cpu_count() or 1) + 1,
        entrypoint=PROGRAM,
        aws_conn_id=None,
        data=str(tmp_path),
        output=str(tmp_path / "out"),
    )
    with pytest.raises(HorovodPreflightError, match=r"os\.cpu_count"):
        op.execute(context())


def test_doctor_failure_stops_the_launch(tmp_path):
    """With our trainer as entrypoint, its doctor runs first; a refusal is a preflight error."""
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho \"doctor: $*\"; echo 'no gloo here' >&2; exit 4\n")
    fake_python.chmod(0o755)
    op = train_op(
        entrypoint=(str(fake_python), "-m", "horovod_airflow.trainer", "train"),
        aws_conn_id=None,
        data=str(tmp_path),
        output=str(tmp_path / "out"),
    )
    with pytest.raises(HorovodPreflightError, match="exited 4") as err:
        op.execute(context())
    assert (
        "doctor: -m horovod_airflow.trainer doctor --np 2 --gpus-per-proc 0" in err.value.log_tail
    )
    assert "no gloo here" in err.value.log_tail


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


def test_metrics_are_read_from_metrics_json(out_dir):
    (out_dir / "metrics.json").write_text(
        METRICS.dumps(
            {
                "val_accuracy": 0.97,
                "val_loss": 0.1,
                "val_samples": 500,
                "epochs": 2,
                "world_size": 2,
                "artifacts": {"checkpoint": str(out_dir / "checkpoint.pt")},
            }
        )
    )
    op = train_op(output=str(out_dir), aws_conn_id=None)
    assert op.collect_result() == {
        "val_accuracy": 0.97,
        "val_loss": 0.1,
        "val_samples": 500,
        "epochs": 2,
        "world_size": 2,
        "output": str(out_dir),
        "metrics_uri": f"{out_dir}/metrics.json",
        "checkpoint_uri": str(out_dir / "checkpoint.pt"),
    }


def test_an_elastic_runs_world_history_reaches_the_xcom_and_the_task_log(out_dir, capsys):
    history = [
        {"time": 1.0, "epoch": 1, "samples_into_epoch": 0, "from": 0, "to": 3, "left": [],
         "joined": ["10.0.0.1", "10.0.0.2", "10.0.0.3"]},
        {"time": 2.0, "epoch": 1, "samples_into_epoch": 960, "from": 3, "to": 2,
         "left": ["10.0.0.3"], "joined": []},
    ]  # fmt: skip
    elastic = {"commit_every": 20, "world_sizes": [3, 2], "world_history": history,
               "redone_steps": 3, "redone_samples": 384}  # fmt: skip
    (out_dir / "metrics.json").write_text(
        METRICS.dumps({"val_accuracy": 0.97, "world_size": 2, "elastic": elastic})
    )
    op = train_op(output=str(out_dir), aws_conn_id=None)
    log = TaskLog(capsys)
    result = op.collect_result()
    assert result["world_size"] == 2
    assert result["elastic"]["world_sizes"] == [3, 2]
    assert result["elastic"]["world_history"][1]["left"] == ["10.0.0.3"]
    assert (result["elastic"]["redone_steps"], result["elastic"]["redone_samples"]) == (3, 384)
    changes = [line for line in log.text.splitlines() if "world size changed" in line]
    assert len(changes) == 1, log.text
    assert "world size changed 3 -> 2 in epoch 1 (left: 10.0.0.3; joined: none)" in changes[0]


def test_missing_optional_keys_are_none_and_custom_metric_key(out_dir):
    (out_dir / "metrics.json").write_text(METRICS.dumps({"f1": 0.5}))
    op = train_op(output=str(out_dir), aws_conn_id=None, metric_key="f1")
    result = op.collect_result()
    assert result["f1"] == 0.5
    assert result["val_accuracy"] is None and result["checkpoint_uri"] is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "exited 0 but metrics.json is missing"),
        ("not json", "is not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (
            METRICS.dumps({"val_loss": 0.1}),
            r"has no 'val_accuracy' \(metric_key\); keys present: \['format', 'val_loss'\]",
        ),
        (
            METRICS.dumps({"val_accuracy": 0.5}).replace("0.5", '"high"'),
            "metrics.json .* key 'val_accuracy' must be number, got 'high'",
        ),
        (
            '{"val_accuracy": 0.9}',
            "metrics.json has no 'format'; supported: horovod-airflow/metrics-v2, "
            "horovod-airflow/metrics-v1.*"
            "training-program contract",
        ),
        (
            '{"format": "horovod-airflow/metrics-v0", "val_accuracy": 0.9}',
            "metrics.json has format 'horovod-airflow/metrics-v0'; "
            "supported: horovod-airflow/metrics-v2, horovod-airflow/metrics-v1",
        ),
    ],
)
def test_bad_metrics_raise_typed_errors(out_dir, content, message):
    if content is not None:
        (out_dir / "metrics.json").write_text(content)
    with pytest.raises(HorovodOperatorError, match=message):
        train_op(output=str(out_dir), aws_conn_id=None).collect_result()


PARITY_DOCUMENT = PARITY.dumps({"max_abs_diff": 1e-6, "argmax_mismatches": 0, "samples": 8,
                                "tolerance": 1e-4, "passed": True,
                                "preprocessing": preprocessing()})  # fmt: skip


def test_export_runs_one_process_and_returns_parity(tmp_path):
    """The export is one process (no horovodrun) and its result comes from parity.json."""
    program = tmp_path / "fake_export.py"
    program.write_text(
        textwrap.dedent("""
        import json, sys, pathlib
        args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
        out = pathlib.Path(args["--output"]); out.mkdir(parents=True, exist_ok=True)
        (out / "model.onnx").write_bytes(b"onnx")
        passed = args.get("--tolerance", "1e-4") != "0"
        parity = json.loads(PARITY_JSON)
        parity["passed"] = passed
        (out / "parity.json").write_text(json.dumps(parity))
        print("exported", args["--checkpoint"])
        sys.exit(0 if passed else 2)
    """).replace("PARITY_JSON", repr(PARITY_DOCUMENT))
    )
    out = tmp_path / "onnx"
    op = HorovodExportOperator(
        task_id="export",
        checkpoint="s3://b/ckpt.pt",
        output=str(out),
        entrypoint=(sys.executable, str(program)),
        aws_conn_id=None,
    )
    assert op.execute(context()) == {
        "onnx_uri": f"{out}/model.onnx",
        "parity_uri": f"{out}/parity.json",
        "max_abs_diff": 1e-6,
        "argmax_mismatches": 0,
        "passed": True,
    }
    failing = HorovodExportOperator(
        task_id="export2",
        checkpoint="c",
        output=str(out),
        entrypoint=(sys.executable, str(program)),
        aws_conn_id=None,
        export_args={"tolerance": 0},
    )
    with pytest.raises(HorovodTrainingError, match="exited with code 2"):
        failing.execute(context())


def test_dag_files_using_the_operators_parse_without_torch(tmp_path):
    dag_file = tmp_path / "dag_with_horovod.py"
    dag_file.write_text(
        textwrap.dedent("""
        from datetime import datetime
        from airflow.sdk import DAG
        from horovod_airflow.operators import HorovodExportOperator, HorovodTrainOperator
        with DAG("hvd_parse_check", start_date=datetime(2026, 1, 1), schedule=None):
            t = HorovodTrainOperator(task_id="train", num_proc="{{ params.np }}",
                                     data="s3://b/d", output="s3://b/o",
                                     launcher="{{ params.launcher }}")
            e = HorovodExportOperator(task_id="export", checkpoint="s3://b/o/checkpoint.pt",
                                      output="s3://b/o/onnx", launcher="docker", image="img")
            t >> e
    """)
    )
    probe = textwrap.dedent(f"""
        import sys
        from airflow.dag_processing.dagbag import DagBag
        bag = DagBag(dag_folder={str(dag_file)!r})
        assert not bag.import_errors, bag.import_errors
        assert "hvd_parse_check" in bag.dags, list(bag.dags)
        import horovod_airflow.operators.launchers.local, horovod_airflow.operators.launchers.docker
        import horovod_airflow.operators.launchers.kubernetes, horovod_airflow.operators.triggers
        heavy = sorted(m for m in ("torch", "horovod", "torchvision", "onnxruntime")
                       if m in sys.modules)
        assert not heavy, heavy
        print("ok")
    """)
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_env_template_must_render_to_a_dict():
    op = train_op(env="{{ params.env }}", aws_conn_id=None, entrypoint=PROGRAM, preflight=False)
    ctx = {**context(), "params": {"env": "A=1"}}
    op.render_template_fields(ctx)
    with pytest.raises(ValueError, match="env must render to a dict of name → value, got 'A=1'"):
        op.build_spec(ctx)


def test_a_failed_try_resumes_and_a_completed_training_is_refused_on_a_later_try(out_dir):
    op = train_op(output=str(out_dir), aws_conn_id=None, entrypoint=PROGRAM, preflight=False)
    assert "--resume" not in op.build_spec(context(try_number=1)).argv
    assert "--resume" in op.build_spec(context(try_number=2)).argv  # no metrics.json: failed

    (out_dir / "metrics.json").write_text("{}")  # the training of this run completed
    with pytest.raises(TrainingCompletedError) as refused:
        op.build_spec(context(try_number=3))
    assert isinstance(refused.value, AirflowFailException)  # fails without using retries
    message = str(refused.value)
    assert f"{out_dir}/metrics.json exists" in message and "Trigger a new DAG run" in message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_proc": "{{ params.np }}"}, "num_proc must be an integer ≥ 1, got 'zero'"),
        ({"trainer_args": "{{ params.np }}"}, "trainer_args"),
        ({"launcher": "{{ params.np }}"}, "launcher must be one of local, docker, kubernetes"),
    ],
)
def test_a_bad_rendered_setting_fails_without_retry(kwargs, message):
    op = train_op(aws_conn_id=None, preflight=False, **kwargs)
    ctx = {**context(), "params": {"np": "zero"}}
    op.render_template_fields(ctx)
    with pytest.raises(HorovodConfigError, match=message) as err:
        op.build_spec(ctx)
    assert isinstance(err.value, AirflowFailException) and isinstance(err.value, ValueError)


def test_preflight_failures_do_not_use_retries():
    assert issubclass(HorovodPreflightError, AirflowFailException)
    assert issubclass(HorovodPreflightError, HorovodOperatorError)
