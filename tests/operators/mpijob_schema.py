"""Structural checks of an MPIJob manifest (``kubeflow.org/v2beta1``), written for this project.

No package in the PyPI index ships the MPI Operator's v2beta1 CRD schema or an SDK for it (the
Kubeflow packages there serve the Training Operator v1 and Trainer v2 APIs), and files of its
repository are not copied into this one. So:

- the MPIJob part (``spec`` keys, enums, replica rules, the name) is checked by the rules below,
  written from the MPI Operator's documented API: ``pkg/apis/kubeflow/v2beta1/types.go`` (field
  names, enums) and ``pkg/apis/kubeflow/validation/validation.go`` (what its webhook refuses) of
  github.com/kubeflow/mpi-operator at commit caa3c47fc42eb762635f78045ec0fcd1a89eb038
  (2026-07-02), read, not copied;
- each pod template is checked against the Kubernetes API itself: the model classes of the
  ``kubernetes`` package from PyPI (the official client, generated from the Kubernetes OpenAPI
  spec; its ``openapi_types`` / ``attribute_map`` give every field and its type), so an unknown
  or misspelt field — which the API server would silently prune from a CRD's pod template —
  and a wrongly typed value are caught.

``mpijob_errors(body)`` returns the problems found, as ``path: what`` strings; empty means valid.
"""

from __future__ import annotations

import re
from typing import Any

