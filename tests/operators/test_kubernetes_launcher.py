"""Kubernetes (Kubeflow MPIJob) launcher and its trigger, with the provider hook patched where
it is imported: there is no cluster on the test machine. The hook double keeps the created
objects and serves scripted MPIJob conditions and a launcher pod log."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred
from kubernetes.client.exceptions import ApiException

from horovod_airflow.core.contract import METRICS, PARITY
from horovod_airflow.operators import (
    HorovodExportOperator,
    HorovodLaunchError,
    HorovodTimeoutError,
    HorovodTrainingError,
    HorovodTrainOperator,
)
from horovod_airflow.operators.command import RANK_ENV_WRAPPER
from horovod_airflow.operators.launchers.base import ElasticSpec, JobSpec
from horovod_airflow.operators.launchers.kubernetes import (
    KubernetesLauncher,
    KubernetesOptions,
    PodOptions,
    build_mpijob,
    mpijob_phase,
)
from horovod_airflow.operators.launchers.kubernetes.client import (
    api_error_message,
    api_retrying,
    is_transient,
)
from horovod_airflow.operators.launchers.kubernetes.manifests import (
    POD_SECURITY,
    SSH_AUTH_MOUNT_PATH,
    TRAINER_GID,
    TRAINER_HOME,
    WORKER_COMMAND,
    WORKER_SSH_PORT,
    WORKER_SSHD_CONFIG,
)
from horovod_airflow.operators.launchers.kubernetes.pods import pod_start_failure
from horovod_airflow.operators.triggers import MPIJobTrigger
from horovod_airflow.trainer.model import preprocessing
from tests.operators.fakes import (
    FAILED,
    HOOK,
    RUNNING,
    SUCCEEDED,
    FakeCore,
    FakeHook,
    LineLog,
    LogStream,
    pod,
)
from tests.operators.helpers import PROGRAM, context, with_launcher_options
from tests.operators.mpijob_schema import mpijob_errors

REPO = Path(__file__).resolve().parents[2]
SECRET = "k8s-test-secret-value"


def spec(**kw: Any) -> JobSpec:
    base = dict(
        name="hvd-train-1234",
        argv=[*PROGRAM, "--data", "s3://b/d", "--output", "s3://b/o"],
        env={"AWS_ENDPOINT_URL": "http://minio:9000", "AWS_DEFAULT_REGION": "us-east-1"},
        secret_env={"AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE"},
        num_proc=4,
        gpus_per_proc=1,
        timeout=3600,
    )
    return JobSpec(**{**base, **kw})


def test_mpijob_manifest():
    body = build_mpijob(spec(), image="hva/trainer:1", namespace="ml", slots_per_worker=2)
    assert body["apiVersion"] == "kubeflow.org/v2beta1" and body["kind"] == "MPIJob"
    assert body["spec"]["slotsPerWorker"] == 2
    assert body["spec"]["runPolicy"]["activeDeadlineSeconds"] == 3600
    replicas = body["spec"]["mpiReplicaSpecs"]
    worker = replicas["Worker"]["template"]["spec"]["containers"][0]
    launcher = replicas["Launcher"]["template"]["spec"]["containers"][0]
    assert replicas["Worker"]["replicas"] == 2 and replicas["Launcher"]["replicas"] == 1
    assert worker["resources"] == {"limits": {"nvidia.com/gpu": 2}}  # 1 GPU × 2 slots
    assert "resources" not in launcher
    hosts = ",".join(f"hvd-train-1234-worker-{i}.hvd-train-1234.ml.svc:2" for i in (0, 1))
    assert launcher["command"] == [
        "horovodrun",
        "--gloo",
        "-np",
        "4",
        "-H",
        hosts,
        "-p",
        "2222",
        "--network-interface",
        "eth0",
        *RANK_ENV_WRAPPER,
        *PROGRAM,
        "--data",
        "s3://b/d",
        "--output",
        "s3://b/o",
    ]
    env = {e["name"]: e["value"] for e in launcher["env"]}
    assert env["HVA_RANK_ENV_FILE"] == "/etc/hva-rank-env/rank.env"
    assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert "AWS_SECRET_ACCESS_KEY" not in env and "AWS_ACCESS_KEY_ID" not in env
    for role in ("Launcher", "Worker"):
        pod = replicas[role]["template"]["spec"]
        assert pod["volumes"][0]["secret"]["secretName"] == "hvd-train-1234-rank-env"
        assert pod["containers"][0]["volumeMounts"][0]["readOnly"] is True
    # The credentials are nowhere in the manifest: only in the Secret.
    assert SECRET not in json.dumps(body) and "AKIAEXAMPLE" not in json.dumps(body)


def sshd_config() -> dict[str, list[str]]:
    """docker/trainer-sshd_config as keyword → values."""
    settings: dict[str, list[str]] = {}
    for raw in (REPO / "docker" / "trainer-sshd_config").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            settings.setdefault(key, []).append(value.strip())
    return settings


def test_the_worker_ssh_constants_are_what_the_trainer_image_has():
    """The manifest's sshd command, port and key mount are the image's, not retyped guesses."""
    config = sshd_config()
    assert config["Port"] == [str(WORKER_SSH_PORT)]
    assert config["HostKey"] == [f"{SSH_AUTH_MOUNT_PATH}/id_rsa"]
    assert config["AuthorizedKeysFile"] == [f"{SSH_AUTH_MOUNT_PATH}/authorized_keys"]
    runtime = (REPO / "docker" / "trainer.Dockerfile").read_text().split(" AS runtime", 1)[1]
    assert f"COPY docker/trainer-sshd_config {WORKER_SSHD_CONFIG}\n" in runtime
    assert WORKER_COMMAND == ("/usr/sbin/sshd", "-De", "-f", WORKER_SSHD_CONFIG)
    assert "openssh-server" in runtime and "openssh-client" in runtime
    user = re.search(r"useradd .*--uid (\d+) .*\s(\w+)\n", runtime)
    assert user and f"/home/{user.group(2)}" == TRAINER_HOME
    assert re.search(rf"^USER {user.group(1)}(:\d+)?$", runtime, re.MULTILINE)
    assert "--user-group" in user.group(0) and int(user.group(1)) == TRAINER_GID


def test_the_ranks_user_can_read_the_mounted_secrets():
    """The kubelet writes Secret volume files as root; the credentials file is 0400. The
    ranks run as the image's user, so both pods set its group as fsGroup (the kubelet then
    gives the files to that group, with group read): without it the rank env file is
    unreadable, and the ranks run without credentials."""
    body = build_mpijob(spec(), image="i", namespace="ml", slots_per_worker=2)
    for role in ("Launcher", "Worker"):
        pod_spec = body["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]
        assert pod_spec["securityContext"] == POD_SECURITY, role
        (volume,) = pod_spec["volumes"]
        assert volume["secret"]["defaultMode"] == 0o400, role


@pytest.mark.parametrize("distributed", [True, False], ids=["train", "one-rank export"])
def test_every_mpijob_runs_the_images_sshd_and_reaches_it(distributed):
    """Workers run the image's sshd in the foreground; the MPI Operator mounts the key pair in
    the image user's ~/.ssh; horovodrun in the launcher uses the sshd's port."""
    kl = KubernetesLauncher(
        image="hva/trainer:1",
        hook=FakeHook([RUNNING]),
        options=KubernetesOptions(slots_per_worker=2),
    )
    body = kl.manifest(spec(distributed=distributed, num_proc=4 if distributed else 1))
    assert body["spec"]["sshAuthMountPath"] == SSH_AUTH_MOUNT_PATH
    replicas = body["spec"]["mpiReplicaSpecs"]
    worker = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert worker["command"] == list(WORKER_COMMAND)
    assert "args" not in worker  # nothing appended to sshd's command line
    assert worker["readinessProbe"]["tcpSocket"]["port"] == WORKER_SSH_PORT
    launcher_command = replicas["Launcher"]["template"]["spec"]["containers"][0]["command"]
    port = launcher_command.index("-p")
    assert launcher_command[0] == "horovodrun"
    assert launcher_command[port + 1] == str(WORKER_SSH_PORT)
    assert port < launcher_command.index(
        RANK_ENV_WRAPPER[0]
    )  # horovodrun's flag, not the program's
    # The pod's interface, never a probe's pick: with one worker pod the probe also accepts
    # lo, and the ranks then look for the rendezvous server at 127.0.0.1.
    nic = launcher_command.index("--network-interface")
    assert launcher_command[nic + 1] == "eth0"
    assert nic < launcher_command.index(RANK_ENV_WRAPPER[0])


def test_cpu_job_requests_no_gpus_and_bad_slots_are_named():
    body = build_mpijob(spec(gpus_per_proc=0), image="i", namespace="ml", slots_per_worker=1)
    worker = body["spec"]["mpiReplicaSpecs"]["Worker"]
    assert (
        worker["replicas"] == 4 and "resources" not in worker["template"]["spec"]["containers"][0]
    )
    with pytest.raises(ValueError, match="num_proc=4 is not a multiple of slots_per_worker=3") as e:
        build_mpijob(spec(), image="i", namespace="ml", slots_per_worker=3)
    assert isinstance(e.value, AirflowFailException)  # a setting: no retry changes it


def test_a_launcher_pods_log_naming_a_refusal_fails_without_retry():
    """The launcher pod's horovodrun output names the first failed rank's exit code; 2 or 3
    (the program refused) is final, anything else stays retryable."""
    from horovod_airflow.operators import HorovodRefusedError

    refusal = "[1]<stderr>:trainer: error: ResumeMismatchError: batch_size: checkpoint 64, now 32"
    refused_log = "\n".join([refusal, "Process name: 1", "Exit code: 3"])
    crashed_log = "\n".join([refusal, "Process name: 1", "Exit code: 137"])
    with pytest.raises(HorovodRefusedError, match="exit code 3: the program refused") as refused:
        launcher(FakeHook([RUNNING, FAILED], log_text=refused_log)).run(spec(), LineLog())
    assert isinstance(refused.value, AirflowFailException)
    assert refusal in refused.value.log_tail and "BackoffLimitExceeded" in str(refused.value)
    assert str(refused.value).count(refusal) == str(refused.value.__cause__).count(refusal)
    with pytest.raises(HorovodTrainingError) as crashed:
        launcher(FakeHook([RUNNING, FAILED], log_text=crashed_log)).run(spec(), LineLog())
    assert not isinstance(crashed.value, AirflowFailException)
    assert "rank 1 failed first (exit code 137)" in str(crashed.value)


@pytest.mark.parametrize(
    ("obj", "phase"),
    [(None, "running"), (RUNNING, "running"), (SUCCEEDED, "succeeded"), (FAILED, "failed")],
)
def test_mpijob_phase(obj, phase):
    assert mpijob_phase(obj)[0] == phase


def launcher(hook: FakeHook, **kw: Any) -> KubernetesLauncher:
    kw.setdefault("poll_interval", 0.01)
    options = KubernetesOptions(slots_per_worker=2, **kw)
    return KubernetesLauncher(image="hva/trainer:1", hook=hook, options=options)


def test_polling_success_creates_secret_surfaces_log_and_cleans_up():
    hook = FakeHook([RUNNING, RUNNING, SUCCEEDED], log_text="[0]<stdout>:epoch 1\n[0]<stdout>:done")
    log = LineLog()
    result = launcher(hook).run(spec(), log)
    assert result.exit_code == 0
    assert "[0]<stdout>:epoch 1" in log.lines
    secret = hook.core_v1_client.secrets.get("hvd-train-1234-rank-env") or {}
    assert hook.deleted == ["hvd-train-1234"]  # delete_on_success
    assert hook.core_v1_client.deleted == ["hvd-train-1234-rank-env"]
    assert secret == {}  # deleted with the job
    assert set(hook.core_v1_client.selectors) == {
        "training.kubeflow.org/job-name=hvd-train-1234",  # started? (once: the launcher runs)
        "training.kubeflow.org/job-name=hvd-train-1234,training.kubeflow.org/job-role=launcher",
    }
    assert log.lines.count("[0]<stdout>:epoch 1") == 1  # followed, then caught up: once


def test_a_delete_after_success_that_fails_is_a_warning_not_a_failure():
    """The MPIJob succeeded, then its deletion got a 500 (the API server overloaded): the
    job's work is done, so the task succeeds and the log says what to delete by hand."""

    class Overloaded(FakeHook):
        def delete_custom_object(self, *args: Any, **kw: Any) -> None:
            raise ApiException(status=500, reason="Internal Server Error")

    hook = Overloaded([RUNNING, SUCCEEDED], log_text="[0]<stdout>:done")
    log = LineLog()
    assert launcher(hook).run(spec(), log).exit_code == 0
    warned = [line for line in log.lines if "could not delete MPIJob" in line]
    assert warned and "kubectl delete -n ml mpijobs hvd-train-1234" in warned[0], log.lines


