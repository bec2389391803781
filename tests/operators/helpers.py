"""Shared helpers for the operator tests: a minimal task context and an eval set on S3."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

PROGRAM = ("python", "-m", "tests.programs.allreduce_program")


@dataclass
class FakeTI:
    """The one attribute of a TaskInstance the operators read."""

    try_number: int = 1


def context(try_number: int = 1, run_id: str = "manual__test") -> dict[str, Any]:
    return {"ti": FakeTI(try_number), "run_id": run_id}


def put_eval_set(s3: Any, bucket: str, prefix: str, n: int = 40) -> tuple[str, float]:
    """Write ``eval.json`` (labels, predictions) and return (data URI, its true accuracy)."""
    labels = [i % 10 for i in range(n)]
    predictions = [lab if i % 4 else (lab + 1) % 10 for i, lab in enumerate(labels)]
    s3.put_object(
        Bucket=bucket,
        Key=f"{prefix}/eval.json",
        Body=json.dumps({"labels": labels, "predictions": predictions}).encode(),
    )
    accuracy = sum(a == b for a, b in zip(labels, predictions, strict=True)) / n
    return f"s3://{bucket}/{prefix}", accuracy


class LineLog:
    """A logger double for launchers: keeps each formatted message."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def _add(self, msg: str, *args: Any) -> None:
        self.lines.append(msg % args if args else msg)

    info = warning = error = debug = _add


class TaskLog:
    """The operator's task log: Airflow 3 logs through structlog to stdout."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self._capsys = capsys
        self._seen = ""

    @property
    def text(self) -> str:
        captured = self._capsys.readouterr()
        self._seen += captured.out + captured.err
        return self._seen
