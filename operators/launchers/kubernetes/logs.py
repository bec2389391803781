"""Following the launcher pod's log (horovodrun's rank-prefixed output of every rank) while
the job runs, each line once, across cut streams."""

from __future__ import annotations

import contextlib
import datetime
import math
import re
import threading
from collections.abc import Callable
from typing import Any

from horovod_airflow.operators.launchers.kubernetes.pods import pod_name, pod_phase

# After a follow stream ends while the launcher still runs (the API server or the kubelet cut
# it), the next one starts this many seconds earlier than the last line seen: clock skew and
# since_seconds' whole seconds may not lose a line; the overlap is dropped by timestamp.
LOG_OVERLAP_S = 5
LOG_DRAIN_S = 30.0  # how long the end of the job waits for the follow stream to end
_TIMESTAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)?$")


def log_timestamp(text: str) -> tuple[datetime.datetime, int] | None:
    """(UTC time to the second, nanoseconds) of an RFC3339(Nano) timestamp, or None."""
    found = _TIMESTAMP.match(text)
    if not found:
        return None
    zone = found.group(3) or "Z"
    when = datetime.datetime.fromisoformat(
        found.group(1) + ("+00:00" if zone == "Z" else zone)
    ).astimezone(datetime.UTC)
    return when, int((found.group(2) or "0").ljust(9, "0"))


class LauncherLog:
    """The launcher pod's log, into ``out`` line by line, each line once.

    :meth:`follow` (in a thread, while the job runs) reads it as the provider's PodManager does:
    ``follow=True, timestamps=True`` from the pod's start; when the stream ends while the pod
    still runs (a cut connection), it reconnects with ``since_seconds`` reaching back a little
    before the last line seen, and drops what it has already emitted by comparing the lines'
    timestamps (the same timestamp may carry several lines: as many as were emitted with it
    are skipped). :meth:`catch_up` reads what is left (or all of it when nothing was followed)
    without following, once the job has ended.
    """

    def __init__(
        self,
        core: Any,
        namespace: str,
        selector: str,
        out: Callable[[str], None],
        *,
        warn: Callable[..., Any],
        poll_interval: float = 2.0,
    ) -> None:
        self.core, self.namespace, self.selector = core, namespace, selector
        self.out, self.warn, self.poll_interval = out, warn, poll_interval
        self.last: tuple[datetime.datetime, int] | None = None  # timestamp of the last line
        self.at_last = 0  # lines emitted with that timestamp
        self._skip = 0  # lines with that timestamp still to drop after a reconnect
        self.pod: str | None = None
        self._done = threading.Event()  # the job ended: stop once the stream ends
        self._response: Any = None
        self._thread: threading.Thread | None = None
        self._warned = False

    # the pod ----------------------------------------------------------------------------
    def _launcher_pod(self) -> tuple[str, str] | None:
        pods = self.core.list_namespaced_pod(namespace=self.namespace, label_selector=self.selector)
        for pod in getattr(pods, "items", None) or []:
            return pod_name(pod), pod_phase(pod)
        return None

    # lines ------------------------------------------------------------------------------
    def _line(self, raw: str) -> None:
        stamp, _, text = raw.partition(" ")
        when = log_timestamp(stamp)
        if when is None:  # not timestamped (never from the API with timestamps=True)
            self.out(raw)
            return
        if self.last is not None:
            if when < self.last:
                return
            if when == self.last and self._skip:
                self._skip -= 1
                return
        if when == self.last:
            self.at_last += 1
        else:
            self.last, self.at_last, self._skip = when, 1, 0
        self.out(text)

    def _since(self) -> dict[str, Any]:
        """Where a new read starts: from the pod's start, or a little before the last line."""
        if self.last is None:
            return {}
        self._skip = self.at_last
        ago = (datetime.datetime.now(datetime.UTC) - self.last[0]).total_seconds()
        return {"since_seconds": max(1, math.ceil(ago) + LOG_OVERLAP_S)}

    def _read(self, pod: str, *, follow: bool) -> None:
        kwargs = {"name": pod, "namespace": self.namespace, "timestamps": True, **self._since()}
        if not follow:
            text = self.core.read_namespaced_pod_log(**kwargs)
            for raw in str(text or "").splitlines():
                self._line(raw)
            return
        response = self.core.read_namespaced_pod_log(**kwargs, follow=True, _preload_content=False)
        self._response = response
        pending = b""
        try:
            for chunk in response.stream(amt=None, decode_content=True):
                pending += chunk if isinstance(chunk, bytes) else str(chunk).encode()
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._line(line.decode("utf-8", "replace").rstrip("\r"))
            if pending:
                self._line(pending.decode("utf-8", "replace").rstrip("\r"))
        finally:
            self._response = None
            for close in ("release_conn", "close"):
                with contextlib.suppress(Exception):
                    getattr(response, close)()

    # while the job runs -------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self.follow, name="launcher-log", daemon=True)
        self._thread.start()

    def follow(self) -> None:
        """Until the job has ended and the launcher pod's stream with it."""
        while True:
            try:
                found = self._launcher_pod()
                if found is not None and found[1] != "Pending":
                    self.pod = found[0]
                    self._read(self.pod, follow=True)
                    if self._done.is_set() or self._launcher_pod() in (
                        (self.pod, "Succeeded"),
                        (self.pod, "Failed"),
                    ):
                        return  # the container ended: its whole log was read
            except Exception as e:  # the end of the job reads what is missing
                if not self._warned:
                    self._warned = True
                    self.warn("following the launcher pod's log: %s (retrying)", e)
            if self._done.wait(self.poll_interval):
                return

    def stop(self, timeout: float | None = None) -> None:
        """The job has ended: let the stream end (its pod has; within ``timeout`` seconds,
        default ``LOG_DRAIN_S``), then stop following."""
        self._done.set()
        if self._thread is None:
            return
        self._thread.join(LOG_DRAIN_S if timeout is None else timeout)
        if self._thread.is_alive():  # a stream that does not end: cut it
            response = self._response
            if response is not None:
                with contextlib.suppress(Exception):
                    response.close()
            self._thread.join(5.0)

    def catch_up(self) -> None:
        """Read what following did not (all of it when nothing was followed)."""
        found = self._launcher_pod()
        if found is None:
            return
        self.pod = found[0]
        self._read(self.pod, follow=False)
