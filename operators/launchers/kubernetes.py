"""Run the job as a Kubeflow MPIJob (``kubeflow.org/v2beta1``): one launcher pod running
``horovodrun`` over ssh to ``num_proc / slots_per_worker`` worker pods.

Both run the trainer image as its user (uid 1000): each worker is the image's sshd on port
2222 (``WORKER_COMMAND``), the MPI Operator mounts the job's key pair in that user's ``~/.ssh``
(``sshAuthMountPath``), and horovodrun connects with ``-p 2222``.

The cluster client comes from the cncf-kubernetes provider's ``KubernetesHook``. Credentials
never appear in the manifest: they go into a Kubernetes Secret (owned by the MPIJob, so it
is garbage-collected with it) that is mounted as the private rank env file
(``HVA_RANK_ENV_FILE``) in every pod; each rank sources it just before it starts (see
``operators.command``). Waiting is done by polling here, or — with ``deferrable=True`` on
the operator — by :class:`operators.triggers.MPIJobTrigger`, freeing the worker slot.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from operators.command import RANK_ENV_FILE_VAR, Host, horovodrun_argv, rank_env_file_text
from operators.exceptions import HorovodLaunchError, HorovodTimeoutError, HorovodTrainingError
from operators.launchers.base import JobResult, JobSpec, Launcher, LogTail, describe_failure

GROUP, VERSION, PLURAL = "kubeflow.org", "v2beta1", "mpijobs"
SECRET_MOUNT = "/etc/hva-rank-env"
SECRET_KEY = "rank.env"
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
JOB_ROLE_LABEL = "training.kubeflow.org/job-role"

# The trainer image as an MPIJob pod: docker/trainer.Dockerfile installs sshd and
# docker/trainer-sshd_config; tests/operators/test_kubernetes_launcher.py checks these values
# against those two files, so the image and the manifest cannot drift apart.
TRAINER_HOME = "/home/trainer"  # the home of the image's user (uid 1000)
# Where the MPI Operator mounts the job's key pair (id_rsa, id_rsa.pub, authorized_keys): the
# user's ~/.ssh, so the launcher's ssh finds its key there and the worker's sshd serves it.
SSH_AUTH_MOUNT_PATH = f"{TRAINER_HOME}/.ssh"
WORKER_SSH_PORT = 2222  # a non-root sshd cannot bind port 22
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


def mpijob_phase(obj: Mapping[str, Any] | None) -> tuple[str, str]:
    """(``"succeeded"`` | ``"failed"`` | ``"running"``, message) from an MPIJob's conditions."""
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    for cond in conditions:
        if cond.get("status") != "True":
            continue
        if cond.get("type") == "Succeeded":
            return "succeeded", str(cond.get("message") or "")
        if cond.get("type") == "Failed":
            reason = cond.get("reason") or ""
            return "failed", f"{reason}: {cond.get('message') or ''}".strip(": ")
    return "running", ""


def secret_name(job: str) -> str:
    return f"{job}-rank-env"


