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

from operators import HorovodTrainingError, HorovodTrainOperator
from operators.staging import stage_dataset
from tests.engines.conftest import (
    MPIJOB_CONN_ID,
    TRAINER_IMAGE,
    WHERE,
    MPIJobNetwork,
    assert_same_training,
    read_json,
)
from tests.operators.helpers import context, with_launcher_options

# Each run starts three containers of the 6.6 GB trainer image and imports torch in each rank.
pytestmark = [pytest.mark.engine, pytest.mark.slow]

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
        num_proc=2,
        gpus_per_proc=0,
        poll_interval=1.0,
        startup_timeout=300,
        data=data,
        output=output,
        **kwargs,
    )
    return HorovodTrainOperator(**with_launcher_options(settings))


def execute(op: HorovodTrainOperator, cluster: Any) -> dict[str, Any]:
    with mock.patch("operators.launchers.kubernetes.KubernetesHook", return_value=cluster):
        return op.execute(context())


class Running:
    """``execute`` in a thread, so the test can kill a worker while the job runs."""

    def __init__(self, op: HorovodTrainOperator, cluster: Any) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(op, cluster), daemon=True)
        self.thread.start()

    def _run(self, op: HorovodTrainOperator, cluster: Any) -> None:
        try:
            execute(op, cluster)
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
    trainer = (*WHERE, "python", "-m", "trainer", "train")

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
    )
    log = capsys.readouterr().out

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
    trainer = (*WHERE, "python", "-m", "trainer", "train")

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
