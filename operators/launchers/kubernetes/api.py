"""The Kubeflow APIs the launcher speaks: the MPI Operator's MPIJob and Kubeflow Trainer v2's
TrainJob (with its own TrainingRuntime), how each labels its pods and says how it ended.

:class:`Flavour` holds what differs between the two; the rest of the launcher asks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GROUP, VERSION, PLURAL = "kubeflow.org", "v2beta1", "mpijobs"
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
JOB_ROLE_LABEL = "training.kubeflow.org/job-role"
# Kubeflow Trainer v2 (kubernetes_api="trainjob"): a TrainJob and its own TrainingRuntime,
# which Trainer turns into a JobSet (replicated jobs "node" and "launcher") that labels its pods.
TRAINER_GROUP, TRAINER_VERSION = "trainer.kubeflow.org", "v1alpha1"
TRAINJOB_LAUNCHER, TRAINJOB_NODE = "launcher", "node"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOBSET_ROLE_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"


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


def trainjob_phase(obj: Mapping[str, Any] | None) -> tuple[str, str]:
    """(``"succeeded"`` | ``"failed"`` | ``"running"``, message) from a TrainJob's conditions
    (``Complete`` or ``Failed`` with status True ends it)."""
    return _phase(obj, "Complete")


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
