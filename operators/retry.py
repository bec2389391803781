"""Which failures a retry can cure: the retry policy every operator of this package uses.

Airflow 3.3's retry policies (``retry_policy=``, evaluated on the worker with the exception in
hand) decide per failure whether the task's remaining retries are used. A retry that cannot
change the outcome only delays the alert and burns GPU hours; a transient failure that is not
retried drops a week's model. :class:`HorovodRetryPolicy` says which is which:

============================================  =========  =====================================
failure                                       decision   why
============================================  =========  =====================================
an invalid setting (``ValueError``,           fail       the same setting fails the same way
``TypeError``, the contract's checks)
the image cannot be pulled                    fail       the tag or the registry login is wrong
                                                         (other engine errors: the default)
the Kubernetes API refused (401/403/404/422)  fail       RBAC, a missing CRD, a bad manifest
S3 or the Kubernetes API answered 5xx/429,    retry,     the same call may succeed later; the
throttled, timed out or could not be reached  backoff    delay doubles per try (``backoff``)
the job failed (a lost rank or worker)        retry      the next try resumes from the
                                                         checkpoint
anything else                                 default    the task's own ``retries``
============================================  =========  =====================================

``AirflowFailException`` (a refused program, a failed preflight, a refused publish) never
reaches a policy: Airflow fails those at once. The policy can fail a task earlier or set the
delay, never add tries beyond ``retries``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk.definitions.retry_policy import RetryDecision, RetryPolicy

from horovod_airflow.core import storage
from horovod_airflow.operators.exceptions import (
    HorovodImageError,
    HorovodTimeoutError,
    HorovodTrainingError,
)

if TYPE_CHECKING:
    from airflow.sdk.definitions.context import Context

#: Kubernetes API answers that no retry changes: unauthenticated, forbidden (RBAC), not found
#: (the CRD or namespace is missing), invalid (the manifest).
API_REFUSALS = frozenset({400, 401, 403, 404, 422})


def _api_status(e: BaseException) -> int | None:
    """The HTTP status of a Kubernetes ``ApiException`` in ``e``'s chain, if any."""
    for err in storage.exception_chain(e):
        status = getattr(err, "status", None)
        if type(err).__name__ == "ApiException" and isinstance(status, int):
            return status
    return None


def _unreachable(e: BaseException) -> bool:
    """A connection to a server (the Kubernetes API, the container engine) failed or timed out."""
    for err in storage.exception_chain(e):
        module = type(err).__module__
        if isinstance(err, ConnectionError | TimeoutError):
            return True
        if module.startswith(("urllib3.", "requests.")) and any(
            word in type(err).__name__ for word in ("Connection", "Timeout", "Protocol")
        ):
            return True
    return False


def classify(e: BaseException) -> tuple[str, str]:
    """(``"fail"``, ``"transient"``, ``"retry"`` or ``"default"``, the reason) for ``e``."""
    if storage.is_transient(e):
        return "transient", "the object store answered 'try again' (5xx, 429, throttled, timeout)"
    status = _api_status(e)
    if status is not None and (status >= 500 or status == 429):
        return "transient", f"the Kubernetes API answered {status}: it may answer later"
    if status in API_REFUSALS:
        return "fail", (
            f"the Kubernetes API refused with {status} (RBAC, a missing CRD or namespace, or an "
            f"invalid manifest): no retry changes that"
        )
    if isinstance(e, HorovodImageError):
        return "fail", "the image cannot be pulled (its name, tag or registry login is wrong)"
    if _unreachable(e):
        return "transient", "a server (Kubernetes API, container engine) could not be reached"
    if isinstance(e, HorovodTimeoutError):
        return "default", "the job ran out of time"
    if isinstance(e, HorovodTrainingError):
        return "retry", "the job failed (a lost rank or worker): the next try resumes"
    if isinstance(e, ValueError | TypeError):
        return "fail", f"invalid input ({type(e).__name__}): the same input fails the same way"
    return "default", ""


class HorovodRetryPolicy(RetryPolicy):
    """The retry policy of this package's operators (see the module's table).

    :param backoff: delay before the first retry of a transient failure; it doubles with each
        try, up to ``max_backoff``. Other retries use the task's ``retry_delay``.
    """

    def __init__(
        self,
        backoff: timedelta = timedelta(seconds=30),
        max_backoff: timedelta = timedelta(minutes=10),
    ) -> None:
        if backoff <= timedelta(0) or max_backoff < backoff:
            raise ValueError(
                f"backoff must be > 0 and max_backoff >= backoff; got backoff={backoff}, "
                f"max_backoff={max_backoff}"
            )
        self.backoff = backoff
        self.max_backoff = max_backoff

    def evaluate(
        self,
        exception: BaseException,
        try_number: int,
        max_tries: int,
        context: Context | None = None,
    ) -> RetryDecision:
        kind, reason = classify(exception)
        if kind == "fail":
            return RetryDecision.fail(reason)
        if kind == "transient":
            delay = min(self.backoff * 2 ** max(try_number - 1, 0), self.max_backoff)
            return RetryDecision.retry(delay=delay, reason=f"{reason}; retrying in {delay}")
        if kind == "retry":
            return RetryDecision.retry(reason=reason)
        return RetryDecision.default()

    def serialize(self) -> dict[str, Any]:
        return {
            "backoff": self.backoff.total_seconds(),
            "max_backoff": self.max_backoff.total_seconds(),
        }

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> HorovodRetryPolicy:
        return cls(
            backoff=timedelta(seconds=float(data["backoff"])),
            max_backoff=timedelta(seconds=float(data["max_backoff"])),
        )


def with_retry_policy(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for ``BaseOperator.__init__`` with ``retry_policy`` set to
    :class:`HorovodRetryPolicy` unless the operator was given one (``None`` included) or the
    DAG's or task group's ``default_args`` hold one (Airflow merges those into the arguments of
    ``BaseOperator.__init__`` only, after this runs, so they are looked up here)."""
    if "retry_policy" not in kwargs and "retry_policy" not in _default_args(kwargs):
        kwargs["retry_policy"] = HorovodRetryPolicy()
    return kwargs


def _default_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``default_args`` that apply to an operator built with ``kwargs``."""
    from airflow.sdk.definitions._internal.contextmanager import DagContext, TaskGroupContext

    merged: dict[str, Any] = {}
    dag = kwargs.get("dag") or DagContext.get_current()
    if dag is not None:
        merged.update(getattr(dag, "default_args", None) or {})
        group = kwargs.get("task_group") or TaskGroupContext.get_current(dag)
        merged.update(getattr(group, "default_args", None) or {})
    merged.update(kwargs.get("default_args") or {})
    return merged
