"""What the Horovod operators share: credentials, launcher choice, kill, reading results.

Runs in the Airflow worker. Never imports torch or horovod; providers (amazon, docker,
cncf-kubernetes) are imported when first needed, so a DAG file parses in milliseconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypedDict

from airflow.sdk import BaseOperator

from horovod_airflow.operators.command import validate_env_name
from horovod_airflow.operators.connection import AwsConnectionMixin
from horovod_airflow.operators.exceptions import (
    HorovodOperatorError,
    HorovodTimeoutError,
    HorovodTrainingError,
)
from horovod_airflow.operators.launchers.base import (
    JobJournal,
    JobSpec,
    Launcher,
)
from horovod_airflow.operators.launchers.docker import DockerLauncher, DockerOptions
from horovod_airflow.operators.launchers.kubernetes import KubernetesLauncher, KubernetesOptions
from horovod_airflow.operators.launchers.local import LocalLauncher, LocalOptions
from horovod_airflow.operators.retry import with_retry_policy

if TYPE_CHECKING:
    from airflow.sdk import Context

    from horovod_airflow.core.contract import Schema


def is_templated(value: Any) -> bool:
    """A value still holding Jinja (validated after rendering, in ``execute``)."""
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def as_int(value: Any, field: str, *, minimum: int) -> int:
    """Validate an int field that may arrive as a rendered template string."""
    if isinstance(value, bool):
        raise ValueError(f"{field} must be an integer ≥ {minimum}, got {value!r}")
    try:
        number = int(str(value).strip()) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field} must be an integer ≥ {minimum}, got {value!r}") from None
    if number < minimum or (not isinstance(value, str) and number != value):
        raise ValueError(f"{field} must be an integer ≥ {minimum}, got {value!r}")
    return number


def as_fraction(value: Any, field: str) -> float:
    """Validate a fraction in [0, 1] (an accuracy) that may arrive as a rendered string."""
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a fraction in [0, 1], got {value!r}")
    try:
        number = float(value.strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field} must be a fraction in [0, 1], got {value!r}") from None
    if not 0.0 <= number <= 1.0:  # also refuses NaN
        raise ValueError(f"{field} must be a fraction in [0, 1], got {value!r}")
    return number


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_name(value: Any, field: str) -> str:
    """Validate a name that becomes one S3 key segment (a model or dataset name)."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(
            f"{field} must be a name of letters, digits, '.', '_' and '-' (one S3 key "
            f"segment), got {value!r}"
        )
    return value


def check_uri(value: Any, field: str) -> str:
    """Validate a URI field (``s3://bucket/prefix`` or a local path)."""
    if not value or not isinstance(value, str):
        raise ValueError(f"{field} must be a URI (s3://... or a path), got {value!r}")
    return value


def as_mapping(value: Any, field: str, keys: Sequence[str] = ()) -> Mapping[str, Any]:
    """Validate an upstream task's XCom dict (rendered) that must hold ``keys``."""
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{field} must be a dict (pass the upstream task's .output, or render with "
            f"render_template_as_native_obj=True), got {type(value).__name__}: {value!r:.80}"
        )
    missing = [k for k in keys if k not in value]
    if missing:
        raise ValueError(f"{field} lacks {missing}; keys present: {sorted(value)}")
    return value


def check_upstream(value: Any, field: str, keys: Sequence[str] = ()) -> None:
    """At parse time: an upstream XCom (``task.output``), a template, or a dict with ``keys``."""
    from airflow.sdk import XComArg

    if isinstance(value, XComArg) or is_templated(value):
        return
    as_mapping(value, field, keys)


def job_name(dag_id: str, task_id: str, run_id: str, map_index: int = -1) -> str:
    """A DNS-1123 name (≤ 52 chars, room for MPIJob pod suffixes), the same for every try of
    one task instance: a retry finds the job (MPIJob, container) an earlier try left."""
    instance = f"{dag_id}/{task_id}/{run_id}" + (f"/{map_index}" if map_index >= 0 else "")
    digest = hashlib.sha256(instance.encode()).hexdigest()
    stem = re.sub(r"[^a-z0-9-]+", "-", task_id.lower()).strip("-")[:38] or "job"
    return f"hvd-{stem}-{digest[:8]}".strip("-")


