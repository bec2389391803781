"""docker-compose.yml up for real on podman, driven through the REST API as a user would.

One DAG run of ``mnist_horovod_retrain`` on the stack (Airflow 3 api-server, scheduler,
dag-processor and triggerer on PostgreSQL; the S3 store; training and export in trainer-image
containers started by the docker launcher through the engine's socket), checked end to end by
the same code as ``compose_stack.sh smoke``, which also finds no secret of the stack in
``podman inspect`` of any container, training containers included. Then ``down`` + ``up``: the
object store's data is kept, and a new run gates against the champion published before.
Training containers sit on a network with the object store and nothing else of the stack.
The fixture's teardown runs ``down --volumes`` and checks that no container, volume or network
of the stack is left.
"""

from __future__ import annotations

import json
import textwrap
import urllib.parse

import pytest

from tests import readme
from tests.engine_scripts import BUILD_TIMEOUT
from tests.stack.conftest import (
    PROJECT,
    PUBLISHED_RUN,
    UP_TIMEOUT,
    Stack,
    compose_stack,
    load_stack_smoke,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 2400)]


def test_every_service_of_the_compose_file_ran(stack: Stack) -> None:
    names = stack.containers()
    for service in (
        "hva-config", "postgres", "seaweedfs", "seaweedfs-init", "airflow-init", "trainer",
        "docker-socket-proxy", "docker-launcher-check",
        "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer",
    ):  # fmt: skip
        assert any(f"_{service}_" in n for n in names), f"no container of {service}: {names}"
    # The settings file, not the caller's environment, configured the services.
    scheduler = next(n for n in names if "_airflow-scheduler_" in n)
    env = stack.podman(
        "inspect", "--format", "{{range .Config.Env}}{{println .}}{{end}}", scheduler
    )
    assert f"HVA_BUCKET={stack.settings['HVA_BUCKET']}" in env.splitlines()
    # The one-shot trainer service ran the doctor in the trainer image: Horovod is usable there.
    trainer = next(n for n in names if "_trainer_" in n)
    assert stack.podman("inspect", "--format", "{{.State.ExitCode}}", trainer).strip() == "0"


def test_the_env_command_prints_the_endpoints_and_login(stack: Stack) -> None:
    printed = dict(
        line.split("=", 1) for line in compose_stack("env", stack.script_env, 120).splitlines()
    )
    assert printed["HVA_STACK_AIRFLOW_URL"] == stack.airflow_url
    assert printed["HVA_STACK_S3_URL"] == f"http://127.0.0.1:{stack.settings['HVA_S3_PORT']}"
    assert printed["HVA_STACK_ADMIN_USER"] == stack.settings["AIRFLOW_ADMIN_USER"]
    assert printed["HVA_STACK_ADMIN_PASSWORD"] == stack.settings["AIRFLOW_ADMIN_PASSWORD"]


def test_a_run_triggered_through_the_rest_api_publishes_a_verified_model(stack: Stack) -> None:
    """``compose_stack.sh smoke`` as a user types it: a run through the REST API, checked."""
    summary = json.loads(compose_stack("smoke", stack.script_env, 2400))
    report = json.dumps(summary, indent=2, default=str)
    assert summary["failures"] == [], report  # secrets in `podman inspect` included
    assert summary["training_containers_inspected"] >= 2, report  # train and export
    assert summary["tasks"] == PUBLISHED_RUN, report
    assert summary["published"]["dag_run_id"] == summary["run_id"], report
    (stack.state / "smoke.json").write_text(report)


@pytest.mark.parametrize(
    ("conf", "param"),
    [({"num_proc": 0}, "num_proc"), ({"dataset_source": "relative/folder"}, "dataset_source")],
)
def test_the_rest_api_refuses_a_conf_that_breaks_a_param(
    stack: Stack, conf: dict[str, object], param: str
) -> None:
    smoke = load_stack_smoke()
    api = smoke.AirflowApi.login(
        stack.airflow_url, stack.settings["AIRFLOW_ADMIN_USER"],
        stack.settings["AIRFLOW_ADMIN_PASSWORD"],
    )  # fmt: skip
    api.wait_for_dag(smoke.RETRAIN_DAG)
    before = {r["dag_run_id"] for r in api.runs(smoke.RETRAIN_DAG)}
    with pytest.raises(smoke.ApiError) as refused:
        api.trigger(smoke.RETRAIN_DAG, conf)
    assert "HTTP 400" in str(refused.value) and param in str(refused.value), refused.value
    assert {r["dag_run_id"] for r in api.runs(smoke.RETRAIN_DAG)} == before


