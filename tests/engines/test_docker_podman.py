"""The docker launcher against a real engine: podman's Docker-compatible API.

The image is the registry-free runtime image of ``scripts/engines/podman_engine.sh``; the venv
and the source are bind-mounted read-only. The container uses host networking so the ranks
reach the session's S3 server on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from typing import Any

import pytest

from horovod_airflow.operators import HorovodTrainingError, HorovodTrainOperator
from horovod_airflow.operators.command import RANK_ENV_FILE_VAR
from horovod_airflow.operators.launchers.docker import SECRET_FILE
from horovod_airflow.operators.staging import stage_dataset
from tests.engines.conftest import JOB_LABEL, PodmanEngine, read_json
from tests.operators.fakes import TaskLog as OperatorTaskLog
from tests.operators.fakes import TaskStateStore
from tests.operators.helpers import context, with_launcher_options

# Each test starts horovodrun and imports torch in a container: over a minute on 2 busy cores.
pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.usefixtures("job_containers_removed"),
]

PROBE = ("python", "-m", "tests.engines.hvd_probe")


class TaskLog(OperatorTaskLog):
    """The operator's task log, which a test can wait on while the job runs."""

    def wait_for(self, needle: str, timeout: float, job: Running) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and job.thread.is_alive():
            if needle in self.text:
                return
            time.sleep(0.2)
        raise AssertionError(
            f"{needle!r} not in the task log within {timeout}s (job error: {job.error!r}); "
            f"log tail:\n{self.text[-3000:]}"
        )


@pytest.fixture
def task_log(capsys: pytest.CaptureFixture[str]) -> TaskLog:
    return TaskLog(capsys)


def docker_op(engine: PodmanEngine, data: str, output: str, **kwargs: Any) -> HorovodTrainOperator:
    kwargs.setdefault("entrypoint", PROBE)
    # The loose launcher settings go into the options object of the launcher they belong to.
    settings = dict(
        task_id=kwargs.pop("task_id", "train_in_podman"),
        launcher="docker",
        image=engine.image,
        docker_url=engine.docker_url,
        mounts=engine.mounts,
        env=engine.env,
        network_mode="host",  # the S3 server listens on the host's 127.0.0.1
        # The launcher sets ipc_mode="host" (the host's /dev/shm), where a shm size means
        # nothing: Docker ignores it, podman refuses the container ("cannot set shmsize when
        # running in the host IPC Namespace"). None leaves it out.
        shm_size=None,
        num_proc=2,
        data=data,
        output=output,
        **kwargs,
    )
    return HorovodTrainOperator(**with_launcher_options(settings))


def fresh_context() -> dict[str, Any]:
    """A task context with a run id of its own: container names derive from it."""
    return context(run_id=f"manual__{uuid.uuid4().hex[:8]}")


class Running:
    """``execute`` in a thread, as the Airflow worker runs it while on_kill may arrive."""

    def __init__(self, op: HorovodTrainOperator) -> None:
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(op,), daemon=True)
        self.thread.start()

    def _run(self, op: HorovodTrainOperator) -> None:
        try:
            self.result = op.execute(fresh_context())
        except BaseException as e:
            self.error = e

    def join(self, timeout: float) -> float:
        start = time.monotonic()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"execute still running after {timeout}s"
        return time.monotonic() - start


def containers_named(engine: PodmanEngine, name_part: str) -> list[dict[str, Any]]:
    return [c for c in engine.job_containers() if any(name_part in n for n in c["Names"])]


def test_trainer_two_ranks_in_one_container_returns_metrics(
    podman_engine, s3_server, mnist_subset, task_log
):
    bucket = s3_server.new_bucket("podman")
    staged = stage_dataset(str(mnist_subset), f"s3://{bucket}", client=s3_server.client())
    output = f"s3://{bucket}/runs/podman"
    op = docker_op(
        podman_engine,
        staged["uri"],
        output,
        entrypoint=("python", "-m", "horovod_airflow.trainer", "train"),
        trainer_args={"epochs": 1, "max_train_samples": 1024, "max_val_samples": 256},
        cleanup="delete",
    )

    store = TaskStateStore()
    result = op.execute(context(run_id=f"manual__{uuid.uuid4().hex[:8]}", store=store))

    metrics = read_json(s3_server, f"{output}/metrics.json")
    assert result["world_size"] == metrics["world_size"] == 2
    assert result["val_accuracy"] == metrics["val_accuracy"]
    assert 0.0 <= result["val_accuracy"] <= 1.0
    assert result["val_samples"] == metrics["val_samples"] == 256
    assert result["checkpoint_uri"] == f"{output}/checkpoint.pt"
    log = task_log.text
    assert "created container" in log
    assert '"event": "final_metrics"' in log  # rank 0's last line came through the attach
    # Live progress through the container's attach: readable task-log lines, and the latest
    # event in the task state store (the task page), the run's last step included.
    assert "progress: epoch 1/1, step 8/8 (100.0%)" in log, log[-3000:]
    progress = store["horovod_progress"]
    assert (progress["step"], progress["of_steps"], progress["epoch"]) == (8, 8, 1)
    assert containers_named(podman_engine, "train-in-podman") == []  # removed


