"""Run the job as a Kubeflow MPIJob (``kubeflow.org/v2beta1``): one launcher pod running
``horovodrun`` over ssh to ``num_proc / slots_per_worker`` worker pods.

Both run the trainer image as its user (uid 1000): each worker is the image's sshd on port
2222 (``WORKER_COMMAND``), the MPI Operator mounts the job's key pair in that user's ``~/.ssh``
(``sshAuthMountPath``), and horovodrun connects with ``-p 2222``.

The cluster client comes from the cncf-kubernetes provider's ``KubernetesHook``. Credentials
never appear in the manifest: they go into a Kubernetes Secret (owned by the MPIJob, so it
is garbage-collected with it) that is mounted as the private rank env file
(``HVA_RANK_ENV_FILE``) in every pod; each rank sources it just before it starts (see
``horovod_airflow.operators.command``). Waiting is done by polling here, or — with
``deferrable=True`` on
the operator — by :class:`horovod_airflow.operators.triggers.MPIJobTrigger`, freeing the worker
slot.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import math
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from horovod_airflow.operators.command import (
    RANK_ENV_FILE_VAR,
    Host,
    horovodrun_argv,
    rank_env_file_text,
)
from horovod_airflow.operators.exceptions import (
    HorovodConfigError,
    HorovodImageError,
    HorovodLaunchError,
    HorovodTimeoutError,
    HorovodTrainingError,
    JobNotOursError,
)
from horovod_airflow.operators.launchers.base import (
    JOB_LABEL,
    JobResult,
    JobSpec,
    Launcher,
    LogTail,
    describe_failure,
    made_by_this_task,
)

GROUP, VERSION, PLURAL = "kubeflow.org", "v2beta1", "mpijobs"
DELETE_WAIT_S = 300.0  # how long a retry waits for the earlier try's job to be deleted
# Waiting out a flaky API server: consecutive transient errors (5xx, 429, connection) tolerated
# while a job is watched, and the backoff between them (doubling: 1, 2, 4, 8, 16 s, ≤ 30 s).
STARTUP_TIMEOUT_S = 600.0  # default: how long the job's pods may take to start
# Container states that a pod does not recover from by waiting (kubelet backs off and retries
# forever): the job fails at once with the reason, as the cncf-kubernetes provider's
# custom_object_launcher.check_pod_start_failure does.
START_FAILURES = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CrashLoopBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
#: The START_FAILURES that mean the image cannot be pulled (no retry cures them).
IMAGE_FAILURES = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
)
API_RETRIES = 5
API_BACKOFF_S = 1.0
API_BACKOFF_MAX_S = 30.0
SECRET_MOUNT = "/etc/hva-rank-env"
SECRET_KEY = "rank.env"
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
JOB_ROLE_LABEL = "training.kubeflow.org/job-role"
# Kubeflow Trainer v2 (kubernetes_api="trainjob"): a TrainJob and its own TrainingRuntime,
# which Trainer turns into a JobSet (replicated jobs "node" and "launcher") that labels its pods.
TRAINER_GROUP, TRAINER_VERSION = "trainer.kubeflow.org", "v1alpha1"
TRAINJOB_LAUNCHER, TRAINJOB_NODE = "launcher", "node"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOBSET_ROLE_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"

# The trainer image as an MPIJob pod: docker/trainer.Dockerfile installs sshd and
# docker/trainer-sshd_config; tests/operators/test_kubernetes_launcher.py checks these values
# against those two files, so the image and the manifest cannot drift apart.
TRAINER_HOME = "/home/trainer"  # the home of the image's user (uid 1000)
# Where the MPI Operator mounts the job's key pair (id_rsa, id_rsa.pub, authorized_keys): the
# user's ~/.ssh, so the launcher's ssh finds its key there and the worker's sshd serves it.
SSH_AUTH_MOUNT_PATH = f"{TRAINER_HOME}/.ssh"
# The group of the image's user: both pods set it as fsGroup, so the kubelet gives the mounted
# Secrets' files to that group with group read. Without it they belong to root, and the
# credentials file (mode 0400) cannot be read by the ranks, which run as the image's user.
TRAINER_GID = 1000
TRAINER_UID = 1000
#: Both pods run restricted (the Pod Security Standards' "restricted" profile): as the
#: image's non-root user, the runtime's default seccomp profile, no privilege escalation, no
#: capability; a worker's sshd needs none (port 2222, it logs in only its own user).
POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": TRAINER_UID,
    "runAsGroup": TRAINER_GID,
    "fsGroup": TRAINER_GID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
WORKER_SSH_PORT = 2222  # a non-root sshd cannot bind port 22
# The pod's network interface: the kubelet names it eth0 whatever the CNI plugin. horovodrun
# is told to use it (--network-interface): left to probe, it also accepts the loopback when
# the job has one worker pod (the probe on that pod reaches itself over lo), and then picks
# one of the interfaces it found at random (the first of a set). When that is lo, the
# ranks look for the rendezvous server at 127.0.0.1 of their own pod and abort
# ("HTTP GET request failed too many times"). One-worker jobs (the one-rank export, or
# num_proc == slots_per_worker) failed that way about every other run.
POD_INTERFACE = "eth0"
WORKER_SSHD_CONFIG = "/etc/ssh/hva_worker_sshd_config"
# A worker is only an sshd in the foreground (-D), logging to stderr (-e), i.e. to the pod log;
# horovodrun in the launcher pod starts the ranks through it.
WORKER_COMMAND: tuple[str, ...] = ("/usr/sbin/sshd", "-De", "-f", WORKER_SSHD_CONFIG)


def KubernetesHook(**kwargs: Any) -> Any:
    """The provider's ``KubernetesHook``, imported when first used (tests patch this name)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import (
        KubernetesHook as _KubernetesHook,
    )

    return _KubernetesHook(**kwargs)


PULL_POLICIES = ("Always", "IfNotPresent", "Never")
RESOURCE_KINDS = ("requests", "limits")
GPU_RESOURCE = "nvidia.com/gpu"
TOLERATION_KEYS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})


def _check_resources(value: Any, name: str, *, gpus_allowed: bool) -> None:
    if not isinstance(value, Mapping) or not set(value) <= set(RESOURCE_KINDS):
        raise ValueError(
            f"{name} must be a dict with 'requests' and/or 'limits' (e.g. "
            f"{{'requests': {{'cpu': '4', 'memory': '16Gi'}}}}), got {value!r}"
        )
    for kind, amounts in value.items():
        if not isinstance(amounts, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str | int | float) and not isinstance(v, bool)
            for k, v in amounts.items()
        ):
            raise ValueError(
                f"{name}[{kind!r}] must map resource names to quantities, got {amounts!r}"
            )
        if not gpus_allowed and GPU_RESOURCE in amounts:
            raise ValueError(
                f"{name}[{kind!r}] sets {GPU_RESOURCE}: GPUs come from gpus_per_proc "
                f"(× slots_per_worker per worker pod)"
            )