def test_a_create_whose_answer_timed_out_leaves_no_job_behind():
    """The API server accepted the MPIJob but its answer never came (a read timeout): the
    try fails, and deletes the job it may have made with its Secret, instead of leaving pods
    waiting on a deleted Secret until the startup timeout."""
    import urllib3

    class AcceptedThenTimedOut(FakeHook):
        def create_custom_object(self, *args: Any, **kw: Any) -> Any:
            super().create_custom_object(*args, **kw)
            raise urllib3.exceptions.ReadTimeoutError(None, "/apis", "read timed out")

    hook = AcceptedThenTimedOut([RUNNING])
    with pytest.raises(HorovodLaunchError, match="cannot create MPIJob 'hvd-train-1234'"):
        launcher(hook).submit(spec(), LineLog())
    assert hook.objects == {} and hook.deleted == ["hvd-train-1234"]
    assert hook.core_v1_client.secrets == {}


def test_a_kill_during_submit_leaves_no_job_or_secret():
    """on_kill arrives while the create is in flight (before the launcher holds a reference to
    the job): the Secret goes at once, the job as soon as the create returns."""
    job = None

    class KilledMidCreate(FakeHook):
        def create_custom_object(self, *args: Any, **kw: Any) -> Any:
            assert job is not None
            job.kill()  # the task's on_kill, from another thread, mid-request
            return super().create_custom_object(*args, **kw)

    hook = KilledMidCreate([RUNNING])
    job = launcher(hook)
    with pytest.raises(HorovodLaunchError, match="killed while MPIJob 'hvd-train-1234'"):
        job.submit(spec(), LineLog())
    assert hook.objects == {} and "hvd-train-1234" in hook.deleted
    assert hook.core_v1_client.secrets == {}


def test_secret_holds_the_rank_env_and_is_owned_by_the_job():
    hook = FakeHook([RUNNING])
    launcher(hook).submit(spec(), LineLog())
    secret = hook.core_v1_client.secrets["hvd-train-1234-rank-env"]
    assert f"AWS_SECRET_ACCESS_KEY={SECRET}" in secret["stringData"]["rank.env"]
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-123"


def test_failure_raises_with_launcher_log_and_keeps_the_job():
    log_text = "[2]<stderr>:RuntimeError: NCCL error\nProcess name: 2\nExit code: 1"
    hook = FakeHook([RUNNING, FAILED], log_text=log_text)
    with pytest.raises(HorovodTrainingError, match="BackoffLimitExceeded") as err:
        launcher(hook).run(spec(), LineLog())
    assert "[2]<stderr>:RuntimeError: NCCL error" in err.value.log_tail
    assert "rank 2 failed first" in str(err.value)
    assert hook.deleted == []  # delete_on_success keeps a failed job for inspection
    # ... but not its credentials: the Secret goes when the job has ended.
    assert hook.core_v1_client.deleted == ["hvd-train-1234-rank-env"]
    assert hook.core_v1_client.secrets == {}


def test_a_failure_names_the_worker_pod_of_the_rank_that_failed_first():
    """horovodrun names the rank; the job's -H list (workers in order, slots each) names the
    pod it ran on, read from the MPIJob before it is deleted."""
    log_text = "[1]<stderr>:Connection closed\nProcess name: 3\nExit code: 255"
    hook = FakeHook([RUNNING], log_text=log_text)
    job_failed = {**FAILED}
    answers = iter([RUNNING, None])

    def look(group, version, plural, name, namespace=None):
        if name not in hook.objects:
            raise ApiException(status=404)
        answer = next(answers, None)
        # the stored MPIJob with the state its conditions say: running, then failed
        return {**hook.objects[name], **(answer or job_failed)}

    hook.get_custom_object = look  # type: ignore[method-assign]
    with pytest.raises(HorovodTrainingError) as err:
        launcher(hook, cleanup="delete").run(spec(), LineLog())
    pod = "hvd-train-1234-worker-1.hvd-train-1234.ml.svc"  # ranks 2 and 3 of 2 × 2 slots
    assert f"rank 3 (host {pod}) failed first (exit code 255)" in str(err.value)
    assert hook.deleted == ["hvd-train-1234"]  # read before the delete policy applied


