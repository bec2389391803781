"""What the Horovod operators share: job names distinct per task instance, label-safe labels."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from horovod_airflow.operators.job import job_labels, job_name


@pytest.mark.parametrize(
    "run_ids",
    [
        ["a:b", "a+b", "a b", "a_b"],
        ["manual__2026-12-02T10:00:00+00:00", "manual__2026-12-02T10_00_00_00_00"],
        ["x" * 300 + "1", "x" * 300 + "2"],
    ],
)
def test_job_names_of_colliding_run_ids_are_distinct_dns_names(run_ids):
    names = [job_name("dag", "train", r) for r in run_ids]
    assert len(set(names)) == len(run_ids), names
    for name in names:
        assert len(name) <= 52 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name


def test_job_name_is_per_task_instance_not_per_try():
    """Every try of one task instance gets the same name, so a retry finds the earlier try's
    job; mapped instances, tasks, runs and DAGs get their own."""
    name = job_name("d", "train", "r")
    assert name == job_name("d", "train", "r") == job_name("d", "train", "r", -1)
    others = [job_name("d", "train", "r", 0), job_name("d", "train", "r", 1),
              job_name("d", "export", "r"), job_name("d", "train", "r2"),
              job_name("d2", "train", "r")]  # fmt: skip
    assert len({name, *others}) == 6
    assert job_name("d", "Train_Step", "r").startswith("hvd-train-step-")


LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


@pytest.mark.parametrize(
    ("run_id", "task_id"),
    [
        ("manual__2026-12-04T18:49:33.123456+00:00", "train"),
        ("scheduled__2026-12-04", "t" * 200),
        ("__odd run id: with spaces/slashes__", "group.train_step"),
    ],
)
def test_job_labels_are_label_safe_and_keep_the_try(run_id, task_id):
    labels = job_labels("mnist_horovod_retrain", task_id, run_id, 3, map_index=2)
    assert set(labels) == {"dag_id", "task_id", "run_id", "map_index", "try_number"}
    assert labels["try_number"] == "3" and labels["map_index"] == "2"
    for key, value in labels.items():
        assert len(value) <= 63 and LABEL_VALUE.fullmatch(value), (key, value)
    other = job_labels("mnist_horovod_retrain", task_id, run_id + "x", 3, map_index=2)
    assert other["run_id"] != labels["run_id"]  # a hash keeps unsafe run ids apart
    assert "map_index" not in job_labels("d", "t", "r", 1)


# --- launcher options: every one reaches its launcher, overrides merge, one timeout ------------
def _train(**kw: Any) -> Any:
    from horovod_airflow.operators import HorovodTrainOperator
    from tests.operators.helpers import PROGRAM

    base = {"task_id": "train", "data": "s3://b/d", "output": "s3://b/o", "num_proc": 4,
            "entrypoint": PROGRAM, "aws_conn_id": None}  # fmt: skip
    return HorovodTrainOperator(**{**base, **kw})


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


LOCAL_PROBES: dict[str, tuple[Any, Callable[[Any, list[str]], bool]]] = {
    "hosts": ("h1:2,h2:2", lambda lr, argv: argv[argv.index("-H") + 1] == "h1:2,h2:2"),
    "ssh_port": (2200, lambda lr, argv: argv[argv.index("-p") + 1] == "2200"),
    "ssh_identity_file": ("/k", lambda lr, argv: "--ssh-identity-file" in argv),
    "network_interface": ("eth1", lambda lr, argv: "eth1" in argv),
    "horovodrun_args": (
        ["--verbose"],
        lambda lr, argv: argv.index("--verbose") < argv.index("-np"),
    ),
    "rank_env_dir": ("/shared", lambda lr, argv: lr.rank_env_dir == "/shared"),
    "kill_grace_s": (3.0, lambda lr, argv: lr.kill_grace_s == 3.0),
    "working_dir": ("/srv", lambda lr, argv: lr.cwd == "/srv"),
    "forward_env": (["MYAPP_*"], lambda lr, argv: _forwards(lr, "MYAPP_PROBE")),
}


def _forwards(launcher: Any, name: str) -> bool:
    """Whether a variable of the worker's environment reaches the job the launcher starts."""
    from unittest import mock

    from horovod_airflow.operators.launchers.base import JobSpec

    with mock.patch.dict(os.environ, {name: "1"}):
        return name in launcher._environ(JobSpec(name="j", argv=["x"], num_proc=1))