def job_labels(
    dag_id: str, task_id: str, run_id: str, try_number: int, map_index: int = -1
) -> dict[str, str]:
    """The task instance's labels, made label-safe as ``KubernetesPodOperator`` makes them
    (the provider's ``make_safe_label_value``: unsafe characters dropped, then a hash)."""
    from airflow.providers.cncf.kubernetes.pod_generator import make_safe_label_value

    labels = {"dag_id": dag_id, "task_id": task_id, "run_id": run_id}
    if map_index >= 0:
        labels["map_index"] = str(map_index)
    labels["try_number"] = str(try_number)
    return {key: make_safe_label_value(value) for key, value in labels.items()}


class HorovodJobSettings(TypedDict, total=False):
    """Keyword arguments several Horovod operators of one DAG share, written once:
    ``HorovodTrainOperator(task_id=..., **SETTINGS)`` (see
    ``horovod_airflow.operators.settings.TRAINER_JOB``)."""

    execution_timeout: timedelta
    aws_conn_id: str | None
    rank_aws_conn_id: str | None
    image: str | None
    gpus_per_proc: int
    env: Mapping[str, str]
    secret_env: Mapping[str, str]
    preflight: bool
    local: LocalOptions | None
    docker: DockerOptions | None
    kubernetes: KubernetesOptions | None


#: The launchers by name (the operator's ``launcher``); each declares its options class and
#: what it needs and can do (``Launcher``), so nothing below names one.
LAUNCHER_CLASSES: dict[str, type[Launcher]] = {
    cls.name: cls for cls in (LocalLauncher, DockerLauncher, KubernetesLauncher)
}
#: launcher → the class of its options (the operator's argument of the same name).
LAUNCHER_OPTIONS: dict[str, type[Any]] = {
    name: cls.options_class for name, cls in LAUNCHER_CLASSES.items()
}
#: The seconds the launcher's deadline keeps before ``execution_timeout`` (at most a tenth of
#: it), so the launcher stops the job itself and fails with its log tail, before Airflow's
#: own timeout interrupts the task.
TIMEOUT_RESERVE_S = 60.0


def moved_setting(name: str) -> str | None:
    """The error for a keyword that is now a launcher option (or gone); None otherwise."""
    if name == "timeout":
        return (
            "timeout: removed; set Airflow's execution_timeout (a timedelta): the launcher "
            "stops the job just before it, the deferrable trigger too"
        )
    owners = [
        launcher
        for launcher, cls in LAUNCHER_OPTIONS.items()
        if name in {f.name for f in dataclasses.fields(cls)}
    ]
    if not owners:
        return None
    where = " or ".join(
        f"{launcher}={LAUNCHER_OPTIONS[launcher].__name__}({name}=...)" for launcher in owners
    )
    only = " and ".join(repr(launcher) for launcher in owners)
    return f"{name} is an option of launcher {only} only: pass {where}"


def check_launcher(launcher: Any, image: Any) -> None:
    """Raise ValueError unless ``launcher`` is known and has the image it needs."""
    if launcher not in LAUNCHER_CLASSES:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHER_CLASSES)}; got {launcher!r}")
    if LAUNCHER_CLASSES[launcher].needs_image and not image:
        raise ValueError(f"image is required when launcher={launcher!r}")