def test_logs_stream_live_and_secrets_reach_the_ranks_as_a_file_only(
    podman_engine, s3_server, task_log
):
    secret = s3_server.env["AWS_SECRET_ACCESS_KEY"]
    bucket = s3_server.new_bucket("podman")
    output = f"s3://{bucket}/runs/live"
    op = docker_op(
        podman_engine,
        "s3://unused/data",
        output,
        task_id="live_logs",
        trainer_args={"hold_seconds": 30},
        cleanup="delete",
    )

    job = Running(op)
    # Lines arrive while the container still runs: streamed, not collected at the end.
    task_log.wait_for("probe rank=1 holding", timeout=300, job=job)
    client = podman_engine.client()
    (running,) = containers_named(podman_engine, "live-logs")
    inspect = client.inspect_container(running["Id"])
    # Not in anything `inspect` shows (environment, command, labels, mounts): a file the
    # launcher copied in before the start, which the ranks sourced (they read S3 with it).
    assert secret not in json.dumps(inspect)
    assert f"{RANK_ENV_FILE_VAR}={SECRET_FILE}" in inspect["Config"]["Env"]
    # Inside the container, no process (horovodrun, the ranks' sh -c) shows it either.
    ps = client.exec_create(running["Id"], ["ps", "-eo", "pid,args", "--no-headers"])
    processes = client.exec_start(ps["Id"]).decode()
    assert "hvd_probe" in processes
    assert secret not in processes

    job.join(timeout=300)
    assert job.error is None, job.error
    assert job.result is not None
    assert job.result["val_accuracy"] == 1.0  # the allreduce summed both ranks
    assert job.result["world_size"] == 2
    assert len(set(read_json(s3_server, f"{output}/metrics.json")["hosts"])) == 1  # one container
    log = task_log.text
    assert secret not in log
    assert containers_named(podman_engine, "live-logs") == []


def test_on_kill_stops_the_running_container(podman_engine, s3_server, task_log):
    bucket = s3_server.new_bucket("podman")
    op = docker_op(
        podman_engine,
        "s3://unused/data",
        f"s3://{bucket}/runs/killed",
        task_id="killed",
        trainer_args={"hold_seconds": 300},
        cleanup="delete",
    )

    job = Running(op)
    task_log.wait_for("probe rank=0 holding", timeout=300, job=job)
    (running,) = containers_named(podman_engine, "killed")
    assert running["State"] == "running"

    op.on_kill()
    took = job.join(timeout=60)
    op.on_kill()  # a second call (Airflow may send two) is a no-op

    assert isinstance(job.error, HorovodTrainingError), job.error
    assert "was stopped (on_kill, exit code" in str(job.error)  # base.end_of_job
    assert took < 45, f"on_kill took {took:.0f}s to stop the container"
    assert containers_named(podman_engine, "killed") == []


def test_failing_trainer_surfaces_exit_code_and_output_tail(podman_engine, s3_server, task_log):
    bucket = s3_server.new_bucket("podman")
    missing = f"s3://{bucket}/datasets/mnist/0000000000000000"
    op = docker_op(
        podman_engine,
        missing,
        f"s3://{bucket}/runs/failed",
        task_id="failing",
        entrypoint=("python", "-m", "horovod_airflow.trainer", "train"),
        trainer_args={"epochs": 1},
        cleanup="delete_on_success",  # the default keeps a failed container, but not this one
    )

    with pytest.raises(HorovodTrainingError) as caught:
        op.execute(fresh_context())

    error = caught.value
    message = str(error)
    assert error.exit_code not in (None, 0)
    assert f"exited with code {error.exit_code}" in message
    assert "rank 0 failed first" in message or "rank 1 failed first" in message
    # The trainer's own last lines, naming what was wrong, are in the exception.
    assert missing in message
    assert error.log_tail and any(missing in line for line in error.log_tail)
    # It holds the S3 connection's keys (the credentials file): the container goes despite
    # delete_on_success, after its final state is logged (its output already is).
    assert containers_named(podman_engine, "failing") == []
    assert "despite cleanup='delete_on_success'" in task_log.text
    assert f"'ExitCode': {error.exit_code}" in task_log.text


def test_failed_container_without_credentials_is_kept_to_inspect(podman_engine, task_log):
    op = docker_op(
        podman_engine,
        "/nonexistent/data",  # the probe reads neither; no aws_conn_id: no credentials
        "/nonexistent/out",
        task_id="keptfail",
        aws_conn_id=None,
        trainer_args={"fail_rank": 1},
        cleanup="delete_on_success",
    )
    with pytest.raises(HorovodTrainingError) as caught:
        op.execute(fresh_context())
    assert caught.value.exit_code not in (None, 0)
    assert "failing on purpose" in str(caught.value)
    (kept,) = containers_named(podman_engine, "keptfail")  # job_containers_removed clears it
    assert kept["Labels"][JOB_LABEL].startswith("hvd-keptfail-")
    assert kept["State"] == "exited"
    assert "despite cleanup" not in task_log.text


