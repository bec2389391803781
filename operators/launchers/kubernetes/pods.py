"""What the job's pods say before it has started: a pod that cannot start ends the job at
once, a pod still Pending ends it after the startup timeout, each named with its reason."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from horovod_airflow.operators.launchers.kubernetes.api import JOB_ROLE_LABEL, JOBSET_ROLE_LABEL

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


def pod_role(pod: Any) -> str:
    labels = getattr(getattr(pod, "metadata", None), "labels", None) or {}
    return str(
        labels.get(JOB_ROLE_LABEL) or labels.get(JOBSET_ROLE_LABEL) or labels.get("role") or ""
    )


def pod_name(pod: Any) -> str:
    return str(getattr(getattr(pod, "metadata", None), "name", "") or "?")


def pod_phase(pod: Any) -> str:
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
    if any(pod_role(p) == "launcher" and pod_phase(p) != "Pending" for p in pods):
        return None, True
    for pod in sorted(pods, key=pod_name):
        status = getattr(pod, "status", None)
        if pod_phase(pod) == "Failed":
            why = getattr(status, "message", None) or getattr(status, "reason", None) or ""
            return f"pod {pod_name(pod)} failed before the job started: {why}".rstrip(": "), False
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
                    f"pod {pod_name(pod)} (container {getattr(cs, 'name', '?')}): "
                    f"{reason}: {message}".rstrip(": "),
                    False,
                )
    if startup_timeout is None or elapsed <= startup_timeout:
        return None, False
    late = f"after {elapsed:.0f}s (startup_timeout={startup_timeout:.0f}s)"
    if not pods:
        return f"no pod of {kind} {name} {late}: is {operator} running?", False
    for pod in sorted(pods, key=pod_name):
        if pod_phase(pod) == "Pending":
            return f"pod {pod_name(pod)} still Pending {late}: {_why_pending(pod)}", False
    workers = ", ".join(f"{pod_name(p)} {pod_phase(p)}" for p in sorted(pods, key=pod_name))
    return f"the launcher pod of {kind} {name} was not created {late} (pods: {workers})", False
