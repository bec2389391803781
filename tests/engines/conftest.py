"""Real engines for the launcher tests: podman's Docker API, and simulated hosts over ssh.

Both are prepared by the scripts a user runs by hand (``scripts/engines/``), so the tests
exercise exactly what the README documents. Each fixture skips, with the script's reason,
where the machine cannot provide the engine (not root, packages not installable, mirror
unreachable: the scripts exit 2), and fails loudly on anything else.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from scripts.devstack import seaweedfs
from tests import readme
from tests.conftest import REPO, VENV_BIN, S3Server
from tests.engine_scripts import podman_cli_env, run_script

ENGINES = REPO / "scripts" / "engines"
JOB_LABEL = "horovod-airflow/job"  # the docker launcher labels its containers with this
# Each rank says where it runs before it becomes the program (exec keeps pid, signals, exit).
WHERE = ("sh", "-c", 'echo "hva-rank rank=$HOROVOD_RANK host=$(hostname)"; exec "$@"', "where")
NETNS_CONN_ID = "aws_netns"


# --- podman: the Docker API on a unix socket, and the runtime image -----------------------
@dataclass
class PodmanEngine:
    """A running Docker-compatible API and the image the docker launcher tests run."""

    docker_url: str  # unix:///.../podman.sock
    image: str  # localhost/hva-runtime:<recipe hash>

    def client(self) -> Any:
        import docker

        return docker.APIClient(base_url=self.docker_url, version="auto", timeout=120)

    @property
    def mounts(self) -> list[str]:
        """Read-only binds that make the host's venv and source usable inside the image.

        A venv's python is a symlink into its base installation (pyenv), so that is mounted
        too; every path keeps its host path, so the venv's absolute paths stay valid.
        """
        paths = sorted({str(REPO), sys.prefix, sys.base_prefix})
        kept = [p for p in paths if not any(p != q and p.startswith(q + "/") for q in paths)]
        return [f"{p}:{p}:ro" for p in kept]

    @property
    def env(self) -> dict[str, str]:
        """Non-secret environment of the job inside the container."""
        return {
            "PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONPATH": str(REPO),
            "HVA_CACHE_DIR": "/tmp/hva-cache",  # the container's own, writable
        }

    def job_containers(self) -> list[dict[str, Any]]:
        """Containers the docker launcher made (running or not)."""
        return self.client().containers(all=True, filters={"label": JOB_LABEL})


@pytest.fixture(scope="session")
def podman_engine() -> Iterator[PodmanEngine]:
    """Serve podman's Docker API (installing podman if missing) and build the image once."""
    state = os.environ.get("HVA_PODMAN_STATE", "/var/tmp/hva-podman")
    was_serving = (
        os.geteuid() == 0
        and subprocess.run(
            ["bash", str(ENGINES / "podman_engine.sh"), "status"], capture_output=True
        ).returncode
        == 0
    )
    run_script("scripts/engines/podman_engine.sh start")
    try:
        image = (
            run_script(readme.command("scripts/engines/podman_engine.sh image"))
            .stdout.strip()
            .splitlines()[-1]
        )
        yield PodmanEngine(docker_url=f"unix://{state}/podman.sock", image=image)
    finally:
        if not was_serving:  # leave a service the user started running
            subprocess.run(["bash", str(ENGINES / "podman_engine.sh"), "stop"], check=False)


@pytest.fixture
def job_containers_removed(podman_engine: PodmanEngine) -> Iterator[None]:
    """After the test, force-remove any container the launcher left (failed tests)."""
    import docker.errors

    before = {c["Id"] for c in podman_engine.job_containers()}
    yield
    client = podman_engine.client()
    for c in podman_engine.job_containers():
        if c["Id"] not in before:
            # The launcher may be removing it at this very moment (its own cleanup): gone is
            # what this wants.
            with contextlib.suppress(docker.errors.NotFound):
                client.remove_container(c["Id"], force=True)


