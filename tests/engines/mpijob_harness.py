"""An MPIJob's pods as podman containers: the Kubernetes API the kubernetes launcher talks to,
answered by doing what the Kubeflow MPI Operator (v2beta1 controller) would do with the
manifest, unchanged.

:class:`PodmanCluster` stands in for the provider's ``KubernetesHook`` (patched where the
launcher imports it). On ``create_custom_object`` it plays the operator:

- an ECDSA P-521 key pair (the operator's ``<job>-ssh`` Secret), mounted read-only at the
  MPIJob's ``sshAuthMountPath`` as ``id_rsa`` / ``id_rsa.pub`` / ``authorized_keys``, with
  the Secret volume's mode (the operator sets 0600 only for ``/root/.ssh``; elsewhere the
  Kubernetes default 0644), owned by root, or group ``fsGroup`` with ``g+r`` where the pod
  sets one (the kubelet's rule for Secret volumes);
- workers ``<job>-worker-<i>``: the worker template's image, command, args, env and Secret
  mounts, hostname ``<job>-worker-<i>``, env ``K_MPI_JOB_ROLE=worker``; each must pass the
  template's ``tcpSocket`` readiness probe before the launcher starts
  (``launcherCreationPolicy: WaitForWorkersReady``);
- the launcher ``<job>-launcher``: its template, plus ``/etc/mpi/hostfile``
  (``<job>-worker-<i>.<job>.<ns>.svc slots=N``) and the env the operator adds
  (``K_MPI_JOB_ROLE``, ``OMPI_MCA_*``, NVIDIA variables cleared);
- each worker on a node of its own with ``slotsPerWorker`` cores (``--cpuset-cpus``, wrapping
  around this machine's cores): a rank sizes its torch threads from the cores it sees, so a
  run with one rank per pod and one with two ranks in a pod use the same threads per rank;
- the headless Service ``<job>``: every container resolves ``<pod>.<job>.<ns>.svc`` (and
  ``….svc.cluster.local``) to the pod's address (``--add-host``: the cluster DNS).

While the launcher runs, the harness reconciles the job every ``DISCOVERY_REFRESH_S`` seconds,
as the operator's controller does on each pod event (``getOrCreateWorker``,
``getOrCreateConfigMap``):

- a worker pod that is gone (``podman rm``) is created again, same name, same address (the
  cluster DNS name resolves to the new pod); one that exited stays (``restartPolicy: Never``);
- the launcher's ``/etc/mpi/discover_hosts.sh`` (mode 0555, next to the hostfile: the
  ConfigMap key ``discover_hosts.sh``) is rewritten to one ``echo <pod>.<job>.<ns>.svc`` per
  worker pod in phase Running (container running), sorted by name, and replaced whole
  (renamed into place: the kubelet's atomic ConfigMap update; a reader sees the old script
  or the new one). Each version is kept in ``discovery[<job>]``.

One refresh period stands for the whole path of a real cluster (the pod event, the
controller's ConfigMap update, the kubelet's projection of it into the launcher pod). There
the kubelet's part alone can take its sync period plus its cache delay, about a minute by
default; the harness's period is shorter so the tests stay short. That changes when a new pod
is seen, not what horovodrun does with a lost one: its rank's failure drops the host, and a
host whose rank failed is blacklisted for good (no ``--blacklist-cooldown-range``), whatever
the script still lists.

The job's state is its launcher's: running, Succeeded (exit 0) or Failed; once the launcher
has ended, the still running workers are removed (``cleanPodPolicy: Running``). Pod specs use
only what the launcher's manifests use; anything else fails loudly rather than being ignored.
It records every create call (``create_calls``, refused ones too) and every pod it starts
(``started``), and sees only the containers on its own network.

It also plays Kubeflow Trainer v2 and JobSet for ``kubernetes_api="trainjob"``: a
``TrainingRuntime`` is stored as created; a ``TrainJob`` is resolved against the runtime its
``runtimeRef`` names (``numNodes`` from the TrainJob's ``trainer``, else the runtime's
``mlPolicy``), and then, as Trainer's MPI plugin and the JobSet controller would:

- the plugin's ``<job>-mpi-ssh-auth`` key pair, mounted at ``mlPolicy.mpi.sshAuthMountPath``
  in every pod, and its ``<job>-mpi-hostfile`` ConfigMap at ``/etc/mpi/hostfile`` in the
  launcher (``<job>-node-0-<i>.<job>.<ns>.svc slots=<numProcPerNode>``, the launcher not
  among them: ``runLauncherAsNode: false``) with the ``OMPI_MCA_*`` env it adds;
- the replicated jobs in their order (``startupPolicyOrder: InOrder``: the next starts when
  every pod of the one before passes its readiness probe), pod ``i`` of Job ``j`` of
  replicated job ``r`` named ``<job>-<r>-<j>-<i>`` with JobSet's labels
  (``jobset.sigs.k8s.io/jobset-name``, ``replicatedjob-name``) and the template's;
- the TrainJob ``Complete`` when the launcher exits 0 (``successPolicy`` targets it),
  ``Failed`` otherwise (``failurePolicy.maxRestarts: 0``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kubernetes.client.exceptions import ApiException

HARNESS_LABEL = "hva-mpijob-harness"  # on every container the harness makes: its job
# ... and its network: a cluster sees (and removes) only its own containers, never those of
# another test session's cluster on this machine (the job names are deterministic)
NETWORK_LABEL = "hva-mpijob-network"
HOSTFILE_DIR = "/etc/mpi"
# What the launcher's pod templates may use; the harness refuses what it does not emulate.
CONTAINER_KEYS = frozenset(
    {"name", "image", "command", "args", "env", "volumeMounts", "readinessProbe", "imagePullPolicy",
     "securityContext"}
)  # fmt: skip
POD_KEYS = frozenset(
    {"containers", "volumes", "securityContext", "restartPolicy", "automountServiceAccountToken"}
)
#: The pod and container security settings the harness applies, as podman options.
POD_SECURITY_KEYS = frozenset(
    {"fsGroup", "runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile"}
)
CONTAINER_SECURITY_KEYS = frozenset({"allowPrivilegeEscalation", "capabilities"})
TRAINER = ("trainer.kubeflow.org", "v1alpha1")
RUNNING_STATES = ("created", "configured", "running", "initialized")
READY_WITHIN_S = 60.0
DISCOVERY_REFRESH_S = 5.0  # one operator reconcile + kubelet ConfigMap projection (see above)
DISCOVER_HOSTS = "discover_hosts.sh"
#: The modes of the operator's ConfigMap volume items (configVolumeItems).
CONFIG_MODES = {"hostfile": 0o444, DISCOVER_HOSTS: 0o555}


def podman(env: Mapping[str, str], *args: str, check: bool = True) -> str:
    done = subprocess.run(
        ["podman", *args], capture_output=True, text=True, env={**os.environ, **env}, timeout=300
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} … exited {done.returncode}: {done.stderr}")
    return done.stdout


def ssh_key_pair() -> tuple[bytes, bytes]:
    """(private PEM, public ``authorized_keys`` line): the operator's ECDSA P-521 key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP521R1())
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return private, public + b"\n"


