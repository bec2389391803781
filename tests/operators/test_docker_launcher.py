"""Docker launcher with the engine client patched where it is imported (no Docker engine on
the test machine; a real podman run is a separate, engine-marked test elsewhere).

The client double records calls and serves a scripted attach stream and exit status; the
host config is built by docker-py's real ``HostConfig`` so the asserted spec is the one the
engine would receive.
"""

from __future__ import annotations

import io
import json
import tarfile
import threading
from typing import Any
from unittest import mock

import pytest
import requests

from horovod_airflow.operators import (
    HorovodLaunchError,
    HorovodRefusedError,
    HorovodTimeoutError,
    HorovodTrainingError,
    HorovodTrainOperator,
)
from horovod_airflow.operators.command import RANK_ENV_FILE_VAR, RANK_ENV_WRAPPER
from horovod_airflow.operators.launchers.base import JobSpec
from horovod_airflow.operators.launchers.docker import (
    SECRET_FILE,
    DockerLauncher,
    DockerOptions,
    split_mounts,
)
from tests.operators.fakes import FakeDockerClient, LineLog
from tests.operators.helpers import PROGRAM, context

SECRET = "docker-test-secret-value"


def spec(**kw: Any) -> JobSpec:
    base = dict(
        name="hvd-train-1234",
        argv=[*PROGRAM, "--data", "s3://b/d", "--output", "s3://b/o"],
        env={"AWS_ENDPOINT_URL": "http://seaweedfs:8333"},
        secret_env={"AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE"},
        num_proc=2,
        gpus_per_proc=1,
        timeout=600,
    )
    return JobSpec(**{**base, **kw})


def launcher(client: FakeDockerClient, **kw: Any) -> DockerLauncher:
    return DockerLauncher(image="hva/trainer:1", client=client, options=DockerOptions(**kw))


def test_private_ipc_gets_the_sized_shm():
    client = FakeDockerClient([], {"StatusCode": 0})
    launcher(client, ipc_mode="shareable", shm_size="2g").run(spec(), LineLog())
    host = client.created["host_config"]
    assert host["IpcMode"] == "shareable"
    assert host["ShmSize"] == 2 * 1024**3


def test_container_spec_gpus_shm_ipc_mounts_and_secret_free_command():
    client = FakeDockerClient([b"[0]<stdout>:hello\n[1]<stdout>:hi\n"], {"StatusCode": 0})
    from docker.types import Mount

    log = LineLog()
    mounts = [
        "/work/main:/work/main:ro",
        Mount("/opt/venv", "/opt/venv", type="bind", read_only=True),
    ]
    result = launcher(client, mounts=mounts, shm_size="2g").run(spec(), log)

    created = client.created
    assert created["image"] == "hva/trainer:1"
    assert created["command"] == [
        "horovodrun",
        "--gloo",
        "-np",
        "2",
        "-H",
        "localhost:2",
        *RANK_ENV_WRAPPER,
        *PROGRAM,
        "--data",
        "s3://b/d",
        "--output",
        "s3://b/o",
    ]
    # No credential in what `docker inspect` shows (command, environment): a file instead,
    # copied in before the container starts, that the ranks' wrapper sources.
    assert SECRET not in json.dumps(created, default=str)
    assert "AWS_SECRET_ACCESS_KEY" not in created["environment"]
    assert created["environment"][RANK_ENV_FILE_VAR] == SECRET_FILE
    assert created["environment"]["AWS_ENDPOINT_URL"] == "http://seaweedfs:8333"
    [(path, archive)] = client.archives
    assert path == "/"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        member = tar.getmember(SECRET_FILE.lstrip("/"))
        text = tar.extractfile(member).read().decode()  # type: ignore[union-attr]
    assert f"AWS_SECRET_ACCESS_KEY={SECRET}" in text.splitlines()
    host = created["host_config"]
    assert host["DeviceRequests"] == [
        {"Driver": "", "Count": 2, "DeviceIDs": [], "Capabilities": [["gpu"]], "Options": {}}
    ]
    assert host["IpcMode"] == "host"
    assert "ShmSize" not in host  # the host's /dev/shm; podman refuses a size with host IPC
    assert host["Init"] is True
    assert host["Binds"] == ["/work/main:/work/main:ro"]
    assert host["Mounts"][0]["Source"] == "/opt/venv" and host["Mounts"][0]["ReadOnly"]
    # look-up → create → attach(stream, logs) → start → wait → remove, in that order
    assert [c[0] for c in client.calls] == [
        "inspect_image",
        "inspect",
        "create",
        "put_archive",
        "attach",
        "start",
        "wait",
        "remove",
    ]
    attach = dict(client.calls)["attach"]
    assert attach["stream"] and attach["logs"]
    assert [ln for ln in log.lines if not ln.startswith("created")] == [
        "[0]<stdout>:hello",
        "[1]<stdout>:hi",
    ]
    assert result.exit_code == 0