# --- simulated hosts: network namespaces, a bridge, sshd per host -------------------------
@dataclass
class SimulatedHosts:
    """Hosts ``h1``, ``h2`` reachable from this (root) namespace over ssh on ``interface``."""

    addresses: dict[str, str]  # host name -> address on the bridge
    ssh_port: int
    identity_file: str
    interface: str
    bridge_ip: str  # this namespace's address on the bridge (horovodrun's driver)
    state: Path
    names: list[str] = field(default_factory=list)
    script_env: dict[str, str] = field(default_factory=dict)

    def hosts_arg(self, slots: int = 1) -> list[str]:
        """``hosts=`` for the operator: one entry per simulated host, by address."""
        return [f"{self.addresses[h]}:{slots}" for h in self.names]

    def processes(self, host: str, needle: str) -> list[tuple[int, str]]:
        """(pid, command line) of the processes in ``host``'s namespace matching ``needle``."""
        out = subprocess.run(
            ["ip", "netns", "pids", host], capture_output=True, text=True, check=True
        ).stdout
        found = []
        for pid in map(int, out.split()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue  # exited meanwhile
            if needle in cmdline:
                found.append((pid, cmdline.strip()))
        return found

    def wait_for_process(self, host: str, needle: str, timeout: float) -> list[tuple[int, str]]:
        """The running program(s) matching ``needle`` on ``host``, once they run.

        Only processes whose program is Python count: until the rank's ``sh -c … exec``
        wrapper and ssh's ``bash -c`` line have exec'd, they carry the needle too.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [
                (pid, cmd)
                for pid, cmd in self.processes(host, needle)
                if Path(cmd.split()[0]).name.startswith("python")
            ]
            if found:
                return found
            time.sleep(0.2)
        raise AssertionError(f"no process matching {needle!r} on {host} within {timeout}s")

    def sshd_pids(self, host: str) -> list[int]:
        """The host's sshd: its listener and every session it forked."""
        return [
            pid
            for pid, cmd in self.processes(host, "sshd")
            if cmd.startswith(("sshd", "/usr/sbin/sshd"))
        ]

    def restore(self) -> None:
        """Bring every host back up (sshd restarted where a test killed it); idempotent."""
        run_script(
            readme.command("scripts/engines/netns_hosts.sh up"), env=self.script_env, timeout=300
        )


@pytest.fixture(scope="session")
def simulated_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulatedHosts]:
    """Bring up h1 and h2 (namespaces, bridge, keys, sshd) and always tear them down."""
    state = tmp_path_factory.mktemp("netns")
    env = {"HVA_NETNS_STATE": str(state), "HVA_NETNS_HOSTS": "h1 h2"}
    try:
        run_script(readme.command("scripts/engines/netns_hosts.sh up"), env=env, timeout=300)
        settings = dict(
            line.removeprefix("export ").split("=", 1)
            for line in run_script(
                "scripts/engines/netns_hosts.sh env", env=env
            ).stdout.splitlines()
        )
        addresses = {
            name: hp.rsplit(":", 1)[0]
            for name, hp in zip(
                ["h1", "h2"], settings["HVA_NETNS_HOSTS_ARG"].split(","), strict=True
            )
        }
        yield SimulatedHosts(
            addresses=addresses,
            ssh_port=int(settings["HVA_NETNS_SSH_PORT"]),
            identity_file=settings["HVA_NETNS_SSH_KEY"],
            interface=settings["HVA_NETNS_IFACE"],
            bridge_ip=settings["HVA_NETNS_BRIDGE_IP"],
            state=state,
            names=["h1", "h2"],
            script_env=env,
        )
    finally:
        if os.geteuid() == 0:
            subprocess.run(
                shlex.split(readme.command("scripts/engines/netns_hosts.sh down")),
                cwd=REPO,
                env={**os.environ, **env},
                check=False,
                capture_output=True,
            )


@contextlib.contextmanager
def s3_server_on(address: str, conn_id: str, name: str) -> Iterator[S3Server]:
    """SeaweedFS's S3 on ``address`` (not loopback: namespaces and containers have their
    own), its worker identity registered as the Airflow connection ``conn_id`` and its ranks'
    as ``<conn_id>_ranks``; the process environment is otherwise untouched. ``name`` names
    its data folder."""
    with (
        tempfile.TemporaryDirectory(prefix=f"hva-s3-{name}-") as data,
        seaweedfs(Path(data), address=address, conn_ids=(conn_id, f"{conn_id}_ranks")) as srv,
    ):
        yield srv


