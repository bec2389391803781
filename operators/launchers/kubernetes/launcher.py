"""The kubernetes launcher: submit the job (or re-attach to the one an earlier try left
running), wait for it (poll, or defer to the triggerer), surface its launcher log, clean up."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from horovod_airflow.operators.command import Host, rank_env_file_text
from horovod_airflow.operators.exceptions import (
    HorovodImageError,
    HorovodLaunchError,
    HorovodTimeoutError,
    HorovodTrainingError,
    JobNotOursError,
)
from horovod_airflow.operators.launchers.base import (
    JobResult,
    JobSpec,
    Launcher,
    LogTail,
    describe_failure,
    made_by_this_task,
)
from horovod_airflow.operators.launchers.kubernetes import client
from horovod_airflow.operators.launchers.kubernetes.api import (
    TRAINING_RUNTIME,
    TRAINJOB,
    Resource,
    flavour,
)
from horovod_airflow.operators.launchers.kubernetes.client import ApiRetry
from horovod_airflow.operators.launchers.kubernetes.logs import LauncherLog
from horovod_airflow.operators.launchers.kubernetes.manifests import (
    SECRET_KEY,
    build_mpijob,
    build_trainjob,
    job_labels,
    mpijob_hosts,
    runtime_hosts,
    secret_name,
)
from horovod_airflow.operators.launchers.kubernetes.options import KubernetesOptions
from horovod_airflow.operators.launchers.kubernetes.overrides import (
    OWNED_TRAINJOB_PATHS,
    apply_mpijob_overrides,
    apply_overrides,
)
from horovod_airflow.operators.launchers.kubernetes.pods import IMAGE_FAILURES, pod_start_failure

DELETE_WAIT_S = 300.0  # how long a retry waits for the earlier try's job to be deleted


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
            self._hook = client.KubernetesHook(conn_id=self.kubernetes_conn_id)
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