def test_an_elastic_mpijob_makes_the_same_calls_and_a_failure_names_the_lost_pod():
    """Elastic: the same create, poll, log and delete calls as any MPIJob (the RBAC test runs
    this one too: no more is granted for it), a manifest the operator's API takes, and a job
    that fell below ``min_np`` fails naming the pod horovodrun names (no -H list to read)."""
    elastic = ElasticSpec(min_np=2, max_np=4, timeout_s=60)
    hook = FakeHook([RUNNING, SUCCEEDED], log_text="[0]<stdout>:done")
    assert launcher(hook).run(spec(elastic=elastic), LineLog()).exit_code == 0
    body = hook.created["hvd-train-1234"]
    assert mpijob_errors(body) == []
    assert body["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 2  # max_np 4 / 2 slots
    pod = "hvd-train-1234-worker-1.hvd-train-1234.ml.svc"
    failed = FakeHook(
        [RUNNING, FAILED],
        log_text=f"ERROR:root:failure count == 2 -> stop running\nProcess name: {pod}[0]\n"
        "Exit code: 255",
    )
    with pytest.raises(HorovodTrainingError, match=re.escape(f"Process name: {pod}[0]")):
        launcher(failed, cleanup="delete").run(spec(elastic=elastic), LineLog())


def test_the_failed_pod_is_left_unnamed_when_the_job_cannot_be_read():
    hook = FakeHook([RUNNING, FAILED], log_text="Process name: 1\nExit code: 1")
    with pytest.raises(HorovodTrainingError, match=r"rank 1 failed first \(exit code 1\)"):
        launcher(hook).run(spec(), LineLog())  # FAILED carries no spec: no -H list


def test_a_failed_create_leaves_no_secret_behind():
    from horovod_airflow.operators import HorovodLaunchError

    hook = FakeHook([RUNNING])

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ApiException(status=422, reason="Unprocessable Entity: bad MPIJob")

    hook.create_custom_object = refuse  # type: ignore[method-assign]
    with pytest.raises(HorovodLaunchError, match="cannot create MPIJob 'hvd-train-1234'"):
        launcher(hook).submit(spec(), LineLog())
    assert SECRET in hook.core_v1_client.created_secret_text  # it was created first ...
    assert hook.core_v1_client.secrets == {}  # ... and deleted with the failed create
    assert hook.core_v1_client.deleted == ["hvd-train-1234-rank-env"]


def test_timeout_raises_and_delete_policy_removes():
    hook = FakeHook([RUNNING])
    with pytest.raises(HorovodTimeoutError):
        launcher(hook, cleanup="delete").run(spec(timeout=0.05), LineLog())
    assert hook.deleted == ["hvd-train-1234"]


def test_on_kill_deletes_job_and_secret_idempotently():
    hook = FakeHook([RUNNING])
    kl = launcher(hook)
    kl.kill()  # nothing submitted: no-op
    kl.submit(spec(), LineLog())
    kl.kill()
    kl.kill()
    assert hook.deleted == ["hvd-train-1234"]
    assert hook.core_v1_client.deleted == ["hvd-train-1234-rank-env"]


def test_trigger_serialize_round_trip():
    trig = MPIJobTrigger(
        name="j",
        namespace="ml",
        kubernetes_conn_id="k8s",
        poll_interval=3,
        timeout=60,
        started_at=1000.0,
        startup_timeout=120,
    )
    path, kwargs = trig.serialize()
    assert path == "horovod_airflow.operators.triggers.MPIJobTrigger"
    json.dumps(kwargs)  # JSON-able
    module, _, name = path.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert cls(**kwargs).serialize() == (path, kwargs)


async def _events(trigger: MPIJobTrigger) -> list[Any]:
    return [event async for event in trigger.run()]


@pytest.mark.parametrize(
    ("phases", "timeout", "status"),
    [
        ([RUNNING, RUNNING, SUCCEEDED], None, "success"),
        ([RUNNING, FAILED], None, "failed"),
        ([RUNNING], 0.05, "timeout"),
    ],
)
def test_trigger_run_yields_exactly_one_event(phases, timeout, status):
    hook = FakeHook(phases)
    hook.objects["j"] = {}
    trig = MPIJobTrigger(name="j", namespace="ml", poll_interval=0.01, timeout=timeout)
    with mock.patch(HOOK, return_value=hook):
        events = asyncio.run(_events(trig))
    assert len(events) == 1
    assert events[0].payload["status"] == status
    assert events[0].payload["name"] == "j" and events[0].payload["namespace"] == "ml"


def test_trigger_reports_api_errors_as_one_event():
    hook = FakeHook([RUNNING])  # no object "j" → 404
    trig = MPIJobTrigger(name="j", namespace="ml", poll_interval=0.01)
    with mock.patch(HOOK, return_value=hook):
        events = asyncio.run(_events(trig))
    assert [e.payload["status"] for e in events] == ["error"]


@pytest.mark.parametrize(("user_action", "deleted"), [(True, ["j"]), (False, [])])
def test_triggerer_deletes_the_job_only_when_a_user_kills_the_task(
    monkeypatch, user_action, deleted
):
    """Airflow's own TriggerRunner: a user's kill (its cancel queue) reaches on_kill; a
    triggerer shutdown (a plain cancel) must leave the job running for the next triggerer."""
    from airflow.jobs.triggerer_job_runner import TriggerRunner

    monkeypatch.setenv("AIRFLOW_DISABLE_GREENBACK_PORTAL", "true")
    hook = FakeHook([RUNNING])
    hook.objects["j"] = {}
    hook.core_v1_client.secrets["j-rank-env"] = {"metadata": {}}
    trig = MPIJobTrigger(name="j", namespace="ml", poll_interval=0.01)

    async def scenario() -> None:
        runner = TriggerRunner()
        task = asyncio.create_task(runner.run_trigger(7, trig))
        runner.triggers[7] = {"task": task, "name": "mpijob j", "events": 0}
        await asyncio.sleep(0.1)  # polling: RUNNING
        if user_action:
            runner.to_cancel.append(7)
            await runner.cancel_triggers()
        else:
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with mock.patch(HOOK, return_value=hook):
        asyncio.run(scenario())
    assert hook.deleted == deleted
    assert hook.core_v1_client.deleted == [f"{n}-rank-env" for n in deleted]


def test_deferrable_operator_defers_then_completes_from_metrics(s3_server):
    bucket = s3_server.new_bucket()
    s3_server.client().put_object(
        Bucket=bucket,
        Key="out/metrics.json",
        Body=METRICS.dumps({"val_accuracy": 0.95, "world_size": 4}).encode(),
    )
    op = HorovodTrainOperator(
        task_id="train",
        launcher="kubernetes",
        image="hva/trainer:1",
        num_proc=4,
        gpus_per_proc=1,
        entrypoint=PROGRAM,
        data=f"s3://{bucket}/d",
        output=f"s3://{bucket}/out",
        kubernetes=KubernetesOptions(slots_per_worker=2, deferrable=True, namespace="ml"),
    )
    hook = FakeHook([SUCCEEDED], log_text="[0]<stdout>:trained")
    with mock.patch(HOOK, return_value=hook):
        with pytest.raises(TaskDeferred) as deferred:
            op.execute(context())
        trigger = deferred.value.trigger
        assert isinstance(trigger, MPIJobTrigger)
        assert deferred.value.method_name == "execute_complete"
        kwargs = deferred.value.kwargs
        assert s3_server.env["AWS_SECRET_ACCESS_KEY"] not in json.dumps(kwargs)
        (name,) = hook.objects
        s3_secret = s3_server.env["AWS_SECRET_ACCESS_KEY"]
        assert s3_secret not in json.dumps(hook.objects[name])
        rank_env = hook.core_v1_client.secrets[f"{name}-rank-env"]["stringData"]["rank.env"]
        assert f"AWS_SECRET_ACCESS_KEY={s3_secret}" in rank_env
        event = asyncio.run(_events(trigger))[0].payload
        result = op.execute_complete(context(), event=event, **kwargs)
    assert result["val_accuracy"] == 0.95 and result["world_size"] == 4
    assert hook.deleted == [name]


def export_op(bucket: str, **kw: Any) -> HorovodExportOperator:
    options = KubernetesOptions(
        slots_per_worker=2,  # the training's; the one-process export uses one slot
        namespace="ml",
        poll_interval=0.01,
        **kw,
    )
    return HorovodExportOperator(
        task_id="export_onnx",
        launcher="kubernetes",
        image="hva/trainer:1",
        checkpoint=f"s3://{bucket}/out/checkpoint.pt",
        output=f"s3://{bucket}/out/onnx",
        data=f"s3://{bucket}/d",
        gpus_per_proc=1,
        kubernetes=options,
    )


def put_parity(s3_server: Any, bucket: str, passed: bool = True) -> None:
    parity = {"max_abs_diff": 7.6e-6, "argmax_mismatches": 0, "passed": passed,
              "samples": 8, "tolerance": 1e-4, "preprocessing": preprocessing()}  # fmt: skip
    s3_server.client().put_object(
        Bucket=bucket, Key="out/onnx/parity.json", Body=PARITY.dumps(parity).encode()
    )


def test_export_runs_as_a_one_rank_mpijob_and_returns_parity(s3_server):
    bucket = s3_server.new_bucket()
    put_parity(s3_server, bucket)
    hook = FakeHook([RUNNING, SUCCEEDED], log_text="[0]<stdout>:exported")
    with mock.patch(HOOK, return_value=hook):
        result = export_op(bucket).execute(context())

    assert result["passed"] is True and result["max_abs_diff"] == 7.6e-6
    assert result["onnx_uri"] == f"s3://{bucket}/out/onnx/model.onnx"
    (name,) = hook.deleted  # delete_on_success
    body = hook.created[name]
    assert body["spec"]["slotsPerWorker"] == 1
    replicas = body["spec"]["mpiReplicaSpecs"]
    assert replicas["Worker"]["replicas"] == 1
    worker = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert worker["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    command = replicas["Launcher"]["template"]["spec"]["containers"][0]["command"]
    host = f"{name}-worker-0.{name}.ml.svc:1"
    assert command[:10] == [
        "horovodrun",
        "--gloo",
        "-np",
        "1",
        "-H",
        host,
        "-p",
        "2222",
        "--network-interface",
        "eth0",
    ]
    assert worker["command"] == list(WORKER_COMMAND)  # an sshd the launcher can reach
    assert body["spec"]["sshAuthMountPath"] == SSH_AUTH_MOUNT_PATH
    program = command[10 + len(RANK_ENV_WRAPPER) :]
    assert program[:3] == ["python", "-m", "horovod_airflow.trainer"] and program[3] == "export"
    assert program[program.index("--checkpoint") + 1] == f"s3://{bucket}/out/checkpoint.pt"
    # Credentials reach the rank through the Secret, never the manifest.
    s3_secret = s3_server.env["AWS_SECRET_ACCESS_KEY"]
    assert s3_secret not in json.dumps(body)
    assert f"AWS_SECRET_ACCESS_KEY={s3_secret}" in hook.core_v1_client.created_secret_text


def test_deferrable_export_defers_then_reads_parity(s3_server):
    bucket = s3_server.new_bucket()
    put_parity(s3_server, bucket, passed=False)
    op = export_op(bucket, deferrable=True)
    hook = FakeHook([SUCCEEDED], log_text="[0]<stdout>:exported")
    with mock.patch(HOOK, return_value=hook):
        with pytest.raises(TaskDeferred) as deferred:
            op.execute(context())
        assert deferred.value.method_name == "execute_complete"
        event = asyncio.run(_events(deferred.value.trigger))[0].payload
        with pytest.raises(HorovodTrainingError, match="ONNX parity check failed"):
            op.execute_complete(context(), event=event, **deferred.value.kwargs)
    assert len(hook.deleted) == 1  # the job succeeded: deleted, even though parity failed


POD_OPTIONS: dict[str, Any] = {
    "service_account": "trainer-sa",
    "image_pull_policy": "Always",
    "image_pull_secrets": ["regcred", "mirror"],
    "node_selector": {"gpu": "h200"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "priority_class": "training",
    "worker_resources": {"requests": {"cpu": "8", "memory": "32Gi"}, "limits": {"memory": "32Gi"}},
    "launcher_resources": {"requests": {"cpu": "500m"}},
}


def k8s_train_op(**kw: Any) -> HorovodTrainOperator:
    base: dict[str, Any] = dict(
        task_id="train",
        launcher="kubernetes",
        image="hva/trainer:1",
        num_proc=4,
        slots_per_worker=2,
        gpus_per_proc=1,
        entrypoint=PROGRAM,
        data="s3://b/d",
        output="s3://b/o",
        namespace="ml",
        aws_conn_id=None,
    )
    return HorovodTrainOperator(**with_launcher_options({**base, **kw}))


def test_pod_settings_reach_both_pod_templates_from_the_operator():
    op = k8s_train_op(**POD_OPTIONS)
    job = op.build_spec(context())
    with mock.patch(
        HOOK,
        return_value=FakeHook([]),
    ):
        body = op.make_launcher().manifest(job)  # type: ignore[attr-defined]
    replicas = body["spec"]["mpiReplicaSpecs"]
    for role in ("Launcher", "Worker"):
        pod = replicas[role]["template"]["spec"]
        assert pod["serviceAccountName"] == "trainer-sa", role
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}], role
        assert pod["nodeSelector"] == {"gpu": "h200"}, role
        assert pod["tolerations"] == POD_OPTIONS["tolerations"], role
        assert pod["priorityClassName"] == "training", role
        assert pod["containers"][0]["imagePullPolicy"] == "Always", role
    worker = replicas["Worker"]["template"]["spec"]["containers"][0]
    launcher_container = replicas["Launcher"]["template"]["spec"]["containers"][0]
    assert worker["resources"] == {
        "requests": {"cpu": "8", "memory": "32Gi"},
        "limits": {"memory": "32Gi", "nvidia.com/gpu": 2},  # gpus_per_proc × slots_per_worker
    }
    assert launcher_container["resources"] == {"requests": {"cpu": "500m"}}
    assert POD_OPTIONS["worker_resources"]["limits"] == {"memory": "32Gi"}  # not mutated


def test_without_pod_settings_the_cluster_defaults_apply():
    body = build_mpijob(spec(), image="i", namespace="ml", slots_per_worker=2)
    for role in ("Launcher", "Worker"):
        pod = body["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]
        assert not {"serviceAccountName", "imagePullSecrets", "nodeSelector", "tolerations",
                    "priorityClassName"} & set(pod)  # fmt: skip
        assert "imagePullPolicy" not in pod["containers"][0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"image_pull_policy": "sometimes"}, "image_pull_policy must be one of Always, IfNot"),
        ({"image_pull_secrets": "regcred"}, "image_pull_secrets must be a list of Secret names"),
        ({"image_pull_secrets": ["ok", ""]}, "image_pull_secrets must be a list"),
        ({"node_selector": {"gpu": 1}}, "node_selector must be a dict of label → value strings"),
        ({"tolerations": {"key": "k"}}, "tolerations must be a list of dicts"),
        ({"tolerations": [{"keys": "k"}]}, "tolerations entry {'keys': 'k'} must be a dict of"),
        ({"service_account": ""}, "service_account must be a non-empty string"),
        ({"priority_class": 5}, "priority_class must be a non-empty string"),
        ({"worker_resources": {"cpu": "1"}}, "worker_resources must be a dict with 'requests'"),
        ({"worker_resources": {"limits": {"cpu": True}}}, r"worker_resources\['limits'\] must"),
        (
            {"worker_resources": {"limits": {"nvidia.com/gpu": 1}}},
            "sets nvidia.com/gpu: GPUs come from gpus_per_proc",
        ),
        ({"launcher_resources": []}, "launcher_resources must be a dict"),
        ({"startup_timeout": 0}, "startup_timeout must be a positive number of seconds or None"),
        ({"startup_timeout": "60"}, "startup_timeout must be a positive number"),
        ({"startup_timeout": True}, "startup_timeout must be a positive number"),
    ],
)
def test_bad_pod_settings_are_named_at_parse_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        k8s_train_op(**kwargs)