class HorovodJobOperatorBase(AwsConnectionMixin, BaseOperator):
    """Shared machinery of :class:`HorovodTrainOperator` and :class:`HorovodExportOperator`.

    :param launcher: where the job runs: ``"local"`` (horovodrun on the worker),
        ``"docker"`` (one container) or ``"kubernetes"`` (a Kubeflow MPIJob or TrainJob:
        ``KubernetesOptions.kubernetes_api``); templated.
    :param aws_conn_id: Airflow AWS connection whose credentials, endpoint and region reach
        the job as the standard ``AWS_*`` variables (secrets masked, never on a command
        line). ``None``: the job uses its own credentials (instance role, files).
    :param rank_aws_conn_id: the connection whose credentials, endpoint and region the job's
        ranks get instead (default ``None``: ``aws_conn_id``'s). For least privilege give
        the ranks an identity that reads ``datasets/``, reads and writes ``runs/`` and
        nothing under ``models/``: publishing runs on the worker, with ``aws_conn_id``, which
        also reads what the job wrote.
    :param env: extra non-secret environment variables for the job (templated).
    :param secret_env: extra secret variables, delivered like the AWS credentials.
    :param image: container image of the docker and kubernetes launchers (templated).
    :param gpus_per_proc: GPUs per rank (0 = CPU).
    :param preflight: check slots/GPUs and run the trainer's doctor before launching (the
        local launcher remembers a doctor pass per interpreter and installed torch/horovod:
        ``HVA_PREFLIGHT_CACHE``).
    :param local: :class:`~horovod_airflow.operators.launchers.local.LocalOptions` (hosts, ssh,
    horovodrun
        arguments, credentials folder, kill grace, working directory).
    :param docker: :class:`~horovod_airflow.operators.launchers.docker.DockerOptions` (engine,
    mounts, IPC,
        network, working directory, cleanup, pull, ``create_container`` overrides).
    :param kubernetes: :class:`~horovod_airflow.operators.launchers.kubernetes.KubernetesOptions`
    (cluster,
        namespace, ``kubernetes_api`` (``"mpijob"``: a Kubeflow MPIJob, or ``"trainjob"``: a
        Kubeflow Trainer v2 TrainJob), slots per worker, pod settings, cleanup, deferrable,
        startup timeout, ``mpijob_overrides`` / ``trainjob_overrides``).

    Launcher options rule: every setting that only one launcher uses lives in that
    launcher's options object, written once and handed to the launcher whole. With a literal
    ``launcher``, an options object for another launcher (or ``image`` with ``"local"``) is
    refused at construction, naming it. With a templated ``launcher`` (a trigger-form Param)
    the objects of several launchers may stand side by side: after rendering, the chosen
    launcher's object is used (its defaults when absent) and the others are not (logged).
    The former loose keywords (``mounts=``, ``namespace=``, ...) are refused naming the
    object they now belong to. Options objects are not templated.

    Timeout: Airflow's ``execution_timeout`` is the only one. The launcher's deadline is what
    remains of it when the job starts, less a reserve (``TIMEOUT_RESERVE_S``, at most a tenth):
    the local launcher stops horovodrun, the docker launcher the container, the kubernetes
    launcher deletes the MPIJob or TrainJob (its ``activeDeadlineSeconds`` is that deadline),
    and the task fails with :class:`HorovodTimeoutError` and the job's last lines. With
    ``deferrable=True`` the trigger enforces the same deadline (Airflow 3 does not apply
    ``execution_timeout`` to a deferred wait). None: no limit.
    """

    template_fields: Sequence[str] = ("env", "image")
    template_fields_renderers = {"env": "json"}  # noqa: RUF012 - Airflow's class attribute
    ui_color = "#e8f1fb"

    def __init__(
        self,
        *,
        launcher: str = "local",
        aws_conn_id: str | None = "aws_default",
        rank_aws_conn_id: str | None = None,
        env: Mapping[str, str] | None = None,
        secret_env: Mapping[str, str] | None = None,
        image: str | None = None,
        gpus_per_proc: int = 0,
        preflight: bool = True,
        local: LocalOptions | None = None,
        docker: DockerOptions | None = None,
        kubernetes: KubernetesOptions | None = None,
        **kwargs: Any,
    ) -> None:
        for name in kwargs:
            moved = moved_setting(name)
            if moved is not None:
                raise ValueError(moved)
        super().__init__(**with_retry_policy(kwargs))
        given = {"local": local, "docker": docker, "kubernetes": kubernetes}
        for name, value in given.items():
            cls = LAUNCHER_OPTIONS[name]
            if value is not None and not isinstance(value, cls):
                raise ValueError(
                    f"{name} must be a {cls.__name__} (from {cls.__module__}), got "
                    f"{type(value).__name__}: {value!r:.80}"
                )
        if env is not None and not isinstance(env, Mapping) and not is_templated(env):
            raise ValueError(f"env must be a dict of name → value, got {type(env).__name__}")
        if isinstance(env, Mapping):
            for name in env:
                validate_env_name(name, "env")
        for name in secret_env or {}:
            validate_env_name(name, "secret_env")
        self.launcher = launcher
        self.launcher_templated = is_templated(launcher)
        self.aws_conn_id = aws_conn_id
        self.rank_aws_conn_id = rank_aws_conn_id
        self.env = dict(env) if isinstance(env, Mapping) else (env or {})
        self.secret_env = dict(secret_env or {})
        self.image = image
        self.gpus_per_proc = as_int(gpus_per_proc, "gpus_per_proc", minimum=0)
        self.preflight = preflight
        self.launcher_options: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        self._running: Launcher | None = None
        self._clock: float | None = None
        if not self.launcher_templated:
            self.check_launcher_settings()

    def options(self, launcher: str | None = None) -> Any:
        """The options object of ``launcher`` (default: the chosen one); its defaults if none
        was given."""
        name = str(self.launcher if launcher is None else launcher)
        return self.launcher_options.get(name) or LAUNCHER_OPTIONS[name]()

    def check_launcher_settings(self) -> None:
        """:func:`check_launcher`; with a literal launcher, nothing given that it ignores."""
        check_launcher(self.launcher, self.image)
        others = [name for name in self.launcher_options if name != self.launcher]
        if self.launcher_templated:
            if others:
                self.log.info("launcher=%r: the options of %s are not used", self.launcher, others)
            return
        for name in others:
            cls = LAUNCHER_OPTIONS[name].__name__
            raise ValueError(
                f"{name}={cls}(...) is for launcher={name!r}, and launcher is "
                f"{self.launcher!r}; remove it (options of several launchers may stand side "
                f"by side only when launcher is templated)"
            )
        if self.image and not LAUNCHER_CLASSES[self.launcher].needs_image:
            users = " and ".join(repr(n) for n, c in LAUNCHER_CLASSES.items() if c.needs_image)
            raise ValueError(
                f"image={self.image!r}: only used by launcher {users}, and launcher is "
                f"{self.launcher!r}; remove it"
            )

    def start_clock(self) -> None:
        """Mark the start of this ``execute``: ``execution_timeout`` counts from here."""
        self._clock = time.monotonic()

    def job_deadline(self) -> float | None:
        """Seconds the job may run from now: what ``execution_timeout`` leaves, less the
        reserve; None without one. Raises :class:`HorovodTimeoutError` when nothing is left."""
        limit = self.execution_timeout
        if limit is None:
            return None
        total = limit.total_seconds()
        spent = 0.0 if self._clock is None else time.monotonic() - self._clock
        deadline = total - spent - min(TIMEOUT_RESERVE_S, total / 10)
        if deadline <= 0:
            raise HorovodTimeoutError(
                f"execution_timeout={total:.0f}s leaves no time for the job after "
                f"{spent:.0f}s of preparation",
                timeout=total,
            )
        return deadline

    def job_identity(self, context: Context) -> tuple[str, dict[str, str]]:
        """(job name, labels) of this task instance: the name is the same for every try (a
        retry finds the earlier try's job); the labels say which try made it. Labels are for
        the container and MPIJob launchers only."""
        ti = context.get("ti")
        dag_id = str(getattr(self, "dag_id", "") or "")
        run_id = str(context.get("run_id", "") or "")
        map_index = getattr(ti, "map_index", -1)
        map_index = map_index if isinstance(map_index, int) else -1
        name = job_name(dag_id, self.task_id, run_id, map_index)
        try_number = int(getattr(ti, "try_number", 1) or 1)
        return name, job_labels(dag_id, self.task_id, run_id, try_number, map_index)

    def job_env(self) -> tuple[dict[str, str], dict[str, str]]:
        """(non-secret env, secret env) for the job, from ``env``, the ranks' AWS connection
        (``rank_aws_conn_id``, else ``aws_conn_id``) and ``secret_env``. Secrets are
        registered with Airflow's masker before anything logs."""
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook
        from airflow.sdk.log import mask_secret

        if not isinstance(self.env, Mapping):  # e.g. a template that rendered to a string
            raise ValueError(f"env must render to a dict of name → value, got {self.env!r:.80}")
        for name in self.env:
            validate_env_name(name, "env")
        public = {str(k): str(v) for k, v in self.env.items()}
        secret = {str(k): str(v) for k, v in self.secret_env.items()}
        conn_id = self.rank_aws_conn_id or self.aws_conn_id
        if conn_id is not None:
            hook = self.s3_hook if conn_id == self.aws_conn_id else S3Hook(aws_conn_id=conn_id)
            creds = hook.get_credentials()  # masks secret_key and token itself
            if creds.access_key:
                secret["AWS_ACCESS_KEY_ID"] = creds.access_key
            if creds.secret_key:
                secret["AWS_SECRET_ACCESS_KEY"] = creds.secret_key
            if creds.token:
                secret["AWS_SESSION_TOKEN"] = creds.token
            region = hook.conn_config.region_name or hook.conn_region_name
            if region:
                public.setdefault("AWS_DEFAULT_REGION", region)
            endpoint = hook.conn_config.endpoint_url
            if endpoint:
                public.setdefault("AWS_ENDPOINT_URL", endpoint)
        for value in secret.values():
            mask_secret(value)
        return public, secret

    # --- launchers --------------------------------------------------------------------
    def make_launcher(self) -> Launcher:
        """The chosen launcher, handed its options object (and the image, where it runs one)."""
        cls: Any = LAUNCHER_CLASSES[str(self.launcher)]
        options = self.options()
        if cls.needs_image:
            return cls(image=str(self.image), options=options)
        return cls(options=options)

    def run_job(self, spec: JobSpec, context: Context) -> None:
        """Preflight, then run (or, where the launcher defers, submit and defer) with the
        deadline ``execution_timeout`` leaves."""
        launcher = self.make_launcher()
        if spec.elastic is not None:  # refused, naming why, where ranks cannot come and go
            launcher.check_elastic(spec)
        ti = context.get("ti")
        launcher.journal = JobJournal(
            context.get("task_state_store"), int(getattr(ti, "try_number", 1) or 1), self.log
        )
        self._running = launcher
        try:
            if self.preflight:
                launcher.preflight(spec, self.log)
            spec = dataclasses.replace(spec, timeout=self.job_deadline())
            if launcher.defers:
                ref = launcher.submit(spec, self.log)
                self.defer(
                    trigger=launcher.trigger(ref, spec.timeout),
                    method_name="execute_complete",
                    kwargs={"ref": ref},  # stored in the metadata DB: never secrets
                )
            launcher.run(spec, self.log)
        finally:
            self._running = None

    def collect_result(self) -> dict[str, Any]:
        """Read what the finished job wrote (metrics.json, parity.json) into the XCom dict."""
        raise NotImplementedError

    def execute_complete(
        self, context: Context, event: Mapping[str, Any], ref: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Resume after the MPIJob trigger fired (deferrable kubernetes launcher)."""
        self.finish_deferred(event, ref, context)
        return self.collect_result()

    def finish_deferred(
        self, event: Mapping[str, Any], ref: Mapping[str, Any], context: Context | None = None
    ) -> None:
        """After the trigger fired: surface the job's output (its progress events reach the
        task state store now: nothing read them while deferred), clean up, raise on failure."""
        secrets = list(self.job_env()[1].values())  # to redact the job's output
        launcher = self.make_launcher()
        if context is not None:
            ti = context.get("ti")
            launcher.journal = JobJournal(
                context.get("task_state_store"), int(getattr(ti, "try_number", 1) or 1), self.log
            )
        launcher.finish(dict(ref), dict(event), self.log, secrets=secrets)

    def on_kill(self) -> None:
        """Stop the job this task started; a no-op when none runs (safe to call twice)."""
        launcher = self._running
        if launcher is not None:
            self.log.info("on_kill: stopping the %s job", launcher.name)
            launcher.kill()

    # --- results ----------------------------------------------------------------------
    def read_json(self, uri: str, what: str, schema: Schema | None = None) -> dict[str, Any]:
        """Read a JSON object the job wrote (through the connection's S3 client); with
        ``schema``, the contract it must follow (else :class:`HorovodTrainingError`)."""
        from horovod_airflow.core import storage
        from horovod_airflow.core.contract import ContractError

        try:
            text = storage.read_text(uri, client=self.s3_client_for(uri))
        except storage.TransientStorageError:
            raise  # the store did not answer: the job's output may well be there (retried)
        except storage.StorageError as e:
            raise HorovodTrainingError(
                f"the job exited 0 but {what} is missing at {uri}: the program must write it "
                f"(see docs/design.md, training-program contract): {e}"
            ) from e
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise HorovodTrainingError(f"{what} at {uri} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise HorovodTrainingError(f"{what} at {uri} must be a JSON object, got {data!r:.80}")
        if schema is None:
            return data
        try:
            return schema.check(data, uri)
        except ContractError as e:
            raise HorovodTrainingError(
                f"{e} (see docs/design.md, training-program contract)"
            ) from e

    @staticmethod
    def number_or_none(value: Any, key: str, uri: str) -> float | int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise HorovodOperatorError(f"{key} in {uri} must be a number, got {value!r}")
        return value
