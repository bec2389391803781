"""The escape hatch of the manifests: ``mpijob_overrides`` / ``trainjob_overrides`` deep-merged
into what the launcher built, refused where they would change what the launcher owns."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from horovod_airflow.operators.launchers.kubernetes.api import TRAINJOB_LAUNCHER, TRAINJOB_NODE


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
        ("spec", "mpiReplicaSpecs", replica, "replicas"): (
            "num_proc (elastic: max_np) / slots_per_worker"
        )
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
