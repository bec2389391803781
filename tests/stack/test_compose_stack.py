"""docker-compose.yml up for real on podman, driven through the REST API as a user would.

One DAG run of ``mnist_horovod_retrain`` on the stack (Airflow 3 api-server, scheduler,
dag-processor and triggerer on PostgreSQL; the S3 store; training and export in trainer-image
containers started by the docker launcher through the engine's socket), checked end to end by
the same code as ``compose_stack.sh smoke``. The fixture's teardown runs ``down`` and checks
that no container, volume or network of the stack is left.
"""

from __future__ import annotations

import json

import pytest

from tests.engine_scripts import BUILD_TIMEOUT
from tests.stack.conftest import Stack, compose_stack, load_stack_smoke

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 2400)]

RETRAIN_TASKS = {"stage_dataset", "train", "gate", "export_onnx", "publish"}


def test_every_service_of_the_compose_file_ran(stack: Stack) -> None:
    names = stack.containers()
    for service in (
        "postgres", "minio", "minio-init", "airflow-init", "trainer", "docker-launcher-check",
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
    assert printed["HVA_STACK_S3_URL"] == f"http://127.0.0.1:{stack.settings['MINIO_API_PORT']}"
    assert printed["HVA_STACK_ADMIN_USER"] == stack.settings["AIRFLOW_ADMIN_USER"]
    assert printed["HVA_STACK_ADMIN_PASSWORD"] == stack.settings["AIRFLOW_ADMIN_PASSWORD"]


def test_a_run_triggered_through_the_rest_api_publishes_a_verified_model(stack: Stack) -> None:
    """``compose_stack.sh smoke`` as a user types it: a run through the REST API, checked."""
    summary = json.loads(compose_stack("smoke", stack.script_env, 2400))
    report = json.dumps(summary, indent=2, default=str)
    assert summary["failures"] == [], report
    assert summary["tasks"] == dict.fromkeys(RETRAIN_TASKS, "success"), report
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