def test_cpu_job_requests_no_gpus():
    client = FakeDockerClient([], {"StatusCode": 0})
    launcher(client).run(spec(gpus_per_proc=0), LineLog())
    assert client.created["host_config"].get("DeviceRequests") is None


def test_lines_split_across_chunks_and_secrets_redacted():
    chunks = [b"[0]<stdout>:par", b"tial line\n[0]<stdout>:key " + SECRET.encode() + b"\n", b"end"]
    client = FakeDockerClient(chunks, {"StatusCode": 0})
    log = LineLog()
    launcher(client).run(spec(), log)
    assert [ln for ln in log.lines if not ln.startswith("created")] == [
        "[0]<stdout>:partial line",
        "[0]<stdout>:key ***",
        "end",
    ]


@pytest.mark.parametrize(
    ("cleanup", "status", "secrets", "removed"),
    [
        ("delete", 3, False, True),
        ("delete_on_success", 3, False, False),
        ("delete_on_success", 0, False, True),
        ("keep", 0, False, False),
        # A container whose environment holds credentials never outlives the job.
        ("delete_on_success", 3, True, True),
        ("keep", 0, True, True),
        ("keep", 3, True, True),
    ],
)
def test_failure_raises_with_tail_and_cleanup_policy(cleanup, status, secrets, removed):
    chunks = [b"[1]<stderr>:CUDA error: out of memory\n", b"Process name: 1\nExit code: 3\n"]
    client = FakeDockerClient(chunks, {"StatusCode": status})
    job = spec() if secrets else spec(secret_env={})
    task_log = LineLog()
    run = lambda: launcher(client, cleanup=cleanup).run(job, task_log)  # noqa: E731
    if status:
        with pytest.raises(HorovodTrainingError, match="rank 1 failed first") as err:
            run()
        assert err.value.exit_code == 3
        assert "[1]<stderr>:CUDA error: out of memory" in err.value.log_tail
        # rank 1's exit 3: the program refused, as the launcher itself now says (not retried)
        assert isinstance(err.value, HorovodRefusedError)
    else:
        run()
    assert (("remove", True) in client.calls) is removed
    if secrets and cleanup != "delete" and (cleanup == "keep" or status):
        assert any("holds credentials" in line for line in task_log.lines), task_log.lines


class RemovalRefusedClient(FakeDockerClient):
    """An engine that refuses the removal (409: removal already in progress)."""

    def remove_container(self, cid: str, force=False) -> None:
        from docker.errors import APIError

        self.calls.append(("remove", force))
        raise APIError("removal of container is already in progress",
                       response=mock.Mock(status_code=409))  # fmt: skip


@pytest.mark.parametrize("status", [0, 7])
def test_a_refused_removal_is_a_warning_never_the_tasks_outcome(status):
    """After a success the work is done: the job succeeds; after a failure, that failure
    (not the removal's) is what the task reports."""
    client = RemovalRefusedClient([b"done\n", b"Process name: 0\nExit code: 7\n"],
                                  {"StatusCode": status})  # fmt: skip
    task_log = LineLog()
    job = launcher(client, cleanup="delete")
    if status == 0:
        assert job.run(spec(), task_log).exit_code == 0
    else:
        with pytest.raises(HorovodTrainingError, match="exited with code 7"):
            job.run(spec(), task_log)
    warned = [line for line in task_log.lines if "could not remove container" in line]
    assert warned and "docker rm -f" in warned[0], task_log.lines
    assert ("succeeded" if status == 0 else "failed") in warned[0]


def test_timeout_stops_the_container():
    client = FakeDockerClient([b"slow\n"], requests.exceptions.ReadTimeout("read timed out"))
    with pytest.raises(HorovodTimeoutError) as err:
        launcher(client, cleanup="delete").run(spec(timeout=5), LineLog())
    assert err.value.timeout == 5
    assert ("wait", 5) in client.calls
    assert [c[0] for c in client.calls][-2:] == ["stop", "remove"]


