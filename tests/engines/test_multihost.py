"""Multi-host Horovod through the operator: one rank on each of two simulated hosts.

``h1`` and ``h2`` are network namespaces with their own hostname, address, CPU and sshd
(``scripts/engines/netns_hosts.sh``); this process plays the Airflow worker in the root
namespace, where horovodrun's driver runs and reaches both hosts over the bridge. The ranks
use S3 on the bridge address (``netns_s3``): 127.0.0.1 is each namespace's own loopback.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import psutil
import pytest

from horovod_airflow.operators import HorovodTrainingError, HorovodTrainOperator
from horovod_airflow.operators.staging import stage_dataset
from tests.engines.conftest import (
    NETNS_CONN_ID,
    WHERE,
    SimulatedHosts,
    assert_same_training,
    read_json,
)
from tests.operators.helpers import context, with_launcher_options

pytestmark = pytest.mark.engine

PROBE = ("python", "-m", "tests.engines.hvd_probe")
TRAIN_ARGS = {
    "epochs": 1,
    "max_train_samples": 1024,
    "max_val_samples": 256,
    "batch_size": 32,
    "seed": 1234,
}
# How long a failure on one host may take to end the task, and to leave no rank anywhere.
FAIL_WITHIN_S = 60
NO_RANK_WITHIN_S = 20


def train_op(output: str, data: str, **kwargs: Any) -> HorovodTrainOperator:
    # The loose launcher settings go into the options object of the launcher they belong to.
    settings = dict(
        task_id=kwargs.pop("task_id", "train_two_hosts"),
        launcher="local",
        aws_conn_id=NETNS_CONN_ID,
        num_proc=2,
        data=data,
        output=output,
        **kwargs,
    )
    return HorovodTrainOperator(**with_launcher_options(settings))


def on_hosts(hosts: SimulatedHosts) -> dict[str, Any]:
    return {
        "hosts": hosts.hosts_arg(slots=1),
        "ssh_port": hosts.ssh_port,
        "ssh_identity_file": hosts.identity_file,
        "network_interface": hosts.interface,
    }


class Running:
    """``execute`` in a thread, so the test can break a host while the job runs."""

    def __init__(self, op: HorovodTrainOperator) -> None:
        self.error: BaseException | None = None
        self.result: dict[str, Any] | None = None
        self.thread = threading.Thread(target=self._run, args=(op,), daemon=True)
        self.thread.start()

    def _run(self, op: HorovodTrainOperator) -> None:
        try:
            self.result = op.execute(context())
        except BaseException as e:
            self.error = e

    def join(self, timeout: float) -> float:
        start = time.monotonic()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the task did not end within {timeout}s"
        return time.monotonic() - start


def assert_no_rank_left(hosts: SimulatedHosts, needle: str) -> None:
    deadline = time.monotonic() + NO_RANK_WITHIN_S
    left: dict[str, list[tuple[int, str]]] = {}
    while time.monotonic() < deadline:
        left = {h: hosts.processes(h, needle) for h in hosts.names}
        if not any(left.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"ranks still running {NO_RANK_WITHIN_S}s after the failure: {left}")


@pytest.mark.slow
def test_one_rank_per_host_matches_a_single_host_run(
    simulated_hosts, netns_s3, mnist_subset, capsys
):
    bucket = netns_s3.new_bucket("multihost")
    staged = stage_dataset(str(mnist_subset), f"s3://{bucket}", client=netns_s3.client())
    trainer = (*WHERE, "python", "-m", "horovod_airflow.trainer", "train")

    single = train_op(
        f"s3://{bucket}/runs/single",
        staged["uri"],
        task_id="single_host",
        entrypoint=trainer,
        trainer_args=TRAIN_ARGS,
    ).execute(context())
    capsys.readouterr()
    multi = train_op(
        f"s3://{bucket}/runs/multi",
        staged["uri"],
        entrypoint=trainer,
        trainer_args=TRAIN_ARGS,
        **on_hosts(simulated_hosts),
    ).execute(context())
    log = capsys.readouterr().out

    # Each rank ran on its own host ...
    assert "[0]<stdout>:hva-rank rank=0 host=h1" in log
    assert "[1]<stdout>:hva-rank rank=1 host=h2" in log
    # ... and the allreduced results equal the single-host run's (same seed, same data).
    assert multi["world_size"] == single["world_size"] == 2
    assert multi["val_samples"] == single["val_samples"] == 256
    # Same ranks, same per-rank thread count (one CPU per simulated host), same reduction
    # order; only the transport differs.
    assert_same_training(
        read_json(netns_s3, single["metrics_uri"]), read_json(netns_s3, multi["metrics_uri"])
    )
    # The credentials reached the remote ranks through the shared rank env file, not argv.
    assert netns_s3.env["AWS_SECRET_ACCESS_KEY"] not in log


def test_rank_killed_on_h2_fails_the_task_and_leaves_no_rank(simulated_hosts, netns_s3, capsys):
    bucket = netns_s3.new_bucket("multihost")
    op = train_op(
        f"s3://{bucket}/runs/rank-killed",
        "s3://unused/data",
        task_id="rank_killed",
        entrypoint=PROBE,
        trainer_args={"hold_seconds": 300},
        **on_hosts(simulated_hosts),
    )
    job = Running(op)
    ((pid, _),) = simulated_hosts.wait_for_process("h2", "tests.engines.hvd_probe", timeout=300)
    time.sleep(1)  # mid-run: both ranks joined and are holding
    # horovodrun puts its environment on the ssh and rank command lines: the credentials are
    # on none of them, on the worker or on either host (one process table for all of them).
    secret = netns_s3.env["AWS_SECRET_ACCESS_KEY"]
    leaked = [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline"])
        if secret in " ".join(p.info["cmdline"] or [])
    ]
    assert leaked == []

    os.kill(pid, signal.SIGKILL)
    took = job.join(timeout=FAIL_WITHIN_S + 30)

    error = job.error
    assert isinstance(error, HorovodTrainingError), error
    assert took < FAIL_WITHIN_S, f"the task took {took:.0f}s to fail"
    h2 = simulated_hosts.addresses["h2"]
    assert f"rank 1 (host {h2}) failed first" in str(error)
    assert_no_rank_left(simulated_hosts, "tests.engines.hvd_probe")


def test_sshd_killed_on_h2_fails_the_task_naming_the_host(simulated_hosts, netns_s3, capsys):
    bucket = netns_s3.new_bucket("multihost")
    op = train_op(
        f"s3://{bucket}/runs/sshd-killed",
        "s3://unused/data",
        task_id="sshd_killed",
        entrypoint=PROBE,
        trainer_args={"hold_seconds": 300},
        **on_hosts(simulated_hosts),
    )
    job = Running(op)
    simulated_hosts.wait_for_process("h2", "tests.engines.hvd_probe", timeout=300)
    time.sleep(1)
    try:
        sshd = simulated_hosts.sshd_pids("h2")  # the listener and the rank's session
        assert len(sshd) >= 2, sshd
        for pid in sshd:
            os.kill(pid, signal.SIGKILL)
        took = job.join(timeout=FAIL_WITHIN_S + 30)

        error = job.error
        assert isinstance(error, HorovodTrainingError), error
        assert took < FAIL_WITHIN_S, f"the task took {took:.0f}s to fail"
        # The error names the host that was lost.
        assert f"rank 1 (host {simulated_hosts.addresses['h2']})" in str(error)
        assert_no_rank_left(simulated_hosts, "tests.engines.hvd_probe")
    finally:
        simulated_hosts.restore()  # sshd back on h2 for the other tests