REGISTRY = "127.0.0.1:5055"  # podman_engine.sh lets the engine pull from it over plain HTTP


@pytest.fixture(scope="module")
def local_registry(podman_engine: PodmanEngine, tmp_path_factory: pytest.TempPathFactory):
    """Debian's docker-registry (the reference registry, distribution 2.8) on loopback."""
    import shutil
    import subprocess
    import urllib.request

    if shutil.which("docker-registry") is None:
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "docker-registry"],
            capture_output=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            timeout=600, check=False,
        )  # fmt: skip
    if shutil.which("docker-registry") is None:
        pytest.skip("docker-registry (Debian package) is not installed and apt-get failed")
    root = tmp_path_factory.mktemp("registry")
    (root / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {root / 'data'}\nhttp:\n  addr: {REGISTRY}\n"
    )
    with open(root / "registry.log", "w") as registry_log:
        proc = subprocess.Popen(
            ["docker-registry", "serve", str(root / "config.yml")],
            stdout=subprocess.DEVNULL, stderr=registry_log,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://{REGISTRY}/v2/", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        f"docker-registry did not serve: {(root / 'registry.log').read_text()}"
                    )
                time.sleep(0.2)
        yield REGISTRY
    finally:
        proc.terminate()
        proc.wait(10)


def test_an_image_missing_from_the_engine_is_pulled_from_its_registry(
    podman_engine, local_registry, s3_server, task_log
):
    import subprocess

    remote = f"{local_registry}/hva-runtime:{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "CONTAINERS_CONF": "/var/tmp/hva-podman/containers.conf"}
    push = subprocess.run(
        ["podman", "push", "--tls-verify=false", podman_engine.image, remote],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert push.returncode == 0, push.stderr
    client = podman_engine.client()
    from docker.errors import ImageNotFound

    with pytest.raises(ImageNotFound):
        client.inspect_image(remote)  # only the registry has it

    bucket = s3_server.new_bucket("podman")
    output = f"s3://{bucket}/runs/pulled"
    op = docker_op(podman_engine, "s3://unused/data", output, task_id="pulled", cleanup="delete")
    op.image = remote
    try:
        result = op.execute(fresh_context())
        assert result["world_size"] == 2
        log = task_log.text
        assert f"image {remote} is not on the engine: pulling it" in log
        assert f"pulled {remote}" in log
        assert client.inspect_image(remote)["Id"]
    finally:
        with contextlib.suppress(Exception):
            client.remove_image(remote)
    assert containers_named(podman_engine, "pulled") == []


def test_a_container_of_the_jobs_name_that_no_try_recorded_is_left_alone(
    podman_engine, s3_server, task_log
):
    """A running container has this task instance's name, but the task state store says try 1
    started another one: it was re-created by someone else. Try 2 neither re-attaches to it
    (it would wait on a stranger's job and report its output) nor removes it, and says so."""
    from horovod_airflow.operators.exceptions import JobNotOursError
    from horovod_airflow.operators.launchers.base import JOB_STATE_KEY

    bucket = s3_server.new_bucket("podman")
    op = docker_op(podman_engine, "s3://unused/data", f"s3://{bucket}/runs/x", task_id="fenced")
    store = TaskStateStore()
    ctx = context(try_number=2, run_id=f"manual__{uuid.uuid4().hex[:8]}", store=store)
    name, _ = op.job_identity(ctx)
    client = podman_engine.client()
    stranger = client.create_container(
        podman_engine.image, command=["sleep", "120"], name=name,
        labels={JOB_LABEL: name, "try_number": "1"},
    )["Id"]  # fmt: skip
    client.start(stranger)
    store[JOB_STATE_KEY] = {"launcher": "docker", "name": name, "id": "0" * 64, "try_number": 1}
    try:
        with pytest.raises(JobNotOursError, match=f"container {name} \\({stranger[:12]}"):
            op.execute(ctx)
        (still,) = containers_named(podman_engine, name)
        assert still["Id"] == stranger and still["State"] == "running"
    finally:
        client.remove_container(stranger, force=True)


def test_a_later_try_returns_what_an_earlier_tries_container_trained(
    podman_engine, s3_server, task_log
):
    """Try 1's container finished and wrote metrics.json, then the task failed (its clean-up,
    the result read or the XCom push). Try 2 returns that result and starts no container."""
    from tests.operators.helpers import context

    bucket = s3_server.new_bucket("podman")
    output = f"s3://{bucket}/runs/finished"
    run_id = f"manual__{uuid.uuid4().hex[:8]}"

    def op() -> HorovodTrainOperator:
        return docker_op(podman_engine, "s3://unused/data", output, task_id="finished")

    first = op().execute(context(try_number=1, run_id=run_id))
    assert task_log.text.count("created container") == 1
    again = op().execute(context(try_number=2, run_id=run_id))
    assert again == first and first["world_size"] == 2
    assert task_log.text.count("created container") == 1  # no second container
    assert "an earlier try completed this training" in task_log.text
