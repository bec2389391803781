"""The cluster client (the cncf-kubernetes provider's ``KubernetesHook``) and which of its
errors are worth another look."""

from __future__ import annotations

from typing import Any

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


class ApiRetry:
    """Counts consecutive transient API errors while a job is watched: how long to back off
    before the next look, or None to give up (not transient, or too many in a row)."""

    def __init__(
        self,
        retries: int = API_RETRIES,
        backoff: float = API_BACKOFF_S,
        max_backoff: float = API_BACKOFF_MAX_S,
    ) -> None:
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.failures = 0

    def delay(self, error: BaseException) -> float | None:
        if not is_transient(error):
            return None
        self.failures += 1
        if self.failures > self.retries:
            return None
        return float(min(self.max_backoff, self.backoff * 2 ** (self.failures - 1)))

    def reset(self) -> None:
        self.failures = 0

    def describe(self, error: BaseException) -> str:
        """The message of the event that gives up."""
        if not is_transient(error):
            return f"Kubernetes API error: {error}"
        return f"{self.failures} Kubernetes API errors in a row (last: {error})"