@pytest.mark.parametrize("launcher", ["local", "docker", "kubernetes", "{{ params.launcher }}"])
@pytest.mark.parametrize(
    "kwargs",
    [{k: v} for k, v in POD_OPTIONS.items()] + [{"deferrable": True}, {"startup_timeout": 60}],
    ids=str,
)
def test_loose_kubernetes_settings_are_refused_naming_their_options_object(launcher, kwargs):
    """Whatever the launcher: a kubernetes setting lives in KubernetesOptions only."""
    (name,) = kwargs
    for operator in (HorovodTrainOperator, HorovodExportOperator):
        args: dict[str, Any] = {"task_id": "t", "output": "s3://b/o", "launcher": launcher,
                                "image": "hva/trainer:1", **kwargs}  # fmt: skip
        args.update({"data": "s3://b/d"} if operator is HorovodTrainOperator else {})
        args.update({"checkpoint": "s3://b/c"} if operator is HorovodExportOperator else {})
        expected = (
            f"{name} is an option of launcher 'kubernetes' only: "
            f"pass kubernetes=KubernetesOptions({name}=...)"
        )
        with pytest.raises(ValueError, match=re.escape(expected)):
            operator(**args)


@pytest.mark.parametrize("launcher", ["local", "docker"])
def test_kubernetes_options_with_another_literal_launcher_are_refused(launcher):
    for operator in (HorovodTrainOperator, HorovodExportOperator):
        args: dict[str, Any] = {"task_id": "t", "output": "s3://b/o", "launcher": launcher,
                                "kubernetes": KubernetesOptions(deferrable=True)}  # fmt: skip
        args.update({"image": "hva/trainer:1"} if launcher == "docker" else {})
        args.update({"data": "s3://b/d"} if operator is HorovodTrainOperator else {})
        args.update({"checkpoint": "s3://b/c"} if operator is HorovodExportOperator else {})
        expected = (
            f"kubernetes=KubernetesOptions(...) is for launcher='kubernetes', and launcher is "
            f"'{launcher}'"
        )
        with pytest.raises(ValueError, match=re.escape(expected)):
            operator(**args)


