"""The cluster calls for one job's objects (the job, its dependents, its credential Secret,
its pods) through the cncf-kubernetes provider's ``KubernetesHook``, and the retries of the
API errors worth another look."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tenacity

from horovod_airflow.operators.command import Host, rank_env_file_text
from horovod_airflow.operators.exceptions import HorovodLaunchError
from horovod_airflow.operators.launchers.base import JobSpec
from horovod_airflow.operators.launchers.kubernetes.api import (
    TRAINING_RUNTIME,
    TRAINJOB,
    Flavour,
    Resource,
)
from horovod_airflow.operators.launchers.kubernetes.manifests import (
    SECRET_KEY,
    job_labels,
    mpijob_hosts,
    runtime_hosts,
    secret_name,
)

DELETE_WAIT_S = 300.0  # how long a retry waits for the earlier try's job to be deleted
# Waiting out a flaky API server: consecutive transient errors (5xx, 429, connection) tolerated
# while a job is watched, and the backoff between them (doubling: 1, 2, 4, 8, 16 s, ≤ 30 s).
API_RETRIES = 5
API_BACKOFF_S = 1.0
API_BACKOFF_MAX_S = 30.0


def KubernetesHook(**kwargs: Any) -> Any:
    """The provider's ``KubernetesHook``, imported when first used (tests patch this name)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import (
        KubernetesHook as _KubernetesHook,
    )

    return _KubernetesHook(**kwargs)


def is_transient(error: BaseException) -> bool:
    """An API error worth another look: HTTP 5xx or 429, or no answer (connection refused or
    reset, timeout). A 4xx (404: the job is gone, 403: no permission) is not."""
    import urllib3.exceptions
    from kubernetes.client.exceptions import ApiException

    if isinstance(error, ApiException):
        status = error.status or 0
        return status == 429 or status >= 500
    return isinstance(
        error,
        urllib3.exceptions.MaxRetryError
        | urllib3.exceptions.ProtocolError
        | urllib3.exceptions.TimeoutError
        | urllib3.exceptions.NewConnectionError
        | ConnectionError
        | TimeoutError,
    )


def api_retrying(
    warn: Callable[..., Any],
    *,
    retries: int | None = None,
    backoff: float | None = None,
    max_backoff: float = API_BACKOFF_MAX_S,
    asynchronous: bool = False,
    **kwargs: Any,
) -> Any:
    """A tenacity ``Retrying`` (``AsyncRetrying`` when ``asynchronous``) for one look at a job:
    a transient error (:func:`is_transient`) is looked at again after ``backoff`` seconds,
    doubling up to ``max_backoff``, at most ``retries`` times in a row (each look starts
    afresh); it gives up with ``tenacity.RetryError``, and any other error is raised at once.
    ``retries`` and ``backoff`` default to ``API_RETRIES`` and ``API_BACKOFF_S`` as they are
    when the policy is made. ``warn`` logs each retry; ``kwargs`` go to tenacity (``sleep``)."""

    def before_sleep(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        delay = state.next_action.sleep if state.next_action else 0.0
        warn("Kubernetes API error, next look in %.1fs: %s", delay, error)

    retrying = tenacity.AsyncRetrying if asynchronous else tenacity.Retrying
    return retrying(
        retry=tenacity.retry_if_exception(is_transient),
        wait=tenacity.wait_exponential(
            multiplier=API_BACKOFF_S if backoff is None else backoff, max=max_backoff
        ),
        stop=tenacity.stop_after_attempt((API_RETRIES if retries is None else retries) + 1),
        before_sleep=before_sleep,
        **kwargs,
    )


def api_error_message(error: BaseException) -> str:
    """The message of the event that ends a watch on an API error (:func:`api_retrying`'s)."""
    if isinstance(error, tenacity.RetryError):
        last = error.last_attempt
        return f"{last.attempt_number} Kubernetes API errors in a row (last: {last.exception()})"
    return f"Kubernetes API error: {error}"


class JobClient:
    """The cluster calls for the jobs of one :class:`~.api.Flavour` (the job, its dependents,
    its credential Secret, its pods), named by ``ref`` (``{"name", "namespace"}``).

    The provider's hook is made on first use (a DAG file parses without a cluster). Deleting
    what is absent is fine; a create that fails raises :class:`HorovodLaunchError` naming what
    could not be made, and leaves nothing of the job behind.
    """

    def __init__(
        self,
        flavour: Flavour,
        *,
        conn_id: str | None,
        hook: Any | None = None,
        poll_interval: float = 15.0,
    ) -> None:
        self.flavour = flavour
        self.conn_id = conn_id
        self.poll_interval = poll_interval
        self._hook = hook

    @property
    def hook(self) -> Any:
        if self._hook is None:
            self._hook = KubernetesHook(conn_id=self.conn_id)
        return self._hook

    @property
    def kind(self) -> str:
        return self.flavour.job.kind

    # --- reading ---------------------------------------------------------------------
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

    def status(self, ref: Mapping[str, str]) -> tuple[str, str]:
        """The job's phase and message (API errors propagate: the caller retries)."""
        obj = self.hook.get_custom_object(
            **self.flavour.job.args(), name=ref["name"], namespace=ref["namespace"]
        )
        return self.flavour.phase(obj)

    def pods(self, ref: Mapping[str, str]) -> list[Any]:
        """The job's pods, launcher and workers."""
        pods = self.hook.core_v1_client.list_namespaced_pod(
            namespace=ref["namespace"], label_selector=self.flavour.pod_selector(ref["name"])
        )
        return list(getattr(pods, "items", None) or [])

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

    # --- creating --------------------------------------------------------------------
    def create(
        self, spec: JobSpec, manifests: Sequence[dict[str, Any]], namespace: str, log: Any
    ) -> dict[str, Any] | None:
        """Create the job's Secret (when it has credentials), its dependents and the job
        (``manifests``, the job last); the job as the API returned it, or None when a job of
        its name appeared meanwhile (409: made by this task instance, to re-attach to)."""
        from kubernetes.client.exceptions import ApiException

        *dependents, body = manifests
        kind = self.kind
        if spec.secret_env:
            self.create_secret(spec, namespace)
        try:
            for resource, dependent in zip(self.flavour.dependents, dependents, strict=True):
                self.create_dependent(resource, dependent, namespace)
            created = self.hook.create_custom_object(
                **self.flavour.job.args(), body=body, namespace=namespace
            )
        except Exception as e:
            if isinstance(e, ApiException) and e.status == 409:
                return None
            self.abandon(spec, namespace, log)
            raise HorovodLaunchError(
                f"cannot create {kind} {spec.name!r} in {namespace!r}: {e}"
            ) from e
        return created if isinstance(created, dict) else {}

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

    # --- deleting --------------------------------------------------------------------
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
