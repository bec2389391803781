"""The kubernetes launcher: submit the job (or re-attach to the one an earlier try left
running), wait for it (poll, or defer to the triggerer), surface its launcher log, clean up."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from horovod_airflow.operators.command import Host
from horovod_airflow.operators.exceptions import (
    HorovodConfigError,
    HorovodImageError,
    HorovodLaunchError,
    HorovodTrainingError,
    JobNotOursError,
)
from horovod_airflow.operators.launchers.base import (
    JobResult,
    JobSpec,
    Launcher,
    LogTail,
    check_elastic_bounds,
    end_of_job,
    made_by_this_task,
)
from horovod_airflow.operators.launchers.kubernetes import client
from horovod_airflow.operators.launchers.kubernetes.api import (
    TRAINJOB,
    flavour,
)
from horovod_airflow.operators.launchers.kubernetes.logs import LauncherLog
from horovod_airflow.operators.launchers.kubernetes.manifests import (
    build_mpijob,
    build_trainjob,
)
from horovod_airflow.operators.launchers.kubernetes.options import KubernetesOptions
from horovod_airflow.operators.launchers.kubernetes.overrides import (
    OWNED_TRAINJOB_PATHS,
    apply_mpijob_overrides,
    apply_overrides,
)
from horovod_airflow.operators.launchers.kubernetes.pods import IMAGE_FAILURES, pod_start_failure


class KubernetesLauncher(Launcher):
    """Submit an MPIJob or a TrainJob (``kubernetes_api``), wait (poll or defer), surface the
    launcher log, clean up."""

    name = "kubernetes"
    options_class = KubernetesOptions
    needs_image = True

    def check_elastic(self, spec: JobSpec) -> None:
        """An elastic MPIJob runs (the MPI Operator keeps ``/etc/mpi/discover_hosts.sh`` of
        the job's worker pods); a TrainJob is refused, saying what Trainer v2 has."""
        assert spec.elastic is not None
        if self.flavour.job is TRAINJOB:
            raise HorovodConfigError(
                "elastic=ElasticOptions(...): refused with kubernetes_api='trainjob'. Kubeflow "
                "Trainer v2 runs a TrainJob on a fixed number of nodes: its MPI plugin writes "
                "a static /etc/mpi/hostfile and no host-discovery script, and its JobSet's "
                "Jobs keep the parallelism they were created with; the torch ElasticPolicy "
                "was removed from its API (kubeflow/trainer#3235) and elastic TrainJobs are "
                "a proposal (KEP-2903). Use kubernetes_api='mpijob': the MPI Operator writes "
                "the discovery script elastic Horovod needs"
            )
        check_elastic_bounds(spec.elastic, spec.num_proc)
        if spec.elastic.cooldown_s is not None:
            raise HorovodConfigError(
                "elastic=ElasticOptions(cooldown_s=...): refused with an MPIJob. The MPI "
                "Operator re-makes a removed worker pod under its old name and lists it in "
                "discover_hosts.sh once it is Running; with a cooldown horovodrun takes that "
                "name back and starts a rank there. Measured in this project's "
                "pods-as-containers harness (Horovod 0.28.1): that rank never reached the "
                "rendezvous, the others gave up after Gloo's 30 s timeout and the whole job "
                "failed, where without a cooldown it finished on the pods left. Leave "
                "cooldown_s unset: a lost pod's ranks stay out until the job ends"
            )
        slots = self.slots_per_worker
        if spec.elastic.max_np % slots or spec.elastic.max_np // slots < 2:
            raise HorovodConfigError(
                f"elastic: max_np={spec.elastic.max_np} must be a multiple of "
                f"slots_per_worker={slots} giving at least 2 worker pods (one per "
                f"slots_per_worker ranks); Horovod drops a whole pod when one of its ranks "
                f"fails, so with one pod a lost rank would end the job all the same"
            )

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
        self.client = client.JobClient(
            self.flavour,
            conn_id=options.kubernetes_conn_id,
            hook=hook,
            poll_interval=self.poll_interval,
        )
        self._ref: dict[str, str] | None = None
        self._claimed: dict[str, str] | None = None  # the names submit() creates
        self._killed = False  # kill() ran while submit() was creating the job

    @property
    def hook(self) -> Any:
        """The provider's ``KubernetesHook`` (made on first use)."""
        return self.client.hook

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
        jobs of one task instance never write one output: a running one is waited for, not
        duplicated; a finished one (kept by ``cleanup``) is deleted before the new one is
        created; and a job that appears meanwhile (409 on create) is re-attached to.
        """
        ns = self.namespace
        ref = {"name": spec.name, "namespace": ns}
        kind = self.kind
        # What kill() deletes while this try has no job yet: the names are deterministic, so
        # a kill between here and _ref still reaches whatever the create makes.
        self._claimed = ref
        existing = self.client.find(ref)
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
            self.client.delete(ref)
            self.client.wait_until_gone(ref)
        created = self.client.create(spec, self.manifests(spec), ns, log)
        if created is None:  # made between the look-up and the create: the same instance's
            log.warning(
                "%s %s/%s appeared while this try created it: re-attaching to it",
                kind,
                ns,
                spec.name,
            )
            self._ref = ref
            return dict(ref)
        self._ref = ref
        if self._killed:  # on_kill ran during the create: what it made must not stay
            self._ref = None
            self.client.delete(ref)
            raise HorovodLaunchError(f"the task was killed while {kind} {spec.name!r} was created")
        uid = (created.get("metadata") or {}).get("uid")
        # The uid fences a re-attach: a job re-created under this name has another one.
        self.journal.record(self.name, kind=kind, name=spec.name, namespace=ns, id=uid)
        if uid:
            self.client.own(spec, ns, uid, log)
        log.info("submitted %s %s/%s (%d ranks)", kind, ns, spec.name, spec.num_proc)
        return dict(ref)

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
        phase, message = self.client.status(ref)
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
            failure, self._started = pod_start_failure(
                self.client.pods(ref),
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
        out = self.journal.output(log, secrets=list(spec.secret_env.values()))
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
        look = client.api_retrying(log.warning)
        while True:
            if self._ref is None:
                raise HorovodTrainingError(f"{self.kind} {ref['name']!r} was deleted (on_kill)")
            try:
                event = look(
                    self.poll,
                    ref,
                    started_at=started_at,
                    timeout=spec.timeout,
                    startup_timeout=self.startup_timeout,
                )
            except Exception as e:  # not transient, or too many in a row
                return {"status": "error", "message": client.api_error_message(e), **ref}
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
        out = out or self.journal.output(log, secrets=secrets)
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
                hosts = self.client.hosts(ref)
            except Exception as e:
                log.warning(
                    "could not read %s %s to name the failed pod: %s", self.kind, ref["name"], e
                )
        # A job that never started or ran out of time may still be running: whatever cleanup
        # says, it goes, or the retry would re-attach to it (the provider deletes too).
        stuck = status in ("not_started", "timeout")
        if stuck or self.cleanup == "delete" or (self.cleanup == "delete_on_success" and success):
            try:
                self.client.delete(ref)
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
                self.client.delete_secret(ref)
            except Exception as e:
                log.warning("could not delete Secret of %s: %s", ref["name"], e)
        what = f"{self.kind} {ref['namespace']}/{ref['name']}"
        if status == "not_started":
            message = str(event.get("message") or "")
            error = (
                HorovodImageError
                if any(f": {reason}" in message for reason in IMAGE_FAILURES)
                else HorovodLaunchError
            )
            raise error(
                f"{what} did not start (deleted): {event.get('message')}", log_tail=out.tail()
            )
        return end_of_job(
            ref["name"],
            0 if success else None,  # an MPIJob has no exit code: its launcher's log names one
            out.tail(),
            what=what,
            hosts=hosts,
            timed_out=float(timeout or event.get("timeout") or 0) if status == "timeout" else None,
            failure=f"{what} {status}: {event.get('message')}",
        )

    def kill(self) -> None:
        if self._claimed is not None and self._ref is None:
            self._killed = True  # during submit: it must not leave what it creates next
        ref, self._ref = self._ref, None
        ref = ref or self._claimed  # killed during submit: delete what it may have made
        if ref is not None:
            self.client.delete(ref)