def write_volume(folder: Path, files: Mapping[str, bytes], mode: int, fs_group: int | None) -> Path:
    """A Secret/ConfigMap volume as the kubelet writes it: root-owned files of ``mode``, or
    group ``fs_group`` with group read added when the pod sets ``fsGroup``."""
    folder.mkdir(parents=True)
    os.chmod(folder, 0o755)
    for name, data in files.items():
        path = folder / name
        path.write_bytes(data)
        if fs_group is None:
            os.chown(path, 0, 0)
            os.chmod(path, mode)
        else:
            os.chown(path, 0, fs_group)
            os.chmod(path, mode | 0o440)
    return folder


def discover_hosts_script(name: str, namespace: str, running: Sequence[str]) -> str:
    """The MPI Operator's ``discover_hosts.sh``: the Running worker pods, sorted by name."""
    lines = "".join(f"echo {pod}.{name}.{namespace}.svc\n" for pod in sorted(running))
    return f"#!/bin/sh\n{lines}"


def mpijob_labels(name: str, role: str) -> dict[str, str]:
    """The labels the MPI Operator puts on an MPIJob's pods."""
    return {"training.kubeflow.org/job-name": name, "training.kubeflow.org/job-role": role}


class _Core:
    """``CoreV1Api``: the job's credential Secret, its pods (containers) and their logs."""

    def __init__(self, cluster: PodmanCluster) -> None:
        self.cluster = cluster
        self.secrets: dict[str, dict[str, Any]] = {}

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        if name in self.secrets:
            raise ApiException(status=409, reason="AlreadyExists")
        self.secrets[name] = json.loads(json.dumps(body))

    def patch_namespaced_secret(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        if name not in self.secrets:
            raise ApiException(status=404)
        secret = self.secrets[name]
        secret["metadata"].update(body.get("metadata") or {})
        if "stringData" in body:
            secret["stringData"] = dict(body["stringData"])

    def delete_namespaced_secret(self, name: str, namespace: str) -> None:
        if self.secrets.pop(name, None) is None:
            raise ApiException(status=404)

    def list_namespaced_pod(self, namespace: str, label_selector: str) -> Any:
        wanted = dict(term.split("=", 1) for term in label_selector.split(","))
        items = []
        for pod in self.cluster.pods():
            if all(pod.metadata.labels.get(k) == v for k, v in wanted.items()):
                items.append(pod)
        return SimpleNamespace(items=items)

    def read_namespaced_pod_log(
        self,
        name: str,
        namespace: str,
        *,
        timestamps: bool = False,
        since_seconds: int | None = None,
        follow: bool = False,
        _preload_content: bool = True,
    ) -> Any:
        """``podman logs`` as the API's pod log: ``timestamps`` (RFC3339Nano prefixes),
        ``since_seconds``, and ``follow`` with ``_preload_content=False`` (a response whose
        ``stream()`` yields the bytes as the container writes them, until it exits)."""
        args = ["podman", "logs", *(["--timestamps"] if timestamps else [])]
        if since_seconds is not None:
            args += ["--since", f"{int(since_seconds)}s"]
        env = {**os.environ, **self.cluster.podman_env}
        if follow:
            assert _preload_content is False, "a followed log is read as a stream"
            process = subprocess.Popen(
                [*args, "--follow", name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
            )
            return _FollowedLog(process)
        # podman logs writes the container's stdout to stdout and its stderr to stderr
        done = subprocess.run([*args, name], capture_output=True, text=True, env=env, timeout=120)
        if done.returncode != 0:
            raise ApiException(status=404, reason=done.stderr.strip())
        return done.stdout + done.stderr


class _FollowedLog:
    """``podman logs --follow`` as a streamed ``urllib3.HTTPResponse``."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    def stream(self, amt: Any = None, decode_content: bool = True) -> Any:
        assert self.process.stdout is not None
        while chunk := self.process.stdout.read1(65536):
            yield chunk
        self.process.wait()

    def release_conn(self) -> None:
        self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class PodmanCluster:
    """The launcher's ``KubernetesHook`` and the MPI Operator, on one podman network."""

    def __init__(
        self,
        podman_env: Mapping[str, str],
        *,
        network: str,
        subnet_prefix: str,  # "10.89.N": pods get <prefix>.10 and up
        workdir: Path,
        namespace: str = "hva",
    ) -> None:
        self.podman_env = dict(podman_env)
        self.network = network
        self.subnet_prefix = subnet_prefix
        self.workdir = workdir
        self.namespace = namespace
        self.core_v1_client = _Core(self)
        self.jobs: dict[str, dict[str, Any]] = {}
        self.created: list[dict[str, Any]] = []  # every MPIJob manifest, as created
        # every create call, refused ones too: (plural, name)
        self.create_calls: list[tuple[str, str]] = []
        self.started: list[str] = []  # every pod (container) started, in order
        self.hostfiles: dict[str, str] = {}
        self.runtimes: dict[str, dict[str, Any]] = {}  # TrainingRuntimes, as stored
        self.trainjobs: dict[str, dict[str, Any]] = {}
        self.custom_object_client = SimpleNamespace(
            patch_namespaced_custom_object=self._patch_custom_object
        )
        self._next_ip = 10
        # the operator's reconcile loop: each MPIJob's worker pods (how to make each again)
        # and its launcher's config folder; one lock with the deletes, so a pod is never made
        # again for a job that is being cleaned up
        self._workers: dict[str, dict[str, dict[str, Any]]] = {}
        self._config_dirs: dict[str, Path] = {}
        self.discovery: dict[str, list[str]] = {}  # every discover_hosts.sh, per job
        self.reconcile_errors: list[str] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._reconciler: threading.Thread | None = None

    # --- KubernetesHook ---------------------------------------------------------------
    def get_namespace(self) -> str:
        return self.namespace

    def create_custom_object(self, group, version, plural, body, namespace=None):
        self.create_calls.append((plural, body["metadata"]["name"]))
        if (group, version) == TRAINER:
            return self._create_trainer_object(plural, body)
        assert (group, version, plural) == ("kubeflow.org", "v2beta1", "mpijobs")
        name = body["metadata"]["name"]
        if name in self.jobs:
            raise ApiException(status=409, reason="AlreadyExists")
        manifest = json.loads(json.dumps(body))  # what the API server stores
        self.jobs[name] = manifest
        self.created.append(manifest)
        self._start(manifest)
        return {**manifest, "metadata": {**manifest["metadata"], "uid": f"uid-{name}"}}

    def get_custom_object(self, group, version, plural, name, namespace=None):
        if (group, version) == TRAINER:
            return self._get_trainer_object(plural, name)
        if name not in self.jobs:
            raise ApiException(status=404)
        status, code = self.state(f"{name}-launcher")
        if status in ("created", "configured", "running", "initialized"):
            conditions = [{"type": "Running", "status": "True"}]
        else:
            with self._lock:
                self._clean_running_workers(name)  # cleanPodPolicy: Running
            if code == 0:
                conditions = [{"type": "Succeeded", "status": "True", "message": "completed"}]
            else:
                conditions = [
                    {
                        "type": "Failed",
                        "status": "True",
                        "reason": "BackoffLimitExceeded",
                        "message": f"launcher {name}-launcher exited with code {code}",
                    }
                ]
        return {**self.jobs[name], "status": {"conditions": conditions}}

    def delete_custom_object(self, group, version, plural, name, namespace=None, **kw):
        if (group, version) == TRAINER:
            store = self.runtimes if plural == "trainingruntimes" else self.trainjobs
            if store.pop(name, None) is None:
                raise ApiException(status=404)
            if plural == "trainjobs":
                for container in self.containers(job=name):
                    podman(self.podman_env, "rm", "-f", "-t", "0", container, check=False)
            return
        with self._lock:
            if self.jobs.pop(name, None) is None:
                raise ApiException(status=404)
            for container in self.containers(job=name):
                podman(self.podman_env, "rm", "-f", "-t", "0", container, check=False)

    def _patch_custom_object(self, group, version, plural, name, namespace, body):
        assert (group, version) == TRAINER and plural == "trainingruntimes", plural
        if name not in self.runtimes:
            raise ApiException(status=404)
        self.runtimes[name]["metadata"].update(body.get("metadata") or {})

    # --- Kubeflow Trainer v2 and JobSet ------------------------------------------------
    def _create_trainer_object(self, plural: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        manifest = json.loads(json.dumps(body))
        uid = {"metadata": {**manifest["metadata"], "uid": f"uid-{plural}-{name}"}}
        if plural == "trainingruntimes":
            if name in self.runtimes:
                raise ApiException(status=409, reason="AlreadyExists")
            self.runtimes[name] = manifest
            return {**manifest, **uid}
        assert plural == "trainjobs", plural
        if name in self.trainjobs:
            raise ApiException(status=409, reason="AlreadyExists")
        ref = manifest["spec"]["runtimeRef"]
        assert ref.get("kind", "ClusterTrainingRuntime") == "TrainingRuntime", ref
        assert ref.get("apiGroup", TRAINER[0]) == TRAINER[0], ref
        runtime = self.runtimes.get(ref["name"])
        if runtime is None:  # Trainer's webhook refuses a TrainJob without its runtime
            raise ApiException(status=422, reason=f"TrainingRuntime {ref['name']} not found")
        self.trainjobs[name] = manifest
        self.created.append(manifest)
        self._start_trainjob(manifest, runtime)
        return {**manifest, **uid}

    def _get_trainer_object(self, plural: str, name: str) -> dict[str, Any]:
        if plural == "trainingruntimes":
            if name not in self.runtimes:
                raise ApiException(status=404)
            return self.runtimes[name]
        if name not in self.trainjobs:
            raise ApiException(status=404)
        launcher = [c for c in self.containers(job=name) if "-launcher-" in c]
        conditions: list[dict[str, Any]] = []
        if launcher:
            status, code = self.state(launcher[0])
            if status not in RUNNING_STATES:
                self._clean_running_workers(name, "-node-")
                if code == 0:
                    conditions = [{"type": "Complete", "status": "True", "message": "done"}]
                else:
                    conditions = [
                        {
                            "type": "Failed",
                            "status": "True",
                            "reason": "JobsFailed",
                            "message": f"launcher {launcher[0]} exited with code {code}",
                        }
                    ]
        return {**self.trainjobs[name], "status": {"conditions": conditions}}

    def _start_trainjob(self, trainjob: dict[str, Any], runtime: dict[str, Any]) -> None:
        name, ns = trainjob["metadata"]["name"], trainjob["metadata"]["namespace"]
        policy = runtime["spec"]["mlPolicy"]
        mpi = policy["mpi"]
        assert mpi.get("mpiImplementation", "OpenMPI") == "OpenMPI", mpi
        assert not mpi.get("runLauncherAsNode"), "runLauncherAsNode is not emulated"
        nodes = int((trainjob["spec"].get("trainer") or {}).get("numNodes") or policy["numNodes"])
        slots = int(mpi.get("numProcPerNode", 1))
        ssh_path = mpi.get("sshAuthMountPath", "/root/.ssh")
        private, public = ssh_key_pair()
        ssh_files = {"id_rsa": private, "id_rsa.pub": public, "authorized_keys": public}
        ssh_mode = 0o600 if ssh_path == "/root/.ssh" else 0o644
        jobset = runtime["spec"]["template"]["spec"]
        assert jobset.get("startupPolicy") == {"startupPolicyOrder": "InOrder"}, jobset
        rjobs = jobset["replicatedJobs"]
        assert [r["name"] for r in rjobs] == ["node", "launcher"], rjobs
        pods: dict[str, list[str]] = {}
        for rjob in rjobs:
            assert int(rjob.get("replicas", 1)) == 1, rjob
            count = nodes if rjob["name"] == "node" else 1
            pods[rjob["name"]] = [f"{name}-{rjob['name']}-0-{i}" for i in range(count)]
        ips = {pod: self._ip() for group in pods.values() for pod in group}
        hosts = []
        for pod, ip in ips.items():
            for fqdn in (f"{pod}.{name}.{ns}.svc", f"{pod}.{name}.{ns}.svc.cluster.local"):
                hosts.append(f"{fqdn}:{ip}")
        hostfile = "".join(f"{pod}.{name}.{ns}.svc slots={slots}\n" for pod in pods["node"])
        self.hostfiles[name] = hostfile
        ncpu = os.cpu_count() or 1
        for rjob in rjobs:  # InOrder: each replicated job once the one before is ready
            role = rjob["name"]
            job_spec = rjob["template"]["spec"]
            template = job_spec["template"]
            for i, pod in enumerate(pods[role]):
                labels = {
                    "jobset.sigs.k8s.io/jobset-name": name,
                    "jobset.sigs.k8s.io/replicatedjob-name": role,
                    "jobset.sigs.k8s.io/job-index": "0",
                }
                extra_env: dict[str, str] = {}
                config = None
                if role == "launcher":
                    extra_env = {
                        "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
                        "OMPI_MCA_orte_default_hostfile": f"{HOSTFILE_DIR}/hostfile",
                        "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
                        "OMPI_MCA_orte_set_default_slots": str(slots),
                    }
                    config = {"hostfile": hostfile.encode()}
                self._run_pod(
                    name,
                    pod,
                    template,
                    labels=labels,
                    ip=ips[pod],
                    hosts=hosts,
                    extra_env=extra_env,
                    ssh=(ssh_path, ssh_files, ssh_mode),
                    config=config,
                    cpus=sorted({(i * slots + k) % ncpu for k in range(slots)})
                    if role == "node"
                    else (),
                )
            if "readinessProbe" in template["spec"]["containers"][0]:
                for pod in pods[role]:
                    self._wait_ready(template, pod, ips[pod])

    # --- the operator's part ----------------------------------------------------------
    def _ip(self) -> str:
        self._next_ip += 1
        return f"{self.subnet_prefix}.{self._next_ip}"

    def _start(self, job: dict[str, Any]) -> None:
        name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
        spec = job["spec"]
        replicas = spec["mpiReplicaSpecs"]
        workers = int(replicas["Worker"]["replicas"])
        slots = int(spec.get("slotsPerWorker", 1))
        ssh_path = spec.get("sshAuthMountPath", "/root/.ssh")
        private, public = ssh_key_pair()
        ssh_files = {"id_rsa": private, "id_rsa.pub": public, "authorized_keys": public}
        ssh_mode = 0o600 if ssh_path == "/root/.ssh" else 0o644
        pods = [f"{name}-worker-{i}" for i in range(workers)] + [f"{name}-launcher"]
        ips = {pod: self._ip() for pod in pods}
        # the headless Service <job>: <pod>.<job>.<ns>.svc for every pod of the job
        hosts = []
        for pod, ip in ips.items():
            for fqdn in (f"{pod}.{name}.{ns}.svc", f"{pod}.{name}.{ns}.svc.cluster.local"):
                hosts.append(f"{fqdn}:{ip}")
        hostfile = "".join(
            f"{name}-worker-{i}.{name}.{ns}.svc slots={slots}\n" for i in range(workers)
        )
        self.hostfiles[name] = hostfile
        ncpu = os.cpu_count() or 1
        made: dict[str, dict[str, Any]] = {}
        for i in range(workers):
            pod = f"{name}-worker-{i}"
            made[pod] = dict(
                template=replicas["Worker"]["template"],
                labels=mpijob_labels(name, "worker"),
                ip=ips[pod],
                hosts=hosts,
                extra_env={"K_MPI_JOB_ROLE": "worker"},
                ssh=(ssh_path, ssh_files, ssh_mode),
                cpus=sorted({(i * slots + k) % ncpu for k in range(slots)}),
            )
            self._run_pod(name, pod, **made[pod])
        for i in range(workers):
            pod = f"{name}-worker-{i}"
            self._wait_ready(replicas["Worker"]["template"], pod, ips[pod])
        running = [pod for pod in made if self.state(pod)[0] == "running"]
        script = discover_hosts_script(name, ns, running)
        self.discovery[name] = [script]
        pod = f"{name}-launcher"
        self._run_pod(
            name,
            pod,
            replicas["Launcher"]["template"],
            labels=mpijob_labels(name, "launcher"),
            ip=ips[pod],
            hosts=hosts,
            extra_env={
                "K_MPI_JOB_ROLE": "launcher",
                "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
                "OMPI_MCA_orte_default_hostfile": f"{HOSTFILE_DIR}/hostfile",
                "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
                "OMPI_MCA_orte_set_default_slots": str(slots),
                "NVIDIA_VISIBLE_DEVICES": "",
                "NVIDIA_DRIVER_CAPABILITIES": "",
            },
            ssh=(ssh_path, ssh_files, ssh_mode),
            config={"hostfile": hostfile.encode(), DISCOVER_HOSTS: script.encode()},
        )
        with self._lock:
            self._workers[name] = made
            self._config_dirs[name] = self.workdir / pod / "mpi-job-config"
            if self._reconciler is None:
                self._reconciler = threading.Thread(target=self._reconcile_loop, daemon=True)
                self._reconciler.start()

    def _reconcile_loop(self) -> None:
        while not self._stop.wait(DISCOVERY_REFRESH_S):
            for name in list(self._workers):
                try:
                    self._reconcile(name)
                except Exception as e:  # the test asserts there were none
                    self.reconcile_errors.append(f"{name}: {e!r}")

    def _reconcile(self, name: str) -> None:
        """One pass of the operator's controller over MPIJob ``name`` while its launcher runs:
        deleted worker pods made again, ``discover_hosts.sh`` rewritten when it changed."""
        with self._lock:
            if name not in self.jobs:
                self._workers.pop(name, None)
                return
            if self.state(f"{name}-launcher")[0] not in RUNNING_STATES:
                return  # done: the operator makes no more pods for it
            # the controller's order: the ConfigMap (the pods Running now), then the workers
            made = self._workers[name]
            states = {pod: self.state(pod)[0] for pod in made}
            ns = self.jobs[name]["metadata"]["namespace"]
            script = discover_hosts_script(
                name, ns, [pod for pod, state in states.items() if state == "running"]
            )
            if script != self.discovery[name][-1]:
                folder = self._config_dirs[name]
                new = folder / f".{DISCOVER_HOSTS}.new"
                new.write_text(script)
                fs_group = os.stat(folder / "hostfile").st_gid
                os.chown(new, 0, fs_group)
                os.chmod(new, CONFIG_MODES[DISCOVER_HOSTS])
                new.rename(folder / DISCOVER_HOSTS)  # whole: old script or new, never half
                self.discovery[name].append(script)
            for pod, state in states.items():
                if state == "gone":  # deleted: made again (the next pass lists it, Running)
                    self._run_pod(name, pod, **made[pod])

    def _run_pod(
        self,
        name: str,
        pod: str,
        template: dict[str, Any],
        *,
        labels: Mapping[str, str],
        ip: str,
        hosts: Sequence[str],
        extra_env: Mapping[str, str],
        ssh: tuple[str, Mapping[str, bytes], int],
        config: Mapping[str, bytes] | None = None,
        cpus: Sequence[int] = (),
    ) -> None:
        spec = template["spec"]
        assert spec.get("restartPolicy", "Never") == "Never", f"{pod}: restartPolicy not emulated"
        unknown = set(spec) - POD_KEYS
        assert not unknown, f"{pod}: pod spec fields the harness does not emulate: {unknown}"
        (container,) = spec["containers"]
        unknown = set(container) - CONTAINER_KEYS
        assert not unknown, f"{pod}: container fields the harness does not emulate: {unknown}"
        security = spec.get("securityContext") or {}
        unknown = set(security) - POD_SECURITY_KEYS
        assert not unknown, f"{pod}: securityContext {unknown} not emulated"
        fs_group = security.get("fsGroup")
        # no API server here: a pod that wants a service-account token cannot have one
        assert spec.get("automountServiceAccountToken") is not True, f"{pod}: token not emulated"
        user_args: list[str] = []
        if "runAsUser" in security:
            user = f"{security['runAsUser']}:{security.get('runAsGroup', security['runAsUser'])}"
            user_args += ["--user", user]
            if security.get("runAsNonRoot"):
                assert security["runAsUser"] != 0, f"{pod}: runAsNonRoot with runAsUser 0"
        seccomp = (security.get("seccompProfile") or {}).get("type", "RuntimeDefault")
        assert seccomp == "RuntimeDefault", f"{pod}: seccomp {seccomp} not emulated"  # podman's
        confined = container.get("securityContext") or {}
        unknown = set(confined) - CONTAINER_SECURITY_KEYS
        assert not unknown, f"{pod}: container securityContext {unknown} not emulated"
        if confined.get("allowPrivilegeEscalation") is False:
            user_args += ["--security-opt", "no-new-privileges"]
        capabilities = confined.get("capabilities") or {}
        assert set(capabilities) <= {"drop"}, f"{pod}: capabilities {capabilities} not emulated"
        for cap in capabilities.get("drop", []):
            user_args += ["--cap-drop", cap.lower()]
        labels = {
            **(template.get("metadata") or {}).get("labels", {}),
            **labels,
            HARNESS_LABEL: name,
            NETWORK_LABEL: self.network,
        }
        args = ["run", "-d", "--name", pod, "--hostname", pod, "--network", self.network]
        args += ["--ip", ip, *user_args]
        if cpus:
            args += ["--cpuset-cpus", ",".join(map(str, cpus))]
        for host in hosts:
            args += ["--add-host", host]
        for key, value in labels.items():
            args += ["--label", f"{key}={value}"]
        env: dict[str, str] = {}
        for item in container.get("env") or []:
            assert set(item) <= {"name", "value"}, f"{pod}: env {item} (valueFrom) not emulated"
            env[item["name"]] = str(item.get("value", ""))
        env.update(extra_env)
        for key, value in env.items():
            args += ["--env", f"{key}={value}"]
        folder = self.workdir / pod
        shutil.rmtree(folder, ignore_errors=True)  # a deleted job's pod of the same name
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        for mount in container.get("volumeMounts") or []:
            volume = volumes[mount["name"]]
            assert set(volume) == {"name", "secret"}, f"{pod}: volume {volume} not emulated"
            source = volume["secret"]
            secret = self.core_v1_client.secrets.get(source["secretName"])
            assert secret is not None, f"{pod}: Secret {source['secretName']} does not exist"
            data = {k: v.encode() for k, v in (secret.get("stringData") or {}).items()}
            path = write_volume(
                folder / mount["name"], data, source.get("defaultMode", 0o644), fs_group
            )
            args += ["-v", f"{path}:{mount['mountPath']}:ro"]
        ssh_path, ssh_files, ssh_mode = ssh
        path = write_volume(folder / "ssh-auth", ssh_files, ssh_mode, fs_group)
        args += ["-v", f"{path}:{ssh_path}:ro"]
        if config is not None:
            path = write_volume(folder / "mpi-job-config", config, 0o444, fs_group)
            for key in config:  # the items' own modes (the script is executable)
                mode = CONFIG_MODES.get(key, 0o444)
                os.chmod(path / key, mode if fs_group is None else mode | 0o440)
            args += ["-v", f"{path}:{HOSTFILE_DIR}:ro"]
        if container.get("command"):
            args += ["--entrypoint", json.dumps(container["command"])]
        args += [container["image"], *container.get("args", [])]
        self.started.append(pod)
        podman(self.podman_env, *args)

    def _wait_ready(self, template: dict[str, Any], pod: str, ip: str) -> None:
        """The pod template's readiness probe (``tcpSocket``), from the host."""
        (container,) = template["spec"]["containers"]
        port = int(container["readinessProbe"]["tcpSocket"]["port"])
        deadline = time.monotonic() + READY_WITHIN_S
        while time.monotonic() < deadline:
            status, code = self.state(pod)
            if status not in ("created", "configured", "running", "initialized"):
                log = self.core_v1_client.read_namespaced_pod_log(pod, self.namespace)
                raise AssertionError(f"worker {pod} {status} (exit {code}) before ready:\n{log}")
            try:
                with socket.create_connection((ip, port), timeout=1):
                    return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"worker {pod} not ready on {ip}:{port} within {READY_WITHIN_S}s")

    def _clean_running_workers(self, name: str, infix: str = "-worker-") -> None:
        for container in self.containers(job=name):
            if infix in container and self.state(container)[0] == "running":
                podman(self.podman_env, "rm", "-f", "-t", "0", container, check=False)

    # --- looking at the containers ----------------------------------------------------
    def state(self, container: str) -> tuple[str, int | None]:
        out = podman(
            self.podman_env,
            "inspect",
            "--format",
            "{{.State.Status}} {{.State.ExitCode}}",
            container,
            check=False,
        ).split()
        if len(out) != 2:
            return "gone", None
        return out[0], int(out[1])

    def containers(self, job: str | None = None, running: bool = False) -> list[str]:
        label = f"{HARNESS_LABEL}={job}" if job else HARNESS_LABEL
        args = ["ps", "--filter", f"label={label}", "--filter"]  # both labels (AND)
        args += [f"label={NETWORK_LABEL}={self.network}", "--format", "{{.Names}}"]
        out = podman(self.podman_env, *args, *([] if running else ["-a"]))
        return sorted(out.split())

    def pods(self) -> list[Any]:
        """The containers as ``V1Pod``s (the attributes the launcher reads)."""
        phases = {"running": "Running", "created": "Pending", "configured": "Pending"}
        pods = []
        for container in self.containers():
            out = podman(
                self.podman_env, "inspect", "--format", "{{json .Config.Labels}}", container
            )
            labels = json.loads(out)
            status, code = self.state(container)
            phase = phases.get(status) or ("Succeeded" if code == 0 else "Failed")
            pods.append(
                SimpleNamespace(
                    metadata=SimpleNamespace(name=container, labels=labels),
                    status=SimpleNamespace(
                        phase=phase,
                        message=None,
                        reason=None,
                        conditions=[],
                        init_container_statuses=None,
                        container_statuses=[],
                    ),
                )
            )
        return pods

    def remove_all(self) -> None:
        self._stop.set()
        if self._reconciler is not None:
            self._reconciler.join(timeout=120)
        with self._lock:
            for container in self.containers():
                podman(self.podman_env, "rm", "-f", "-t", "0", container, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)