@dataclass(frozen=True)
class PodOptions:
    """Settings of both MPIJob pod templates (launcher and workers), validated on creation."""

    service_account: str | None = None  # serviceAccountName of both pods
    image_pull_policy: str | None = None  # Always | IfNotPresent | Never; None: the cluster's
    image_pull_secrets: Sequence[str] = ()  # names of registry Secrets in the namespace
    node_selector: Mapping[str, str] = field(default_factory=dict)  # nodeSelector of both pods
    tolerations: Sequence[Mapping[str, Any]] = ()  # tolerations of both pods
    priority_class: str | None = None  # priorityClassName of both pods
    worker_resources: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    launcher_resources: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # the pods get a service-account token only when asked (nothing in them calls the API)
    mount_service_account_token: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.mount_service_account_token, bool):
            raise ValueError(
                f"mount_service_account_token must be True or False, got "
                f"{self.mount_service_account_token!r}"
            )
        for name in ("service_account", "priority_class"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        if self.image_pull_policy is not None and self.image_pull_policy not in PULL_POLICIES:
            raise ValueError(
                f"image_pull_policy must be one of {', '.join(PULL_POLICIES)} or None, "
                f"got {self.image_pull_policy!r}"
            )
        secrets = self.image_pull_secrets
        if isinstance(secrets, str) or not all(isinstance(n, str) and n for n in secrets):
            raise ValueError(f"image_pull_secrets must be a list of Secret names, got {secrets!r}")
        if not isinstance(self.node_selector, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.node_selector.items()
        ):
            raise ValueError(
                f"node_selector must be a dict of label → value strings, got {self.node_selector!r}"
            )
        if isinstance(self.tolerations, Mapping | str):
            raise ValueError(f"tolerations must be a list of dicts, got {self.tolerations!r}")
        for toleration in self.tolerations:
            if not isinstance(toleration, Mapping) or not set(toleration) <= TOLERATION_KEYS:
                raise ValueError(
                    f"tolerations entry {toleration!r} must be a dict of "
                    f"{', '.join(sorted(TOLERATION_KEYS))}"
                )
        _check_resources(self.worker_resources, "worker_resources", gpus_allowed=False)
        _check_resources(self.launcher_resources, "launcher_resources", gpus_allowed=True)

    def names_set(self) -> list[str]:
        """The settings given (every default is empty), to refuse them off Kubernetes."""
        return [f.name for f in fields(self) if getattr(self, f.name)]

    def apply(self, pod_spec: dict[str, Any], container: dict[str, Any]) -> None:
        """Put the settings shared by both pods into a pod spec and its container."""
        if self.service_account:
            pod_spec["serviceAccountName"] = self.service_account
        if self.image_pull_secrets:
            pod_spec["imagePullSecrets"] = [{"name": n} for n in self.image_pull_secrets]
        if self.node_selector:
            pod_spec["nodeSelector"] = dict(self.node_selector)
        if self.tolerations:
            pod_spec["tolerations"] = [dict(t) for t in self.tolerations]
        if self.priority_class:
            pod_spec["priorityClassName"] = self.priority_class
        if self.image_pull_policy:
            container["imagePullPolicy"] = self.image_pull_policy


CLEANUP_POLICIES = ("delete", "keep", "delete_on_success")


@dataclass(frozen=True)
class KubernetesOptions(PodOptions):
    """Settings of ``launcher="kubernetes"`` (a Kubeflow MPIJob or TrainJob): the pod settings
    of :class:`PodOptions` (``service_account``, ``image_pull_policy``, ``image_pull_secrets``,
    ``node_selector``, ``tolerations``, ``priority_class``, ``worker_resources``,
    ``launcher_resources``: set on both pods) and:

    :param kubernetes_conn_id / namespace: the cluster; None namespace: the connection's.
    :param kubernetes_api: ``"mpijob"`` (default: a Kubeflow MPI Operator MPIJob) or
        ``"trainjob"`` (a Kubeflow Trainer v2 TrainJob with its own TrainingRuntime); the same
        pods and settings either way.
    :param slots_per_worker: ranks per worker pod (``num_proc`` must be a multiple; a
        one-process export uses one slot on one worker pod).
    :param cleanup: ``"delete"``, ``"keep"`` or ``"delete_on_success"`` (the credential
        Secret never outlives a finished job).
    :param deferrable: free the Airflow worker slot while the MPIJob runs (a trigger waits).
    :param poll_interval: seconds between MPIJob status checks.
    :param startup_timeout: seconds the pods may take to start (scheduling, image pull)
        before the task fails naming the pod and the reason; None: no limit.
    :param mpijob_overrides: a dict deep-merged into the MPIJob manifest last (dicts merge
        key by key; lists of named dicts such as ``containers``, ``env``, ``volumes`` merge by
        ``name``; other lists and values replace), e.g. ``{"spec": {"mpiReplicaSpecs":
        {"Worker": {"template": {"spec": {"hostIPC": True}}}}}}``. What the launcher owns
        (``OWNED_MPIJOB_PATHS``: the job's name, namespace, command, image, replicas, slots,
        deadline) is refused when the merge would change it. MPIJob only.
    :param trainjob_overrides: the same escape hatch for ``kubernetes_api="trainjob"``, per
        manifest kind: ``{"TrainingRuntime": {...}, "TrainJob": {...}}`` (either or both), each
        deep-merged into that manifest last, e.g. ``{"TrainingRuntime": {"spec": {"template":
        {"spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template":
        {"spec": {"hostIPC": True}}}}}]}}}}}``. What the launcher owns
        (``OWNED_TRAINJOB_PATHS``: names, namespaces, the runtime reference, node count, ranks
        per node, parallelism, command, image, deadline) is refused when the merge would change
        it. TrainJob only.

    The workers' sshd port is the image's (``WORKER_SSH_PORT``, checked against
    ``docker/trainer-sshd_config``), not an option.
    """

    kubernetes_conn_id: str | None = "kubernetes_default"
    namespace: str | None = None
    slots_per_worker: int = 1
    cleanup: str = "delete_on_success"
    deferrable: bool = False
    poll_interval: float = 15.0
    startup_timeout: float | None = STARTUP_TIMEOUT_S
    mpijob_overrides: Mapping[str, Any] = field(default_factory=dict)
    kubernetes_api: str = "mpijob"
    trainjob_overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        flavour(self.kubernetes_api)  # raises ValueError naming the allowed values
        for name in ("kubernetes_conn_id", "namespace"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        slots = self.slots_per_worker
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots_per_worker must be an integer ≥ 1, got {slots!r}")
        if self.cleanup not in CLEANUP_POLICIES:
            raise ValueError(
                f"cleanup must be one of {', '.join(CLEANUP_POLICIES)}; got {self.cleanup!r}"
            )
        if not isinstance(self.deferrable, bool):
            raise ValueError(f"deferrable must be True or False, got {self.deferrable!r}")
        for name, optional in (("poll_interval", False), ("startup_timeout", True)):
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(
                    f"{name} must be a positive number of seconds"
                    f"{' or None' if optional else ''}, got {value!r}"
                )
        if not isinstance(self.mpijob_overrides, Mapping):
            raise ValueError(f"mpijob_overrides must be a dict, got {self.mpijob_overrides!r}")
        trainjob = self.trainjob_overrides
        if not isinstance(trainjob, Mapping) or any(
            kind not in OWNED_TRAINJOB_PATHS or not isinstance(value, Mapping)
            for kind, value in trainjob.items()
        ):
            raise ValueError(
                f"trainjob_overrides must be a dict of manifest kind "
                f"({' or '.join(map(repr, OWNED_TRAINJOB_PATHS))}) → dict, got {trainjob!r}"
            )
        for name, api in (("mpijob_overrides", "mpijob"), ("trainjob_overrides", "trainjob")):
            if getattr(self, name) and self.kubernetes_api != api:
                raise ValueError(
                    f"{name} applies to kubernetes_api={api!r} only, and kubernetes_api is "
                    f"{self.kubernetes_api!r}; remove it"
                    f"{' (use trainjob_overrides)' if api == 'mpijob' else ''}"
                )

    def pod_options(self) -> PodOptions:
        """The :class:`PodOptions` part (what both pod templates get)."""
        return PodOptions(**{f.name: getattr(self, f.name) for f in fields(PodOptions)})


def _named(items: Any) -> bool:
    return isinstance(items, list) and all(
        isinstance(i, Mapping) and isinstance(i.get("name"), str) for i in items
    )


def deep_merge(base: Any, override: Any) -> Any:
    """``override`` merged into ``base`` (neither is changed): dicts key by key, lists of
    named dicts (containers, env, volumes) by ``name``, anything else replaced."""
    if isinstance(base, Mapping) and isinstance(override, Mapping):
        merged = {k: copy.deepcopy(v) for k, v in base.items()}
        for key, value in override.items():
            merged[key] = deep_merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    if _named(base) and _named(override):
        by_name = {item["name"]: item for item in override}
        merged_list = [deep_merge(item, by_name.pop(item["name"], {})) for item in base]
        return merged_list + [copy.deepcopy(item) for item in override if item["name"] in by_name]
    return copy.deepcopy(override)


def _get(obj: Any, path: Sequence[str]) -> Any:
    for key in path:
        if isinstance(obj, list):
            obj = next((i for i in obj if isinstance(i, Mapping) and i.get("name") == key), None)
        elif isinstance(obj, Mapping):
            obj = obj.get(key)
        else:
            return None
    return obj


_ROLES = {"Launcher": "launcher", "Worker": "worker"}
#: What ``mpijob_overrides`` may not change (path → what owns it). A path segment inside a
#: list of named dicts is the item's ``name``.
OWNED_MPIJOB_PATHS: dict[tuple[str, ...], str] = {
    ("apiVersion",): "the MPI Operator API this launcher speaks",
    ("kind",): "the MPI Operator API this launcher speaks",
    ("metadata", "name"): "the job name (a retry finds its job by it)",
    ("metadata", "namespace"): "KubernetesOptions.namespace",
    ("spec", "slotsPerWorker"): "KubernetesOptions.slots_per_worker",
    ("spec", "runPolicy", "activeDeadlineSeconds"): "the operator's execution_timeout",
    **{
        ("spec", "mpiReplicaSpecs", replica, "replicas"): "num_proc / slots_per_worker"
        for replica in _ROLES
    },
    **{
        ("spec", "mpiReplicaSpecs", replica, "template", "spec", "containers", c, key): what
        for replica, c in _ROLES.items()
        for key, what in (("command", "the job's command"), ("image", "the operator's image"))
    },
}


_TRAINJOB_ROLE_CONTAINERS = {TRAINJOB_NODE: TRAINJOB_NODE, TRAINJOB_LAUNCHER: TRAINJOB_LAUNCHER}
_RUNTIME_JOBS = ("spec", "template", "spec", "replicatedJobs")
_TRAINER_API = "the Trainer API this launcher speaks"
#: What ``trainjob_overrides`` may not change, per manifest kind (path → what owns it); a
#: path segment inside a list of named dicts (``replicatedJobs``, ``containers``) is the
#: item's ``name``.
OWNED_TRAINJOB_PATHS: dict[str, dict[tuple[str, ...], str]] = {
    "TrainingRuntime": {
        ("apiVersion",): _TRAINER_API,
        ("kind",): _TRAINER_API,
        ("metadata", "name"): "the job name (the TrainJob's runtimeRef names it)",
        ("metadata", "namespace"): "KubernetesOptions.namespace",
        ("spec", "mlPolicy", "numNodes"): "num_proc / slots_per_worker",
        ("spec", "mlPolicy", "mpi", "numProcPerNode"): "KubernetesOptions.slots_per_worker",
        **{
            (*_RUNTIME_JOBS, job, "template", "spec", key): "num_proc / slots_per_worker"
            for job in _TRAINJOB_ROLE_CONTAINERS
            for key in ("parallelism", "completions")
        },
        **{
            (*_RUNTIME_JOBS, job, "template", "spec", "template", "spec", "containers", c, key): (
                what
            )
            for job, c in _TRAINJOB_ROLE_CONTAINERS.items()
            for key, what in (("command", "the job's command"), ("image", "the operator's image"))
        },
    },
    "TrainJob": {
        ("apiVersion",): _TRAINER_API,
        ("kind",): _TRAINER_API,
        ("metadata", "name"): "the job name (a retry finds its job by it)",
        ("metadata", "namespace"): "KubernetesOptions.namespace",
        ("spec", "runtimeRef"): "the job's own TrainingRuntime",
        ("spec", "trainer", "numNodes"): "num_proc / slots_per_worker",
        ("spec", "activeDeadlineSeconds"): "the operator's execution_timeout",
    },
}


def apply_overrides(
    manifest: dict[str, Any],
    overrides: Mapping[str, Any],
    owned: Mapping[tuple[str, ...], str],
    option: str,
) -> dict[str, Any]:
    """``overrides`` deep-merged into ``manifest``; ValueError naming ``option`` and an owned
    path it changes."""
    if not overrides:
        return manifest
    merged = deep_merge(manifest, overrides)
    for path, owner in owned.items():
        if _get(merged, path) != _get(manifest, path):
            raise ValueError(
                f"{option} sets {'.'.join(path)}, which the launcher sets from {owner}"
            )
    return dict(merged)


def apply_mpijob_overrides(
    manifest: dict[str, Any], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """``overrides`` deep-merged into the MPIJob ``manifest``; ValueError naming an owned path
    it changes."""
    return apply_overrides(manifest, overrides, OWNED_MPIJOB_PATHS, "mpijob_overrides")


def is_transient(error: BaseException) -> bool:
    """An API error worth another look: HTTP 5xx or 429, or no answer (connection refused or
    reset, timeout). A 4xx (404: the job is gone, 403: no permission) is not."""
    import urllib3.exceptions
    from kubernetes.client.exceptions import ApiException

    if isinstance(error, ApiException):
        status = error.status or 0
        return status == 429 or status >= 500
    return isinstance(
        error,
        urllib3.exceptions.MaxRetryError
        | urllib3.exceptions.ProtocolError
        | urllib3.exceptions.TimeoutError
        | urllib3.exceptions.NewConnectionError
        | ConnectionError
        | TimeoutError,
    )


class ApiRetry:
    """Counts consecutive transient API errors while a job is watched: how long to back off
    before the next look, or None to give up (not transient, or too many in a row)."""

    def __init__(
        self,
        retries: int = API_RETRIES,
        backoff: float = API_BACKOFF_S,
        max_backoff: float = API_BACKOFF_MAX_S,
    ) -> None:
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.failures = 0

    def delay(self, error: BaseException) -> float | None:
        if not is_transient(error):
            return None
        self.failures += 1
        if self.failures > self.retries:
            return None
        return float(min(self.max_backoff, self.backoff * 2 ** (self.failures - 1)))

    def reset(self) -> None:
        self.failures = 0

    def describe(self, error: BaseException) -> str:
        """The message of the event that gives up."""
        if not is_transient(error):
            return f"Kubernetes API error: {error}"
        return f"{self.failures} Kubernetes API errors in a row (last: {error})"


def _pod_role(pod: Any) -> str:
    labels = getattr(getattr(pod, "metadata", None), "labels", None) or {}
    return str(
        labels.get(JOB_ROLE_LABEL) or labels.get(JOBSET_ROLE_LABEL) or labels.get("role") or ""
    )


def _pod_name(pod: Any) -> str:
    return str(getattr(getattr(pod, "metadata", None), "name", "") or "?")


def _pod_phase(pod: Any) -> str:
    return str(getattr(getattr(pod, "status", None), "phase", "") or "Pending")


def _why_pending(pod: Any) -> str:
    """A Pending pod's reason: unschedulable (the scheduler's message) or a waiting container."""
    status = getattr(pod, "status", None)
    for cond in getattr(status, "conditions", None) or []:
        if getattr(cond, "type", "") == "PodScheduled" and getattr(cond, "status", "") == "False":
            return (
                f"{getattr(cond, 'reason', '') or 'not scheduled'}: {getattr(cond, 'message', '')}"
            )
    for cs in getattr(status, "container_statuses", None) or []:
        waiting = getattr(getattr(cs, "state", None), "waiting", None)
        if waiting is not None and getattr(waiting, "reason", None):
            return f"{waiting.reason}: {getattr(waiting, 'message', '') or ''}".rstrip(": ")
    return "Pending"


def pod_start_failure(
    pods: Sequence[Any],
    name: str,
    *,
    elapsed: float,
    startup_timeout: float | None,
    kind: str = "MPIJob",
    operator: str = "the MPI Operator",
) -> tuple[str | None, bool]:
    """(why the job (``kind``) ``name`` cannot start, or None; whether it has started).

    It has started once its launcher pod left Pending (the MPI Operator, or JobSet's in-order
    start-up, creates the launcher when every worker is ready). Before that, a container in a
    ``START_FAILURES`` state or a pod that failed ends the job at once; a pod still Pending,
    or no pod at all, ends it after ``startup_timeout`` seconds (None: never). The message
    names the pod and the reason.
    """
    if any(_pod_role(p) == "launcher" and _pod_phase(p) != "Pending" for p in pods):
        return None, True
    for pod in sorted(pods, key=_pod_name):
        status = getattr(pod, "status", None)
        if _pod_phase(pod) == "Failed":
            why = getattr(status, "message", None) or getattr(status, "reason", None) or ""
            return f"pod {_pod_name(pod)} failed before the job started: {why}".rstrip(": "), False
        statuses = [
            *(getattr(status, "init_container_statuses", None) or []),
            *(getattr(status, "container_statuses", None) or []),
        ]
        for cs in statuses:
            waiting = getattr(getattr(cs, "state", None), "waiting", None)
            reason = getattr(waiting, "reason", None)
            if reason in START_FAILURES:
                message = getattr(waiting, "message", None) or ""
                return (
                    f"pod {_pod_name(pod)} (container {getattr(cs, 'name', '?')}): "
                    f"{reason}: {message}".rstrip(": "),
                    False,
                )
    if startup_timeout is None or elapsed <= startup_timeout:
        return None, False
    late = f"after {elapsed:.0f}s (startup_timeout={startup_timeout:.0f}s)"
    if not pods:
        return f"no pod of {kind} {name} {late}: is {operator} running?", False
    for pod in sorted(pods, key=_pod_name):
        if _pod_phase(pod) == "Pending":
            return f"pod {_pod_name(pod)} still Pending {late}: {_why_pending(pod)}", False
    workers = ", ".join(f"{_pod_name(p)} {_pod_phase(p)}" for p in sorted(pods, key=_pod_name))
    return f"the launcher pod of {kind} {name} was not created {late} (pods: {workers})", False


def _phase(obj: Mapping[str, Any] | None, succeeded: str) -> tuple[str, str]:
    """(``"succeeded"`` | ``"failed"`` | ``"running"``, message) from a job's conditions: the
    first true ``succeeded`` or ``Failed`` condition ends it."""
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    for cond in conditions:
        if cond.get("status") != "True":
            continue
        if cond.get("type") == succeeded:
            return "succeeded", str(cond.get("message") or "")
        if cond.get("type") == "Failed":
            reason = cond.get("reason") or ""
            return "failed", f"{reason}: {cond.get('message') or ''}".strip(": ")
    return "running", ""


def mpijob_phase(obj: Mapping[str, Any] | None) -> tuple[str, str]:
    """(``"succeeded"`` | ``"failed"`` | ``"running"``, message) from an MPIJob's conditions."""
    return _phase(obj, "Succeeded")


def mpijob_hosts(obj: Mapping[str, Any] | None) -> list[Host]:
    """The ``-H`` hosts of an MPIJob's launcher command (worker pods' names, slots each), so
    a failure can name the pod of the rank that failed first; [] when they cannot be read."""
    try:
        spec = (obj or {})["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
        return launcher_command_hosts(spec)
    except (KeyError, IndexError, TypeError, ValueError):
        return []


def runtime_hosts(obj: Mapping[str, Any] | None) -> list[Host]:
    """The ``-H`` hosts of a TrainingRuntime's launcher command; [] when unreadable."""
    try:
        for job in (obj or {})["spec"]["template"]["spec"]["replicatedJobs"]:
            if job["name"] == TRAINJOB_LAUNCHER:
                return launcher_command_hosts(job["template"]["spec"]["template"]["spec"])
    except (KeyError, IndexError, TypeError, ValueError):
        pass
    return []


def secret_name(job: str) -> str:
    return f"{job}-rank-env"


def job_labels(spec: JobSpec) -> dict[str, str]:
    """The labels of the MPIJob, its pods and its Secret: the task instance's (``dag_id``,
    ``task_id``, ``run_id``, ``try_number``) and the job's name."""
    return {**spec.labels, JOB_LABEL: spec.name}


def _pod_templates(
    spec: JobSpec,
    *,
    image: str,
    hosts: Sequence[Host],
    slots_per_worker: int,
    pod_options: PodOptions | None,
    launcher_name: str,
    worker_name: str,
    restart_policy: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(launcher, worker) pod templates, the same for both flavours: the launcher runs
    horovodrun over ssh (port 2222) to ``hosts``; a worker is the image's sshd as its user.
    ``restart_policy`` goes into the pod spec (a JobSet's Jobs need it there; the MPIJob sets
    it per replica)."""
    command = horovodrun_argv(
        spec.argv,
        num_proc=spec.num_proc,
        hosts=hosts,
        ssh_port=WORKER_SSH_PORT,
        network_interface=POD_INTERFACE,
        controller=spec.controller,
    )
    env = [{"name": k, "value": str(v)} for k, v in sorted(spec.env.items())]
    env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if spec.secret_env:
        env.append({"name": RANK_ENV_FILE_VAR, "value": f"{SECRET_MOUNT}/{SECRET_KEY}"})
        volumes.append(
            {
                "name": "rank-env",
                "secret": {"secretName": secret_name(spec.name), "defaultMode": 0o400},
            }
        )
        mounts.append({"name": "rank-env", "mountPath": SECRET_MOUNT, "readOnly": True})
    gpus = spec.gpus_per_proc * slots_per_worker
    options = pod_options or PodOptions()
    labels = job_labels(spec)

    def pod(role: str, container: dict[str, Any]) -> dict[str, Any]:
        container["securityContext"] = dict(CONTAINER_SECURITY)
        pod_spec: dict[str, Any] = {
            "containers": [container],
            "volumes": volumes,
            "securityContext": dict(POD_SECURITY),
            "automountServiceAccountToken": options.mount_service_account_token,
        }
        if restart_policy:
            pod_spec["restartPolicy"] = restart_policy
        options.apply(pod_spec, container)
        return {"metadata": {"labels": {**labels, "role": role}}, "spec": pod_spec}

    worker_container: dict[str, Any] = {
        "name": worker_name,
        "image": image,
        "command": list(WORKER_COMMAND),
        "env": env,
        "volumeMounts": mounts,
        # Ready once sshd listens: the launcher is started only when every worker is ready
        # (MPIJob: launcherCreationPolicy WaitForWorkersReady; JobSet: startupPolicy InOrder).
        # Each probe is a connection sshd logs (-e: the pod log), hence every 5 s.
        "readinessProbe": {"tcpSocket": {"port": WORKER_SSH_PORT}, "periodSeconds": 5},
    }
    worker_resources = {kind: dict(amounts) for kind, amounts in options.worker_resources.items()}
    if gpus:
        worker_resources.setdefault("limits", {})[GPU_RESOURCE] = gpus
    if worker_resources:
        worker_container["resources"] = worker_resources
    launcher_container: dict[str, Any] = {
        "name": launcher_name,
        "image": image,
        "command": command,
        "env": env,
        "volumeMounts": mounts,
    }
    if options.launcher_resources:
        launcher_container["resources"] = {
            kind: dict(amounts) for kind, amounts in options.launcher_resources.items()
        }
    return pod("launcher", launcher_container), pod("worker", worker_container)


def _workers(spec: JobSpec, slots_per_worker: int, kind: str) -> int:
    if spec.num_proc % slots_per_worker:
        # a setting no retry changes: a config error (not retried), not a plain ValueError
        raise HorovodConfigError(
            f"num_proc={spec.num_proc} is not a multiple of slots_per_worker="
            f"{slots_per_worker}: each {kind} worker runs exactly slots_per_worker ranks"
        )
    return spec.num_proc // slots_per_worker


def build_mpijob(
    spec: JobSpec,
    *,
    image: str,
    namespace: str,
    slots_per_worker: int,
    pod_options: PodOptions | None = None,
) -> dict[str, Any]:
    """The MPIJob manifest for a horovodrun job. ``spec.argv`` is the program's command."""
    workers = _workers(spec, slots_per_worker, "MPIJob")
    name = spec.name
    hosts = [
        Host(f"{name}-worker-{i}.{name}.{namespace}.svc", slots_per_worker) for i in range(workers)
    ]
    launcher_pod, worker_pod = _pod_templates(
        spec,
        image=image,
        hosts=hosts,
        slots_per_worker=slots_per_worker,
        pod_options=pod_options,
        launcher_name="launcher",
        worker_name="worker",
    )
    run_policy: dict[str, Any] = {"cleanPodPolicy": "Running", "backoffLimit": 0}
    if spec.timeout:
        run_policy["activeDeadlineSeconds"] = int(spec.timeout)
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "MPIJob",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": job_labels(spec),
        },
        "spec": {
            "slotsPerWorker": slots_per_worker,
            "sshAuthMountPath": SSH_AUTH_MOUNT_PATH,
            "runPolicy": run_policy,
            "launcherCreationPolicy": "WaitForWorkersReady",
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "restartPolicy": "Never", "template": launcher_pod},
                "Worker": {"replicas": workers, "restartPolicy": "Never", "template": worker_pod},
            },
        },
    }


def trainjob_hosts_names(name: str, namespace: str, workers: int) -> list[str]:
    """The node pods' DNS names: JobSet names pod ``i`` of the first (only) Job of replicated
    job ``node`` ``<jobset>-node-0-<i>`` and puts it in the headless Service ``<jobset>``
    (the JobSet, and so the Service, is named after the TrainJob)."""
    return [f"{name}-{TRAINJOB_NODE}-0-{i}.{name}.{namespace}.svc" for i in range(workers)]


def build_trainjob(
    spec: JobSpec,
    *,
    image: str,
    namespace: str,
    slots_per_worker: int,
    pod_options: PodOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(TrainingRuntime, TrainJob) of Kubeflow Trainer v2 (``trainer.kubeflow.org/v1alpha1``)
    for a horovodrun job: the same pods as :func:`build_mpijob`'s.

    The runtime is the job's own (same name, same namespace; the launcher makes the TrainJob
    own it once created): its ``mlPolicy.mpi`` has Trainer's MPI plugin make the ssh key pair
    (mounted at ``sshAuthMountPath``) and ``/etc/mpi/hostfile``; its JobSet template has a
    ``node`` replicated job (the sshd workers, ``numNodes`` pods) started before the
    ``launcher`` one (``startupPolicyOrder: InOrder``: each waits until the one before is
    ready), and the JobSet succeeds when the launcher does.
    """
    workers = _workers(spec, slots_per_worker, "TrainJob")
    name = spec.name
    hosts = [Host(h, slots_per_worker) for h in trainjob_hosts_names(name, namespace, workers)]
    launcher_pod, worker_pod = _pod_templates(
        spec,
        image=image,
        hosts=hosts,
        slots_per_worker=slots_per_worker,
        pod_options=pod_options,
        launcher_name=TRAINJOB_LAUNCHER,
        worker_name=TRAINJOB_NODE,
        restart_policy="Never",
    )
    labels = job_labels(spec)
    runtime = {
        "apiVersion": f"{TRAINER_GROUP}/{TRAINER_VERSION}",
        "kind": "TrainingRuntime",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "mlPolicy": {
                "numNodes": workers,
                "mpi": {
                    "mpiImplementation": "OpenMPI",
                    "numProcPerNode": slots_per_worker,
                    "sshAuthMountPath": SSH_AUTH_MOUNT_PATH,
                    "runLauncherAsNode": False,
                },
            },
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "startupPolicy": {"startupPolicyOrder": "InOrder"},
                    "successPolicy": {
                        "operator": "All",
                        "targetReplicatedJobs": [TRAINJOB_LAUNCHER],
                    },
                    "failurePolicy": {"maxRestarts": 0},
                    "replicatedJobs": [
                        {
                            "name": TRAINJOB_NODE,
                            "replicas": 1,
                            "template": {
                                "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                                "spec": {
                                    "parallelism": workers,
                                    "completions": workers,
                                    "backoffLimit": 0,
                                    "template": worker_pod,
                                },
                            },
                        },
                        {
                            "name": TRAINJOB_LAUNCHER,
                            "replicas": 1,
                            "template": {
                                "spec": {
                                    "parallelism": 1,
                                    "completions": 1,
                                    "backoffLimit": 0,
                                    "template": launcher_pod,
                                }
                            },
                        },
                    ],
                },
            },
        },
    }
    trainjob_spec: dict[str, Any] = {
        "runtimeRef": {
            "apiGroup": TRAINER_GROUP,
            "kind": "TrainingRuntime",
            "name": name,
        },
        "trainer": {"numNodes": workers},
    }
    if spec.timeout:
        trainjob_spec["activeDeadlineSeconds"] = int(spec.timeout)
    trainjob = {
        "apiVersion": f"{TRAINER_GROUP}/{TRAINER_VERSION}",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": trainjob_spec,
    }
    return runtime, trainjob


def trainjob_phase(obj: Mapping[str, Any] | None) -> tuple[str, str]:
    """(``"succeeded"`` | ``"failed"`` | ``"running"``, message) from a TrainJob's conditions
    (``Complete`` or ``Failed`` with status True ends it)."""
    return _phase(obj, "Complete")


def launcher_command_hosts(pod_spec: Mapping[str, Any]) -> list[Host]:
    """The ``-H`` hosts of a launcher pod spec's horovodrun command."""
    command = list(pod_spec["containers"][0]["command"])
    hosts = []
    for item in str(command[command.index("-H") + 1]).split(","):
        name, _, slots = item.rpartition(":")
        hosts.append(Host(name, int(slots)))
    return hosts


@dataclass(frozen=True)
class Resource:
    """A custom resource type the launcher creates."""

    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def args(self) -> dict[str, str]:
        return {"group": self.group, "version": self.version, "plural": self.plural}


MPIJOB = Resource(GROUP, VERSION, PLURAL, "MPIJob")
TRAINJOB = Resource(TRAINER_GROUP, TRAINER_VERSION, "trainjobs", "TrainJob")
TRAINING_RUNTIME = Resource(TRAINER_GROUP, TRAINER_VERSION, "trainingruntimes", "TrainingRuntime")


@dataclass(frozen=True)
class Flavour:
    """What differs between the MPIJob and the TrainJob: the job's resource, the objects made
    with it (a TrainJob's own TrainingRuntime), how its pods are labelled, its state."""

    api: str  # the operator's kubernetes_api value
    job: Resource
    dependents: tuple[Resource, ...]  # created before the job, owned by it, named like it
    operator: str  # who turns the job into pods, for "is ... running?"
    pod_name_label: str  # the label naming the job on its pods
    pod_role_label: str  # the label naming the pod's role ...
    launcher_role: str  # ... and its value on the launcher pod

    def pod_selector(self, name: str) -> str:
        return f"{self.pod_name_label}={name}"

    def launcher_selector(self, name: str) -> str:
        return f"{self.pod_selector(name)},{self.pod_role_label}={self.launcher_role}"

    def phase(self, obj: Mapping[str, Any] | None) -> tuple[str, str]:
        return trainjob_phase(obj) if self.job is TRAINJOB else mpijob_phase(obj)


FLAVOURS = {
    "mpijob": Flavour(
        "mpijob", MPIJOB, (), "the MPI Operator", JOB_NAME_LABEL, JOB_ROLE_LABEL, "launcher"
    ),
    "trainjob": Flavour(
        "trainjob",
        TRAINJOB,
        (TRAINING_RUNTIME,),
        "Kubeflow Trainer (and JobSet)",
        JOBSET_NAME_LABEL,
        JOBSET_ROLE_LABEL,
        TRAINJOB_LAUNCHER,
    ),
}
KUBERNETES_APIS = tuple(FLAVOURS)


def flavour(api: str) -> Flavour:
    """The flavour named ``api`` (the operator's ``kubernetes_api``), or ValueError."""
    if api not in FLAVOURS:
        raise ValueError(
            f"kubernetes_api must be one of {', '.join(repr(a) for a in KUBERNETES_APIS)} "
            f"(Kubeflow MPI Operator MPIJob, or Kubeflow Trainer v2 TrainJob), got {api!r}"
        )
    return FLAVOURS[api]


# --- following the launcher pod's log -----------------------------------------------------
# After a follow stream ends while the launcher still runs (the API server or the kubelet cut
# it), the next one starts this many seconds earlier than the last line seen: clock skew and
# since_seconds' whole seconds may not lose a line; the overlap is dropped by timestamp.
LOG_OVERLAP_S = 5
LOG_DRAIN_S = 30.0  # how long the end of the job waits for the follow stream to end
_TIMESTAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)?$")