def test_on_kill_stops_the_running_container_and_is_idempotent():
    block = threading.Event()
    client = FakeDockerClient([b"running\n"], {"StatusCode": 137}, block=block)
    dl = launcher(client)
    dl.kill()  # nothing started yet → no-op apart from refusing to start later
    assert client.calls == []
    dl = launcher(client)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            dl.run(spec(), LineLog())
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    for _ in range(100):
        if ("wait", 600) in client.calls:
            break
        threading.Event().wait(0.05)
    dl.kill()
    dl.kill()
    worker.join(10)
    assert isinstance(errors[0], HorovodTrainingError) and "on_kill" in str(errors[0])
    assert client.calls.count(("stop", "c0ffee" * 10)) >= 1
    assert client.calls[-1] == ("remove", True)


def test_operator_uses_docker_hook_with_injectable_url(s3_server):
    """The operator builds the client through the provider's DockerHook (patched where it is
    imported), with docker_url / docker_conn_id passed through, and reads metrics after."""
    from horovod_airflow.core.contract import METRICS

    client = FakeDockerClient([b"[0]<stdout>:done\n"], {"StatusCode": 0})
    bucket = s3_server.new_bucket()
    s3_server.client().put_object(
        Bucket=bucket, Key="out/metrics.json", Body=METRICS.dumps({"val_accuracy": 0.9}).encode()
    )
    op = HorovodTrainOperator(
        task_id="train",
        launcher="docker",
        image="hva/trainer:1",
        num_proc=2,
        entrypoint=PROGRAM,
        data=f"s3://{bucket}/d",
        output=f"s3://{bucket}/out",
        docker=DockerOptions(docker_url="unix:///run/podman/podman.sock", docker_conn_id=None),
    )
    with mock.patch("horovod_airflow.operators.launchers.docker.DockerHook") as hook_cls:
        hook_cls.return_value.get_conn.return_value = client
        result = op.execute(context())
    hook_cls.assert_called_once_with(docker_conn_id=None, base_url="unix:///run/podman/podman.sock")
    assert result["val_accuracy"] == 0.9
    env = client.created["environment"]
    secret = s3_server.env["AWS_SECRET_ACCESS_KEY"]
    assert "AWS_SECRET_ACCESS_KEY" not in env and env[RANK_ENV_FILE_VAR] == SECRET_FILE
    assert env["AWS_ENDPOINT_URL"] == s3_server.endpoint
    assert secret not in json.dumps(client.created, default=str)
    assert secret.encode() in client.archives[0][1]  # the file copied into the container


def test_bad_mount_is_named():
    with pytest.raises(ValueError, match="mount '/a' must be 'host_path:container_path"):
        split_mounts(["/a"])
    with pytest.raises(ValueError, match="mode must be 'ro' or 'rw'"):
        split_mounts(["/a:/b:rx"])


def test_an_image_the_engine_has_is_not_pulled():
    client = FakeDockerClient([b"ok\n"], {"StatusCode": 0})
    launcher(client).run(spec(), LineLog())
    assert ("inspect_image", "hva/trainer:1") in client.calls
    assert not [c for c in client.calls if c[0] == "pull"]


def test_a_missing_image_is_pulled_before_the_container_is_created():
    client = FakeDockerClient([b"ok\n"], {"StatusCode": 0})
    client.images = set()
    log = LineLog()
    DockerLauncher(image="registry:5000/team/trainer:2", client=client).run(spec(), log)
    names = [c[0] for c in client.calls]
    assert names.index("pull") < names.index("create")
    assert ("pull", "registry:5000/team/trainer:2") in client.calls
    assert "pulled registry:5000/team/trainer:2" in log.lines


def test_force_pull_pulls_an_image_the_engine_has():
    client = FakeDockerClient([b"ok\n"], {"StatusCode": 0})
    launcher(client, force_pull=True).run(spec(), LineLog())
    assert ("pull", "hva/trainer:1") in client.calls


def test_a_failed_pull_names_the_image_and_creates_nothing():
    from horovod_airflow.operators import HorovodLaunchError

    client = FakeDockerClient([b"ok\n"], {"StatusCode": 0})
    client.images = set()
    client.pull_events = [{"error": "unauthorized: authentication required"}]
    with pytest.raises(HorovodLaunchError, match=r"cannot pull image 'hva/trainer:1': unauth"):
        launcher(client).run(spec(), LineLog())
    assert "create" not in [c[0] for c in client.calls]


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("trainer", ("trainer", "latest")),
        ("trainer:1", ("trainer", "1")),
        ("registry:5000/team/trainer", ("registry:5000/team/trainer", "latest")),
        ("registry:5000/team/trainer:2", ("registry:5000/team/trainer", "2")),
        ("trainer@sha256:" + "a" * 64, ("trainer@sha256:" + "a" * 64, None)),
    ],
)
def test_split_image(image, expected):
    from horovod_airflow.operators.launchers.docker import split_image

    assert split_image(image) == expected


