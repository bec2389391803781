"""What stops a rank's run, by kind: ``python -m horovod_airflow.trainer train`` exits with
the message (``cli``)."""

from __future__ import annotations


class TrainingError(RuntimeError):
    """The run cannot go on (inconsistent ranks, incompatible checkpoint, too little data)."""


class ResumeMismatchError(TrainingError):
    """``--resume`` found a checkpoint made with other data, world size or settings."""


class RankDivergenceError(TrainingError):
    """Ranks hold different parameters: the distributed update is broken."""