def test_every_local_option_reaches_the_launcher_or_horovodrun():
    from horovod_airflow.operators.launchers.local import LocalOptions
    from tests.operators.helpers import context

    assert set(LOCAL_PROBES) == _fields(LocalOptions), "a LocalOptions field without a probe"
    options = LocalOptions(**{name: value for name, (value, _) in LOCAL_PROBES.items()})
    op = _train(local=options)
    spec = op.build_spec(context())
    launcher = op.make_launcher()
    assert launcher.options is options
    command = launcher.command(spec)  # the horovodrun command the local launcher starts
    for name, (_, reached) in LOCAL_PROBES.items():
        assert reached(launcher, command), name


DOCKER_PROBES: dict[str, tuple[Any, Callable[[Any, dict[str, Any]], bool]]] = {
    "docker_conn_id": ("registry", lambda dl, kw: dl.docker_conn_id == "registry"),
    "docker_url": ("tcp://engine:2375", lambda dl, kw: dl.docker_url == "tcp://engine:2375"),
    "mounts": (["/data:/data:ro"], lambda dl, kw: kw["host_config"]["Binds"] == ["/data:/data:ro"]),
    "ipc_mode": ("shareable", lambda dl, kw: kw["host_config"]["IpcMode"] == "shareable"),
    "shm_size": ("2g", lambda dl, kw: kw["host_config"]["ShmSize"] == 2 * 1024**3),
    "network_mode": ("stack", lambda dl, kw: kw["host_config"]["NetworkMode"] == "stack"),
    "working_dir": ("/work", lambda dl, kw: kw["working_dir"] == "/work"),
    "cleanup": ("keep", lambda dl, kw: dl.cleanup == "keep"),
    "force_pull": (True, lambda dl, kw: dl.force_pull is True),
    "container_overrides": ({"user": "1000"}, lambda dl, kw: kw["user"] == "1000"),
    "host_config_overrides": (
        {"cpuset_cpus": "0-1"},
        lambda dl, kw: kw["host_config"]["CpusetCpus"] == "0-1",
    ),
}


def test_every_docker_option_reaches_the_container_spec():
    from horovod_airflow.operators.launchers.docker import DockerOptions
    from tests.operators.fakes import FakeDockerClient
    from tests.operators.helpers import context

    assert set(DOCKER_PROBES) == _fields(DockerOptions), "a DockerOptions field without a probe"
    options = DockerOptions(**{name: value for name, (value, _) in DOCKER_PROBES.items()})
    op = _train(launcher="docker", image="hva/trainer:1", docker=options)
    spec = op.build_spec(context())
    launcher = op.make_launcher()
    launcher._client = FakeDockerClient([], {"StatusCode": 0})
    kwargs = launcher.create_kwargs(spec)
    for name, (_, reached) in DOCKER_PROBES.items():
        assert reached(launcher, kwargs), name


def _pods(body: dict[str, Any]) -> list[dict[str, Any]]:
    replicas = body["spec"]["mpiReplicaSpecs"]
    return [replicas[r]["template"]["spec"] for r in ("Launcher", "Worker")]


def _container(body: dict[str, Any], replica: str) -> dict[str, Any]:
    return body["spec"]["mpiReplicaSpecs"][replica]["template"]["spec"]["containers"][0]


