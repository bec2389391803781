"""Bad data is stopped before training, in a real run of the retraining DAG.

Real Airflow (``dag.test()``, SQLite metadata), the real S3 server, real horovodrun for the one
run that trains. Run 1 stages a real MNIST cut and publishes; then a dataset with 10 % of its
rows, and one with class 7 removed, each fail ``stage_dataset`` naming the change: ``train``
never runs (upstream_failed), nothing is uploaded under ``datasets/`` and ``latest.json`` is
untouched. A slightly grown dataset then passes its staging (the training after it is marked
done without running, to spare CI a second training).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dags.test_retrain_dag import (  # noqa: F401  (autouse fixtures: errors, bucket)
    SMALL_RUN,
    _deploy,
    _get,
    _hva_bucket_restored,
    _keys,
    _record_task_errors,
    _states,
)
from tests.mnist_subset import read_split, write_dataset, write_subset

REPO = Path(__file__).resolve().parents[2]
MNIST = REPO / "data" / "mnist"
DOWNSTREAM = ("train", "gate", "export_onnx", "publish", "record_refused")


@pytest.mark.slow
def test_a_truncated_or_one_class_short_dataset_fails_staging_and_trains_nothing(
    s3_server, airflow_db, tmp_path
):
    from airflow.sdk import DagRunState

    client = s3_server.client()
    bucket = s3_server.new_bucket("datachecks")
    dag = _deploy(bucket).retrain_dag
    base = write_subset(MNIST, tmp_path / "base", train=3000, test=1000)

    first = dag.test(run_conf={**SMALL_RUN, "dataset_source": str(base), "min_accuracy": 0.5})
    assert first.state == DagRunState.SUCCESS, _states(first)
    staged = first.get_task_instance("stage_dataset").xcom_pull(task_ids="stage_dataset")
    assert staged["checks"] == {"passed": True, "previous": None, "previous_staged_at": None}
    latest = _get(client, bucket, "models/mnist_cnn/latest.json")
    datasets = {k: v for k, v in _keys(client, bucket, "datasets/").items()}

    splits = {s: read_split(base, s) for s in ("train", "test")}
    tenth = write_dataset(
        tmp_path / "tenth",
        {s: (x[: len(x) // 10], y[: len(y) // 10]) for s, (x, y) in splits.items()},
    )
    images, labels = splits["train"]
    no_7 = write_dataset(
        tmp_path / "no7",
        {"train": (images[labels != 7], labels[labels != 7]), "test": splits["test"]},
    )
    for source, expected in (
        (tenth, "train: 300 samples, previously 3000 (-90.0 %, allowed -50 %)"),
        (no_7, "class 7 missing from train"),
    ):
        run = dag.test(run_conf={**SMALL_RUN, "dataset_source": str(source), "min_accuracy": 0.5})
        states = _states(run)
        assert run.state == DagRunState.FAILED, states
        assert states["stage_dataset"] == "failed", states
        assert {states[t] for t in DOWNSTREAM} == {"upstream_failed"}, states
        error = states.errors["stage_dataset"]
        assert "DatasetRefusedError" in error and expected in error, error[-2000:]
        assert f"against {staged['uri']}" in error
        stage_ti = run.get_task_instance("stage_dataset")
        assert stage_ti.try_number == 1  # not retried, though the DAG gives every task a retry
        assert _keys(client, bucket, "datasets/") == datasets  # nothing uploaded
        assert _get(client, bucket, "models/mnist_cnn/latest.json") == latest

    grown = write_subset(MNIST, tmp_path / "grown", train=3300, test=1000)
    run = dag.test(
        run_conf={**SMALL_RUN, "dataset_source": str(grown), "min_accuracy": 0.5},
        mark_success_pattern="^(train|gate|export_onnx|publish)$",
    )
    states = _states(run)
    assert states["stage_dataset"] == "success", states
    passed = run.get_task_instance("stage_dataset").xcom_pull(task_ids="stage_dataset")
    assert passed["checks"]["previous"] == staged["uri"]  # compared with run 1's, not a refused one
    assert passed["uri"] != staged["uri"] and passed["uploaded"]
    assert _get(client, bucket, "models/mnist_cnn/latest.json") == latest