SPEC_FIELDS = {
    "slotsPerWorker", "runLauncherAsWorker", "runPolicy", "mpiReplicaSpecs", "sshAuthMountPath",
    "launcherCreationPolicy", "mpiImplementation",
}  # fmt: skip
RUN_POLICY_FIELDS = {
    "cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit",
    "schedulingPolicy", "suspend", "managedBy",
}  # fmt: skip
REPLICA_FIELDS = {"replicas", "template", "restartPolicy"}
CLEAN_POD_POLICIES = {"None", "Running", "All"}
LAUNCHER_CREATION_POLICIES = {"AtStartup", "WaitForWorkersReady"}
MPI_IMPLEMENTATIONS = {"OpenMPI", "Intel", "MPICH"}
RESTART_POLICIES = {"Never", "OnFailure"}  # what the webhook accepts
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
LABEL_NAME = re.compile(r"([a-z0-9.-]{1,253}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_model(value: Any, type_name: str, path: str, errors: list[str]) -> None:
    """``value`` (JSON as sent) against a type of the kubernetes client's models."""
    import kubernetes.client as k8s

    if type_name.startswith("list["):
        if not isinstance(value, list):
            errors.append(f"{path}: must be a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            _check_model(item, type_name[5:-1], f"{path}[{i}]", errors)
        return
    if type_name.startswith("dict["):
        if not isinstance(value, dict):
            errors.append(f"{path}: must be a map, got {type(value).__name__}")
            return
        inner = type_name[5:-1].split(", ", 1)[1]
        quantities = path.endswith(("limits", "requests"))
        for key, item in value.items():
            if quantities and inner == "str" and (_is_int(item) or isinstance(item, float)):
                continue  # a resource.Quantity may be sent as a JSON number
            _check_model(item, inner, f"{path}.{key}", errors)
        return
    simple = {"str": str, "bool": bool, "float": (int, float), "datetime": str, "date": str}
    if type_name == "int":
        if not _is_int(value):
            errors.append(f"{path}: must be an integer, got {value!r}")
        return
    if type_name in simple:
        if not isinstance(value, simple[type_name]) or (
            type_name == "float" and isinstance(value, bool)
        ):
            errors.append(f"{path}: must be {type_name}, got {value!r}")
        return
    if type_name == "object":  # IntOrString, RawExtension
        return
    model = getattr(k8s, type_name)
    if not isinstance(value, dict):
        errors.append(f"{path}: must be an object ({type_name}), got {type(value).__name__}")
        return
    fields = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, item in value.items():
        if key not in fields:
            errors.append(f"{path}: unknown field {key!r} of {type_name}")
            continue
        _check_model(item, model.openapi_types[fields[key]], f"{path}.{key}", errors)


def _check_labels(labels: Any, path: str, errors: list[str]) -> None:
    for key, value in (labels or {}).items():
        if not LABEL_NAME.fullmatch(str(key)):
            errors.append(f"{path}: label name {key!r} is invalid")
        if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.fullmatch(value):
            errors.append(f"{path}.{key}: label value {value!r} is invalid")


def _check_replica(spec: Any, role: str, path: str, errors: list[str]) -> None:
    if not isinstance(spec, dict):
        errors.append(f"{path}: must be an object")
        return
    for key in set(spec) - REPLICA_FIELDS:
        errors.append(f"{path}: unknown field {key!r}")
    replicas = spec.get("replicas")
    if not _is_int(replicas):
        errors.append(f"{path}.replicas: must define number of replicas (an integer)")
    elif role == "Launcher" and replicas != 1:
        errors.append(f"{path}.replicas: must be 1")
    elif role == "Worker" and replicas < 1:
        errors.append(f"{path}.replicas: must be greater than or equal to 1")
    if spec.get("restartPolicy") not in RESTART_POLICIES:
        errors.append(f"{path}.restartPolicy: {spec.get('restartPolicy')!r} not in "
                      f"{sorted(RESTART_POLICIES)}")  # fmt: skip
    template = spec.get("template")
    if not isinstance(template, dict) or not (template.get("spec") or {}).get("containers"):
        errors.append(f"{path}.template.spec.containers: must define at least one container")
        return
    _check_model(template, "V1PodTemplateSpec", f"{path}.template", errors)
    _check_labels((template.get("metadata") or {}).get("labels"), f"{path}.template", errors)


def mpijob_errors(body: dict[str, Any]) -> list[str]:
    """What the MPI Operator's API (or the Kubernetes API, for pod templates) would refuse."""
    errors: list[str] = []
    if body.get("apiVersion") != "kubeflow.org/v2beta1" or body.get("kind") != "MPIJob":
        errors.append("apiVersion/kind: must be kubeflow.org/v2beta1 MPIJob")
    meta = body.get("metadata") or {}
    _check_model(meta, "V1ObjectMeta", "metadata", errors)
    _check_labels(meta.get("labels"), "metadata", errors)
    spec = body.get("spec")
    if not isinstance(spec, dict):
        return [*errors, "spec: required"]
    for key in set(spec) - SPEC_FIELDS:
        errors.append(f"spec: unknown field {key!r}")
    slots = spec.get("slotsPerWorker")
    if not _is_int(slots) or slots < 0:
        errors.append(f"spec.slotsPerWorker: must be a non-negative integer, got {slots!r}")
    if not isinstance(spec.get("sshAuthMountPath"), str) or not spec["sshAuthMountPath"]:
        errors.append("spec.sshAuthMountPath: must have a mount path for SSH credentials")
    policy = spec.get("launcherCreationPolicy", "AtStartup")
    if policy not in LAUNCHER_CREATION_POLICIES:
        errors.append(f"spec.launcherCreationPolicy: {policy!r} not in "
                      f"{sorted(LAUNCHER_CREATION_POLICIES)}")  # fmt: skip
    implementation = spec.get("mpiImplementation", "OpenMPI")
    if implementation not in MPI_IMPLEMENTATIONS:
        errors.append(f"spec.mpiImplementation: {implementation!r} not supported")
    run_policy = spec.get("runPolicy") or {}
    for key in set(run_policy) - RUN_POLICY_FIELDS:
        errors.append(f"spec.runPolicy: unknown field {key!r}")
    if run_policy.get("cleanPodPolicy", "None") not in CLEAN_POD_POLICIES:
        errors.append(f"spec.runPolicy.cleanPodPolicy: {run_policy['cleanPodPolicy']!r} not "
                      f"in {sorted(CLEAN_POD_POLICIES)}")  # fmt: skip
    for key in ("ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit"):
        if key in run_policy and (not _is_int(run_policy[key]) or run_policy[key] < 0):
            errors.append(f"spec.runPolicy.{key}: must be a non-negative integer")
    replicas = spec.get("mpiReplicaSpecs")
    if not isinstance(replicas, dict):
        return [*errors, "spec.mpiReplicaSpecs: must have replica specs"]
    for key in set(replicas) - {"Launcher", "Worker"}:
        errors.append(f"spec.mpiReplicaSpecs: unknown replica type {key!r}")
    if "Launcher" not in replicas:
        errors.append("spec.mpiReplicaSpecs.Launcher: must have Launcher replica spec")
    for role, replica in replicas.items():
        _check_replica(replica, role, f"spec.mpiReplicaSpecs.{role}", errors)
    # Pods are named <job>-worker-<i>: the last one must still be a DNS-1035 label.
    workers = (replicas.get("Worker") or {}).get("replicas")
    last = f"{meta.get('name', '')}-worker-{max(int(workers or 1), 1) - 1}"
    if len(last) > 63 or not DNS_1035.fullmatch(last):
        errors.append(f"metadata.name: pod hostname {last!r} would not be a DNS-1035 label")
    return errors