KUBERNETES_PROBES: dict[str, tuple[Any, Callable[[Any, dict[str, Any]], bool]]] = {
    "service_account": ("sa", lambda kl, b: all(p["serviceAccountName"] == "sa" for p in _pods(b))),
    "image_pull_policy": (
        "Always",
        lambda kl, b: all(p["containers"][0]["imagePullPolicy"] == "Always" for p in _pods(b)),
    ),
    "image_pull_secrets": (
        ["regcred"],
        lambda kl, b: all(p["imagePullSecrets"] == [{"name": "regcred"}] for p in _pods(b)),
    ),
    "node_selector": (
        {"gpu": "h200"},
        lambda kl, b: _pods(b)[1]["nodeSelector"] == {"gpu": "h200"},
    ),
    "tolerations": (
        [{"key": "k", "operator": "Exists"}],
        lambda kl, b: _pods(b)[0]["tolerations"] == [{"key": "k", "operator": "Exists"}],
    ),
    "priority_class": ("high", lambda kl, b: _pods(b)[1]["priorityClassName"] == "high"),
    "mount_service_account_token": (
        True,
        lambda kl, b: all(p["automountServiceAccountToken"] is True for p in _pods(b)),
    ),
    "worker_resources": (
        {"requests": {"cpu": "4"}},
        lambda kl, b: _container(b, "Worker")["resources"]["requests"] == {"cpu": "4"},
    ),
    "launcher_resources": (
        {"limits": {"cpu": "1"}},
        lambda kl, b: _container(b, "Launcher")["resources"] == {"limits": {"cpu": "1"}},
    ),
    "kubernetes_conn_id": ("k8s", lambda kl, b: kl.kubernetes_conn_id == "k8s"),
    "namespace": ("ml", lambda kl, b: b["metadata"]["namespace"] == "ml"),
    "slots_per_worker": (2, lambda kl, b: b["spec"]["slotsPerWorker"] == 2),
    "cleanup": ("keep", lambda kl, b: kl.cleanup == "keep"),
    "deferrable": (True, lambda kl, b: kl.options.deferrable is True),  # run_job reads it
    "poll_interval": (2.5, lambda kl, b: kl.poll_interval == 2.5),
    "startup_timeout": (30.0, lambda kl, b: kl.startup_timeout == 30.0),
    "mpijob_overrides": (
        {"spec": {"runPolicy": {"ttlSecondsAfterFinished": 600}}},
        lambda kl, b: b["spec"]["runPolicy"]["ttlSecondsAfterFinished"] == 600,
    ),
    # the TrainJob flavour's: probed on the TrainJob (b), the other probes on the MPIJob
    "kubernetes_api": ("trainjob", lambda kl, b: kl.flavour.api == b["kind"].lower()),
    "trainjob_overrides": (
        {"TrainJob": {"metadata": {"annotations": {"team": "ml"}}}},
        lambda kl, b: b["metadata"]["annotations"] == {"team": "ml"},
    ),
}
#: The probes of options that apply to one flavour only (the other one refuses them).
TRAINJOB_ONLY = {"kubernetes_api", "trainjob_overrides"}
MPIJOB_ONLY = {"mpijob_overrides"}


@pytest.mark.parametrize(("api", "unused"), [("mpijob", TRAINJOB_ONLY), ("trainjob", MPIJOB_ONLY)])
def test_every_kubernetes_option_reaches_the_job(api, unused):
    from horovod_airflow.operators.launchers.kubernetes import KubernetesOptions
    from tests.operators.fakes import FakeHook
    from tests.operators.helpers import context

    assert set(KUBERNETES_PROBES) == _fields(KubernetesOptions), "a field without a probe"
    options = KubernetesOptions(
        **{name: value for name, (value, _) in KUBERNETES_PROBES.items() if name not in unused}
    )
    assert options.kubernetes_api == api
    op = _train(launcher="kubernetes", image="hva/trainer:1", kubernetes=options)
    spec = op.build_spec(context())
    launcher = op.make_launcher()
    launcher.client._hook = FakeHook([])
    body = launcher.manifest(spec)
    assert body["kind"] == {"mpijob": "MPIJob", "trainjob": "TrainJob"}[api]
    # the pod probes read MPIJob pods; the TrainJob's pods are the same (test_trainjob_launcher)
    probed = set(KUBERNETES_PROBES) - unused if api == "mpijob" else TRAINJOB_ONLY
    for name in probed:
        assert KUBERNETES_PROBES[name][1](launcher, body), name


def test_docker_overrides_merge_over_the_spec_and_owned_keys_are_refused():
    from horovod_airflow.operators.launchers.base import JobSpec
    from horovod_airflow.operators.launchers.docker import DockerLauncher, DockerOptions
    from tests.operators.fakes import FakeDockerClient

    options = DockerOptions(
        container_overrides={"hostname": "trainer", "stop_signal": "SIGINT"},
        host_config_overrides={"init": False, "privileged": True},
    )
    launcher = DockerLauncher(image="i:1", options=options, client=FakeDockerClient([], {}))
    kwargs = launcher.create_kwargs(JobSpec(name="j", argv=["python", "x.py"], num_proc=2))
    assert kwargs["hostname"] == "trainer" and kwargs["stop_signal"] == "SIGINT"
    assert kwargs["host_config"]["Privileged"] is True and kwargs["host_config"]["Init"] is False
    assert kwargs["command"][-2:] == ["python", "x.py"]  # the launcher's own keys stay
    for field, key, owner in [
        ("container_overrides", "command", "the job's command"),
        ("container_overrides", "environment", "env / secret_env"),
        ("container_overrides", "working_dir", "DockerOptions.working_dir"),
        ("host_config_overrides", "network_mode", "DockerOptions.network_mode"),
        ("host_config_overrides", "device_requests", "gpus_per_proc"),
    ]:
        with pytest.raises(ValueError, match=rf"{field}\['{key}'\]: set by the launcher .*{owner}"):
            DockerOptions(**{field: {key: "x"}})
    unknown = DockerLauncher(
        image="i:1",
        options=DockerOptions(host_config_overrides={"cpu_sets": "0"}),
        client=FakeDockerClient([], {}),
    )
    with pytest.raises(ValueError, match=r"host_config_overrides: .*cpu_sets"):
        unknown.create_kwargs(JobSpec(name="j", argv=["x"], num_proc=1))