def left_container(running: bool) -> dict[str, Any]:
    """A container an earlier try left, as ``inspect_container`` describes it."""
    return {
        "Id": "01d" * 20,
        "Name": "hvd-train-1234",
        "State": {"Running": running, "Status": "running" if running else "exited",
                  "ExitCode": 0 if running else 137},
        "Config": {"Labels": {"try_number": "1", "horovod-airflow/job": "hvd-train-1234"}},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("left", "race", "calls", "message"),
    [
        (
            None,
            None,
            ["inspect", "create", "put_archive", "attach", "start", "wait"],
            "created container",
        ),
        (
            left_container(running=True),
            None,
            ["inspect", "attach", "wait"],
            "(made by try 1) is still running: re-attaching to it",
        ),
        (
            left_container(running=False),
            None,
            ["inspect", "remove", "create", "put_archive", "attach", "start", "wait"],
            "removing container hvd-train-1234 (made by try 1, exited, exit code 137)",
        ),
        (
            None,
            left_container(running=True),
            ["inspect", "create", "inspect", "attach", "wait"],
            "still running: re-attaching",
        ),
    ],
    ids=["first try", "running", "exited", "409 on create"],
)
def test_a_retry_reattaches_to_a_running_container_and_replaces_an_exited_one(
    left, race, calls, message
):
    client = FakeDockerClient([b"[0]<stdout>:epoch 1\n"], {"StatusCode": 0})
    client.existing, client.race = left, race
    log = LineLog()
    result = launcher(client).run(spec(labels={"try_number": "2"}), log)
    assert result.exit_code == 0 and "[0]<stdout>:epoch 1" in log.lines
    assert any(message in line for line in log.lines), log.lines
    started = [c[0] for c in client.calls if c[0] not in ("inspect_image",)]
    assert started[: len(calls)] == calls
    attach = next(kw for name, kw in client.calls if name == "attach")
    assert attach["logs"] is True  # a re-attached container's earlier output is replayed
    if "start" in calls:
        assert client.created["labels"] == {
            "try_number": "2",
            "horovod-airflow/job": "hvd-train-1234",
        }


@pytest.mark.parametrize(
    ("errors", "copies", "fails"),
    [([500], 2, False), ([500, 502, 500], 3, True), ([404], 1, True)],
    ids=["one engine error: copied again", "three: the try fails", "a client error: no copy again"],
)
def test_a_failed_copy_of_the_credentials_file_is_tried_again_only_on_engine_errors(
    errors, copies, fails
):
    client = FakeDockerClient([b"[0]<stdout>:epoch 1\n"], {"StatusCode": 0})
    client.archive_errors = errors
    log = LineLog()
    with mock.patch("time.sleep"):
        if fails:
            with pytest.raises(HorovodLaunchError, match="cannot copy the credentials file"):
                launcher(client).run(spec(), log)
        else:
            assert launcher(client).run(spec(), log).exit_code == 0
    names = [c[0] for c in client.calls]
    assert names.count("put_archive") == copies
    assert len({data for _, data in client.archives}) == 1  # the same file each time
    if fails:  # removed before it ever started
        assert "start" not in names and ("remove", True) in client.calls
    else:
        assert names.index("start") > max(i for i, n in enumerate(names) if n == "put_archive")
    assert SECRET not in "\n".join(log.lines)


def test_progress_events_reach_the_task_log_and_the_task_state_store():
    from horovod_airflow.core.contract import EVENT_PROGRESS, event_line
    from horovod_airflow.operators.launchers.base import JobJournal
    from horovod_airflow.operators.progress import PROGRESS_STATE_KEY
    from tests.operators.fakes import TaskStateStore

    fields = {"step": 5, "of_steps": 10, "epoch": 1, "of_epochs": 2, "samples_per_sec": 800.0,
              "eta_seconds": 65.0, "loss": 0.5, "lr": 0.01}  # fmt: skip
    line = f"[0]<stdout>:{event_line(EVENT_PROGRESS, fields)}\n".encode()
    client = FakeDockerClient([b"[0]<stdout>:hello\n", line], {"StatusCode": 0})
    store, log = TaskStateStore(), LineLog()
    docker = launcher(client)
    docker.journal = JobJournal(store, 1, log)
    docker.run(spec(), log)
    assert "progress: epoch 1/2, step 5/10 (50.0%), 800 samples/s, ETA 1m05s, loss 0.5000" in (
        log.lines
    )
    assert {k: v for k, v in store[PROGRESS_STATE_KEY].items() if k != "updated_at"} == fields