def test_a_templated_launcher_uses_the_options_of_the_one_it_renders_to():
    """The DAG's case: the launcher comes from a Param, so the options of several launchers
    stand side by side; after rendering, the chosen one's reach its launcher."""
    from horovod_airflow.operators import HorovodConfigError
    from horovod_airflow.operators.launchers.docker import DockerLauncher, DockerOptions

    docker = DockerOptions(network_mode="stack")
    op = k8s_train_op(
        launcher="{{ params.launcher }}", node_selector={"gpu": "h200"}, docker=docker
    )
    op.launcher = "docker"  # what the template rendered to
    job = op.build_spec(context())
    launcher = op.make_launcher()
    assert isinstance(launcher, DockerLauncher) and launcher.options is docker
    op.launcher = "kubernetes"
    job = op.build_spec(context())
    kl = op.make_launcher()
    assert isinstance(kl, KubernetesLauncher) and kl.options.namespace == "ml"
    kl.client._hook = FakeHook([])
    pod = kl.manifest(job)["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h200"}
    op.launcher = "slurm"
    with pytest.raises(HorovodConfigError, match="launcher must be one of local, docker, kub"):
        op.build_spec(context())


@pytest.mark.parametrize(
    "kwargs",
    [{"ssh_port": 2200}, {"ssh_identity_file": "/k"}, {"network_interface": "eth0"}],
    ids=str,
)
def test_horovodrun_ssh_settings_are_refused_on_kubernetes(kwargs):
    """The MPIJob's ssh is the image's sshd and the operator's key: a port or key given here
    would be ignored."""
    from horovod_airflow.operators.launchers.local import LocalOptions

    expected = "local=LocalOptions(...) is for launcher='local', and launcher is 'kubernetes'"
    with pytest.raises(ValueError, match=re.escape(expected)):
        k8s_train_op(local=LocalOptions(**kwargs))


def left_by_try_1(state: dict[str, Any]) -> dict[str, Any]:
    """An MPIJob an earlier try made, as the look-up of the next try sees it."""
    return {**state, "metadata": {"name": "hvd-train-1234", "labels": {"try_number": "1"}}}


@pytest.mark.parametrize(
    ("left", "linger", "replaced", "message"),
    [
        (None, 0, False, "submitted MPIJob ml/hvd-train-1234"),
        (RUNNING, 0, False, "(made by try 1) is still running: re-attaching to it"),
        (SUCCEEDED, 0, True, "deleting MPIJob ml/hvd-train-1234 (made by try 1, succeeded)"),
        (FAILED, 0, True, "(made by try 1, failed: BackoffLimitExceeded: launcher failed)"),
        (FAILED, 3, True, "deleting MPIJob ml/hvd-train-1234 (made by try 1, failed"),
    ],
    ids=["first try", "running", "succeeded", "failed", "slow foreground deletion"],
)
def test_a_retry_reattaches_to_a_running_job_and_replaces_a_finished_one(
    left, linger, replaced, message
):
    hook = FakeHook([left_by_try_1(left), SUCCEEDED] if left else [SUCCEEDED], log_text="[0]<x>:ok")
    hook.linger = linger
    if left:
        hook.objects["hvd-train-1234"] = {"metadata": {"name": "hvd-train-1234"}}
    log = LineLog()
    result = launcher(hook).run(spec(labels={"try_number": "2"}), log)

    assert result.exit_code == 0 and any(message in line for line in log.lines), log.lines
    reattached = left is RUNNING
    # Never two jobs of one task instance: the running one is waited for, a finished one is
    # deleted (and gone) before the new one is created.
    assert ("hvd-train-1234" in hook.created) is not reattached
    assert hook.deleted == (["hvd-train-1234"] if replaced else []) + ["hvd-train-1234"]
    assert hook.lingering == {}
    if reattached:  # the running job keeps its own Secret; this try writes none
        assert hook.core_v1_client.created_secret_text == ""
    else:
        assert hook.created["hvd-train-1234"]["metadata"]["labels"]["try_number"] == "2"


