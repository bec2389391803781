"""The manifests of a job: the launcher and worker pod templates (the trainer image's sshd
workers, horovodrun in the launcher), and from them the MPIJob, or the TrainingRuntime and
TrainJob; the credential Secret's name and the ``-H`` hosts read back from a manifest."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from horovod_airflow.operators.command import RANK_ENV_FILE_VAR, Host, horovodrun_argv
from horovod_airflow.operators.exceptions import HorovodConfigError
from horovod_airflow.operators.launchers.base import JOB_LABEL, JobSpec, elastic_args
from horovod_airflow.operators.launchers.kubernetes.api import (
    ANCESTOR_LABEL,
    GROUP,
    TRAINER_GROUP,
    TRAINER_VERSION,
    TRAINJOB_LAUNCHER,
    TRAINJOB_NODE,
    VERSION,
)
from horovod_airflow.operators.launchers.kubernetes.options import GPU_RESOURCE, PodOptions

SECRET_MOUNT = "/etc/hva-rank-env"
SECRET_KEY = "rank.env"

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
# The MPI Operator's (v2beta1) discovery script for elastic Horovod: its controller writes
# key discover_hosts.sh of the job's ConfigMap <job>-config, mounted at /etc/mpi in the launcher
# (mode 0555), as one "echo <pod>.<job>.<ns>.svc" per worker pod in phase Running, sorted by
# name, and rewrites it as worker pods come and go (kubeflow/mpi-operator
# pkg/controller/mpi_job_controller.go, updateDiscoverHostsInConfigMap). It prints no slots:
# horovodrun gets them from --slots-per-host.
DISCOVER_HOSTS_SCRIPT = "/etc/mpi/discover_hosts.sh"
WORKER_SSHD_CONFIG = "/etc/ssh/hva_worker_sshd_config"
# A worker is only an sshd in the foreground (-D), logging to stderr (-e), i.e. to the pod log;
# horovodrun in the launcher pod starts the ranks through it.
WORKER_COMMAND: tuple[str, ...] = ("/usr/sbin/sshd", "-De", "-f", WORKER_SSHD_CONFIG)


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
    if spec.elastic is not None:  # the operator's discovery script lists the hosts, not -H
        at = command.index("-H")
        command[at : at + 2] = elastic_args(
            spec.elastic, DISCOVER_HOSTS_SCRIPT, slots_per_host=slots_per_worker
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
    """The worker pods: ``num_proc / slots_per_worker``; an elastic job's, ``max_np /
    slots_per_worker`` (every pod it may use: horovodrun waits for ``num_proc`` slots, then
    starts a rank on every listed slot up to ``max_np``)."""
    for name, ranks in (("num_proc", spec.num_proc), *_elastic_max(spec)):
        if ranks % slots_per_worker:
            # a setting no retry changes: a config error (not retried), not a plain ValueError
            raise HorovodConfigError(
                f"{name}={ranks} is not a multiple of slots_per_worker="
                f"{slots_per_worker}: each {kind} worker runs exactly slots_per_worker ranks"
            )
    ranks = spec.elastic.max_np if spec.elastic is not None else spec.num_proc
    return ranks // slots_per_worker


def _elastic_max(spec: JobSpec) -> list[tuple[str, int]]:
    return [("elastic.max_np", spec.elastic.max_np)] if spec.elastic is not None else []


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


def launcher_command_hosts(pod_spec: Mapping[str, Any]) -> list[Host]:
    """The ``-H`` hosts of a launcher pod spec's horovodrun command."""
    command = list(pod_spec["containers"][0]["command"])
    hosts = []
    for item in str(command[command.index("-H") + 1]).split(","):
        name, _, slots = item.rpartition(":")
        hosts.append(Host(name, int(slots)))
    return hosts