def log_timestamp(text: str) -> tuple[datetime.datetime, int] | None:
    """(UTC time to the second, nanoseconds) of an RFC3339(Nano) timestamp, or None."""
    found = _TIMESTAMP.match(text)
    if not found:
        return None
    zone = found.group(3) or "Z"
    when = datetime.datetime.fromisoformat(
        found.group(1) + ("+00:00" if zone == "Z" else zone)
    ).astimezone(datetime.UTC)
    return when, int((found.group(2) or "0").ljust(9, "0"))


class LauncherLog:
    """The launcher pod's log, into ``out`` line by line, each line once.

    :meth:`follow` (in a thread, while the job runs) reads it as the provider's PodManager does:
    ``follow=True, timestamps=True`` from the pod's start; when the stream ends while the pod
    still runs (a cut connection), it reconnects with ``since_seconds`` reaching back a little
    before the last line seen, and drops what it has already emitted by comparing the lines'
    timestamps (the same timestamp may carry several lines: as many as were emitted with it
    are skipped). :meth:`catch_up` reads what is left (or all of it when nothing was followed)
    without following, once the job has ended.
    """

    def __init__(
        self,
        core: Any,
        namespace: str,
        selector: str,
        out: Callable[[str], None],
        *,
        warn: Callable[..., Any],
        poll_interval: float = 2.0,
    ) -> None:
        self.core, self.namespace, self.selector = core, namespace, selector
        self.out, self.warn, self.poll_interval = out, warn, poll_interval
        self.last: tuple[datetime.datetime, int] | None = None  # timestamp of the last line
        self.at_last = 0  # lines emitted with that timestamp
        self._skip = 0  # lines with that timestamp still to drop after a reconnect
        self.pod: str | None = None
        self._done = threading.Event()  # the job ended: stop once the stream ends
        self._response: Any = None
        self._thread: threading.Thread | None = None
        self._warned = False

    # the pod ----------------------------------------------------------------------------
    def _launcher_pod(self) -> tuple[str, str] | None:
        pods = self.core.list_namespaced_pod(namespace=self.namespace, label_selector=self.selector)
        for pod in getattr(pods, "items", None) or []:
            return _pod_name(pod), _pod_phase(pod)
        return None

    # lines ------------------------------------------------------------------------------
    def _line(self, raw: str) -> None:
        stamp, _, text = raw.partition(" ")
        when = log_timestamp(stamp)
        if when is None:  # not timestamped (never from the API with timestamps=True)
            self.out(raw)
            return
        if self.last is not None:
            if when < self.last:
                return
            if when == self.last and self._skip:
                self._skip -= 1
                return
        if when == self.last:
            self.at_last += 1
        else:
            self.last, self.at_last, self._skip = when, 1, 0
        self.out(text)

    def _since(self) -> dict[str, Any]:
        """Where a new read starts: from the pod's start, or a little before the last line."""
        if self.last is None:
            return {}
        self._skip = self.at_last
        ago = (datetime.datetime.now(datetime.UTC) - self.last[0]).total_seconds()
        return {"since_seconds": max(1, math.ceil(ago) + LOG_OVERLAP_S)}

    def _read(self, pod: str, *, follow: bool) -> None:
        kwargs = {"name": pod, "namespace": self.namespace, "timestamps": True, **self._since()}
        if not follow:
            text = self.core.read_namespaced_pod_log(**kwargs)
            for raw in str(text or "").splitlines():
                self._line(raw)
            return
        response = self.core.read_namespaced_pod_log(**kwargs, follow=True, _preload_content=False)
        self._response = response
        pending = b""
        try:
            for chunk in response.stream(amt=None, decode_content=True):
                pending += chunk if isinstance(chunk, bytes) else str(chunk).encode()
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._line(line.decode("utf-8", "replace").rstrip("\r"))
            if pending:
                self._line(pending.decode("utf-8", "replace").rstrip("\r"))
        finally:
            self._response = None
            for close in ("release_conn", "close"):
                with contextlib.suppress(Exception):
                    getattr(response, close)()

    # while the job runs -------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self.follow, name="launcher-log", daemon=True)
        self._thread.start()

    def follow(self) -> None:
        """Until the job has ended and the launcher pod's stream with it."""
        while True:
            try:
                found = self._launcher_pod()
                if found is not None and found[1] != "Pending":
                    self.pod = found[0]
                    self._read(self.pod, follow=True)
                    if self._done.is_set() or self._launcher_pod() in (
                        (self.pod, "Succeeded"),
                        (self.pod, "Failed"),
                    ):
                        return  # the container ended: its whole log was read
            except Exception as e:  # the end of the job reads what is missing
                if not self._warned:
                    self._warned = True
                    self.warn("following the launcher pod's log: %s (retrying)", e)
            if self._done.wait(self.poll_interval):
                return

    def stop(self, timeout: float | None = None) -> None:
        """The job has ended: let the stream end (its pod has; within ``timeout`` seconds,
        default ``LOG_DRAIN_S``), then stop following."""
        self._done.set()
        if self._thread is None:
            return
        self._thread.join(LOG_DRAIN_S if timeout is None else timeout)
        if self._thread.is_alive():  # a stream that does not end: cut it
            response = self._response
            if response is not None:
                with contextlib.suppress(Exception):
                    response.close()
            self._thread.join(5.0)

    def catch_up(self) -> None:
        """Read what following did not (all of it when nothing was followed)."""
        found = self._launcher_pod()
        if found is None:
            return
        self.pod = found[0]
        self._read(self.pod, follow=False)


