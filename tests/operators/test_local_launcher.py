"""The local launcher for real: horovodrun with 2 CPU ranks against the moto S3 server."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from airflow.sdk.exceptions import AirflowFailException

from horovod_airflow.operators import (
    HorovodRefusedError,
    HorovodTimeoutError,
    HorovodTrainingError,
    HorovodTrainOperator,
    TrainingCompletedError,
)
from horovod_airflow.operators.launchers.local import LocalOptions
from tests.operators.fakes import TaskLog
from tests.operators.helpers import PROGRAM, context, put_eval_set, with_launcher_options

pytestmark = pytest.mark.usefixtures("s3_server")


@pytest.fixture
def task_log(capsys: pytest.CaptureFixture[str]) -> TaskLog:
    return TaskLog(capsys)


def make_op(data: str, output: str, **kwargs) -> HorovodTrainOperator:
    kwargs.setdefault("entrypoint", PROGRAM)
    kwargs.setdefault("num_proc", 2)
    return HorovodTrainOperator(
        task_id=kwargs.pop("task_id", "train"),
        data=data,
        output=output,
        **with_launcher_options(kwargs),
    )


def test_two_ranks_return_metrics_from_metrics_json(s3_server, task_log):
    s3 = s3_server.client()
    bucket = s3_server.new_bucket()
    data, accuracy = put_eval_set(s3, bucket, "eval")
    output = f"s3://{bucket}/runs/one"
    op = make_op(data, output, trainer_args={"epochs": 3, "print_env": "AWS_SECRET_ACCESS_KEY"})

    result = op.execute(context())

    metrics = json.loads(s3.get_object(Bucket=bucket, Key="runs/one/metrics.json")["Body"].read())
    assert result["val_accuracy"] == pytest.approx(accuracy) == metrics["val_accuracy"]
    assert result["world_size"] == 2
    assert result["epochs"] == 3
    assert result["val_samples"] == 40
    assert result["output"] == output
    assert result["metrics_uri"] == f"{output}/metrics.json"
    assert result["checkpoint_uri"] is None  # the tiny program writes no checkpoint
    assert metrics["resumed"] is False
    log = task_log.text
    # Rank output was streamed into the task log, with horovodrun's rank prefixes.
    assert "[0]<stdout>:" in log and "[1]<stdout>:" in log
    # The credentials reached the ranks (rank 0 reports it) but never the log.
    assert "env AWS_SECRET_ACCESS_KEY is set" in log
    assert s3_server.env["AWS_SECRET_ACCESS_KEY"] not in log


def test_retry_passes_resume(s3_server, task_log):
    s3 = s3_server.client()
    bucket = s3_server.new_bucket()
    data, _ = put_eval_set(s3, bucket, "eval")
    op = make_op(data, f"s3://{bucket}/runs/retry")

    op.execute(context(try_number=2))

    metrics = json.loads(s3.get_object(Bucket=bucket, Key="runs/retry/metrics.json")["Body"].read())
    assert metrics["resumed"] is True
    assert "started resume=True" in task_log.text


def test_a_later_try_returns_the_training_an_earlier_try_completed(s3_server, task_log):
    """Try 1's job finished and wrote metrics.json, then the task failed (its clean-up, the
    result read or the XCom push). Try 2 returns that training's result and trains nothing;
    a try with other settings is refused instead of reusing or overwriting it."""
    s3 = s3_server.client()
    bucket = s3_server.new_bucket()
    data, _ = put_eval_set(s3, bucket, "eval")
    output = f"s3://{bucket}/runs/done"
    first = make_op(data, output).execute(context(try_number=1))
    written = s3.head_object(Bucket=bucket, Key="runs/done/metrics.json")["ETag"]
    launches = task_log.text.count("launching 2 ranks")

    again = make_op(data, output).execute(context(try_number=2))
    assert again == first
    assert task_log.text.count("launching 2 ranks") == launches  # no second job
    assert "an earlier try completed this training" in task_log.text
    assert s3.head_object(Bucket=bucket, Key="runs/done/metrics.json")["ETag"] == written

    with pytest.raises(TrainingCompletedError, match="world_size: recorded 2, now 1") as err:
        make_op(data, output, num_proc=1).execute(context(try_number=3))
    assert isinstance(err.value, AirflowFailException)
    with pytest.raises(TrainingCompletedError, match="dataset: recorded"):
        make_op(f"s3://{bucket}/other", output).execute(context(try_number=2))
    with pytest.raises(TrainingCompletedError, match="epochs: recorded 1, now 5"):
        make_op(data, output, trainer_args={"epochs": 5}).execute(context(try_number=2))


def test_failing_rank_raises_training_error_with_log_tail(s3_server):
    bucket = s3_server.new_bucket()
    data, _ = put_eval_set(s3_server.client(), bucket, "eval")
    op = make_op(data, f"s3://{bucket}/runs/fail", trainer_args={"fail_rank": 1, "exit_code": 7})

    with pytest.raises(HorovodTrainingError) as err:
        op.execute(context())

    assert err.value.exit_code != 0
    tail = "\n".join(err.value.log_tail)
    assert "rank 1: failing on purpose with exit code 7" in tail
    assert "failing on purpose" in str(err.value)
    assert not isinstance(err.value, AirflowFailException)  # a crash: Airflow retries it


@pytest.mark.parametrize("code", [2, 3])
def test_a_rank_that_refuses_fails_the_task_without_retry(s3_server, code):
    """Exit 2 (bad command line) or 3 (refused inputs: a checkpoint of other settings, data
    that fails its checks) from a rank, through horovodrun: every retry would meet the same
    refusal, so the task fails for good (AirflowFailException), naming the exit code."""
    bucket = s3_server.new_bucket()
    data, _ = put_eval_set(s3_server.client(), bucket, "eval")
    op = make_op(
        data, f"s3://{bucket}/runs/refuse", trainer_args={"fail_rank": 1, "exit_code": code}
    )
    with pytest.raises(HorovodRefusedError) as err:
        op.execute(context())
    assert isinstance(err.value, AirflowFailException)
    assert isinstance(err.value, HorovodTrainingError)  # still what a caller catches today
    assert f"exit code {code}: the program refused" in str(err.value)
    assert "failing on purpose" in str(err.value)  # the rank's own lines lead
    assert any("failing on purpose" in line for line in err.value.log_tail)  # kept for callers
    assert str(err.value).count("failing on purpose") == str(err.value.__cause__).count(
        "failing on purpose"
    )  # the tail is not repeated


def _job_processes(marker: str) -> list[psutil.Process]:
    """Every live process whose command line mentions ``marker`` (this test's output URI)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(
                p.info["cmdline"] or []
            ):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _execute_in_thread(op: HorovodTrainOperator) -> tuple[threading.Thread, dict]:
    """Run ``op.execute`` in a thread (as Airflow's task runner would, leaving this thread
    free to watch and kill); the exception it raised ends up in ``outcome["error"]``."""
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            op.execute(context())
        except BaseException as e:
            outcome["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return worker, outcome


def test_on_kill_leaves_no_process_and_no_secret_on_any_command_line(s3_server, task_log):
    bucket = s3_server.new_bucket()
    data, _ = put_eval_set(s3_server.client(), bucket, "eval")
    output = f"s3://{bucket}/runs/killed"
    op = make_op(data, output, trainer_args={"sleep": 120}, kill_grace_s=5)
    worker, outcome = _execute_in_thread(op)
    _wait_for(lambda: task_log.text.count("sleeping 120") >= 2, 120, "both ranks to sleep")

    procs = _job_processes(output)
    assert len(procs) >= 3  # horovodrun + 2 ranks (+ their sh wrappers)
    secret = s3_server.env["AWS_SECRET_ACCESS_KEY"]
    key_id = s3_server.env["AWS_ACCESS_KEY_ID"]
    # The rank wrapper exec()s the program, so a rank's command line is the program's own.
    ranks = [p for p in procs if p.cmdline()[:3] == list(PROGRAM)]
    for p in procs:
        cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes().decode(errors="replace")
        assert secret not in cmdline and key_id not in cmdline, p.cmdline()
    # The ranks do hold the credentials, in their private environment.
    assert len(ranks) == 2, [p.cmdline() for p in procs]
    for p in ranks:
        assert p.environ().get("AWS_SECRET_ACCESS_KEY") == secret

    op.on_kill()
    op.on_kill()  # idempotent
    worker.join(60)
    assert not worker.is_alive()
    assert isinstance(outcome.get("error"), HorovodTrainingError)
    leftovers = _job_processes(output)
    assert leftovers == [], [p.cmdline() for p in leftovers]
    assert secret not in task_log.text


def test_timeout_stops_the_job(s3_server):
    bucket = s3_server.new_bucket()
    data, _ = put_eval_set(s3_server.client(), bucket, "eval")
    output = f"s3://{bucket}/runs/slow"
    op = make_op(
        data,
        output,
        trainer_args={"sleep": 120},
        execution_timeout=timedelta(seconds=30),
        kill_grace_s=5,
    )

    with pytest.raises(HorovodTimeoutError) as err:
        op.execute(context())

    # The deadline is what execution_timeout leaves after the preflight, less a tenth.
    assert 15 < err.value.timeout <= 27
    assert _job_processes(output) == []


@pytest.mark.slow
def test_sigkilled_task_process_leaves_no_ranks(s3_server, tmp_path):
    """If the Airflow task process dies without on_kill (SIGKILL, OOM killer), horovodrun
    gets SIGTERM from the kernel (parent-death signal) and stops its ranks."""
    import signal
    import subprocess
    import sys

    bucket = s3_server.new_bucket()
    data, _ = put_eval_set(s3_server.client(), bucket, "eval")
    output = f"s3://{bucket}/runs/orphan"
    script = tmp_path / "task.py"
    script.write_text(
        "from horovod_airflow.operators import HorovodTrainOperator\n"
        "from tests.operators.helpers import PROGRAM, context\n"
        f"op = HorovodTrainOperator(task_id='t', num_proc=2, entrypoint=PROGRAM, data={data!r},\n"
        f"    output={output!r}, trainer_args={{'sleep': 120}})\n"
        "op.execute(context())\n"
    )
    task = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: list[str] = []

    def both_sleeping() -> bool:
        assert task.stdout is not None
        line = task.stdout.readline()
        seen.append(line)
        return "".join(seen).count("sleeping 120") >= 2

    _wait_for(both_sleeping, 120, "both ranks to sleep")
    assert len(_job_processes(output)) >= 3
    task.send_signal(signal.SIGKILL)
    task.wait(10)
    _wait_for(lambda: _job_processes(output) == [], 60, "horovodrun and its ranks to exit")


@pytest.mark.slow
def test_horovodrun_killed_leaves_no_ranks(s3_server, task_log):
    """horovodrun itself SIGKILLed: the ranks it started in their own sessions are found
    (by the job's marker in their environment) and killed; the task fails naming the exit."""
    import signal

    bucket = s3_server.new_bucket()
    data, _ = put_eval_set(s3_server.client(), bucket, "eval")
    output = f"s3://{bucket}/runs/horovodrun-dies"
    op = make_op(data, output, trainer_args={"sleep": 120}, kill_grace_s=5)
    worker, outcome = _execute_in_thread(op)
    _wait_for(lambda: task_log.text.count("sleeping 120") >= 2, 120, "both ranks to sleep")
    import os

    # The launcher's own child: horovodrun (the others are its rank middlemen and ranks).
    (horovodrun,) = [p for p in _job_processes(output) if p.ppid() == os.getpid()]
    assert "horovodrun" in " ".join(horovodrun.cmdline())
    horovodrun.send_signal(signal.SIGKILL)
    worker.join(60)
    assert not worker.is_alive(), "the launcher still waits on the orphaned ranks"
    assert isinstance(outcome.get("error"), HorovodTrainingError), outcome
    assert "-9" in str(outcome["error"]) or "SIGKILL" in str(outcome["error"]), outcome["error"]
    leftovers = _job_processes(output)
    assert leftovers == [], [p.cmdline() for p in leftovers]


def test_processes_reparented_away_from_a_dead_launch_are_killed(tmp_path):
    """A process that left the job's tree (its own session, its parent SIGKILLed, so it was
    reparented) is still found, by the job's environment marker, and killed; the launcher
    does not wait for it although it holds the output pipe."""
    import logging

    from horovod_airflow.operators.launchers.base import JobSpec
    from horovod_airflow.operators.launchers.local import LocalLauncher

    pid_file = tmp_path / "orphan.pid"
    script = tmp_path / "launch.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"setsid sleep 300 & echo $! > {pid_file}\n"
        "echo 'started the orphan'\n"
        "sleep 0.5; kill -9 $$\n"
    )
    script.chmod(0o755)
    spec = JobSpec(name="orphan", argv=[str(script)], num_proc=1, distributed=False)
    started = time.monotonic()
    with pytest.raises(HorovodTrainingError) as err:
        LocalLauncher(options=LocalOptions(kill_grace_s=2)).run(spec, logging.getLogger("test"))
    assert time.monotonic() - started < 60  # not the orphan's 300 s
    assert "started the orphan" in err.value.log_tail
    orphan = int(pid_file.read_text())

    def gone() -> bool:
        try:
            return psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    _wait_for(gone, 10, "the orphan to die")