def test_mpijob_overrides_deep_merge_by_name_and_owned_paths_are_refused():
    from horovod_airflow.operators.launchers.kubernetes import KubernetesLauncher, KubernetesOptions
    from horovod_airflow.operators.launchers.kubernetes.manifests import POD_SECURITY
    from tests.operators.fakes import FakeHook
    from tests.operators.test_kubernetes_launcher import spec

    worker_pod = {
        "hostIPC": True,
        "containers": [
            {"name": "worker", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
             "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]},
            {"name": "sidecar", "image": "busybox", "command": ["sleep", "inf"]},
        ],
    }  # fmt: skip
    overrides = {"spec": {"mpiReplicaSpecs": {"Worker": {"template": {"spec": worker_pod}}}}}
    options = KubernetesOptions(namespace="ml", slots_per_worker=2, mpijob_overrides=overrides)
    body = KubernetesLauncher(image="i:1", options=options, hook=FakeHook([])).manifest(spec())
    pod = body["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    worker, sidecar = pod["containers"]
    assert pod["hostIPC"] is True and pod["securityContext"] == POD_SECURITY
    assert worker["name"] == "worker" and worker["securityContext"]["capabilities"]["add"]
    assert worker["readinessProbe"]  # the launcher's keys stay beside the merged ones
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["NCCL_DEBUG"] == "INFO" and env["PYTHONUNBUFFERED"] == "1"
    assert sidecar["name"] == "sidecar"
    assert overrides["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"] is worker_pod
    assert "readinessProbe" not in worker_pod["containers"][0]  # the argument is not changed

    owned = [
        ({"metadata": {"name": "other"}}, "metadata.name"),
        ({"spec": {"slotsPerWorker": 4}}, "spec.slotsPerWorker"),
        ({"spec": {"mpiReplicaSpecs": {"Worker": {"replicas": 9}}}}, "Worker.replicas"),
        ({"spec": {"mpiReplicaSpecs": {"Launcher": {"template": {"spec": {"containers": [
            {"name": "launcher", "command": ["sh"]}]}}}}}}, "containers.launcher.command"),
        ({"spec": {"runPolicy": {"activeDeadlineSeconds": 5}}}, "execution_timeout"),
    ]  # fmt: skip
    for override, named in owned:
        options = KubernetesOptions(namespace="ml", mpijob_overrides=override)
        launcher = KubernetesLauncher(image="i:1", options=options, hook=FakeHook([]))
        with pytest.raises(ValueError, match=f"mpijob_overrides sets .*{re.escape(named)}"):
            launcher.manifest(spec(num_proc=1))


def test_horovodrun_args_reach_horovodrun_and_owned_flags_are_refused():
    from horovod_airflow.operators.launchers.local import LocalOptions
    from tests.operators.helpers import context

    op = _train(local=LocalOptions(horovodrun_args=["--timeline-filename", "/tmp/t.json"]))
    argv = op.make_launcher().command(op.build_spec(context()))
    assert argv[argv.index("--timeline-filename") + 1] == "/tmp/t.json"
    assert argv.index("--timeline-filename") < argv.index("-np")
    for flag in ("-np", "--hosts=a:1", "-p", "--mpi", "--network-interface"):
        with pytest.raises(ValueError, match=r"horovodrun_args .*set by the launcher itself"):
            LocalOptions(horovodrun_args=[flag, "1"])


@pytest.mark.parametrize(
    ("limit", "deadline"),
    [(None, None), (timedelta(seconds=100), 90.0), (timedelta(hours=2), 7200.0 - 60)],
)
def test_the_launchers_deadline_comes_from_execution_timeout(limit, deadline):
    op = _train(execution_timeout=limit)
    op.start_clock()
    got = op.job_deadline()
    assert got == deadline if deadline is None else deadline - 1 < got <= deadline


def test_no_time_left_fails_before_launching():
    from horovod_airflow.operators import HorovodTimeoutError

    op = _train(execution_timeout=timedelta(seconds=10))
    op._clock = time.monotonic() - 9.5
    with pytest.raises(HorovodTimeoutError, match="leaves no time for the job"):
        op.job_deadline()


def test_a_deferred_mpijob_gets_the_execution_timeout_deadline():
    """Airflow 3 does not apply execution_timeout to a deferred wait: the trigger does, and
    the MPIJob's activeDeadlineSeconds is the same deadline."""
    from unittest import mock

    from airflow.sdk.exceptions import TaskDeferred

    from horovod_airflow.operators.launchers.kubernetes import KubernetesOptions
    from tests.operators.fakes import HOOK, RUNNING, FakeHook
    from tests.operators.helpers import context

    op = _train(
        launcher="kubernetes",
        image="hva/trainer:1",
        execution_timeout=timedelta(hours=1),
        kubernetes=KubernetesOptions(namespace="ml", deferrable=True),
    )
    hook = FakeHook([RUNNING])
    patched = mock.patch(HOOK, return_value=hook)
    with patched, pytest.raises(TaskDeferred) as deferred:
        op.execute(context())
    trigger = deferred.value.trigger
    assert 3600 - 60 - 5 < trigger.timeout <= 3600 - 60
    (body,) = hook.objects.values()
    assert body["spec"]["runPolicy"]["activeDeadlineSeconds"] == int(trigger.timeout)


def test_the_dag_shares_one_settings_object_for_train_and_export():
    """Train and export get the deployment's job settings from one object (TRAINER_JOB), the
    docker options included, not each its own copy."""
    import importlib

    from horovod_airflow.operators import settings
    from horovod_airflow.operators.launchers.docker import DockerOptions

    # Other tests reload the settings (a bucket of their own): build the DAG from these.
    importlib.reload(settings)
    dag = importlib.reload(importlib.import_module("dags.mnist_horovod_retrain")).retrain_dag
    TRAINER_JOB = settings.TRAINER_JOB
    assert isinstance(TRAINER_JOB["docker"], DockerOptions)
    for task_id in ("train", "export_onnx"):
        task = dag.task_dict[task_id]
        assert task.launcher_options["docker"] is TRAINER_JOB["docker"], task_id
        for name in ("image", "gpus_per_proc", "aws_conn_id", "rank_aws_conn_id"):
            assert getattr(task, name) == TRAINER_JOB[name], (task_id, name)
        assert task.execution_timeout == TRAINER_JOB["execution_timeout"], task_id


def test_a_task_state_store_that_fails_is_a_warning_and_the_labels_decide():
    """The store (Airflow's API server) failing to answer must not fail a job that runs: the
    launcher logs it and the next try falls back to the job's name and labels."""
    from horovod_airflow.operators.launchers.base import JobJournal, made_by_this_task
    from tests.operators.fakes import LineLog

    class Down:
        def get(self, key: str) -> None:
            raise ConnectionError("execution API unreachable")

        def set(self, key: str, value: object) -> None:
            raise ConnectionError("execution API unreachable")

    log = LineLog()
    journal = JobJournal(Down(), try_number=2, log=log)
    journal.record("docker", name="hvd-x", id="c0ffee")
    assert journal.recorded is None
    assert [line.split(":")[0] for line in log.lines] == [
        "could not read the task state store (horovod_job)",
        "could not record the job in the task state store",
    ]
    assert made_by_this_task("any", "1", None)  # nothing recorded: the labels decide
    assert made_by_this_task("c0ffee", "1", {"id": "c0ffee", "try_number": 1})
    assert made_by_this_task("beef", "3", {"id": "c0ffee", "try_number": 2})
    assert not made_by_this_task("beef", "2", {"id": "c0ffee", "try_number": 2})
    assert not made_by_this_task("beef", None, {"id": "c0ffee", "try_number": 2})


@pytest.mark.parametrize("launcher", ["local", "docker", "kubernetes"])
def test_the_ranks_get_the_rank_connections_credentials_on_every_launcher(s3_server, launcher):
    """rank_aws_conn_id: the job's credentials are the ranks' identity's, whatever the
    launcher; the worker keeps its own (aws_conn_id) for what it reads and publishes."""
    image = {} if launcher == "local" else {"image": "hva/trainer:1"}
    op = _train(launcher=launcher, aws_conn_id="aws_default", rank_aws_conn_id="hva_ranks",
                **image)  # fmt: skip
    public, secret = op.job_env()
    assert secret["AWS_ACCESS_KEY_ID"] == s3_server.ranks.access_key
    assert secret["AWS_SECRET_ACCESS_KEY"] == s3_server.ranks.secret_key
    assert public["AWS_ENDPOINT_URL"] == s3_server.endpoint
    assert op.s3_hook.get_credentials().access_key == s3_server.worker.access_key
    default = _train(launcher=launcher, aws_conn_id="aws_default", **image)
    assert default.job_env()[1]["AWS_ACCESS_KEY_ID"] == s3_server.worker.access_key
