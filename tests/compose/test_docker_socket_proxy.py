"""docker/docker_socket_proxy.py's allowlist, on the request bodies docker-py really builds.

The create bodies come from docker-py's own ``APIClient.create_container_config`` fed with the
docker launcher's real ``create_kwargs``: what the launcher sends passes, and each way out of
a container's sandbox (privilege, a bind of ``/``, host namespaces, capabilities, devices,
another network) is refused, as are the API calls the launcher never makes. The proxy in
front of a real engine: tests/engines/test_docker_socket_proxy.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
NETWORK = "hva-training"


def _load() -> ModuleType:
    path = REPO / "docker" / "docker_socket_proxy.py"
    spec = importlib.util.spec_from_file_location("docker_socket_proxy", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROXY = _load()


def create_body(**host_config: Any) -> bytes:
    """The JSON body docker-py sends for the docker launcher's container (plus overrides)."""
    import docker

    from horovod_airflow.operators.launchers.base import JobSpec
    from horovod_airflow.operators.launchers.docker import DockerLauncher, DockerOptions

    client = docker.APIClient(base_url="unix:///nonexistent.sock", version="1.41")
    launcher = DockerLauncher(
        image="hva/trainer:1",
        options=DockerOptions(network_mode=NETWORK, host_config_overrides=host_config),
        client=client,
    )
    spec = JobSpec(
        name="hvd-train-1", argv=["python", "-m", "x"], num_proc=2, gpus_per_proc=1,
        secret_env={"AWS_SECRET_ACCESS_KEY": "s"}, labels={"try_number": "1"},
    )  # fmt: skip
    kwargs = launcher.create_kwargs(spec)
    kwargs.pop("name")  # a query parameter, not the body
    return json.dumps(client.create_container_config(**kwargs)).encode()


def test_the_launchers_own_calls_pass() -> None:
    PROXY.check("POST", "/v1.41/containers/create?name=hvd-train-1", create_body(), NETWORK)
    for method, path in [
        ("GET", "/_ping"), ("GET", "/v1.41/version"), ("GET", "/v1.41/images/hva/trainer:1/json"),
        ("POST", "/v1.41/images/create?fromImage=hva/trainer&tag=1"),
        ("GET", "/v1.41/containers/hvd-train-1/json"),
        ("PUT", "/v1.41/containers/c0ffee/archive?path=/"),
        ("POST", "/v1.41/containers/c0ffee/attach?stream=1&stdout=1&stderr=1&logs=1"),
        ("POST", "/v1.41/containers/c0ffee/start"), ("POST", "/v1.41/containers/c0ffee/wait"),
        ("POST", "/v1.41/containers/c0ffee/stop?t=10"),
        ("DELETE", "/v1.41/containers/c0ffee?force=True"),
        ("GET", f"/v1.41/networks/{NETWORK}"),
    ]:  # fmt: skip
        PROXY.check(method, path, b"", NETWORK)


@pytest.mark.parametrize(
    ("host_config", "reason"),
    [
        ({"privileged": True}, "privileged"),
        ({"cap_add": ["SYS_ADMIN"]}, "CapAdd"),
        ({"devices": ["/dev/sda:/dev/sda"]}, "Devices"),
        ({"security_opt": ["seccomp=unconfined"]}, "SecurityOpt"),
        ({"pid_mode": "host"}, "PidMode"),
        ({"userns_mode": "host"}, "UsernsMode"),
        ({"volumes_from": ["other"]}, "VolumesFrom"),
    ],
)
def test_a_container_that_could_leave_its_sandbox_is_refused(
    host_config: dict[str, Any], reason: str
) -> None:
    with pytest.raises(PROXY.Refused, match=reason):
        PROXY.check("POST", "/v1.41/containers/create", create_body(**host_config), NETWORK)


def test_host_binds_mounts_and_other_networks_are_refused() -> None:
    body = json.loads(create_body())
    for change, reason in [
        ({"Binds": ["/:/host"]}, "Binds"),
        ({"Mounts": [{"Type": "bind", "Source": "/", "Target": "/host"}]}, "bind"),
        ({"Mounts": [{"Type": "volume", "Source": "postgres-db", "Target": "/db"}]}, "volume"),
        ({"NetworkMode": "host"}, "must join the network"),
        ({"NetworkMode": "horovod-airflow_default"}, "must join the network"),
    ]:
        bad = {**body, "HostConfig": {**body["HostConfig"], **change}}
        with pytest.raises(PROXY.Refused, match=reason):
            PROXY.check("POST", "/containers/create", json.dumps(bad).encode(), NETWORK)
    extra = {**body, "NetworkingConfig": {"EndpointsConfig": {"horovod-airflow_default": {}}}}
    with pytest.raises(PROXY.Refused, match="only"):
        PROXY.check("POST", "/containers/create", json.dumps(extra).encode(), NETWORK)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1.41/containers/c0ffee/exec"),
        ("POST", "/v1.41/exec/abc/start"),
        ("GET", "/v1.41/volumes"),
        ("POST", "/v1.41/volumes/create"),
        ("GET", "/v1.41/containers/json"),
        ("GET", "/v1.41/containers/c0ffee/archive?path=/etc"),
        ("POST", "/v1.41/build"),
        ("GET", "/v1.41/secrets"),
        ("POST", "/v1.41/plugins/pull"),
        ("POST", "/v1.41/containers/c0ffee/update"),
        ("DELETE", "/v1.41/containers/../volumes/x"),
        ("GET", "/v1.41/containers/c0ffee%2F..%2F..%2Fvolumes/json"),
    ],
)
def test_calls_the_launcher_never_makes_are_refused(method: str, path: str) -> None:
    with pytest.raises(PROXY.Refused):
        PROXY.check(method, path, b"", NETWORK)


def test_a_keep_alive_connection_cannot_carry_an_unchecked_request() -> None:
    head = b"GET /_ping HTTP/1.1\r\nHost: docker\r\nConnection: keep-alive"
    assert PROXY.with_connection_close(head).endswith(b"\r\nConnection: close")
    assert b"keep-alive" not in PROXY.with_connection_close(head)
    upgrade = b"POST /containers/c/attach HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: tcp"
    assert PROXY.with_connection_close(upgrade).endswith(b"Upgrade: tcp\r\nConnection: Upgrade")
