"""docker/docker_socket_proxy.py in front of a real engine (podman's Docker API): the docker
launcher runs a job through it (create, the credentials file, attach, start, wait, remove),
and what the proxy refuses never reaches the engine."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from horovod_airflow.operators.launchers.base import JobSpec
from horovod_airflow.operators.launchers.docker import DockerLauncher, DockerOptions
from tests.conftest import REPO
from tests.engines.conftest import PodmanEngine
from tests.operators.fakes import LineLog

pytestmark = [pytest.mark.engine]


@pytest.fixture
def proxied(podman_engine: PodmanEngine, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(the proxy's docker_url, the one network it lets containers join)."""
    network = f"hva-proxy-{uuid.uuid4().hex[:8]}"
    subprocess.run(["podman", "network", "create", network], check=True, capture_output=True)
    listen = tmp_path / "docker.sock"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "docker" / "docker_socket_proxy.py"), f"--listen={listen}",
         f"--upstream={podman_engine.docker_url.removeprefix('unix://')}", f"--network={network}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not listen.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout
            time.sleep(0.1)
        yield f"unix://{listen}", network
    finally:
        proc.terminate()
        proc.wait(10)
        subprocess.run(["podman", "network", "rm", "-f", network], capture_output=True)


def test_the_launcher_runs_a_job_through_the_proxy(
    podman_engine: PodmanEngine, proxied: tuple[str, str]
) -> None:
    import docker

    url, network = proxied
    secret = f"proxy-secret-{uuid.uuid4().hex}"
    client = docker.APIClient(base_url=url, version="auto", timeout=120)
    launcher = DockerLauncher(
        image=podman_engine.image,
        options=DockerOptions(network_mode=network, cleanup="delete"),
        client=client,
    )
    # A bare launcher's journal has no task state store: it records nothing.
    log = LineLog()
    spec = JobSpec(
        name=f"hva-proxy-job-{uuid.uuid4().hex[:8]}",
        argv=["sh", "-c", 'printf %s "$AWS_SECRET_ACCESS_KEY" | sha256sum'],
        secret_env={"AWS_SECRET_ACCESS_KEY": secret}, distributed=False, timeout=120,
    )  # fmt: skip
    result = launcher.run(spec, log)
    assert result.exit_code == 0
    assert any(hashlib.sha256(secret.encode()).hexdigest() in line for line in log.lines), log.lines


@pytest.mark.parametrize(
    "attempt",
    ["privileged", "bind of /", "host network", "volumes", "exec", "container list"],
)
def test_what_the_proxy_refuses_never_reaches_the_engine(
    podman_engine: PodmanEngine, proxied: tuple[str, str], attempt: str
) -> None:
    import docker

    url, network = proxied
    client = docker.APIClient(base_url=url, version="auto", timeout=60)
    name = f"hva-proxy-refused-{uuid.uuid4().hex[:8]}"
    image = podman_engine.image

    def create(**host: object) -> object:
        return client.create_container(
            image, "true", name=name,
            host_config=client.create_host_config(**{"network_mode": network, **host}),
        )  # fmt: skip

    calls = {
        "privileged": lambda: create(privileged=True),
        "bind of /": lambda: create(binds=["/:/host"]),
        "host network": lambda: create(network_mode="host"),
        "volumes": lambda: client.create_volume(name),
        "exec": lambda: client.exec_create(name, "true"),
        "container list": lambda: client.containers(all=True),
    }
    with pytest.raises(docker.errors.APIError) as refused:
        calls[attempt]()
    assert refused.value.response.status_code == 403
    assert "refused by the docker socket proxy" in str(refused.value.explanation)
    engine = podman_engine.client()
    assert not engine.containers(all=True, filters={"name": name})
    assert not [v for v in engine.volumes().get("Volumes") or [] if v["Name"] == name]
    assert os.path.exists(url.removeprefix("unix://"))