@pytest.fixture(scope="session")
def netns_s3(simulated_hosts: SimulatedHosts) -> Iterator[S3Server]:
    """A SeaweedFS S3 server on the bridge address, reachable from every simulated host.

    The session's ``s3_server`` listens on 127.0.0.1, which is each namespace's own loopback.
    Registered as the Airflow connection ``aws_netns``; the process environment is untouched.
    """
    with s3_server_on(simulated_hosts.bridge_ip, NETNS_CONN_ID, "netns") as srv:
        yield srv


def read_json(s3: S3Server, uri: str) -> dict[str, Any]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    body = s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    return json.loads(body)


def assert_same_training(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two runs' metrics.json agree: same ranks, same seed and data, only the transport or
    the placement of the ranks differs. Counts and accuracy are equal; loss sums to float32
    precision (the reduction order is the same, the summation may not be bit for bit)."""
    assert b["val_correct"] == a["val_correct"]
    assert b["val_accuracy"] == a["val_accuracy"]
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
    assert [e["train_loss"] for e in b["history"]] == pytest.approx(
        [e["train_loss"] for e in a["history"]], rel=1e-5
    )
    assert b["param_hash"] == a["param_hash"]


# --- an MPIJob's pods as podman containers (tests/engines/mpijob_harness.py) -------------
TRAINER_IMAGE = "localhost/horovod-airflow-trainer:0.1.0"  # docker/trainer.Dockerfile
MPIJOB_CONN_ID = "aws_mpijob"


@dataclass
class MPIJobNetwork:
    """A podman network for the job's pods, and S3 on its gateway (reachable from them)."""

    name: str
    subnet_prefix: str  # "10.89.N"
    podman_env: dict[str, str]
    s3: S3Server


@pytest.fixture(scope="session")
def mpijob_network(stack_images: dict[str, str]) -> Iterator[MPIJobNetwork]:
    """Network ``hva-mpijob-<n>`` with a holder container (the bridge exists only while a
    container is attached) and SeaweedFS's S3 on the gateway; always removed afterwards. The
    trainer image is built first where missing (``stack_images``)."""
    assert stack_images["trainer"] == TRAINER_IMAGE, (
        f"the compose settings name the trainer image {stack_images['trainer']}, "
        f"these tests run {TRAINER_IMAGE}"
    )
    env = podman_cli_env()

    def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["podman", *args],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            check=check,
            timeout=300,
        )

    octet = 200 + os.getpid() % 50
    name, prefix = f"hva-mpijob-{octet}", f"10.89.{octet}"
    holder = f"{name}-holder"
    try:
        podman("network", "create", "--subnet", f"{prefix}.0/24", name)
        podman(
            "run", "-d", "--name", holder, "--network", name, "--ip", f"{prefix}.2",
            "--entrypoint", '["sleep","infinity"]', TRAINER_IMAGE,
        )  # fmt: skip
        with s3_server_on(f"{prefix}.1", MPIJOB_CONN_ID, "mpijob") as s3:
            yield MPIJobNetwork(name=name, subnet_prefix=prefix, podman_env=env, s3=s3)
    finally:
        podman("rm", "-f", "-t", "0", holder, check=False)
        podman("network", "rm", "-f", name, check=False)


@pytest.fixture
def mpijob_cluster(mpijob_network: MPIJobNetwork, tmp_path: Path) -> Iterator[Any]:
    """A :class:`~tests.engines.mpijob_harness.PodmanCluster` on the network; every container
    it made is removed afterwards, and the test fails if one was still running."""
    from tests.engines.mpijob_harness import PodmanCluster

    cluster = PodmanCluster(
        mpijob_network.podman_env,
        network=mpijob_network.name,
        subnet_prefix=mpijob_network.subnet_prefix,
        workdir=tmp_path / "pods",
    )
    try:
        yield cluster
        left = cluster.containers(running=True)
        assert left == [], f"containers still running after the test: {left}"
    finally:
        cluster.remove_all()