def build_mpijob(
    spec: JobSpec,
    *,
    image: str,
    namespace: str,
    slots_per_worker: int,
    image_pull_policy: str = "IfNotPresent",
    service_account: str | None = None,
) -> dict[str, Any]:
    """The MPIJob manifest for a horovodrun job. ``spec.argv`` is the program's command."""
    if spec.num_proc % slots_per_worker:
        raise ValueError(
            f"num_proc={spec.num_proc} is not a multiple of slots_per_worker="
            f"{slots_per_worker}: each MPIJob worker runs exactly slots_per_worker ranks"
        )
    workers = spec.num_proc // slots_per_worker
    name = spec.name
    hosts = [
        Host(f"{name}-worker-{i}.{name}.{namespace}.svc", slots_per_worker) for i in range(workers)
    ]
    command = horovodrun_argv(
        spec.argv,
        num_proc=spec.num_proc,
        hosts=hosts,
        ssh_port=WORKER_SSH_PORT,
        controller=spec.controller,
    )
    env = [{"name": k, "value": str(v)} for k, v in sorted(spec.env.items())]
    env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if spec.secret_env:
        env.append({"name": RANK_ENV_FILE_VAR, "value": f"{SECRET_MOUNT}/{SECRET_KEY}"})
        volumes.append(
            {"name": "rank-env", "secret": {"secretName": secret_name(name), "defaultMode": 0o400}}
        )
        mounts.append({"name": "rank-env", "mountPath": SECRET_MOUNT, "readOnly": True})
    gpus = spec.gpus_per_proc * slots_per_worker

    def pod(role: str, container: dict[str, Any]) -> dict[str, Any]:
        pod_spec: dict[str, Any] = {"containers": [container], "volumes": volumes}
        if service_account:
            pod_spec["serviceAccountName"] = service_account
        return {
            "metadata": {"labels": {"horovod-airflow/job": name, "role": role}},
            "spec": pod_spec,
        }

    worker_container: dict[str, Any] = {
        "name": "worker",
        "image": image,
        "imagePullPolicy": image_pull_policy,
        "command": list(WORKER_COMMAND),
        "env": env,
        "volumeMounts": mounts,
        # Ready once sshd listens: launcherCreationPolicy WaitForWorkersReady then starts the
        # launcher only when horovodrun can reach every worker.
        "readinessProbe": {"tcpSocket": {"port": WORKER_SSH_PORT}, "periodSeconds": 2},
    }
    if gpus:
        worker_container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    launcher_container = {
        "name": "launcher",
        "image": image,
        "imagePullPolicy": image_pull_policy,
        "command": command,
        "env": env,
        "volumeMounts": mounts,
    }
    run_policy: dict[str, Any] = {"cleanPodPolicy": "Running", "backoffLimit": 0}
    if spec.timeout:
        run_policy["activeDeadlineSeconds"] = int(spec.timeout)
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "MPIJob",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"horovod-airflow/job": name},
        },
        "spec": {
            "slotsPerWorker": slots_per_worker,
            "sshAuthMountPath": SSH_AUTH_MOUNT_PATH,
            "runPolicy": run_policy,
            "launcherCreationPolicy": "WaitForWorkersReady",
            "mpiReplicaSpecs": {
                "Launcher": {
                    "replicas": 1,
                    "restartPolicy": "Never",
                    "template": pod("launcher", launcher_container),
                },
                "Worker": {
                    "replicas": workers,
                    "restartPolicy": "Never",
                    "template": pod("worker", worker_container),
                },
            },
        },
    }