class KubernetesLauncher(Launcher):
    """Submit an MPIJob or a TrainJob (``kubernetes_api``), wait (poll or defer), surface the
    launcher log, clean up."""

    name = "kubernetes"
    options_class = KubernetesOptions
    needs_image = True

    def __init__(
        self, *, image: str, options: KubernetesOptions | None = None, hook: Any | None = None
    ) -> None:
        self.options = options = options or KubernetesOptions()
        self.flavour = flavour(options.kubernetes_api)
        self.startup_timeout = options.startup_timeout
        self._started = False  # the job's launcher pod has left Pending
        self.image = image
        self.pod_options = options.pod_options()
        self.kubernetes_conn_id = options.kubernetes_conn_id
        self._namespace = options.namespace
        self.slots_per_worker = options.slots_per_worker
        self.poll_interval = options.poll_interval
        self.cleanup = options.cleanup
        self._hook = hook
        self._ref: dict[str, str] | None = None
        self._claimed: dict[str, str] | None = None  # the names submit() creates
        self._killed = False  # kill() ran while submit() was creating the job

    @property
    def hook(self) -> Any:
        if self._hook is None:
            self._hook = KubernetesHook(conn_id=self.kubernetes_conn_id)
        return self._hook

    @property
    def namespace(self) -> str:
        return self._namespace or self.hook.get_namespace() or "default"

    @property
    def kind(self) -> str:
        return self.flavour.job.kind

    def manifests(self, spec: JobSpec) -> list[dict[str, Any]]:
        """What the job is made of, in creation order, the job last: the MPIJob, or the
        TrainJob's TrainingRuntime and the TrainJob. A one-process job (``spec.distributed``
        False, e.g. the export) runs as one rank on one worker pod, whatever
        ``slots_per_worker`` the training uses. ``mpijob_overrides`` (MPIJob) or
        ``trainjob_overrides`` (per kind) is merged in last."""
        slots = self.slots_per_worker if spec.distributed else 1
        build = build_trainjob if self.flavour.job is TRAINJOB else build_mpijob
        made = build(
            spec,
            image=self.image,
            namespace=self.namespace,
            slots_per_worker=slots,
            pod_options=self.pod_options,
        )
        if isinstance(made, tuple):
            return [
                apply_overrides(
                    m,
                    self.options.trainjob_overrides.get(m["kind"], {}),
                    OWNED_TRAINJOB_PATHS[m["kind"]],
                    f"trainjob_overrides[{m['kind']!r}]",
                )
                for m in made
            ]
        return [apply_mpijob_overrides(made, self.options.mpijob_overrides)]

    def manifest(self, spec: JobSpec) -> dict[str, Any]:
        """The job's own manifest (MPIJob or TrainJob)."""
        return self.manifests(spec)[-1]

    @property
    def defers(self) -> bool:
        return bool(self.options.deferrable)

    def trigger(self, ref: Mapping[str, str], timeout: float | None) -> Any:
        """The trigger that polls the job ``ref`` in Airflow's triggerer until it ends."""
        from horovod_airflow.operators.triggers import MPIJobTrigger

        options = self.options
        return MPIJobTrigger(
            name=ref["name"],
            namespace=ref["namespace"],
            kubernetes_conn_id=options.kubernetes_conn_id,
            poll_interval=options.poll_interval,
            timeout=timeout,
            startup_timeout=options.startup_timeout,
            kubernetes_api=options.kubernetes_api,
        )

    def submit(self, spec: JobSpec, log: Any) -> dict[str, str]:
        """Start the job of this task instance, or re-attach to the one an earlier try left
        running; return ``{"name", "namespace"}``.

        The name is the same for every try (``horovod_airflow.operators.job.job_name``), so two
        jobs of one
        task instance never write one output: a running one is waited for, not duplicated; a
        finished one (kept by ``cleanup``) is deleted before the new one is created; and a
        job that appears meanwhile (409 on create) is re-attached to.
        """
        from kubernetes.client.exceptions import ApiException

        ns = self.namespace
        ref = {"name": spec.name, "namespace": ns}
        kind = self.kind
        # What kill() deletes while this try has no job yet: the names are deterministic, so
        # a kill between here and _ref still reaches whatever the create makes.
        self._claimed = ref
        existing = self.find(ref)
        if existing is not None:
            phase, message = self.flavour.phase(existing)
            meta = existing.get("metadata") or {}
            found_try = (meta.get("labels") or {}).get("try_number")
            made_by = f"try {found_try or '?'}"
            recorded = self.journal.recorded_by(self.name)
            running = phase == "running" and not meta.get("deletionTimestamp")
            if running and not made_by_this_task(str(meta.get("uid")), found_try, recorded):
                assert recorded is not None
                raise JobNotOursError(
                    f"{kind} {ns}/{spec.name} (uid {meta.get('uid')}, made by {made_by}) is "
                    f"running, but try {recorded.get('try_number')} of this task instance "
                    f"created uid {recorded.get('id')} (task state store): it was re-created "
                    f"by someone else and is not re-attached to, nor deleted. Delete it "
                    f"(kubectl delete -n {ns} {self.flavour.job.plural} {spec.name}), then "
                    f"clear the task"
                )
            if running:
                log.info(
                    "%s %s/%s of this task instance (made by %s) is still running: "
                    "re-attaching to it instead of starting a second one",
                    kind,
                    ns,
                    spec.name,
                    made_by,
                )
                self._ref = ref
                return dict(ref)
            log.info(
                "deleting %s %s/%s (made by %s, %s%s) before starting this try",
                kind,
                ns,
                spec.name,
                made_by,
                "being deleted" if meta.get("deletionTimestamp") else phase,
                f": {message}" if message else "",
            )
            self.delete(ref)
            self.wait_until_gone(ref)
        *dependents, body = self.manifests(spec)
        if spec.secret_env:
            self.create_secret(spec, ns)
        try:
            for resource, dependent in zip(self.flavour.dependents, dependents, strict=True):
                self.create_dependent(resource, dependent, ns)
            created = self.hook.create_custom_object(
                **self.flavour.job.args(), body=body, namespace=ns
            )
        except ApiException as e:
            if e.status == 409:  # made between the look-up and the create: the same instance's
                log.warning(
                    "%s %s/%s appeared while this try created it: re-attaching to it",
                    kind,
                    ns,
                    spec.name,
                )
                self._ref = ref
                return dict(ref)
            self.abandon(spec, ns, log)
            raise HorovodLaunchError(f"cannot create {kind} {spec.name!r} in {ns!r}: {e}") from e
        except Exception as e:
            self.abandon(spec, ns, log)
            raise HorovodLaunchError(f"cannot create {kind} {spec.name!r} in {ns!r}: {e}") from e
        self._ref = ref
        if self._killed:  # on_kill ran during the create: what it made must not stay
            self._ref = None
            self.delete(ref)
            raise HorovodLaunchError(f"the task was killed while {kind} {spec.name!r} was created")
        uid = (created or {}).get("metadata", {}).get("uid") if isinstance(created, dict) else None
        # The uid fences a re-attach: a job re-created under this name has another one.
        self.journal.record(self.name, kind=kind, name=spec.name, namespace=ns, id=uid)
        if uid:
            self.own(spec, ns, uid, log)
        log.info("submitted %s %s/%s (%d ranks)", kind, ns, spec.name, spec.num_proc)
        return dict(ref)

    def create_dependent(self, resource: Resource, body: dict[str, Any], namespace: str) -> None:
        """Create an object the job needs first (its TrainingRuntime). One of this name is left
        from an earlier try whose job is gone: it is replaced (the job is deterministic, but
        the image or the command may have changed since)."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.hook.create_custom_object(**resource.args(), body=body, namespace=namespace)
        except ApiException as e:
            if e.status != 409:
                raise
            self.delete_dependent(
                resource, {"name": body["metadata"]["name"], "namespace": namespace}
            )
            self.hook.create_custom_object(**resource.args(), body=body, namespace=namespace)

    def own(self, spec: JobSpec, namespace: str, uid: str, log: Any) -> None:
        """Make the job own its Secret and its dependents: they die with it (Kubernetes garbage
        collection), whatever deletes it."""
        owner = {
            "metadata": {
                "ownerReferences": [
                    {
                        "apiVersion": self.flavour.job.api_version,
                        "kind": self.kind,
                        "name": spec.name,
                        "uid": uid,
                    }
                ]
            }
        }
        if spec.secret_env:
            try:
                self.hook.core_v1_client.patch_namespaced_secret(
                    name=secret_name(spec.name), namespace=namespace, body=owner
                )
            except Exception as e:
                log.warning("could not make the %s own its Secret: %s", self.kind, e)
        for resource in self.flavour.dependents:
            try:
                self.hook.custom_object_client.patch_namespaced_custom_object(
                    **resource.args(), name=spec.name, namespace=namespace, body=owner
                )
            except Exception as e:
                log.warning("could not make the %s own its %s: %s", self.kind, resource.kind, e)

    def abandon(self, spec: JobSpec, namespace: str, log: Any) -> None:
        """After a failed create: nothing of the job may stay, the job included (a create
        whose response timed out may have been accepted: its pods would wait on a deleted
        Secret until the startup timeout)."""
        ref = {"name": spec.name, "namespace": namespace}
        for resource in (self.flavour.job, *self.flavour.dependents):
            try:
                self.delete_dependent(resource, ref)
            except Exception as cleanup_error:
                log.warning(
                    "could not delete %s %s/%s after the failed create: %s",
                    resource.kind,
                    namespace,
                    spec.name,
                    cleanup_error,
                )
        self.abandon_secret(spec, namespace, log)

    def create_secret(self, spec: JobSpec, namespace: str) -> None:
        """Create the job's credential Secret; one left from an earlier try gets this try's
        credentials (a running job of this instance reads the same connection's)."""
        from kubernetes.client.exceptions import ApiException

        core = self.hook.core_v1_client
        data = {SECRET_KEY: rank_env_file_text(spec.secret_env)}
        try:
            try:
                core.create_namespaced_secret(
                    namespace=namespace,
                    body={
                        "apiVersion": "v1",
                        "kind": "Secret",
                        "metadata": {
                            "name": secret_name(spec.name),
                            "namespace": namespace,
                            "labels": job_labels(spec),
                        },
                        "type": "Opaque",
                        "stringData": data,
                    },
                )
            except ApiException as e:
                if e.status != 409:
                    raise
                core.patch_namespaced_secret(
                    name=secret_name(spec.name),
                    namespace=namespace,
                    body={"metadata": {"labels": job_labels(spec)}, "stringData": data},
                )
        except Exception as e:
            raise HorovodLaunchError(
                f"cannot create Secret {secret_name(spec.name)!r} in {namespace!r}: {e}"
            ) from e

    def abandon_secret(self, spec: JobSpec, namespace: str, log: Any) -> None:
        """After a failed create: a Secret without its job would hold credentials forever."""
        if not spec.secret_env:
            return
        try:
            self.delete_secret({"name": spec.name, "namespace": namespace})
        except Exception as cleanup_error:
            log.warning(
                "could not delete Secret %s/%s after the failed create: %s",
                namespace,
                secret_name(spec.name),
                cleanup_error,
            )

    def find(
        self, ref: Mapping[str, str], resource: Resource | None = None
    ) -> dict[str, Any] | None:
        """The job (or the ``resource``) named ``ref``, or None when there is none."""
        from kubernetes.client.exceptions import ApiException

        resource = resource or self.flavour.job
        try:
            obj = self.hook.get_custom_object(
                **resource.args(), name=ref["name"], namespace=ref["namespace"]
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise HorovodLaunchError(
                f"cannot look up {resource.kind} {ref['namespace']}/{ref['name']}: {e}"
            ) from e
        return dict(obj or {})

    def hosts(self, ref: Mapping[str, str]) -> list[Host]:
        """The ``-H`` hosts of the job's launcher command (to name a failed rank's pod)."""
        if self.flavour.job is TRAINJOB:
            return runtime_hosts(self.find(ref, TRAINING_RUNTIME))
        return mpijob_hosts(self.find(ref))

    def wait_until_gone(self, ref: Mapping[str, str], timeout: float | None = None) -> None:
        """Wait for a deleted job to be gone (foreground deletion removes its pods first)."""
        timeout = DELETE_WAIT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while self.find(ref) is not None:
            if time.monotonic() > deadline:
                raise HorovodLaunchError(
                    f"{self.kind} {ref['namespace']}/{ref['name']} of an earlier try is still "
                    f"being deleted after {timeout:.0f}s; this try does not start a second job"
                )
            time.sleep(min(self.poll_interval, 5.0))

    def status(self, ref: Mapping[str, str]) -> tuple[str, str]:
        obj = self.hook.get_custom_object(
            **self.flavour.job.args(), name=ref["name"], namespace=ref["namespace"]
        )
        return self.flavour.phase(obj)

    def poll(
        self,
        ref: Mapping[str, str],
        *,
        started_at: float,
        timeout: float | None,
        startup_timeout: float | None = None,
    ) -> dict[str, Any] | None:
        """One look at the job: the event that ends the wait, or None while it runs.

        Shared by the polling loop (:meth:`run`) and
        :class:`horovod_airflow.operators.triggers.MPIJobTrigger`;
        API errors propagate (the caller retries transient ones).
        """
        phase, message = self.status(ref)
        if phase != "running":
            status = "success" if phase == "succeeded" else "failed"
            return {"status": status, "message": message, **ref}
        if timeout is not None and time.time() - started_at > timeout:
            return {
                "status": "timeout",
                "timeout": timeout,
                "message": f"ran longer than {timeout}s",
                **ref,
            }
        if not self._started:  # until the launcher pod runs: fail fast on start failures
            pods = self.hook.core_v1_client.list_namespaced_pod(
                namespace=ref["namespace"], label_selector=self.flavour.pod_selector(ref["name"])
            )
            failure, self._started = pod_start_failure(
                getattr(pods, "items", None) or [],
                ref["name"],
                elapsed=time.time() - started_at,
                startup_timeout=startup_timeout,
                kind=self.kind,
                operator=self.flavour.operator,
            )
            if failure:
                return {"status": "not_started", "message": failure, **ref}
        return None

    def run(self, spec: JobSpec, log: Any) -> JobResult:
        ref = self.submit(spec, log)
        out = LogTail(log, secrets=list(spec.secret_env.values()))
        follower = self.launcher_log(ref, out, log)
        follower.start()  # the launcher pod's lines reach the task log as they come
        try:
            event = self._wait(spec, ref, log)
        except BaseException:
            follower.stop(timeout=1.0)
            raise
        return self.finish(
            ref,
            event,
            log,
            secrets=list(spec.secret_env.values()),
            timeout=spec.timeout,
            out=out,
            follower=follower,
        )

    def _wait(self, spec: JobSpec, ref: Mapping[str, str], log: Any) -> dict[str, Any]:
        """Poll until the job ends; the event that ends it."""
        started_at = time.time()
        retry = ApiRetry()
        while True:
            if self._ref is None:
                raise HorovodTrainingError(f"{self.kind} {ref['name']!r} was deleted (on_kill)")
            try:
                event = self.poll(
                    ref,
                    started_at=started_at,
                    timeout=spec.timeout,
                    startup_timeout=self.startup_timeout,
                )
            except Exception as e:
                delay = retry.delay(e)
                if delay is None:
                    return {"status": "error", "message": retry.describe(e), **ref}
                log.warning("Kubernetes API error, next look in %.0fs: %s", delay, e)
                time.sleep(delay)
                continue
            retry.reset()
            if event is not None:
                return event
            time.sleep(self.poll_interval)

    def launcher_log(
        self, ref: Mapping[str, str], out: Callable[[str], None], log: Any
    ) -> LauncherLog:
        """The reader of the launcher pod's log (horovodrun's rank-prefixed output of every
        rank) into ``out``."""
        return LauncherLog(
            self.hook.core_v1_client,
            ref["namespace"],
            self.flavour.launcher_selector(ref["name"]),
            out,
            warn=log.warning,
            poll_interval=min(self.poll_interval, 5.0),
        )

    def finish(
        self,
        ref: Mapping[str, str],
        event: Mapping[str, Any],
        log: Any,
        *,
        secrets: Sequence[str] = (),
        timeout: float | None = None,
        out: LogTail | None = None,
        follower: LauncherLog | None = None,
    ) -> JobResult:
        """Surface the rest of the launcher log (all of it when it was not followed, as after
        a deferral: nothing follows it while the task is deferred), apply the cleanup policy,
        raise unless it succeeded."""
        out = out or LogTail(log, secrets=secrets)
        reader = follower or self.launcher_log(ref, out, log)
        try:
            reader.stop()  # the job has ended: its launcher's stream ends too
            reader.catch_up()
        except Exception as e:
            log.warning("could not read the launcher pod log of %s: %s", ref["name"], e)
        status = event.get("status")
        success = status == "success"
        hosts: list[Host] = []
        if not success:  # before any deletion: the job's -H list names the failed rank's pod
            try:
                hosts = self.hosts(ref)
            except Exception as e:
                log.warning(
                    "could not read %s %s to name the failed pod: %s", self.kind, ref["name"], e
                )
        # A job that never started or ran out of time may still be running: whatever cleanup
        # says, it goes, or the retry would re-attach to it (the provider deletes too).
        stuck = status in ("not_started", "timeout")
        if stuck or self.cleanup == "delete" or (self.cleanup == "delete_on_success" and success):
            try:
                self.delete(ref)
            except Exception as e:
                # Never a task failure: after a success the work is done; after a failure
                # that failure is what the task reports (a retry re-attaches or replaces).
                log.warning(
                    "could not delete %s %s/%s and its Secret after it ended (%s): %s. Delete "
                    "them by hand (kubectl delete -n %s %s %s)",
                    self.kind,
                    ref["namespace"],
                    ref["name"],
                    status,
                    e,
                    ref["namespace"],
                    self.flavour.job.plural,
                    ref["name"],
                )
        elif status == "error":
            # Its state is unknown (the API did not answer): it may still be running and
            # reading its Secret. Both stay; a retry re-attaches to it or replaces it.
            log.warning(
                "kept %s %s/%s and its Secret: the API did not say whether it still runs",
                self.kind,
                ref["namespace"],
                ref["name"],
            )
        else:
            # The job is kept for inspection, but its credentials never outlive it: the pods
            # have finished and the launcher's log is in the task log already.
            try:
                self.delete_secret(ref)
            except Exception as e:
                log.warning("could not delete Secret of %s: %s", ref["name"], e)
        if success:
            return JobResult(exit_code=0, log_tail=out.tail())
        if status == "not_started":
            message = str(event.get("message") or "")
            error = (
                HorovodImageError
                if any(f": {reason}" in message for reason in IMAGE_FAILURES)
                else HorovodLaunchError
            )
            raise error(
                f"{self.kind} {ref['namespace']}/{ref['name']} did not start (deleted): "
                f"{event.get('message')}",
                log_tail=out.tail(),
            )
        if status == "timeout":
            raise HorovodTimeoutError(
                f"{self.kind} {ref['name']!r} did not finish in time: {event.get('message')}",
                timeout=float(timeout or event.get("timeout") or 0),
                log_tail=out.tail(),
            )
        message = describe_failure(ref["name"], 1, out.tail(), hosts)
        raise HorovodTrainingError(
            f"{self.kind} {ref['namespace']}/{ref['name']} {status}: {event.get('message')}; "
            f"{message}",
            exit_code=None,
            log_tail=out.tail(),
        )

    def delete(self, ref: Mapping[str, str]) -> None:
        """Delete the job (its pods go with it), its dependents and its Secret; absent ones
        are fine."""
        self.delete_dependent(self.flavour.job, ref)
        for resource in self.flavour.dependents:
            self.delete_dependent(resource, ref)
        self.delete_secret(ref)

    def delete_dependent(self, resource: Resource, ref: Mapping[str, str]) -> None:
        """Delete one object (foreground: its own dependents first); an absent one is fine."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.hook.delete_custom_object(
                **resource.args(),
                name=ref["name"],
                namespace=ref["namespace"],
                propagation_policy="Foreground",
            )
        except ApiException as e:
            if e.status != 404:
                raise

    def delete_secret(self, ref: Mapping[str, str]) -> None:
        """Delete the job's credential Secret; an absent one is fine."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.hook.core_v1_client.delete_namespaced_secret(
                name=secret_name(ref["name"]), namespace=ref["namespace"]
            )
        except ApiException as e:
            if e.status != 404:  # 404: none was created, or garbage-collected with the job
                raise

    def kill(self) -> None:
        if self._claimed is not None and self._ref is None:
            self._killed = True  # during submit: it must not leave what it creates next
        ref, self._ref = self._ref, None
        ref = ref or self._claimed  # killed during submit: delete what it may have made
        if ref is not None:
            self.delete(ref)