def test_a_retry_that_finds_the_job_being_deleted_waits_until_gone_then_starts_its_own():
    """A running job already being deleted (a user, or try 1's on_kill) is not re-attached to:
    its pods are going. This try waits until it is gone, then creates its own."""
    being_deleted = left_by_try_1(RUNNING)
    being_deleted["metadata"]["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    hook = FakeHook([being_deleted, SUCCEEDED], log_text="[0]<x>:ok")
    hook.objects["hvd-train-1234"] = {"metadata": {"name": "hvd-train-1234"}}
    hook.linger = 2  # its pods still terminate for two more looks
    log = LineLog()
    assert launcher(hook).run(spec(labels={"try_number": "2"}), log).exit_code == 0
    message = "deleting MPIJob ml/hvd-train-1234 (made by try 1, being deleted)"
    assert any(message in line for line in log.lines), log.lines
    assert not any("re-attaching" in line for line in log.lines), log.lines
    assert hook.created["hvd-train-1234"]["metadata"]["labels"]["try_number"] == "2"
    assert hook.deleted == ["hvd-train-1234", "hvd-train-1234"] and hook.lingering == {}


def test_a_job_of_an_earlier_try_that_never_goes_away_fails_the_launch():
    from horovod_airflow.operators import HorovodLaunchError

    hook = FakeHook([left_by_try_1(FAILED)])
    hook.objects["hvd-train-1234"] = {}
    hook.linger = 10**6
    with (
        mock.patch("horovod_airflow.operators.launchers.kubernetes.client.DELETE_WAIT_S", 0.05),
        pytest.raises(HorovodLaunchError, match="still being deleted after 0s; this try does"),
    ):
        launcher(hook).submit(spec(), LineLog())
    assert hook.created == {}


def test_a_409_on_create_reattaches_to_the_job_that_appeared():
    hook = FakeHook([SUCCEEDED], log_text="[0]<stdout>:done")
    real_create = hook.create_custom_object

    def raced(group, version, plural, body, namespace=None):
        real_create(group, version, plural, body, namespace)  # another try's create won ...
        return real_create(group, version, plural, body, namespace)  # ... this one gets 409

    hook.create_custom_object = raced  # type: ignore[method-assign]
    log = LineLog()
    assert launcher(hook).run(spec(), log).exit_code == 0
    assert any("appeared while this try created it: re-attaching" in line for line in log.lines)
    # The Secret that job mounts was not deleted as if the create had failed: only at the end.
    assert hook.core_v1_client.deleted == ["hvd-train-1234-rank-env"]
    assert hook.deleted == ["hvd-train-1234"]


@pytest.mark.parametrize("status", [403, 500])
def test_a_failed_look_up_starts_nothing(status):
    from horovod_airflow.operators import HorovodLaunchError

    hook = FakeHook([RUNNING])

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ApiException(status=status, reason="nope")

    hook.get_custom_object = refuse  # type: ignore[method-assign]
    with pytest.raises(HorovodLaunchError, match="cannot look up MPIJob ml/hvd-train-1234"):
        launcher(hook).submit(spec(), LineLog())
    assert hook.created == {} and hook.core_v1_client.created_secret_text == ""


def test_a_stale_secret_gets_this_tries_credentials():
    hook = FakeHook([RUNNING])
    hook.core_v1_client.secrets["hvd-train-1234-rank-env"] = {"metadata": {}, "stringData": {}}
    real_create = hook.core_v1_client.create_namespaced_secret

    def conflict(namespace: str, body: dict[str, Any]) -> None:
        if body["metadata"]["name"] in hook.core_v1_client.secrets:
            raise ApiException(status=409)
        real_create(namespace, body)

    hook.core_v1_client.create_namespaced_secret = conflict  # type: ignore[method-assign]
    launcher(hook).submit(spec(), LineLog())
    assert (
        SECRET in hook.core_v1_client.secrets["hvd-train-1234-rank-env"]["stringData"]["rank.env"]
    )


def test_labels_of_the_task_instance_are_on_the_job_its_pods_and_its_secret(tmp_path):
    op = k8s_train_op(output=str(tmp_path / "out"), secret_env={"HVA_TEST_TOKEN": "t0ken-v"})
    ti = SimpleNamespace(try_number=3, map_index=-1)
    ctx = {"ti": ti, "run_id": "manual__2026-12-04T18:49:33.123456+00:00"}
    job = op.build_spec(ctx)
    first = op.build_spec({**ctx, "ti": SimpleNamespace(try_number=1, map_index=-1)})
    assert job.name == first.name  # one name for every try
    hook = FakeHook([RUNNING])
    with mock.patch(HOOK, return_value=hook):
        launcher = op.make_launcher()
        launcher.submit(job, LineLog())  # type: ignore[attr-defined]
    body = hook.created[job.name]
    expected = {"dag_id": "adhoc_airflow", "task_id": "train", "try_number": "3",
                "horovod-airflow/job": job.name}  # fmt: skip
    run_label = body["metadata"]["labels"]["run_id"]
    assert run_label.startswith("manual__2026-12-04T18493")  # made safe: ':' and '+' dropped
    assert len(run_label) <= 63
    carriers = {
        "MPIJob": body["metadata"],
        "Launcher": body["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["metadata"],
        "Worker": body["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["metadata"],
        "Secret": hook.core_v1_client.secrets[f"{job.name}-rank-env"]["metadata"],
    }
    for what, meta in carriers.items():
        assert expected.items() <= meta["labels"].items(), what
        assert meta["labels"]["run_id"] == run_label, what


def test_a_deferrable_retry_while_the_job_runs_defers_on_it_without_a_second_job(tmp_path):
    op = k8s_train_op(deferrable=True, output=str(tmp_path / "out"))
    name = op.build_spec(context()).name
    hook = FakeHook([left_by_try_1(RUNNING)])
    hook.objects[name] = {"metadata": {"name": name}}
    with (
        mock.patch(
            HOOK,
            return_value=hook,
        ),
        pytest.raises(TaskDeferred) as deferred,
    ):
        op.execute(context(try_number=2))
    assert hook.created == {} and hook.deleted == []
    assert deferred.value.trigger.name == name


def unreachable() -> Exception:
    import urllib3.exceptions

    return urllib3.exceptions.MaxRetryError(None, "https://k8s:6443/apis", reason=None)


def reset() -> Exception:
    import urllib3.exceptions

    return urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104))


def _looks(answers: list[Any], log: Any = None, **retry: Any) -> tuple[Any, list[float], int]:
    """(the result or the error, the backoffs slept, how many looks) of one retried look that
    meets ``answers`` (exceptions are raised) in turn."""
    log = log or LineLog()
    sleeps: list[float] = []
    looks = 0

    def look() -> Any:
        nonlocal looks
        answer = answers[min(looks, len(answers) - 1)]
        looks += 1
        if isinstance(answer, BaseException):
            raise answer
        return answer

    try:
        result = api_retrying(log.warning, sleep=sleeps.append, **retry)(look)
    except Exception as e:
        result = e
    return result, sleeps, looks


def test_the_backoff_doubles_is_capped_resets_and_gives_up():
    error = ApiException(status=503)
    log = LineLog()
    gave_up, sleeps, looks = _looks([error], log, retries=7, backoff=1.0, max_backoff=30.0)
    assert sleeps == [1, 2, 4, 8, 16, 30, 30] and looks == 8
    assert log.lines[0].startswith("Kubernetes API error, next look in 1.0s: (503)")
    assert len(log.lines) == 7
    assert "8 Kubernetes API errors in a row" in api_error_message(gave_up)
    # each look starts afresh
    assert _looks([ApiException(status=429), "ok"], retries=7, backoff=1.0)[:2] == ("ok", [1])


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ApiException(status=500), True),
        (ApiException(status=502), True),
        (ApiException(status=503), True),
        (ApiException(status=429), True),
        (unreachable(), True),
        (reset(), True),
        (ConnectionRefusedError(111, "refused"), True),
        (TimeoutError("read timed out"), True),
        (ApiException(status=404), False),
        (ApiException(status=403), False),
        (ApiException(status=401), False),
        (ApiException(status=422), False),
        (ValueError("bad config"), False),
    ],
    ids=repr,
)
def test_which_api_errors_are_retried(error, transient):
    assert is_transient(error) is transient
    result, sleeps, looks = _looks([error], retries=3, backoff=0.5)
    assert (sleeps == [0.5, 1, 2] and looks == 4) is transient
    assert (sleeps == [] and looks == 1) is not transient  # a 4xx never gets a second look
    assert (result is error) is not transient  # raised as it is, for the caller to name


@pytest.mark.parametrize(
    ("answers", "status", "looks", "message"),
    [
        ([ApiException(status=500), ApiException(status=429), unreachable(), RUNNING, reset(),
          SUCCEEDED], "success", 6, ""),
        ([ApiException(status=503), RUNNING] * 4 + [FAILED], "failed", 9,
         "BackoffLimitExceeded"),
        ([ApiException(status=503)] * 5, "error", 4, "4 Kubernetes API errors in a row"),
        ([ApiException(status=404)], "error", 1, "(404)"),
        ([ApiException(status=403), RUNNING], "error", 1, "(403)"),
    ],
    ids=["transient errors then success", "errors apart reset the count", "too many in a row",
         "404 at once", "403 at once"],
)  # fmt: skip
def test_the_trigger_retries_transient_api_errors_with_backoff(answers, status, looks, message):
    hook = FakeHook(answers)
    hook.objects["j"] = {}
    trig = MPIJobTrigger(name="j", namespace="ml", poll_interval=0.001, api_retries=3,
                         api_backoff=0.001)  # fmt: skip
    with mock.patch(HOOK, return_value=hook):
        events = asyncio.run(_events(trig))
    assert [e.payload["status"] for e in events] == [status]
    assert hook.gets == looks
    assert message in events[0].payload["message"]


def test_the_polling_launcher_rides_out_transient_errors_and_keeps_an_unknown_job():
    hook = FakeHook([ApiException(status=502), unreachable(), RUNNING, SUCCEEDED])
    with mock.patch("horovod_airflow.operators.launchers.kubernetes.client.API_BACKOFF_S", 0.001):
        assert launcher(hook).run(spec(), LineLog()).exit_code == 0
    assert hook.gets == 4

    hook = FakeHook([RUNNING, ApiException(status=403)])
    log = LineLog()
    with pytest.raises(HorovodTrainingError, match=r"error: Kubernetes API error: \(403\)"):
        launcher(hook).run(spec(), log)
    # Whether it still runs is unknown: the job and the Secret it reads stay for the retry.
    assert hook.deleted == [] and hook.core_v1_client.deleted == []
    assert any("the API did not say whether it still runs" in line for line in log.lines)


PULL = ("ImagePullBackOff", 'Back-off pulling image "hva/trainer:1"')
W0, W1, LAUNCHER = "hvd-train-1234-worker-0", "hvd-train-1234-worker-1", "hvd-train-1234-launcher"


@pytest.mark.parametrize(
    ("pods", "elapsed", "startup_timeout", "failure", "started"),
    [
        ([pod(W0, "Running"), pod(LAUNCHER, "Running", role="launcher")], 1e6, 60, None, True),
        ([pod(W0, "Running"), pod(W1, "Pending", waiting=PULL)], 1, 60,
         f"pod {W1} (container worker): ImagePullBackOff: Back-off pulling image", False),
        ([pod(W0, "Pending", waiting=("ErrImagePull", "not found"))], 1, None,
         f"pod {W0} (container worker): ErrImagePull: not found", False),
        ([pod(W0, "Pending", waiting=("InvalidImageName", "bad"))], 1, 60,
         f"pod {W0} (container worker): InvalidImageName: bad", False),
        ([pod(W0, "Running", waiting=("CrashLoopBackOff", "back-off 5m0s"))], 1, 60,
         f"pod {W0} (container worker): CrashLoopBackOff: back-off 5m0s", False),
        ([pod(W0, "Failed", message="sshd: no hostkeys available")], 1, 60,
         f"pod {W0} failed before the job started: sshd: no hostkeys available", False),
        ([pod(W0, "Pending", waiting=("ContainerCreating", ""))], 59, 60, None, False),
        ([pod(W0, "Pending", waiting=("ContainerCreating", ""))], 61, 60,
         f"pod {W0} still Pending after 61s (startup_timeout=60s): ContainerCreating", False),
        ([pod(W0, "Running"), pod(W1, "Pending",
          unschedulable="0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")], 601, 600,
         f"pod {W1} still Pending after 601s (startup_timeout=600s): Unschedulable: 0/3 nodes "
         "are available: 3 Insufficient nvidia.com/gpu.", False),
        ([], 61, 60, "no pod of MPIJob hvd-train-1234 after 61s (startup_timeout=60s): is the "
         "MPI Operator running?", False),
        ([pod(W0, "Running")], 61, 60, "the launcher pod of MPIJob hvd-train-1234 was not "
         f"created after 61s (startup_timeout=60s) (pods: {W0} Running)", False),
        ([pod(W0, "Pending")], 1e9, None, None, False),  # None: waits for ever
    ],
    ids=["launcher runs", "image pull back-off", "pull error, no timeout", "invalid image",
         "crash loop", "failed pod", "pending within the timeout", "pending past it",
         "unschedulable", "no pods", "no launcher", "no startup timeout"],
)  # fmt: skip
def test_start_failures_name_the_pod_and_the_reason(
    pods, elapsed, startup_timeout, failure, started
):
    found, has_started = pod_start_failure(
        pods, "hvd-train-1234", elapsed=elapsed, startup_timeout=startup_timeout
    )
    assert has_started is started
    if failure is None:
        assert found is None
    else:
        assert found is not None and found.startswith(failure), found


