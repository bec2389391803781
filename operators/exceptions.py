"""Typed failures of the pipeline, each carrying what an on-call engineer needs to act.

The failures of a Horovod job subclass :class:`HorovodOperatorError` (an
``AirflowException``), so Airflow retries them like any task failure; callers that care can
catch the precise kind. Failures that a retry cannot fix (a bad setting, a failed preflight,
a Clear of a train that completed, a refused publish, a champion that changed under the gate)
and a program's refusal (its exit codes 2 and 3, :class:`HorovodRefusedError`) are
``AirflowFailException``: the task fails without using its retries, and the message says what
to do instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from airflow.sdk.exceptions import AirflowException, AirflowFailException

TAIL_LINES_IN_MESSAGE = 40


class HorovodOperatorError(AirflowException):
    """Base of every error raised by the Horovod operators."""

    def __init__(self, message: str, *, log_tail: Sequence[str] = ()) -> None:
        self.log_tail = list(log_tail)
        if self.log_tail:
            shown = self.log_tail[-TAIL_LINES_IN_MESSAGE:]
            message = f"{message}\n--- last {len(shown)} lines of output ---\n" + "\n".join(shown)
        super().__init__(message)


class HorovodPreflightError(HorovodOperatorError, AirflowFailException):
    """The job cannot start here: too few slots/GPUs, or the program's doctor said no.

    A retry on the same worker meets the same machine, so it fails without retrying.
    """


class HorovodConfigError(AirflowFailException, ValueError):
    """A rendered setting of the operator is invalid (named in the message); no retry fixes it."""


class TrainingCompletedError(AirflowFailException):
    """A later try found a completed training at its output that is not this task's (another
    world size, dataset or setting, or an unreadable metrics.json): it is neither reused nor
    overwritten. Trigger a new DAG run to train again (a completed training of this task is
    returned instead, see ``HorovodTrainOperator``).
    """


class HorovodLaunchError(HorovodOperatorError):
    """The launcher could not start the job (horovodrun missing, engine or API error)."""


class HorovodImageError(HorovodLaunchError):
    """The job's image cannot be pulled: the engine or the kubelet said it does not exist or
    may not be read (its name, tag or registry login is wrong). The retry policy
    (:mod:`horovod_airflow.operators.retry`) does not retry it."""


class JobNotOursError(HorovodLaunchError, AirflowFailException):
    """A job with this task instance's name runs, but it is not the one its tries started (the
    task state store recorded another id or uid): it is neither re-attached to nor deleted.
    Remove it (or find who re-created it), then clear the task."""


class HorovodTrainingError(HorovodOperatorError):
    """The job started and exited non-zero, or finished without the promised outputs."""

    def __init__(
        self, message: str, *, exit_code: int | None = None, log_tail: Sequence[str] = ()
    ) -> None:
        self.exit_code = exit_code
        super().__init__(message, log_tail=log_tail)


class HorovodRefusedError(HorovodTrainingError, AirflowFailException):
    """The program refused its inputs or settings (exit 2 or 3, the contract's
    ``NO_RETRY_EXIT_CODES``): a checkpoint of other settings, a dataset that fails its checks,
    a bad command line. Every retry would meet the same refusal, so none is made."""


class HorovodTimeoutError(HorovodOperatorError):
    """The job ran past its deadline (the operator's ``execution_timeout``) and was stopped."""

    def __init__(self, message: str, *, timeout: float, log_tail: Sequence[str] = ()) -> None:
        self.timeout = timeout
        super().__init__(message, log_tail=log_tail)


class PublishRefusedError(AirflowFailException):
    """The model registry refuses this publish, and retrying it cannot change that.

    The gate did not pass, ONNX parity failed, or the run's version name already holds
    another run's model.
    """


class ChampionChangedError(PublishRefusedError):
    """``latest.json`` is no longer the one the gate compared against: another publish won.

    Nothing was overwritten. Re-run the gate (clear it and its downstream tasks) to compare
    against the new champion.
    """


class StaleModelError(AirflowFailException):
    """Serving has stayed on one model too long: too many runs in a row refused by the gate,
    or nothing published for too many days. Fails the gate task (and so alerts) without a
    retry: a retry would find the same history."""


class RetentionConflictError(AirflowException):
    """The registry (a ``latest.json`` or the set of published versions) changed between the
    retention plan and a deletion: the plan may delete what the new state needs, so it is
    refused. A retry (or the next pass) plans again over the new state."""


class DatasetRefusedError(AirflowFailException):
    """The staged dataset failed its data checks against the previous one (the message names
    each change and its threshold). Nothing was uploaded and nothing trains; a retry would
    meet the same data, so none is made. If the change is intended, loosen the checks."""
