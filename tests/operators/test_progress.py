"""Live progress for real: our trainer on 2 horovodrun ranks through the local launcher prints
progress events; the task log gets a readable line for each and the task state store the
latest; metrics.json (v2) keeps the bounded per-step record the curves are drawn from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from horovod_airflow.core.contract import EVENT_PROGRESS, METRICS, parse_event
from horovod_airflow.operators import HorovodTrainOperator
from horovod_airflow.operators.model_registry.summaries import (
    render_training_curves,
    step_series,
)
from horovod_airflow.operators.progress import PROGRESS_STATE_KEY
from tests.operators.fakes import TaskLog, TaskStateStore
from tests.operators.helpers import context, with_launcher_options
from tests.trainer.conftest import stage_local

pytestmark = pytest.mark.usefixtures("s3_server")


@pytest.fixture
def task_log(capsys: pytest.CaptureFixture[str]) -> TaskLog:
    return TaskLog(capsys)


def test_two_rank_training_reports_progress_to_log_and_task_state(
    mnist_subset: Path, tmp_path: Path, task_log: TaskLog
) -> None:
    data = stage_local(mnist_subset)
    output = tmp_path / "out"
    store = TaskStateStore()
    op = HorovodTrainOperator(
        task_id="train",
        data=str(data),
        output=str(output),
        num_proc=2,
        trainer_args={
            "epochs": 2,
            "batch_size": 32,
            "max_train_samples": 1024,
            "progress_seconds": 1,
            "log_interval": 0,
        },
        **with_launcher_options({}),
    )

    result = op.execute(context(store=store))

    assert result["epochs"] == 2
    log = task_log.text
    # the task log's lines carry structlog's suffix after the job's line: the JSON alone
    jsons = [line[: line.rfind("}") + 1] for line in log.splitlines()]
    events = [e for e in (parse_event(j, EVENT_PROGRESS) for j in jsons) if e]
    steps_per_epoch = 1024 // 2 // 32
    # at least the first step and each epoch's last step, from rank 0 only
    assert len(events) >= 3, log[-3000:]
    assert {e["of_steps"] for e in events} == {2 * steps_per_epoch}
    assert events[-1]["step"] == 2 * steps_per_epoch and events[-1]["epoch"] == 2
    assert events[-1]["eta_seconds"] == 0
    assert events[-1]["samples_per_sec"] > 0
    assert [e["step"] for e in events] == sorted({e["step"] for e in events})  # rank 0 alone
    readable = [ln for ln in log.splitlines() if "progress: epoch 2/2, step" in ln]
    assert readable and "samples/s, ETA 0m00s" in readable[-1], log[-3000:]

    latest = store[PROGRESS_STATE_KEY]
    assert latest["step"] == latest["of_steps"] == 2 * steps_per_epoch
    assert latest["epoch"] == latest["of_epochs"] == 2
    assert latest["updated_at"]

    metrics = METRICS.check(json.loads((output / "metrics.json").read_text()), "metrics.json")
    assert metrics["format"] == "horovod-airflow/metrics-v2"
    steps = step_series(metrics)
    assert steps is not None and steps["every"] == 1
    assert steps["step"] == list(range(1, 2 * steps_per_epoch + 1))
    assert steps["epoch"][-1] == 2.0
    assert all(loss > 0 for loss in steps["loss"])
    assert len(set(steps["lr"])) > 1  # warmup / schedule: the lr moves per step
    png = render_training_curves(metrics["history"], steps)
    assert png.startswith(b"\x89PNG")
