"""Triggers that wait for a Horovod job without holding an Airflow worker slot.

Runs in the triggerer (asyncio); importable without torch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from horovod_airflow.operators.launchers.kubernetes.client import (
    API_BACKOFF_S,
    API_RETRIES,
    api_error_message,
    api_retrying,
)


class MPIJobTrigger(BaseTrigger):
    """Poll a Kubeflow MPIJob (or, with ``kubernetes_api="trainjob"``, a Kubeflow Trainer
    TrainJob) until it succeeds, fails or runs past ``timeout`` (seconds from ``started_at``:
    the deadline the operator derived from its ``execution_timeout``).

    Transient API errors (HTTP 5xx, 429, no connection) are retried with exponential backoff
    (``api_backoff`` seconds, doubling, at most ``api_retries`` in a row); any other error
    (a 404: the job was deleted; a 403) ends the wait at once with an ``"error"`` event.

    Until the job's launcher pod runs, a pod that cannot start (image pull, crash loop, failed)
    ends the wait at once, and one still Pending after ``startup_timeout`` seconds too.

    Yields exactly one event: ``{"status": "success" | "failed" | "timeout" | "not_started" |
    "error", "message": ..., "name": ..., "namespace": ...}``. When a user kills the deferred task
    (mark failed or succeeded, clear), Airflow's triggerer calls :meth:`on_kill`, which deletes
    the job (and a TrainJob's runtime) and its Secret; a triggerer restart or hand-over leaves
    the job running.
    """

    def __init__(
        self,
        *,
        name: str,
        namespace: str,
        kubernetes_conn_id: str | None = "kubernetes_default",
        poll_interval: float = 15.0,
        timeout: float | None = None,
        started_at: float | None = None,
        startup_timeout: float | None = None,
        api_retries: int = API_RETRIES,
        api_backoff: float = API_BACKOFF_S,
        kubernetes_api: str = "mpijob",
    ) -> None:
        super().__init__()
        self.kubernetes_api = kubernetes_api
        self.startup_timeout = startup_timeout
        self.api_retries = api_retries
        self.api_backoff = api_backoff
        self.name = name
        self.namespace = namespace
        self.kubernetes_conn_id = kubernetes_conn_id
        self.poll_interval = poll_interval
        self.timeout = timeout
        # Wall-clock start, serialized, so a triggerer restart does not reset the timeout.
        self.started_at = time.time() if started_at is None else started_at

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "name": self.name,
                "namespace": self.namespace,
                "kubernetes_conn_id": self.kubernetes_conn_id,
                "poll_interval": self.poll_interval,
                "timeout": self.timeout,
                "started_at": self.started_at,
                "startup_timeout": self.startup_timeout,
                "api_retries": self.api_retries,
                "api_backoff": self.api_backoff,
                "kubernetes_api": self.kubernetes_api,
            },
        )

    def _launcher(self) -> Any:
        from horovod_airflow.operators.launchers.kubernetes import (
            KubernetesLauncher,
            KubernetesOptions,
        )

        options = KubernetesOptions(
            kubernetes_conn_id=self.kubernetes_conn_id,
            namespace=self.namespace,
            kubernetes_api=self.kubernetes_api,
        )
        return KubernetesLauncher(image="", options=options)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        ref = {"name": self.name, "namespace": self.namespace}
        launcher = self._launcher()
        look = api_retrying(
            self.log.warning,
            retries=self.api_retries,
            backoff=self.api_backoff,
            asynchronous=True,
        )
        while True:
            try:
                # The provider's sync client, off the event loop.
                event = await look(
                    asyncio.to_thread,
                    launcher.poll,
                    ref,
                    started_at=self.started_at,
                    timeout=self.timeout,
                    startup_timeout=self.startup_timeout,
                )
            except Exception as e:  # a 4xx, or too many errors in a row
                yield TriggerEvent({"status": "error", "message": api_error_message(e), **ref})
                return
            if event is not None:
                yield TriggerEvent(event)
                return
            await asyncio.sleep(self.poll_interval)

    async def on_kill(self) -> None:
        """Delete the job (its pods go with it) and its Secret: the deferred counterpart of
        ``HorovodTrainOperator.on_kill``. Airflow (3.3+) calls it only on a user's action."""
        ref = {"name": self.name, "namespace": self.namespace}
        await asyncio.to_thread(self._launcher().client.delete, ref)
