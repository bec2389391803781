"""The kubernetes launcher's MPIJob, run for real: its pods as podman containers.

No Kubernetes cluster runs here. ``tests/engines/mpijob_harness.py`` answers the launcher's
API calls and does with the manifest, unchanged, what the MPI Operator does: key pair at
``sshAuthMountPath``, workers from the worker template, the launcher (horovodrun) once every
worker's sshd is ready, the hostfile, the Service's names. The operator runs exactly as in
Airflow (``launcher="kubernetes"``, polling), the credentials travel in the job's Secret,
and the ranks read and write S3 on the network's gateway.
"""

from __future__ import annotations

import threading
import time
from typing import Any
from unittest import mock

import pytest

from horovod_airflow.operators import HorovodTrainingError, HorovodTrainOperator
from horovod_airflow.operators.launchers.local_options import ElasticOptions
from horovod_airflow.operators.staging import stage_dataset
from tests.engine_scripts import BUILD_TIMEOUT
from tests.engines.conftest import (
    MPIJOB_CONN_ID,
    TRAINER_IMAGE,
    WHERE,
    MPIJobNetwork,
    assert_same_training,
    read_json,
)
from tests.operators.fakes import TaskStateStore
from tests.operators.helpers import context, with_launcher_options

# Each run starts three containers of the 6.6 GB trainer image and imports torch in each rank;
# the first test to need that image builds it where scripts/prebuild.sh has not.
pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 900)]

TRAIN_ARGS = {
    "epochs": 1,
    "max_train_samples": 512,
    "max_val_samples": 128,
    "batch_size": 32,
    "seed": 1234,
}
# Both ranks joined, then hold until killed: the worker is lost mid-run.
HOLD = (
    "python",
    "-c",
    "import time, torch, horovod.torch as hvd; hvd.init(); hvd.allreduce(torch.zeros(1)); "
    "print('hva-holding rank', hvd.rank(), flush=True); time.sleep(600)",
)
FAIL_WITHIN_S = 90


def k8s_op(data: str, output: str, **kwargs: Any) -> HorovodTrainOperator:
    # The loose launcher settings go into the options object of the launcher they belong to.
    settings = dict(
        task_id=kwargs.pop("task_id", "train_mpijob"),
        launcher="kubernetes",
        image=TRAINER_IMAGE,
        namespace="hva",
        aws_conn_id=MPIJOB_CONN_ID,
        num_proc=kwargs.pop("num_proc", 2),
        gpus_per_proc=0,
        poll_interval=1.0,
        startup_timeout=300,
        data=data,
        output=output,
        **kwargs,
    )
    return HorovodTrainOperator(**with_launcher_options(settings))


