"""What the Horovod operators share: credentials, launcher choice, kill, reading results.

Runs in the Airflow worker. Never imports torch or horovod; providers (amazon, docker,
cncf-kubernetes) are imported when first needed, so a DAG file parses in milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from operators.command import Host, validate_env_name
from operators.connection import AwsConnectionMixin
from operators.exceptions import HorovodOperatorError, HorovodTrainingError
from operators.launchers.base import JobSpec, Launcher
from operators.launchers.kubernetes import STARTUP_TIMEOUT_S, PodOptions, flavour

if TYPE_CHECKING:
    from airflow.sdk import Context

LAUNCHERS = ("local", "docker", "kubernetes")
CLEANUP_POLICIES = ("delete", "keep", "delete_on_success")


def is_templated(value: Any) -> bool:
    """A value still holding Jinja (validated after rendering, in ``execute``)."""
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def check_launcher(launcher: Any, image: Any) -> None:
    """Raise ValueError unless ``launcher`` is known and has the image it needs."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}; got {launcher!r}")
    if launcher in ("docker", "kubernetes") and not image:
        raise ValueError(f"image is required when launcher={launcher!r}")


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


class HorovodJobOperatorBase(AwsConnectionMixin, BaseOperator):
    """Shared machinery of :class:`HorovodTrainOperator` and :class:`HorovodExportOperator`.

    :param launcher: where the job runs: ``"local"`` (horovodrun on the worker),
        ``"docker"`` (one container) or ``"kubernetes"`` (a Kubeflow MPIJob).
    :param aws_conn_id: Airflow AWS connection whose credentials, endpoint and region reach
        the job as the standard ``AWS_*`` variables (secrets masked, never on a command
        line). ``None``: the job uses its own credentials (instance role, files).
    :param env: extra non-secret environment variables for the job (templated).
    :param secret_env: extra secret variables, delivered like the AWS credentials.
    :param image: container image, required by the docker and kubernetes launchers (templated).
    :param gpus_per_proc: GPUs per rank (0 = CPU).
    :param timeout: seconds before the job is stopped (``HorovodTimeoutError``); None: no limit.
    :param preflight: check slots/GPUs and run the trainer's doctor before launching (the
        local launcher remembers a doctor pass per interpreter and installed torch/horovod:
        ``HVA_PREFLIGHT_CACHE``).
    :param docker_conn_id / docker_url: the Docker engine (``docker_url`` defaults to
        ``$DOCKER_HOST`` or the local socket); ``docker_conn_id`` is for registry login.
    :param mounts: docker bind mounts: ``"host:container[:ro]"`` strings or ``docker.types.Mount``.
    :param ipc_mode: docker IPC namespace, default ``"host"`` (Gloo/NCCL shared memory).
    :param shm_size: docker ``/dev/shm`` size when ``ipc_mode`` is not ``"host"``.
    :param kubernetes_conn_id / namespace: the cluster for the MPIJob.
    :param slots_per_worker: ranks per MPIJob worker pod (``num_proc`` must be a multiple).
    :param deferrable: kubernetes only: free the worker slot while the MPIJob runs.
    :param poll_interval: seconds between MPIJob status checks.
    :param cleanup: MPIJob/container policy: ``"delete"``, ``"keep"`` or ``"delete_on_success"``.
    :param force_pull: docker only: pull ``image`` before every job; by default it is pulled
        only when the engine does not have it (with the registry login of ``docker_conn_id``).
    :param service_account / image_pull_policy / image_pull_secrets / node_selector /
        tolerations / priority_class: kubernetes only: set on both MPIJob pods (launcher and
        workers) as ``serviceAccountName``, ``imagePullPolicy`` (``Always``, ``IfNotPresent``,
        ``Never``; None: the cluster's default), ``imagePullSecrets`` (Secret names),
        ``nodeSelector``, ``tolerations`` (dicts) and ``priorityClassName``.
    :param startup_timeout: kubernetes only: seconds the MPIJob's pods may take to start
        (scheduling, image pull) before the task fails naming the pod and the reason; None:
        no limit. An image pull error, a crash loop or a failed pod fails it at once.
    :param worker_resources / launcher_resources: kubernetes only: ``{"requests": {...}, "limits":
        {...}}`` of each worker container (GPUs are not set here: ``gpus_per_proc`` adds
        ``nvidia.com/gpu``) and of the launcher container (horovodrun only; no rank runs there).
    :param kubernetes_api: kubernetes only: ``"mpijob"`` (default: a Kubeflow MPI Operator
        MPIJob) or ``"trainjob"`` (a Kubeflow Trainer v2 TrainJob with its own
        TrainingRuntime); the same pods and settings either way.

    A setting that only another launcher uses (a kubernetes setting with ``launcher="docker"``)
    is refused with ``ValueError`` naming it: at parse time, or after rendering when
    ``launcher`` is templated.
    """

    template_fields: Sequence[str] = ("env", "image")
    template_fields_renderers = {"env": "json"}  # noqa: RUF012 - Airflow's class attribute
    ui_color = "#e8f1fb"

    def __init__(
        self,
        *,
        launcher: str = "local",
        aws_conn_id: str | None = "aws_default",
        env: Mapping[str, str] | None = None,
        secret_env: Mapping[str, str] | None = None,
        image: str | None = None,
        gpus_per_proc: int = 0,
        timeout: float | None = None,
        preflight: bool = True,
        kill_grace_s: float = 15.0,
        rank_env_dir: str | None = None,
        docker_conn_id: str | None = None,
        docker_url: str | None = None,
        mounts: Sequence[Any] = (),
        shm_size: str | None = "1g",
        ipc_mode: str = "host",
        network_mode: str | None = None,
        kubernetes_conn_id: str | None = "kubernetes_default",
        namespace: str | None = None,
        slots_per_worker: int = 1,
        deferrable: bool = False,
        poll_interval: float = 15.0,
        cleanup: str = "delete_on_success",
        force_pull: bool = False,
        service_account: str | None = None,
        image_pull_policy: str | None = None,
        image_pull_secrets: Sequence[str] = (),
        node_selector: Mapping[str, str] | None = None,
        tolerations: Sequence[Mapping[str, Any]] = (),
        priority_class: str | None = None,
        worker_resources: Mapping[str, Mapping[str, Any]] | None = None,
        launcher_resources: Mapping[str, Mapping[str, Any]] | None = None,
        startup_timeout: float | None = STARTUP_TIMEOUT_S,
        kubernetes_api: str = "mpijob",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not is_templated(launcher):
            check_launcher(launcher, image)
        if cleanup not in CLEANUP_POLICIES:
            raise ValueError(
                f"cleanup must be one of {', '.join(CLEANUP_POLICIES)}; got {cleanup!r}"
            )
        if env is not None and not isinstance(env, Mapping) and not is_templated(env):
            raise ValueError(f"env must be a dict of name → value, got {type(env).__name__}")
        if isinstance(env, Mapping):
            for name in env:
                validate_env_name(name, "env")
        for name in secret_env or {}:
            validate_env_name(name, "secret_env")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        self.launcher = launcher
        self.aws_conn_id = aws_conn_id
        self.env = dict(env) if isinstance(env, Mapping) else (env or {})
        self.secret_env = dict(secret_env or {})
        self.image = image
        self.gpus_per_proc = as_int(gpus_per_proc, "gpus_per_proc", minimum=0)
        self.timeout = timeout
        self.preflight = preflight
        self.kill_grace_s = kill_grace_s
        self.rank_env_dir = rank_env_dir
        self.docker_conn_id = docker_conn_id
        self.docker_url = docker_url
        self.mounts = list(mounts)
        self.shm_size = shm_size
        self.ipc_mode = ipc_mode
        self.network_mode = network_mode
        self.kubernetes_conn_id = kubernetes_conn_id
        self.namespace = namespace
        self.slots_per_worker = as_int(slots_per_worker, "slots_per_worker", minimum=1)
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.cleanup = cleanup
        self.force_pull = bool(force_pull)
        self.service_account = service_account
        self.image_pull_policy = image_pull_policy
        self.image_pull_secrets = image_pull_secrets
        self.node_selector = {} if node_selector is None else node_selector
        self.tolerations = tolerations
        self.priority_class = priority_class
        self.worker_resources = {} if worker_resources is None else worker_resources
        self.launcher_resources = {} if launcher_resources is None else launcher_resources
        if startup_timeout is not None and (
            isinstance(startup_timeout, bool)
            or not isinstance(startup_timeout, int | float)
            or startup_timeout <= 0
        ):
            raise ValueError(
                f"startup_timeout must be a positive number of seconds or None, "
                f"got {startup_timeout!r}"
            )
        self.startup_timeout = startup_timeout
        flavour(kubernetes_api)  # raises ValueError naming the allowed values
        self.kubernetes_api = kubernetes_api
        self.pod_options()  # raises ValueError naming a bad kubernetes setting
        self._running: Launcher | None = None
        if not is_templated(launcher):
            self.check_launcher_settings()

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
        if self.launcher == "local":
            return name, {}
        try_number = int(getattr(ti, "try_number", 1) or 1)
        return name, job_labels(dag_id, self.task_id, run_id, try_number, map_index)

    def pod_options(self) -> PodOptions:
        """The kubernetes settings of both MPIJob pods (validated)."""
        return PodOptions(
            service_account=self.service_account,
            image_pull_policy=self.image_pull_policy,
            image_pull_secrets=self.image_pull_secrets,
            node_selector=self.node_selector,
            tolerations=self.tolerations,
            priority_class=self.priority_class,
            worker_resources=self.worker_resources,
            launcher_resources=self.launcher_resources,
        )

    def launcher_only_settings(self) -> dict[str, list[str]]:
        """launcher → the settings given that only that launcher uses."""
        kubernetes = self.pod_options().names_set()
        if self.deferrable:
            kubernetes.append("deferrable")
        if self.startup_timeout != STARTUP_TIMEOUT_S:
            kubernetes.append("startup_timeout")
        if self.kubernetes_api != "mpijob":
            kubernetes.append("kubernetes_api")
        return {"kubernetes": kubernetes}

    def check_launcher_settings(self) -> None:
        """:func:`check_launcher`, and no setting given that the launcher would ignore."""
        check_launcher(self.launcher, self.image)
        for launcher, names in self.launcher_only_settings().items():
            if names and self.launcher != launcher:
                raise ValueError(
                    f"{', '.join(names)}: only used by launcher={launcher!r}, and launcher is "
                    f"{self.launcher!r}; remove {'them' if len(names) > 1 else 'it'}"
                )

    def job_env(self) -> tuple[dict[str, str], dict[str, str]]:
        """(non-secret env, secret env) for the job, from ``env``, the AWS connection and
        ``secret_env``. Secrets are registered with Airflow's masker before anything logs."""
        from airflow.sdk.log import mask_secret

        if not isinstance(self.env, Mapping):  # e.g. a template that rendered to a string
            raise ValueError(f"env must render to a dict of name → value, got {self.env!r:.80}")
        for name in self.env:
            validate_env_name(name, "env")
        public = {str(k): str(v) for k, v in self.env.items()}
        secret = {str(k): str(v) for k, v in self.secret_env.items()}
        if self.aws_conn_id is not None:
            hook = self.s3_hook
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
    def make_launcher(self, hosts: Sequence[Host] = ()) -> Launcher:
        if self.launcher == "local":
            from operators.launchers.local import LocalLauncher

            return LocalLauncher(
                hosts, kill_grace_s=self.kill_grace_s, rank_env_dir=self.rank_env_dir
            )
        if self.launcher == "docker":
            from operators.launchers.docker import DockerLauncher

            return DockerLauncher(
                image=str(self.image),
                docker_conn_id=self.docker_conn_id,
                docker_url=self.docker_url,
                mounts=self.mounts,
                shm_size=self.shm_size,
                ipc_mode=self.ipc_mode,
                network_mode=self.network_mode,
                cleanup=self.cleanup,
                force_pull=self.force_pull,
            )
        from operators.launchers.kubernetes import KubernetesLauncher

        return KubernetesLauncher(
            image=str(self.image),
            kubernetes_conn_id=self.kubernetes_conn_id,
            namespace=self.namespace,
            slots_per_worker=self.slots_per_worker,
            poll_interval=self.poll_interval,
            cleanup=self.cleanup,
            pod_options=self.pod_options(),
            startup_timeout=self.startup_timeout,
            kubernetes_api=self.kubernetes_api,
        )

    def run_job(self, spec: JobSpec, context: Context, hosts: Sequence[Host] = ()) -> None:
        """Preflight, then run (or, for a deferrable MPIJob, submit and defer)."""
        launcher = self.make_launcher(hosts)
        self._running = launcher
        try:
            if self.preflight:
                launcher.preflight(spec, self.log)
            if self.launcher == "kubernetes" and self.deferrable:
                from operators.launchers.kubernetes import KubernetesLauncher
                from operators.triggers import MPIJobTrigger

                assert isinstance(launcher, KubernetesLauncher)
                ref = launcher.submit(spec, self.log)
                self.defer(
                    trigger=MPIJobTrigger(
                        name=ref["name"],
                        namespace=ref["namespace"],
                        kubernetes_conn_id=self.kubernetes_conn_id,
                        poll_interval=self.poll_interval,
                        timeout=spec.timeout,
                        startup_timeout=self.startup_timeout,
                        kubernetes_api=self.kubernetes_api,
                    ),
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
        self.finish_deferred(event, ref)
        return self.collect_result()

    def finish_deferred(self, event: Mapping[str, Any], ref: Mapping[str, Any]) -> None:
        """After the trigger fired: surface the launcher pod's log, clean up, raise on failure."""
        from operators.launchers.kubernetes import KubernetesLauncher

        secrets = list(self.job_env()[1].values())  # to redact the pod log
        launcher = self.make_launcher()
        assert isinstance(launcher, KubernetesLauncher)
        launcher.finish(dict(ref), dict(event), self.log, secrets=secrets)

    def on_kill(self) -> None:
        """Stop the job this task started; a no-op when none runs (safe to call twice)."""
        launcher = self._running
        if launcher is not None:
            self.log.info("on_kill: stopping the %s job", launcher.name)
            launcher.kill()

    # --- results ----------------------------------------------------------------------
    def read_json(self, uri: str, what: str) -> dict[str, Any]:
        """Read a JSON object the job wrote (through the connection's S3 client)."""
        from trainer import storage

        try:
            text = storage.read_text(uri, client=self.s3_client_for(uri))
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
        return data

    @staticmethod
    def number_or_none(value: Any, key: str, uri: str) -> float | int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise HorovodOperatorError(f"{key} in {uri} must be a number, got {value!r}")
        return value