@pytest.mark.parametrize(
    ("listings", "startup_timeout", "message"),
    [
        ([[pod(W0, "Pending", waiting=("ContainerCreating", ""))],
          [pod(W0, "Pending", waiting=PULL)]],
         600, f"pod {W0} (container worker): ImagePullBackOff"),
        ([[pod(W0, "Running"), pod(W1, "Pending", unschedulable="0/2 nodes: Insufficient cpu")]],
         0.05, f"pod {W1} still Pending after 0s (startup_timeout=0s): Unschedulable: 0/2 nodes"),
    ],
    ids=["image pull", "unschedulable"],
)  # fmt: skip
def test_a_job_that_cannot_start_fails_the_task_fast_and_is_deleted(
    listings, startup_timeout, message
):
    from horovod_airflow.operators import HorovodLaunchError

    hook = FakeHook([RUNNING])
    hook.core_v1_client.pods = listings
    with pytest.raises(HorovodLaunchError, match=re.escape(message)) as err:
        launcher(hook, startup_timeout=startup_timeout).run(spec(timeout=3600), LineLog())
    assert "did not start (deleted)" in str(err.value)
    # Deleted although delete_on_success keeps failed jobs: a retry must not re-attach to it.
    assert hook.deleted == ["hvd-train-1234"]
    assert hook.core_v1_client.deleted == ["hvd-train-1234-rank-env"]


def test_once_the_launcher_runs_pods_are_no_longer_listed():
    hook = FakeHook([RUNNING, RUNNING, RUNNING, SUCCEEDED])
    launcher(hook).run(spec(), LineLog())
    startup_looks = [s for s in hook.core_v1_client.selectors if "job-role" not in s]
    assert len(startup_looks) == 1


def test_the_deferred_task_fails_fast_on_a_start_failure_and_deletes_the_job(tmp_path):
    from horovod_airflow.operators import HorovodLaunchError

    op = k8s_train_op(deferrable=True, output=str(tmp_path / "out"), startup_timeout=300)
    hook = FakeHook([RUNNING])
    hook.core_v1_client.pods = [[pod(W0, "Pending", waiting=PULL)]]
    with mock.patch(HOOK, return_value=hook):
        with pytest.raises(TaskDeferred) as deferred:
            op.execute(context())
        trigger = deferred.value.trigger
        assert trigger.startup_timeout == 300
        (event,) = asyncio.run(_events(trigger))
        assert event.payload["status"] == "not_started"
        assert f"pod {W0} (container worker): ImagePullBackOff" in event.payload["message"]
        with pytest.raises(HorovodLaunchError, match="did not start"):
            op.execute_complete(context(), event=event.payload, **deferred.value.kwargs)
    assert list(hook.deleted) == [trigger.name]


def manifests() -> dict[str, dict[str, Any]]:
    """Every shape of MPIJob the launcher builds."""
    from horovod_airflow.operators.job import job_labels

    labels = job_labels("mnist_horovod_retrain", "train", "manual__2026-12-04T18:49:33+00:00", 2)
    return {
        "train, all pod settings": build_mpijob(
            spec(labels=labels), image="hva/trainer:1", namespace="ml", slots_per_worker=2,
            pod_options=PodOptions(**POD_OPTIONS),
        ),
        "one-rank export": KubernetesLauncher(
            image="hva/trainer:1", hook=FakeHook([]), options=KubernetesOptions(slots_per_worker=2)
        ).manifest(spec(num_proc=1, distributed=False, labels=labels)),
        "cpu, no secrets, no timeout": build_mpijob(
            spec(gpus_per_proc=0, secret_env={}, timeout=None), image="hva/trainer:1",
            namespace="ml", slots_per_worker=1,
        ),
    }  # fmt: skip


@pytest.mark.parametrize("shape", list(manifests()))
def test_every_manifest_passes_the_mpijob_api_checks(shape):
    assert mpijob_errors(manifests()[shape]) == []


