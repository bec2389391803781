"""Drive the compose stack as a user would, through the Airflow REST API, and check the result.

    python scripts/engines/stack_smoke.py --env-file /var/tmp/hva-stack/stack.env [--conf '{...}']

(``scripts/engines/compose_stack.sh smoke`` runs it.) Logs in with the admin user of the settings
file, unpauses ``mnist_horovod_retrain`` and the serving DAG, triggers the retraining DAG with a
small CPU conf, waits for it, then checks what a platform engineer would: every task succeeded;
``latest.json`` names a version whose ``model.onnx`` has the sha256 its manifest records; the
serving DAG ran on the Asset event and succeeded; no training container is left on the engine;
no secret of the stack (its secret files) appears anywhere in ``podman inspect`` of any
container of the engine, the training containers included (inspected while they run). Prints
one JSON summary; exits 1 naming each failed check. tests/stack uses the same functions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: its registry layout
from horovod_airflow.apps.mnist import MODEL_NAME
from horovod_airflow.core.contract import LATEST, ONNX_NAME, VERSION_MANIFEST
from horovod_airflow.operators.model_registry import latest_uri

RETRAIN_DAG = "mnist_horovod_retrain"
SERVE_DAG = "mnist_serve_latest_model"
JOB_LABEL = "horovod-airflow/job"  # the docker launcher labels its containers with this
# Small enough for 2 CPU ranks in a few minutes, large enough for the gate's floor below.
# max_regression 1: unpausing the DAG also starts its latest scheduled (@weekly) run, on all the
# data, which publishes first (max_active_runs=1); this smaller run must not be gated against it.
SMOKE_CONF = {
    "num_proc": 2,
    "epochs": 1,
    "max_train_samples": 6000,
    "min_accuracy": 0.9,
    "max_regression": 1.0,
}
#: The settings this script reads from the stack's secret files (HVA_SECRETS_DIR).
SECRET_SETTINGS = {
    "AIRFLOW_ADMIN_PASSWORD": "airflow_admin_password",
    "HVA_S3_SECRET_KEY": "s3_worker_secret_key",
}


def read_env_file(path: str | Path) -> dict[str, str]:
    """KEY=VALUE lines of a dotenv file (comments and blanks skipped), and, where it names
    its secrets folder (HVA_SECRETS_DIR, relative to the file's folder), the secrets as
    ``secret:<name>`` and the ones this script uses under :data:`SECRET_SETTINGS`' names."""
    env = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    if env.get("HVA_SECRETS_DIR"):
        folder = Path(path).resolve().parent / env["HVA_SECRETS_DIR"]
        for file in sorted(folder.iterdir()):
            env[f"secret:{file.name}"] = file.read_text().strip()
        for key, name in SECRET_SETTINGS.items():
            env[key] = env[f"secret:{name}"]
    return env


def secret_values(env: dict[str, str]) -> dict[str, str]:
    """``name -> value`` of every non-empty secret of the stack."""
    return {k.removeprefix("secret:"): v for k, v in env.items() if k.startswith("secret:") and v}


class ApiError(RuntimeError):
    """A REST call failed: names the method, the path, the status and the body."""


@dataclass
class AirflowApi:
    """The stack's Airflow REST API (v2), authenticated with a token of the admin user."""

    base_url: str
    token: str = ""

    @classmethod
    def login(cls, base_url: str, username: str, password: str, timeout: float = 120) -> AirflowApi:
        """Wait for the api-server, then take a token (FAB's ``POST /auth/token``)."""
        api = cls(base_url.rstrip("/"))
        deadline = time.monotonic() + timeout
        while True:
            try:
                api.token = api.call(
                    "POST", "/auth/token", {"username": username, "password": password}
                )["access_token"]
                return api
            except (ApiError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise ApiError(f"could not log in to {base_url} as {username}: {exc}") from exc
                time.sleep(3)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            raise ApiError(
                f"{method} {path}: HTTP {exc.code}: {exc.read().decode()[:500]}"
            ) from exc
        return json.loads(text) if text else None

    def wait_for_dag(self, dag_id: str, timeout: float = 300) -> dict[str, Any]:
        """The DAG once the dag-processor has parsed it (with its import errors, if any)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.call("GET", f"/api/v2/dags/{dag_id}")
            except ApiError as exc:
                if time.monotonic() > deadline:
                    errors = self.call("GET", "/api/v2/importErrors")
                    raise ApiError(
                        f"{dag_id} was not parsed within {timeout}s: {exc}; import errors: {errors}"
                    ) from exc
                time.sleep(3)

    def unpause(self, dag_id: str) -> None:
        self.call("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        run = self.call(
            "POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf}
        )
        return str(run["dag_run_id"])

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            run = self.call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{urllib.request.quote(run_id)}")
            if run["state"] in ("success", "failed"):
                return run
            if time.monotonic() > deadline:
                raise ApiError(f"{dag_id} run {run_id} still {run['state']} after {timeout}s")
            time.sleep(5)

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        tis = self.call(
            "GET", f"/api/v2/dags/{dag_id}/dagRuns/{urllib.request.quote(run_id)}/taskInstances"
        )["task_instances"]
        return {ti["task_id"]: ti["state"] for ti in tis}

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        path = (
            f"/api/v2/dags/{dag_id}/dagRuns/{urllib.request.quote(run_id)}/taskInstances/"
            f"{task_id}/logs/{try_number}?full_content=true"
        )
        try:
            content = self.call("GET", path).get("content")
        except ApiError as exc:
            return str(exc)
        if isinstance(content, list):
            return "\n".join(
                str(e.get("event", e)) if isinstance(e, dict) else str(e) for e in content
            )
        return str(content)

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return self.call("GET", f"/api/v2/dags/{dag_id}/dagRuns?order_by=-run_after&limit=20")[
            "dag_runs"
        ]

    def serving_run_of(self, version: str, timeout: float) -> dict[str, Any] | None:
        """The serving DAG's run triggered by the Asset event that published ``version``."""
        deadline = time.monotonic() + timeout
        while True:
            for run in self.runs(SERVE_DAG):
                if run["run_type"] != "asset_triggered":
                    continue
                events = self.call(
                    "GET",
                    f"/api/v2/dags/{SERVE_DAG}/dagRuns/"
                    f"{urllib.request.quote(run['dag_run_id'])}/upstreamAssetEvents",
                )["asset_events"]
                if any((e.get("extra") or {}).get("version") == version for e in events):
                    if run["state"] in ("success", "failed") or time.monotonic() > deadline:
                        return dict(run)
                    break
            if time.monotonic() > deadline:
                return None
            time.sleep(5)


def s3_client(env: dict[str, str]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{env['HVA_S3_PORT']}",
        aws_access_key_id=env["HVA_S3_ACCESS_KEY"],
        aws_secret_access_key=env["HVA_S3_SECRET_KEY"],
        region_name=env.get("AWS_REGION", "us-east-1"),
    )


def read_object(s3: Any, uri: str) -> bytes:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bytes(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


def read_published(env: dict[str, str]) -> dict[str, Any]:
    """latest.json, the version's manifest and the sha256 of the ONNX file it names."""
    s3 = s3_client(env)
    uri = latest_uri(f"s3://{env['HVA_BUCKET']}", MODEL_NAME)
    latest = LATEST.loads(read_object(s3, uri), uri)
    onnx = read_object(s3, latest["onnx_uri"])
    return {
        "latest": latest,
        "manifest": VERSION_MANIFEST.loads(
            read_object(s3, latest["manifest_uri"]), latest["manifest_uri"]
        ),
        "onnx_sha256": hashlib.sha256(onnx).hexdigest(),
        "onnx_bytes": len(onnx),
    }


def s3_store_state(env: dict[str, str]) -> str:
    """The buckets the host reaches, and the S3 container's restarts (diagnostics)."""
    try:
        buckets = [b["Name"] for b in s3_client(env).list_buckets()["Buckets"]]
    except Exception as exc:
        buckets = [f"list_buckets failed: {exc!r}"]
    containers = podman_json("ps", "-a", "--filter", "label=com.docker.compose.service=seaweedfs",
                             "--format", "json")  # fmt: skip
    ids = [c["Id"] for c in containers]
    restarts = [
        f"{i['Name']}: started {i['State']['StartedAt']}, restarts {i.get('RestartCount')}"
        for i in (podman_json("inspect", *ids) if ids else [])
    ]
    return f"buckets at 127.0.0.1:{env['HVA_S3_PORT']}: {buckets}; S3 containers: {restarts}"


def podman_json(*args: str) -> Any:
    out = subprocess.run(["podman", *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out or "[]")


def training_containers() -> list[str]:
    """Containers the docker launcher made that are still on the engine (any state)."""
    return [
        c["Names"][0]
        for c in podman_json("ps", "-a", "--filter", f"label={JOB_LABEL}", "--format", "json")
    ]


def secrets_in_inspect(env: dict[str, str], ids: list[str] | None = None) -> list[str]:
    """`container: secret name` for each secret of the stack found anywhere in ``podman
    inspect`` of the containers ``ids`` (default: every container on the engine): its
    environment, command, labels, mounts, everything the engine shows to those who may use it."""
    found = []
    ids = [c["Id"] for c in podman_json("ps", "-a", "--format", "json")] if ids is None else ids
    secrets = secret_values(env)
    assert secrets, "no secrets to look for: the settings name no secrets folder"
    for info in podman_json("inspect", *ids) if ids else []:
        text = json.dumps(info)
        found += [f"{info['Name']}: {name}" for name, value in secrets.items() if value in text]
    return found


class TrainingContainerWatch:
    """Inspects each training container while it exists (the launcher removes them once
    done): the secrets found in its ``podman inspect``, and how many were inspected."""

    def __init__(self, env: dict[str, str], period: float = 1.0) -> None:
        import threading

        self.env, self.period = env, period
        self.seen: set[str] = set()
        self.found: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                ids = [c["Id"] for c in podman_json("ps", "-a", "--filter", f"label={JOB_LABEL}",
                                                     "--format", "json")]  # fmt: skip
                new = [i for i in ids if i not in self.seen]
                if new:
                    self.found += secrets_in_inspect(self.env, new)
                    self.seen.update(new)
            except subprocess.CalledProcessError:
                pass  # removed between ps and inspect: the next one is looked at
            self._stop.wait(self.period)

    def __enter__(self) -> TrainingContainerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def run_smoke(env: dict[str, str], conf: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """Trigger, wait, check. Returns the summary with a ``failures`` list (empty: all good)."""
    api = AirflowApi.login(
        f"http://127.0.0.1:{env['AIRFLOW_PORT']}",
        env["AIRFLOW_ADMIN_USER"],
        env["AIRFLOW_ADMIN_PASSWORD"],
    )
    for dag_id in (RETRAIN_DAG, SERVE_DAG):
        api.wait_for_dag(dag_id)
        api.unpause(dag_id)
    start = time.monotonic()
    with TrainingContainerWatch(env) as watch:
        run_id = api.trigger(RETRAIN_DAG, conf)
        run = api.wait_for_run(RETRAIN_DAG, run_id, timeout)
    summary: dict[str, Any] = {
        "run_id": run_id,
        "state": run["state"],
        "seconds": round(time.monotonic() - start, 1),
        "tasks": api.task_states(RETRAIN_DAG, run_id),
        "training_containers_inspected": len(watch.seen),
        "failures": [],
    }
    failures = summary["failures"]
    for task_id, state in summary["tasks"].items():
        # a run whose gate passed publishes; its refused branch skips itself
        if state != ("skipped" if task_id == "record_refused" else "success"):
            failures.append(f"task {task_id} is {state}")
            summary.setdefault("logs", {})[task_id] = api.task_log(RETRAIN_DAG, run_id, task_id)[
                -3000:
            ]
    if run["state"] != "success":
        failures.append(f"run {run_id} is {run['state']}")
        return summary
    try:
        published = read_published(env)
    except Exception as exc:  # say what the S3 store held, and whether it had restarted
        failures.append(f"reading the published model failed: {exc!r}; {s3_store_state(env)}")
        return summary
    latest, manifest = published["latest"], published["manifest"]
    summary["published"] = {
        k: latest.get(k) for k in ("version", "onnx_uri", "val_accuracy", "dag_run_id")
    }
    if latest.get("dag_run_id") != run_id:
        failures.append(f"latest.json names run {latest.get('dag_run_id')}, not {run_id}")
    if manifest["files"][ONNX_NAME]["sha256"] != published["onnx_sha256"]:
        failures.append("model.onnx's sha256 differs from its manifest's")
    # The serving DAG is scheduled on the Asset event of the publish: its run for this version.
    serve = api.serving_run_of(str(latest.get("version")), timeout=300)
    summary["serving_run"] = serve
    if serve is None or serve["state"] != "success":
        failures.append(
            f"the serving DAG's run for version {latest.get('version')}: "
            f"{serve['state'] if serve else 'none'}"
        )
    left = training_containers()
    if left:
        failures.append(f"training containers left on the engine: {left}")
    if not watch.seen:
        failures.append("no training container was seen to inspect it for secrets")
    leaks = watch.found + secrets_in_inspect(env)
    if leaks:
        failures.append(f"secrets in `podman inspect` of containers: {leaks}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--env-file", required=True, help="the stack's settings (compose_stack.sh env)"
    )
    parser.add_argument("--conf", default=json.dumps(SMOKE_CONF), help="the run's conf, JSON")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the run")
    args = parser.parse_args(argv)
    summary = run_smoke(read_env_file(args.env_file), json.loads(args.conf), args.timeout)
    print(json.dumps(summary, indent=2, default=str))
    for failure in summary["failures"]:
        print(f"stack_smoke: FAILED: {failure}", file=sys.stderr)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