def test_training_containers_reach_the_object_store_but_not_postgres_or_the_api_server(
    stack: Stack,
) -> None:
    """From a container of the trainer image on the training network (as the docker launcher
    starts them): S3 answers; PostgreSQL and the api-server are reached neither by name nor
    by their addresses on the stack's other network."""
    names = stack.containers()

    def address(service: str) -> str:
        name = next(n for n in names if f"_{service}_" in n)
        nets = json.loads(
            stack.podman("inspect", "--format", "{{json .NetworkSettings.Networks}}", name)
        )
        return str(nets[f"{PROJECT}_default"]["IPAddress"])

    probe = textwrap.dedent(
        """
        import json, socket, sys
        result = {}
        for label, host, port in json.loads(sys.argv[1]):
            try:
                socket.create_connection((host, port), timeout=3).close()
                result[label] = "open"
            except OSError as e:
                result[label] = type(e).__name__
        print(json.dumps(result))
        """
    )
    targets = [
        ("s3", "seaweedfs", 8333),
        ("postgres", "postgres", 5432),
        ("postgres-ip", address("postgres"), 5432),
        ("apiserver", "airflow-apiserver", 8080),
        ("apiserver-ip", address("airflow-apiserver"), 8080),
    ]
    out = stack.podman(
        "run", "--rm", "--network", stack.settings["HVA_DOCKER_NETWORK"],
        stack.settings["HVA_TRAINER_IMAGE"], "python", "-c", probe, json.dumps(targets),
    )  # fmt: skip
    reached = json.loads(out.strip().splitlines()[-1])
    assert reached["s3"] == "open", reached
    for label in ("postgres", "postgres-ip", "apiserver", "apiserver-ip"):
        assert reached[label] != "open", reached


def test_down_and_up_keep_the_data_and_a_new_run_gates_against_the_champion(
    stack: Stack,
) -> None:
    """``down`` (volumes kept) and ``up``: the object store still holds what was published, and
    the next run's gate compares with that champion (its XCom names the version)."""
    smoke = load_stack_smoke()
    s3 = smoke.s3_client(stack.settings)
    try:
        before = smoke.read_published(stack.settings)
    except s3.exceptions.NoSuchKey:  # a shuffled order: nothing published yet
        summary = json.loads(compose_stack("smoke", stack.script_env, 2400))
        assert summary["failures"] == [], summary
        before = smoke.read_published(stack.settings)
    champion = before["latest"]["version"]

    compose_stack(readme.command("scripts/engines/compose_stack.sh down").split(maxsplit=1)[1],
                  stack.script_env, 300)  # fmt: skip
    assert not stack.containers()
    volumes = stack.podman("volume", "ls", "--format", "{{.Name}}").split()
    assert f"{PROJECT}_seaweedfs-data" in volumes and f"{PROJECT}_postgres-db" in volumes
    compose_stack("up", stack.script_env, UP_TIMEOUT)

    assert smoke.read_published(stack.settings) == before  # latest.json, manifest, model.onnx
    api = smoke.AirflowApi.login(
        stack.airflow_url, stack.settings["AIRFLOW_ADMIN_USER"],
        stack.settings["AIRFLOW_ADMIN_PASSWORD"],
    )  # fmt: skip
    api.wait_for_dag(smoke.RETRAIN_DAG)
    run_id = api.trigger(smoke.RETRAIN_DAG, smoke.SMOKE_CONF)
    run = api.wait_for_run(smoke.RETRAIN_DAG, run_id, 1800)
    assert run["state"] == "success", api.task_states(smoke.RETRAIN_DAG, run_id)
    gate = api.call(
        "GET",
        f"/api/v2/dags/{smoke.RETRAIN_DAG}/dagRuns/{urllib.parse.quote(run_id)}/taskInstances/"
        "gate/xcomEntries/"
        "return_value?deserialize=true",
    )["value"]
    gate = json.loads(gate) if isinstance(gate, str) else gate
    assert gate["champion_version"] == champion, gate


def test_dag_code_in_the_scheduler_reaches_the_engine_only_through_the_proxy(stack: Stack) -> None:
    """As a DAG author's task would, from inside the scheduler: the engine answers a call the
    launcher makes, refuses (403, from the proxy) a privileged container, a bind of ``/``, the
    volumes API and exec; and the engine's own socket is not there to use instead."""
    scheduler = next(n for n in stack.containers() if "_airflow-scheduler_" in n)
    probe = textwrap.dedent(
        """
        import json, os, docker
        c = docker.APIClient(base_url=os.environ["DOCKER_HOST"], version="auto", timeout=30)
        net, image = os.environ["HVA_DOCKER_NETWORK"], os.environ["HVA_TRAINER_IMAGE"]
        out = {"ping": c.ping(), "engine_socket": os.path.exists("/var/run/docker.sock")}
        def status(call):
            try:
                call()
                return "passed"
            except docker.errors.APIError as e:
                return e.response.status_code
        def create(**k):
            return c.create_container(image, "true", host_config=c.create_host_config(
                network_mode=net, **k))
        out["privileged"] = status(lambda: create(privileged=True))
        out["bind"] = status(lambda: create(binds=["/:/host"]))
        out["volumes"] = status(lambda: c.volumes())
        out["exec"] = status(lambda: c.exec_create("x", "true"))
        print(json.dumps(out))
        """
    )
    out = stack.podman("exec", scheduler, "python", "-c", probe)
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {
        "ping": True, "engine_socket": False,
        "privileged": 403, "bind": 403, "volumes": 403, "exec": 403,
    }, seen  # fmt: skip