def _set(path: str, value: Any) -> Any:
    def mutate(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = body
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value

    return mutate


WORKER_POD = "spec.mpiReplicaSpecs.Worker.template.spec"


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (_set("kind", "Job"), "apiVersion/kind"),
        (_set("spec.sshAuthMountPath", ""), "spec.sshAuthMountPath: must have a mount path"),
        (_set("spec.launcherCreationPolicy", "Later"), "spec.launcherCreationPolicy: 'Later'"),
        (_set("spec.slotsPerWorker", "2"), "spec.slotsPerWorker: must be a non-negative"),
        (_set("spec.waitForWorkers", True), "spec: unknown field 'waitForWorkers'"),
        (_set("spec.runPolicy.cleanPodPolicy", "Some"), "spec.runPolicy.cleanPodPolicy: 'Some'"),
        (_set("spec.runPolicy.activeDeadlineSeconds", -1), "activeDeadlineSeconds: must be a"),
        (_set("spec.mpiReplicaSpecs.Launcher.replicas", 2), "Launcher.replicas: must be 1"),
        (_set("spec.mpiReplicaSpecs.Worker.replicas", 0), "Worker.replicas: must be greater"),
        (_set("spec.mpiReplicaSpecs.Worker.restartPolicy", "Always"), "Worker.restartPolicy"),
        (_set(f"{WORKER_POD}.nodeSelectors", {"a": "b"}), "unknown field 'nodeSelectors'"),
        (_set(f"{WORKER_POD}.containers.0.commands", ["sshd"]), "unknown field 'commands'"),
        (_set(f"{WORKER_POD}.containers.0.command", "sshd -D"), "command: must be a list"),
        (_set(f"{WORKER_POD}.containers.0.readinessProbe", {"tcpSocket": {"prt": 2222}}),
         "unknown field 'prt' of V1TCPSocketAction"),
        (_set(f"{WORKER_POD}.tolerations.0.tolerationSeconds", "60"), "must be an integer"),
        (_set(f"{WORKER_POD}.containers", []), "must define at least one container"),
        (_set("spec.mpiReplicaSpecs.Worker.template.metadata.labels.run_id", "a:b"),
         "label value 'a:b' is invalid"),
        (_set("metadata.name", "x" * 60), "would not be a DNS-1035 label"),
        (_set("metadata.name", "Hvd_Train"), "would not be a DNS-1035 label"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)  # fmt: skip
def test_the_mpijob_checks_catch_what_the_api_would_refuse_or_prune(mutate, error):
    body = manifests()["train, all pod settings"]
    mutate(body)
    errors = mpijob_errors(body)
    assert any(error in e for e in errors), errors


# --- the launcher pod's log, followed while the job runs ----------------------------------
def stamped(second: int, nano: int, line: str) -> bytes:
    return f"2026-12-04T10:00:{second:02d}.{nano:09d}Z {line}\n".encode()


class CutStreams(FakeCore):
    """A launcher pod whose log comes in two follow streams: the first is cut after two
    lines (the API server dropped it), the reconnect (``since_seconds``) repeats those two
    lines and two more of the same second, then the rest, and ends (the pod has finished)."""

    def __init__(self, log: LineLog) -> None:
        super().__init__("")
        self.log = log
        self.streams = 0

    def read_namespaced_pod_log(self, name: str, namespace: str, **kw: Any) -> Any:
        self.log_reads.append(kw)
        assert kw.get("timestamps") is True
        if kw.get("_preload_content") is not False:  # the catch-up at the end: all again
            return b"".join(self.chunks(whole=True)).decode()
        self.streams += 1
        if self.streams == 1:
            return LogStream(self.first())
        return LogStream(self.chunks(whole=False))

    def first(self) -> Any:
        yield stamped(1, 5, "[0]<stdout>:epoch 1")
        yield stamped(2, 0, "[0]<stdout>:epoch 2 ")[:-10]  # a line in two chunks ...
        yield stamped(2, 0, "[0]<stdout>:epoch 2 ")[-10:]  # ... and a cut stream

    def chunks(self, *, whole: bool) -> Any:
        yield stamped(1, 5, "[0]<stdout>:epoch 1")
        yield stamped(2, 0, "[0]<stdout>:epoch 2 ")
        yield stamped(2, 0, "[1]<stdout>:epoch 2 ")  # same timestamp: a new line
        if not whole:  # the job goes on while the task log already shows its lines
            deadline = time.monotonic() + 10
            while "[1]<stdout>:epoch 2 " not in self.log.lines and time.monotonic() < deadline:
                time.sleep(0.01)
        yield stamped(3, 1, "[0]<stdout>:done")


def test_the_launcher_log_is_followed_into_the_task_log_while_the_job_runs():
    log = LineLog()
    seen_when_done: list[list[str]] = []

    class Hook(FakeHook):
        def get_custom_object(self, group, version, plural, name, namespace=None):
            obj = super().get_custom_object(group, version, plural, name, namespace)
            if "[0]<stdout>:done" in log.lines or self.gets > 500:
                seen_when_done.append(list(log.lines))
                return SUCCEEDED
            return obj

    hook = Hook([RUNNING])
    hook.core_v1_client = CutStreams(log)
    launcher(hook).run(spec(), log)
    expected = ["[0]<stdout>:epoch 1", "[0]<stdout>:epoch 2 ", "[1]<stdout>:epoch 2 ",
                "[0]<stdout>:done"]  # fmt: skip
    # every line reached the task log while the job was still running ...
    assert seen_when_done and all(line in seen_when_done[0] for line in expected)
    # ... each once, in order, over a reconnect and the final catch-up
    assert [line for line in log.lines if "<stdout>" in line] == expected
    reads = hook.core_v1_client.log_reads
    assert reads[0] == {"timestamps": True, "follow": True, "_preload_content": False}
    assert reads[1]["follow"] is True and reads[1]["since_seconds"] >= 5  # resumed
    assert "follow" not in reads[-1] and reads[-1]["since_seconds"] >= 5  # caught up


def test_a_follow_stream_that_never_ends_is_cut_at_the_end_of_the_job(monkeypatch):
    monkeypatch.setattr("horovod_airflow.operators.launchers.kubernetes.logs.LOG_DRAIN_S", 0.2)
    log = LineLog()

    class Endless(FakeCore):
        def read_namespaced_pod_log(self, name: str, namespace: str, **kw: Any) -> Any:
            if kw.get("_preload_content") is False:

                def forever() -> Any:
                    yield stamped(1, 0, "[0]<stdout>:hello")
                    while True:
                        time.sleep(0.01)
                        yield b""

                return LogStream(forever())
            return stamped(1, 0, "[0]<stdout>:hello").decode()

    hook = FakeHook([RUNNING, RUNNING, SUCCEEDED])
    hook.core_v1_client = Endless("")
    started = time.monotonic()
    assert launcher(hook).run(spec(), log).exit_code == 0
    assert time.monotonic() - started < 10
    assert log.lines.count("[0]<stdout>:hello") == 1


def test_log_timestamps_compare_by_time_not_by_text():
    from horovod_airflow.operators.launchers.kubernetes.logs import log_timestamp

    earlier = log_timestamp("2026-12-04T10:00:05.1Z")
    later = log_timestamp("2026-12-04T10:00:05.12Z")
    assert earlier is not None and later is not None and earlier < later
    assert log_timestamp("2026-12-04T11:00:05+01:00") == log_timestamp("2026-12-04T10:00:05Z")
    assert log_timestamp("[0]<stdout>:x") is None


@pytest.mark.parametrize(
    ("found_uid", "found_try", "reattached"),
    [
        ("uid-A", "1", True),  # the job try 1 recorded
        ("uid-B", "2", True),  # try 2 created it and died before recording it
        ("uid-B", "1", False),  # re-created under the name by someone else
    ],
    ids=["recorded", "made by a later try", "re-created"],
)
def test_a_retry_reattaches_only_to_the_job_its_tries_recorded(found_uid, found_try, reattached):
    from horovod_airflow.operators.exceptions import JobNotOursError
    from horovod_airflow.operators.launchers.base import JOB_STATE_KEY, JobJournal
    from tests.operators.fakes import TaskStateStore

    found = {**RUNNING, "metadata": {"name": "hvd-train-1234", "uid": found_uid,
                                     "labels": {"try_number": found_try}}}  # fmt: skip
    hook = FakeHook([found, SUCCEEDED], log_text="[0]<x>:ok")
    hook.objects["hvd-train-1234"] = {"metadata": {"name": "hvd-train-1234"}}
    store = TaskStateStore(
        {JOB_STATE_KEY: {"launcher": "kubernetes", "id": "uid-A", "try_number": 1}}
    )
    runner = launcher(hook)
    runner.journal = JobJournal(store, try_number=3)
    log = LineLog()
    if reattached:
        assert runner.run(spec(labels={"try_number": "3"}), log).exit_code == 0
        assert any("re-attaching to it" in line for line in log.lines), log.lines
        assert hook.created == {}
        return
    with pytest.raises(JobNotOursError, match="re-created by someone else") as e:
        runner.run(spec(labels={"try_number": "3"}), log)
    assert "uid uid-B" in str(e.value) and "created uid uid-A" in str(e.value)
    assert hook.created == {} and hook.deleted == []  # neither re-attached to nor deleted


def test_the_job_a_try_creates_is_recorded_with_its_uid_for_the_next_try():
    from horovod_airflow.operators.launchers.base import JOB_STATE_KEY, JobJournal
    from tests.operators.fakes import TaskStateStore

    hook = FakeHook([SUCCEEDED], log_text="[0]<x>:ok")
    store = TaskStateStore()
    runner = launcher(hook)
    runner.journal = JobJournal(store, try_number=2)
    runner.run(spec(labels={"try_number": "2"}), LineLog())
    assert store[JOB_STATE_KEY] == {
        "launcher": "kubernetes", "kind": "MPIJob", "name": "hvd-train-1234",
        "namespace": "ml", "id": "uid-123", "try_number": 2,
    }  # fmt: skip


def _progress_line(step: int) -> str:
    from horovod_airflow.core.contract import EVENT_PROGRESS, event_line

    return "[0]<stdout>:" + event_line(
        EVENT_PROGRESS,
        {"step": step, "of_steps": 8, "epoch": 1, "of_epochs": 1, "samples_per_sec": 100.0,
         "eta_seconds": 8.0 - step, "loss": 0.3, "lr": 0.1},
    )  # fmt: skip


def test_progress_followed_while_the_job_runs_reaches_the_task_state_store():
    from horovod_airflow.operators.launchers.base import JobJournal
    from horovod_airflow.operators.progress import PROGRESS_STATE_KEY
    from tests.operators.fakes import TaskStateStore

    hook = FakeHook([RUNNING, SUCCEEDED], log_text=_progress_line(4) + "\n" + _progress_line(8))
    store, log = TaskStateStore(), LineLog()
    k8s = launcher(hook)
    k8s.journal = JobJournal(store, 1, log)
    k8s.run(spec(), log)
    assert store[PROGRESS_STATE_KEY]["step"] == 8
    assert any(line.startswith("progress: epoch 1/1, step 4/8 (50.0%)") for line in log.lines)


def test_a_deferred_wait_records_the_jobs_progress_when_the_task_resumes(s3_server):
    from horovod_airflow.operators.progress import PROGRESS_STATE_KEY
    from tests.operators.fakes import TaskStateStore

    bucket = s3_server.new_bucket()
    s3_server.client().put_object(Bucket=bucket, Key="out/metrics.json",
                                  Body=METRICS.dumps({"val_accuracy": 0.9}).encode())  # fmt: skip
    op = HorovodTrainOperator(
        task_id="train", launcher="kubernetes", image="hva/trainer:1", num_proc=2,
        entrypoint=PROGRAM, data=f"s3://{bucket}/d", output=f"s3://{bucket}/out",
        kubernetes=KubernetesOptions(deferrable=True, namespace="ml"),
    )  # fmt: skip
    hook = FakeHook([SUCCEEDED], log_text=_progress_line(8))
    store = TaskStateStore()
    with mock.patch(HOOK, return_value=hook):
        with pytest.raises(TaskDeferred) as deferred:
            op.execute(context(store=store))
        assert PROGRESS_STATE_KEY not in store  # nothing reads the job's output while deferred
        event = asyncio.run(_events(deferred.value.trigger))[0].payload
        op.execute_complete(context(store=store), event=event, **deferred.value.kwargs)
    assert store[PROGRESS_STATE_KEY]["step"] == 8