def execute(
    op: HorovodTrainOperator, cluster: Any, ctx: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The operator's ``execute``, its launcher talking to ``cluster`` (None: to the hook the
    operator's launcher already has)."""
    if cluster is None:
        return op.execute(ctx or context())
    with mock.patch(
        "horovod_airflow.operators.launchers.kubernetes.client.KubernetesHook", return_value=cluster
    ):
        return op.execute(ctx or context())


class Running:
    """``execute`` in a thread, so the test can kill a worker while the job runs."""

    def __init__(
        self, op: HorovodTrainOperator, cluster: Any, ctx: dict[str, Any] | None = None
    ) -> None:
        self.error: BaseException | None = None
        self.result: dict[str, Any] | None = None
        self.thread = threading.Thread(target=self._run, args=(op, cluster, ctx), daemon=True)
        self.thread.start()

    def _run(self, op: HorovodTrainOperator, cluster: Any, ctx: dict[str, Any] | None) -> None:
        try:
            self.result = execute(op, cluster, ctx)
        except BaseException as e:
            self.error = e

    def join(self, timeout: float) -> float:
        start = time.monotonic()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the task did not end within {timeout}s"
        return time.monotonic() - start


def test_two_worker_pods_train_like_one_pod_with_two_ranks(
    mpijob_network: MPIJobNetwork, mpijob_cluster, mnist_subset, capsys
):
    s3 = mpijob_network.s3
    bucket = s3.new_bucket("mpijob")
    staged = stage_dataset(str(mnist_subset), f"s3://{bucket}", client=s3.client())
    trainer = (*WHERE, "python", "-m", "horovod_airflow.trainer", "train")

    # The single-host run: both ranks in one worker pod (slots_per_worker=2).
    single = execute(
        k8s_op(
            staged["uri"],
            f"s3://{bucket}/runs/single",
            task_id="one_pod",
            entrypoint=trainer,
            trainer_args=TRAIN_ARGS,
            slots_per_worker=2,
        ),
        mpijob_cluster,
    )
    capsys.readouterr()
    store = TaskStateStore()
    multi = execute(
        k8s_op(
            staged["uri"],
            f"s3://{bucket}/runs/multi",
            task_id="two_pods",
            entrypoint=trainer,
            trainer_args=TRAIN_ARGS,
            slots_per_worker=1,
        ),
        mpijob_cluster,
        context(store=store),
    )
    log = capsys.readouterr().out
    # Live progress through the launcher pod's log stream: readable lines in the task log,
    # and the latest event (the run's last step) in the task state store.
    progress = store["horovod_progress"]
    assert progress["step"] == progress["of_steps"] > 0, progress
    assert f"step {progress['step']}/{progress['of_steps']} (100.0%)" in log, log[-3000:]

    one_pod, two_pods = (m["metadata"]["name"] for m in mpijob_cluster.created)
    assert mpijob_cluster.hostfiles[two_pods] == (
        f"{two_pods}-worker-0.{two_pods}.hva.svc slots=1\n"
        f"{two_pods}-worker-1.{two_pods}.hva.svc slots=1\n"
    )
    # One rank per worker container, reached over ssh from the launcher container ...
    assert f"[0]<stdout>:hva-rank rank=0 host={two_pods}-worker-0" in log
    assert f"[1]<stdout>:hva-rank rank=1 host={two_pods}-worker-1" in log
    # ... and the allreduced results equal the one-pod run's (same seed, same data).
    assert multi["world_size"] == single["world_size"] == 2
    assert multi["val_samples"] == single["val_samples"] == TRAIN_ARGS["max_val_samples"]
    assert_same_training(read_json(s3, single["metrics_uri"]), read_json(s3, multi["metrics_uri"]))
    # The credentials reached the ranks through the job's Secret, never the manifest or log.
    secret = s3.env["AWS_SECRET_ACCESS_KEY"]
    assert secret not in log
    assert all(secret not in str(m) for m in mpijob_cluster.created)
    # Both jobs succeeded and were deleted with their pods and Secrets.
    assert mpijob_cluster.jobs == {} and mpijob_cluster.core_v1_client.secrets == {}
    assert mpijob_cluster.containers() == [], one_pod

    # Had the task failed after the job (its clean-up, the result read, the XCom push), try 2
    # returns the training try 1's MPIJob did and creates no second job.
    again = execute(
        k8s_op(staged["uri"], f"s3://{bucket}/runs/multi", task_id="two_pods",
               entrypoint=trainer, trainer_args=TRAIN_ARGS, slots_per_worker=1),
        mpijob_cluster,
        context(try_number=2),
    )  # fmt: skip
    assert again == multi
    assert len(mpijob_cluster.created) == 2  # one_pod's and two_pods', nothing more


def test_a_worker_pod_killed_mid_run_fails_the_task_naming_the_worker(
    mpijob_network: MPIJobNetwork, mpijob_cluster, capsys
):
    bucket = mpijob_network.s3.new_bucket("mpijob")
    op = k8s_op(
        "s3://unused/data",
        f"s3://{bucket}/runs/worker-killed",
        task_id="worker_killed",
        entrypoint=HOLD,
    )
    job = Running(op, mpijob_cluster)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and job.thread.is_alive():
        names = [m["metadata"]["name"] for m in mpijob_cluster.created]
        if names and mpijob_cluster.state(f"{names[0]}-launcher")[0] != "gone":
            text = mpijob_cluster.core_v1_client.read_namespaced_pod_log(
                f"{names[0]}-launcher", "hva"
            )
            if "[0]<stdout>:hva-holding rank 0" in text and "[1]<stdout>:hva-holding" in text:
                break
        time.sleep(1)
    else:
        pytest.fail(f"the ranks did not both start (job error: {job.error!r})")
    (name,) = names
    worker = f"{name}-worker-1"
    from tests.engines.mpijob_harness import podman

    podman(mpijob_network.podman_env, "kill", worker)
    took = job.join(timeout=FAIL_WITHIN_S + 60)

    error = job.error
    assert isinstance(error, HorovodTrainingError), error
    assert took < FAIL_WITHIN_S, f"the task took {took:.0f}s to fail"
    # horovodrun names the rank; the launcher names the pod it ran on, from the job's -H list
    assert f"rank 1 (host {worker}.{name}.hva.svc) failed first" in str(error), str(error)
    # The failed job is kept (cleanup="delete_on_success"), but none of its pods runs.
    assert mpijob_cluster.containers(running=True) == []


def test_a_two_node_trainjob_trains_like_one_pod_with_two_ranks(
    mpijob_network: MPIJobNetwork, mpijob_cluster, mnist_subset, capsys
):
    """``kubernetes_api="trainjob"``: the TrainJob and its own TrainingRuntime, turned into
    pods as Trainer's MPI plugin and JobSet would, train to the same results as the
    single-pod MPIJob run of the test above (same seed, same data)."""
    s3 = mpijob_network.s3
    bucket = s3.new_bucket("trainjob")
    staged = stage_dataset(str(mnist_subset), f"s3://{bucket}", client=s3.client())
    trainer = (*WHERE, "python", "-m", "horovod_airflow.trainer", "train")

    single = execute(
        k8s_op(
            staged["uri"],
            f"s3://{bucket}/runs/single",
            task_id="one_pod",
            entrypoint=trainer,
            trainer_args=TRAIN_ARGS,
            slots_per_worker=2,
        ),
        mpijob_cluster,
    )
    capsys.readouterr()
    multi = execute(
        k8s_op(
            staged["uri"],
            f"s3://{bucket}/runs/trainjob",
            task_id="two_nodes",
            entrypoint=trainer,
            trainer_args=TRAIN_ARGS,
            slots_per_worker=1,
            kubernetes_api="trainjob",
        ),
        mpijob_cluster,
    )
    log = capsys.readouterr().out

    trainjob = mpijob_cluster.created[-1]
    assert trainjob["kind"] == "TrainJob"
    name = trainjob["metadata"]["name"]
    assert mpijob_cluster.hostfiles[name] == (
        f"{name}-node-0-0.{name}.hva.svc slots=1\n{name}-node-0-1.{name}.hva.svc slots=1\n"
    )
    # One rank per node pod, reached over ssh (port 2222) from the launcher pod ...
    assert f"[0]<stdout>:hva-rank rank=0 host={name}-node-0-0" in log
    assert f"[1]<stdout>:hva-rank rank=1 host={name}-node-0-1" in log
    assert f"submitted TrainJob hva/{name} (2 ranks)" in log
    # the launcher pod's log, followed while the job ran and caught up at its end: each line once
    assert log.count(f"[0]<stdout>:hva-rank rank=0 host={name}-node-0-0") == 1
    # ... and the allreduced results equal the one-pod MPIJob run's.
    assert multi["world_size"] == single["world_size"] == 2
    assert multi["val_samples"] == single["val_samples"] == TRAIN_ARGS["max_val_samples"]
    assert_same_training(read_json(s3, single["metrics_uri"]), read_json(s3, multi["metrics_uri"]))
    secret = s3.env["AWS_SECRET_ACCESS_KEY"]
    assert secret not in log
    assert all(secret not in str(m) for m in mpijob_cluster.created)
    # Succeeded: the TrainJob, its runtime, its Secret and its pods are gone.
    assert mpijob_cluster.trainjobs == {} and mpijob_cluster.runtimes == {}
    assert mpijob_cluster.core_v1_client.secrets == {}
    assert mpijob_cluster.containers() == []


# Each rank waits for the release object on S3 (sys.argv[1]), saying so once its first look
# has answered (boto3 loaded: the ranks then leave within a poll of each other, well inside
# Gloo's rendezvous timeout), then becomes the trainer with the operator's arguments: the job
# runs as long as the test needs.
GATE = (
    "import os, sys, time\n"
    "from horovod_airflow.core import storage\n"
    "released = storage.exists(sys.argv[1])\n"
    "print('hva-gated rank', os.environ['HOROVOD_RANK'], flush=True)\n"
    "deadline = time.monotonic() + 600\n"
    "while not released:\n"
    "    if time.monotonic() > deadline:\n"
    "        sys.exit('hva-gate: never released')\n"
    "    time.sleep(0.5)\n"
    "    released = storage.exists(sys.argv[1])\n"
    "os.execvp(sys.executable,\n"
    "          [sys.executable, '-m', 'horovod_airflow.trainer', 'train', *sys.argv[2:]])\n"
)


class Severed:
    """A try's connection to the cluster, until its Airflow worker dies (SIGKILL, node lost).

    It forwards every call to the cluster until :meth:`die`; then its open log streams are cut
    and every later call blocks for good: a killed process makes no more calls, and the
    threads of the try (its wait, its log follower) stay stuck where they were (daemons)."""

    def __init__(self, target: Any, dead: threading.Event | None = None) -> None:
        self._target = target
        self._dead = dead or threading.Event()
        self._streams: list[Any] = []

    def die(self) -> None:
        self._dead.set()
        for stream in self._streams:
            stream.close()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if name in ("core_v1_client", "custom_object_client"):
            child = Severed(value, self._dead)
            child._streams = self._streams
            return child
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._dead.is_set():
                threading.Event().wait()  # never returns
            answer = value(*args, **kwargs)
            if kwargs.get("follow"):
                self._streams.append(answer)
                if self._dead.is_set():  # opened while it died: cut like the others
                    answer.close()
            return answer

        return call


def wait_for_log(
    cluster: Any, pod: str, needles: list[str], what: Running, timeout: float = 300
) -> str:
    """The pod's log once it has every needle (or fail, naming the task's error)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and what.thread.is_alive():
        if cluster.state(pod)[0] != "gone":
            text = cluster.core_v1_client.read_namespaced_pod_log(pod, "hva")
            if all(n in text for n in needles):
                return text
        time.sleep(1)
    pytest.fail(f"{pod} never logged {needles} (task error: {what.error!r})")


KIND = {"mpijob": "MPIJob", "trainjob": "TrainJob"}


def pod_names(api: str, name: str) -> tuple[list[str], str]:
    """(the worker pods, the launcher pod) of job ``name``, as the harness names them."""
    if api == "trainjob":
        return [f"{name}-node-0-{i}" for i in range(2)], f"{name}-launcher-0-0"
    return [f"{name}-worker-{i}" for i in range(2)], f"{name}-launcher"


def creates(api: str, name: str) -> list[tuple[str, str]]:
    """The create calls that make job ``name``: the TrainJob's own runtime first."""
    if api == "trainjob":
        return [("trainingruntimes", name), ("trainjobs", name)]
    return [("mpijobs", name)]


@pytest.mark.parametrize("api", ["mpijob", "trainjob"])
def test_a_retry_while_the_first_try_still_runs_reattaches_and_starts_no_second_job(
    mpijob_network: MPIJobNetwork, mpijob_cluster, mnist_subset, capsys, api
):
    """Try 1's Airflow worker dies while its job runs; the job keeps running in the cluster.
    Try 2 of the same task instance re-attaches to it: one create, one set of pods, one
    training, whose metrics try 2 returns; nothing is left afterwards."""
    s3 = mpijob_network.s3
    bucket = s3.new_bucket(f"retry-{api}")
    staged = stage_dataset(str(mnist_subset), f"s3://{bucket}", client=s3.client())
    release = f"s3://{bucket}/release"

    def op() -> HorovodTrainOperator:
        return k8s_op(
            staged["uri"],
            f"s3://{bucket}/runs/retry",
            task_id=f"retried-{api}",
            entrypoint=(*WHERE, "python", "-c", GATE, release),
            trainer_args=TRAIN_ARGS,
            slots_per_worker=1,
            kubernetes_api=api,
        )

    # Try 1, through its own connection to the cluster (no process-wide patch: its threads
    # outlive this test, stuck as a killed worker's would be).
    first, severed = op(), Severed(mpijob_cluster)
    make_launcher = first.make_launcher

    def with_severable_hook(*args: Any, **kwargs: Any) -> Any:
        launcher = make_launcher(*args, **kwargs)
        launcher.client._hook = severed  # the cluster client made on first use
        return launcher

    first.make_launcher = with_severable_hook  # type: ignore[method-assign]
    try_1 = Running(first, None, context(try_number=1))
    deadline = time.monotonic() + 300
    while not mpijob_cluster.created:
        assert time.monotonic() < deadline and try_1.thread.is_alive(), try_1.error
        time.sleep(0.5)
    name = mpijob_cluster.created[0]["metadata"]["name"]
    workers, launcher = pod_names(api, name)
    wait_for_log(
        mpijob_cluster, launcher, ["[0]<stdout>:hva-gated", "[1]<stdout>:hva-gated"], try_1
    )
    severed.die()  # the worker running try 1 is lost; the job runs on in the cluster
    assert try_1.thread.is_alive() and try_1.error is None
    assert mpijob_cluster.state(launcher)[0] == "running"
    assert f"submitted {KIND[api]} hva/{name} (2 ranks)" in capsys.readouterr().out

    # Try 2 of the same task instance (Airflow's retry) re-attaches; only then is the job
    # released to train.
    try_2 = Running(op(), mpijob_cluster, context(try_number=2))
    seen = ""
    deadline = time.monotonic() + 120
    while "re-attaching to it instead of starting a second one" not in seen:
        assert time.monotonic() < deadline and try_2.thread.is_alive(), (try_2.error, seen)
        seen += capsys.readouterr().out
        time.sleep(0.5)
    assert f"{KIND[api]} hva/{name} of this task instance (made by try 1) is still running" in seen
    s3.client().put_object(Bucket=bucket, Key="release", Body=b"go")
    try_2.join(timeout=600)
    assert try_2.error is None, try_2.error
    result = try_2.result
    assert result is not None
    log = seen + capsys.readouterr().out

    # One job, created once (by try 1); one set of pods, started once.
    assert mpijob_cluster.create_calls == creates(api, name)
    assert [m["metadata"]["labels"]["try_number"] for m in mpijob_cluster.created] == ["1"]
    assert mpijob_cluster.started == [*workers, launcher]
    assert "submitted" not in log  # try 2 created nothing
    # Try 2 followed that job's launcher pod from its start, and returns that training's
    # metrics.
    assert log.count(f"[0]<stdout>:hva-rank rank=0 host={workers[0]}") == 1
    assert f"[1]<stdout>:hva-rank rank=1 host={workers[1]}" in log
    metrics = read_json(s3, result["metrics_uri"])
    assert result["world_size"] == metrics["world_size"] == 2
    assert result["val_accuracy"] == metrics["val_accuracy"]
    assert result["val_samples"] == TRAIN_ARGS["max_val_samples"]
    assert len(metrics["history"]) == TRAIN_ARGS["epochs"]
    # Succeeded: the job, its runtime, its Secret and its pods are gone. Try 1 made no call
    # after it died: its threads are stuck in the severed connection.
    assert mpijob_cluster.jobs == {} and mpijob_cluster.trainjobs == {}
    assert mpijob_cluster.runtimes == {} and mpijob_cluster.core_v1_client.secrets == {}
    assert mpijob_cluster.containers() == []
    assert try_1.thread.is_alive() and try_1.error is None


# 50 steps an epoch at world 3 (8 samples a rank): the removal lands early in epoch 1 and the
# job has the rest of the epoch and a second one to go on with two.
ELASTIC_TRAIN = {
    "epochs": 2,
    # all of the subset: training must outlast the harness re-making the removed pod and the
    # launcher's script listing it again (1,200 once ended first, in a shuffled cold run)
    "max_train_samples": 2000,
    "max_val_samples": 128,
    "batch_size": 8,
    "seed": 1234,
    "log_interval": 1,
    "elastic_commit_every": 5,
}


def test_an_elastic_mpijob_goes_on_without_a_worker_pod_removed_mid_run(
    mpijob_network: MPIJobNetwork, mpijob_cluster, mnist_subset, capsys
):
    """``elastic=ElasticOptions(min_np=2, max_np=3)``: three worker pods, horovodrun on the
    operator's ``/etc/mpi/discover_hosts.sh``. ``podman rm -f`` of one worker container in
    epoch 1: the task succeeds on try 1 with the other two, every training sample of each
    epoch trained on (the trainer's own count), and the pod the operator makes again under
    the removed one's name is listed again but never rejoins (horovodrun blacklisted it)."""
    from tests.engines.mpijob_harness import discover_hosts_script, podman

    s3 = mpijob_network.s3
    bucket = s3.new_bucket("elastic")
    staged = stage_dataset(str(mnist_subset), f"s3://{bucket}", client=s3.client())
    op = k8s_op(
        staged["uri"],
        f"s3://{bucket}/runs/elastic",
        task_id="elastic",  # the default entrypoint: our trainer, which gets --elastic
        trainer_args=ELASTIC_TRAIN,
        num_proc=3,
        slots_per_worker=1,
        elastic=ElasticOptions(min_np=2, max_np=3, timeout_s=60),
    )
    job = Running(op, mpijob_cluster)
    deadline = time.monotonic() + 300
    while not mpijob_cluster.created:
        assert time.monotonic() < deadline and job.thread.is_alive(), job.error
        time.sleep(0.5)
    name = mpijob_cluster.created[0]["metadata"]["name"]
    workers = [f"{name}-worker-{i}" for i in range(3)]
    wait_for_log(mpijob_cluster, f"{name}-launcher", ["[trainer] epoch 1 step 5/"], job)
    podman(mpijob_network.podman_env, "rm", "-f", "-t", "0", workers[1])
    # What horovodrun in the launcher pod runs, as the pod's user: the two left, once the
    # operator's update has reached the pod; then all three again, once the operator has
    # made the removed pod again (Running) while the job still ran.
    env = mpijob_network.podman_env
    two = "".join(f"{workers[i]}.{name}.hva.svc\n" for i in (0, 2))
    three = "".join(f"{w}.{name}.hva.svc\n" for w in workers)
    for listed in (two, three):
        seen = None
        while seen != listed:
            assert job.thread.is_alive(), (job.error, seen, mpijob_cluster.discovery[name])
            out = podman(env, "exec", f"{name}-launcher", "/etc/mpi/discover_hosts.sh")
            seen = out
            time.sleep(0.5)
    job.join(timeout=600)
    assert job.error is None, job.error
    result = job.result
    assert result is not None
    log = capsys.readouterr().out

    # The manifest: three worker pods, horovodrun on the operator's script, no token.
    manifest = mpijob_cluster.created[0]
    assert manifest["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 3
    (launcher,) = manifest["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
    assert "/etc/mpi/discover_hosts.sh" in launcher["command"]
    assert "--elastic" in launcher["command"]  # the trainer's elastic loop
    # The script: all three, then the two left (the operator's update after the removal),
    # then all three again with the pod it made under the removed one's name ...
    assert mpijob_cluster.reconcile_errors == []
    scripts = mpijob_cluster.discovery[name]
    assert scripts[0] == discover_hosts_script(name, "hva", workers)
    assert scripts[1] == discover_hosts_script(name, "hva", [workers[0], workers[2]]), scripts
    assert scripts[2] == scripts[0], scripts
    assert mpijob_cluster.started.count(workers[1]) == 2  # made again by the "operator"
    # ... yet the run went on with two: the world shrank once, by the removed pod, and never
    # grew back (horovodrun blacklisted that host name when its rank failed).
    metrics = read_json(s3, result["metrics_uri"])
    elastic = metrics["elastic"]
    assert elastic["world_sizes"] == [3, 2], elastic
    assert elastic["world_history"][-1]["left"] == [workers[1]], elastic
    assert elastic["world_history"][-1]["epoch"] == 1
    assert result["world_size"] == metrics["world_size"] == 2
    # Every training sample of each epoch trained on: the trainer's allreduced count (it fails
    # the run when that differs from the training set); only the steps since the last commit
    # were trained again, as many as it reports.
    train = ELASTIC_TRAIN["max_train_samples"]
    assert [h["train_samples"] for h in metrics["history"]] == [train, train]
    assert [h["world_size"] for h in metrics["history"]] == [2, 2]
    assert 0 <= elastic["redone_steps"] < ELASTIC_TRAIN["elastic_commit_every"]
    per_step = ELASTIC_TRAIN["batch_size"] * 3
    assert 0 <= elastic["redone_samples"] <= elastic["redone_steps"] * per_step, elastic
    assert (elastic["redone_samples"] == 0) == (elastic["redone_steps"] == 0), elastic
    assert result["val_samples"] == ELASTIC_TRAIN["max_val_samples"]
    assert f"submitted MPIJob hva/{name} (3 ranks)" in log
    # Succeeded: the job, its Secret and its pods (the re-made one too) are gone.
    assert mpijob_cluster.jobs == {} and mpijob_cluster.core_v1_client.secrets == {}
    assert mpijob_cluster.containers() == []
