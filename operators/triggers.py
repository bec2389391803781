"""Triggers that wait for a Horovod job without holding an Airflow worker slot.

Runs in the triggerer (asyncio); importable without torch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent


class MPIJobTrigger(BaseTrigger):
    """Poll a Kubeflow MPIJob until it succeeds, fails or runs past ``timeout``.

    Yields exactly one event: ``{"status": "success" | "failed" | "timeout" | "error",
    "message": ..., "name": ..., "namespace": ...}``. When a user kills the deferred task
    (mark failed or succeeded, clear), Airflow's triggerer calls :meth:`on_kill`, which deletes
    the MPIJob and its Secret; a triggerer restart or hand-over leaves the job running.
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
    ) -> None:
        super().__init__()
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
            },
        )

    def _launcher(self) -> Any:
        from operators.launchers.kubernetes import KubernetesLauncher

        return KubernetesLauncher(
            image="", kubernetes_conn_id=self.kubernetes_conn_id, namespace=self.namespace
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        ref = {"name": self.name, "namespace": self.namespace}
        launcher = self._launcher()
        while True:
            try:
                # The provider's sync client, off the event loop.
                phase, message = await asyncio.to_thread(launcher.status, ref)
            except Exception as e:
                yield TriggerEvent({"status": "error", "message": str(e), **ref})
                return
            if phase != "running":
                status = "success" if phase == "succeeded" else "failed"
                yield TriggerEvent({"status": status, "message": message, **ref})
                return
            if self.timeout is not None and time.time() - self.started_at > self.timeout:
                yield TriggerEvent(
                    {
                        "status": "timeout",
                        "timeout": self.timeout,
                        "message": f"ran longer than {self.timeout}s",
                        **ref,
                    }
                )
                return
            await asyncio.sleep(self.poll_interval)

    async def on_kill(self) -> None:
        """Delete the MPIJob (its pods go with it) and its Secret: the deferred counterpart of
        ``HorovodTrainOperator.on_kill``. Airflow (3.3+) calls it only on a user's action."""
        ref = {"name": self.name, "namespace": self.namespace}
        await asyncio.to_thread(self._launcher().delete, ref)
