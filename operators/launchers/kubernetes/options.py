"""The options of ``launcher="kubernetes"``: :class:`PodOptions` (both pod templates) and
:class:`KubernetesOptions` (the cluster, the API, the cleanup, the waiting), validated on
creation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from horovod_airflow.operators.launchers.kubernetes.api import flavour
from horovod_airflow.operators.launchers.kubernetes.overrides import OWNED_TRAINJOB_PATHS

STARTUP_TIMEOUT_S = 600.0  # default: how long the job's pods may take to start

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