@pytest.mark.parametrize("host", ["this worker", "another worker"])
def test_a_retry_stops_what_the_job_recorded_by_an_earlier_try_left_running(
    s3_server, task_log, host
):
    """Try 1's job is recorded in the task state store (host, marker). A process of it that
    outlived its worker (here one that was reparented away) is stopped before try 2 starts its
    own, so two jobs never write one output; on another worker nothing can be checked (said)."""
    import os
    import socket
    import subprocess

    from horovod_airflow.operators.launchers.base import JOB_STATE_KEY
    from horovod_airflow.operators.launchers.local import JOB_MARKER_VAR
    from tests.operators.fakes import TaskStateStore

    marker = "4242-0123456789abcdef"
    left = subprocess.Popen(
        ["sleep", "300"], env={**os.environ, JOB_MARKER_VAR: marker}, start_new_session=True
    )
    recorded_host = socket.gethostname() if host == "this worker" else "worker-7"
    store = TaskStateStore(
        {JOB_STATE_KEY: {"launcher": "local", "host": recorded_host, "id": marker,
                         "pid": left.pid, "try_number": 1}}
    )  # fmt: skip
    bucket = s3_server.new_bucket()
    data, _ = put_eval_set(s3_server.client(), bucket, "eval")
    try:
        make_op(data, f"s3://{bucket}/runs/left").execute(context(try_number=2, store=store))
        if host == "this worker":
            assert left.wait(timeout=30) is not None  # stopped before try 2 started
            assert "try 1 of this task instance left 1 process(es) of its job" in task_log.text
        else:
            assert left.poll() is None  # not this worker's to stop
            assert "ran its job on worker worker-7" in task_log.text
    finally:
        left.kill()
        left.wait()
    now = store[JOB_STATE_KEY]
    assert now["launcher"] == "local" and now["try_number"] == 2
    assert now["host"] == socket.gethostname() and now["id"] != marker