class KubernetesLauncher(Launcher):
    """Submit an MPIJob, wait (poll or defer), surface the launcher log, clean up."""

    name = "kubernetes"

    def __init__(
        self,
        *,
        image: str,
        kubernetes_conn_id: str | None = "kubernetes_default",
        namespace: str | None = None,
        slots_per_worker: int = 1,
        poll_interval: float = 15.0,
        cleanup: str = "delete_on_success",
        hook: Any | None = None,
    ) -> None:
        self.image = image
        self.kubernetes_conn_id = kubernetes_conn_id
        self._namespace = namespace
        self.slots_per_worker = slots_per_worker
        self.poll_interval = poll_interval
        self.cleanup = cleanup
        self._hook = hook
        self._ref: dict[str, str] | None = None

    @property
    def hook(self) -> Any:
        if self._hook is None:
            self._hook = KubernetesHook(conn_id=self.kubernetes_conn_id)
        return self._hook

    @property
    def namespace(self) -> str:
        return self._namespace or self.hook.get_namespace() or "default"

    def manifest(self, spec: JobSpec) -> dict[str, Any]:
        """The MPIJob; a one-process job (``spec.distributed`` False, e.g. the export) runs as
        one rank on one worker pod, whatever ``slots_per_worker`` the training uses."""
        slots = self.slots_per_worker if spec.distributed else 1
        return build_mpijob(
            spec, image=self.image, namespace=self.namespace, slots_per_worker=slots
        )

    def submit(self, spec: JobSpec, log: Any) -> dict[str, str]:
        """Create the Secret and the MPIJob; return ``{"name", "namespace"}``."""
        body = self.manifest(spec)
        ns = self.namespace
        try:
            if spec.secret_env:
                self.hook.core_v1_client.create_namespaced_secret(
                    namespace=ns,
                    body={
                        "apiVersion": "v1",
                        "kind": "Secret",
                        "metadata": {
                            "name": secret_name(spec.name),
                            "namespace": ns,
                            "labels": {"horovod-airflow/job": spec.name},
                        },
                        "type": "Opaque",
                        "stringData": {SECRET_KEY: rank_env_file_text(spec.secret_env)},
                    },
                )
            created = self.hook.create_custom_object(
                group=GROUP, version=VERSION, plural=PLURAL, body=body, namespace=ns
            )
        except Exception as e:
            if spec.secret_env:  # a Secret without its job would hold credentials forever
                try:
                    self.delete_secret({"name": spec.name, "namespace": ns})
                except Exception as cleanup_error:
                    log.warning(
                        "could not delete Secret %s/%s after the failed create: %s",
                        ns,
                        secret_name(spec.name),
                        cleanup_error,
                    )
            raise HorovodLaunchError(f"cannot create MPIJob {spec.name!r} in {ns!r}: {e}") from e
        self._ref = {"name": spec.name, "namespace": ns}
        uid = (created or {}).get("metadata", {}).get("uid") if isinstance(created, dict) else None
        if spec.secret_env and uid:
            # The Secret dies with the MPIJob (Kubernetes garbage collection).
            try:
                self.hook.core_v1_client.patch_namespaced_secret(
                    name=secret_name(spec.name),
                    namespace=ns,
                    body={
                        "metadata": {
                            "ownerReferences": [
                                {
                                    "apiVersion": f"{GROUP}/{VERSION}",
                                    "kind": "MPIJob",
                                    "name": spec.name,
                                    "uid": uid,
                                }
                            ]
                        }
                    },
                )
            except Exception as e:
                log.warning("could not make the MPIJob own its Secret: %s", e)
        log.info("submitted MPIJob %s/%s (%d ranks)", ns, spec.name, spec.num_proc)
        return dict(self._ref)

    def status(self, ref: Mapping[str, str]) -> tuple[str, str]:
        obj = self.hook.get_custom_object(
            group=GROUP,
            version=VERSION,
            plural=PLURAL,
            name=ref["name"],
            namespace=ref["namespace"],
        )
        return mpijob_phase(obj)

    def run(self, spec: JobSpec, log: Any) -> JobResult:
        ref = self.submit(spec, log)
        deadline = time.monotonic() + spec.timeout if spec.timeout else None
        while True:
            if self._ref is None:
                raise HorovodTrainingError(f"MPIJob {ref['name']!r} was deleted (on_kill)")
            phase, message = self.status(ref)
            if phase != "running":
                event = {
                    "status": "success" if phase == "succeeded" else "failed",
                    "message": message,
                    **ref,
                }
                break
            if deadline is not None and time.monotonic() > deadline:
                event = {"status": "timeout", "message": f"ran longer than {spec.timeout}s", **ref}
                break
            time.sleep(self.poll_interval)
        return self.finish(
            ref, event, log, secrets=list(spec.secret_env.values()), timeout=spec.timeout
        )

    def launcher_log(self, ref: Mapping[str, str]) -> list[str]:
        """The launcher pod's log (horovodrun's rank-prefixed output of every rank)."""
        core = self.hook.core_v1_client
        pods = core.list_namespaced_pod(
            namespace=ref["namespace"],
            label_selector=f"{JOB_NAME_LABEL}={ref['name']},{JOB_ROLE_LABEL}=launcher",
        )
        lines: list[str] = []
        for pod in getattr(pods, "items", []) or []:
            text = core.read_namespaced_pod_log(name=pod.metadata.name, namespace=ref["namespace"])
            lines += str(text).splitlines()
        return lines

    def finish(
        self,
        ref: Mapping[str, str],
        event: Mapping[str, Any],
        log: Any,
        *,
        secrets: Sequence[str] = (),
        timeout: float | None = None,
    ) -> JobResult:
        """Surface the launcher log, apply the cleanup policy, raise unless it succeeded."""
        out = LogTail(log, secrets=secrets)
        try:
            for line in self.launcher_log(ref):
                out(line)
        except Exception as e:
            log.warning("could not read the launcher pod log of %s: %s", ref["name"], e)
        status = event.get("status")
        success = status == "success"
        if self.cleanup == "delete" or (self.cleanup == "delete_on_success" and success):
            self.delete(ref)
        else:
            # The job is kept for inspection, but its credentials never outlive it: the pods
            # have finished and the launcher's log is in the task log already.
            try:
                self.delete_secret(ref)
            except Exception as e:
                log.warning("could not delete Secret of %s: %s", ref["name"], e)
        if success:
            return JobResult(exit_code=0, log_tail=out.tail())
        if status == "timeout":
            raise HorovodTimeoutError(
                f"MPIJob {ref['name']!r} did not finish in time: {event.get('message')}",
                timeout=float(timeout or event.get("timeout") or 0),
                log_tail=out.tail(),
            )
        message = describe_failure(ref["name"], 1, out.tail())
        raise HorovodTrainingError(
            f"MPIJob {ref['namespace']}/{ref['name']} {status}: {event.get('message')}; {message}",
            exit_code=None,
            log_tail=out.tail(),
        )

    def delete(self, ref: Mapping[str, str]) -> None:
        """Delete the MPIJob (its pods go with it) and its Secret; absent ones are fine."""
        from kubernetes.client.exceptions import ApiException

        def absent(e: ApiException) -> bool:
            return e.status == 404

        try:
            self.hook.delete_custom_object(
                group=GROUP,
                version=VERSION,
                plural=PLURAL,
                name=ref["name"],
                namespace=ref["namespace"],
                propagation_policy="Foreground",
            )
        except ApiException as e:
            if not absent(e):
                raise
        self.delete_secret(ref)

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
        ref, self._ref = self._ref, None
        if ref is not None:
            self.delete(ref)
