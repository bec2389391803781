"""Typed failures of a Horovod job, each carrying what an on-call engineer needs to act.

All subclass :class:`HorovodOperatorError` (an ``AirflowException``), so Airflow retries
them like any task failure; callers that care can catch the precise kind.
"""

from __future__ import annotations

from collections.abc import Sequence

from airflow.sdk.exceptions import AirflowException

TAIL_LINES_IN_MESSAGE = 40


class HorovodOperatorError(AirflowException):
    """Base of every error raised by the Horovod operators."""

    def __init__(self, message: str, *, log_tail: Sequence[str] = ()) -> None:
        self.log_tail = list(log_tail)
        if self.log_tail:
            shown = self.log_tail[-TAIL_LINES_IN_MESSAGE:]
            message = f"{message}\n--- last {len(shown)} lines of output ---\n" + "\n".join(shown)
        super().__init__(message)


class HorovodPreflightError(HorovodOperatorError):
    """The job cannot start here: too few slots/GPUs, or the program's doctor said no."""


class HorovodLaunchError(HorovodOperatorError):
    """The launcher could not start the job (horovodrun missing, engine or API error)."""


class HorovodTrainingError(HorovodOperatorError):
    """The job started and exited non-zero, or finished without the promised outputs."""

    def __init__(
        self, message: str, *, exit_code: int | None = None, log_tail: Sequence[str] = ()
    ) -> None:
        self.exit_code = exit_code
        super().__init__(message, log_tail=log_tail)


class HorovodTimeoutError(HorovodOperatorError):
    """The job ran longer than the operator's ``timeout`` and was stopped."""

    def __init__(self, message: str, *, timeout: float, log_tail: Sequence[str] = ()) -> None:
        self.timeout = timeout
        super().__init__(message, log_tail=log_tail)
