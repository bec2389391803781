"""Real 2-rank ``horovodrun`` training on a small real-MNIST subset (CPU, Gloo)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from horovod_airflow.core import storage
from horovod_airflow.core.contract import EXIT_REFUSED, METRICS
from tests.conftest import MNIST_DIR
from tests.mnist_subset import write_subset
from tests.trainer.conftest import (
    TINY,
    VAL_SAMPLES,
    Run,
    describe,
    events,
    horovodrun_command,
    run_horovod,
    stage_local,
    trainer_env,
)


def test_allreduced_accuracy_equals_single_process_eval_of_checkpoint(
    tiny_run: Run, staged_subset: Path
) -> None:
    import torch

    from horovod_airflow.trainer import data
    from horovod_airflow.trainer.model import build_model
    from horovod_airflow.trainer.resume import load_checkpoint
    from horovod_airflow.trainer.train import evaluate

    metrics = tiny_run.metrics
    assert metrics["world_size"] == 2
    assert metrics["val_samples"] == VAL_SAMPLES  # the whole validation set, no padding

    torch.set_num_threads(1)
    state = load_checkpoint(str(tiny_run.output / "checkpoint.pt"))  # weights_only=True inside
    model = build_model(state["config"]["model"])
    model.load_state_dict(state["model"])
    dataset = data.fetch_dataset(str(staged_subset), str(tiny_run.cache))
    x, y = data.load_split(dataset, "test", VAL_SAMPLES)
    loss_sum, correct, count = evaluate(model, x, y, batch_size=500).tolist()

    assert int(count) == metrics["val_samples"]
    assert int(correct) == metrics["val_correct"]
    assert metrics["val_accuracy"] == pytest.approx(correct / count, abs=0)
    assert metrics["val_loss"] == pytest.approx(loss_sum / count, rel=1e-5)
    assert 0.2 < metrics["val_accuracy"] <= 1.0  # it learned something in 8 steps

    # The shards are unequal (249 + 250), so the mean of the ranks' own accuracies -- what a
    # trainer reducing per-rank metrics would report -- is a different number: this test
    # tells the exact sum from an average.
    half = VAL_SAMPLES // 2
    shards = [evaluate(model, x[a:b], y[a:b], 500) for a, b in ((0, half), (half, VAL_SAMPLES))]
    assert [int(s[2]) for s in shards] == [249, 250]
    mean_of_ranks = sum(float(s[1] / s[2]) for s in shards) / 2
    assert mean_of_ranks != metrics["val_accuracy"]
    assert sum(int(s[1]) for s in shards) == metrics["val_correct"]


def test_the_trainers_metrics_follow_the_published_json_schema(tiny_run: Run) -> None:
    """What a program in another language is told to write (docs/contract/) is what ours
    writes: a real run's metrics.json, and its per-step record, pass the JSON Schema files."""
    from jsonschema import Draft202012Validator

    from tests.conftest import REPO

    def errors(name: str, document: object) -> list[str]:
        schema = json.loads((REPO / "docs" / "contract" / f"{name}.schema.json").read_text())
        return [e.message for e in Draft202012Validator(schema).iter_errors(document)]

    metrics = tiny_run.metrics
    assert errors("metrics", metrics) == []
    assert errors("steps", metrics["steps"]) == []
    assert errors("metrics", {**metrics, "world_size": "2"})  # the files do refuse


def test_ranks_hold_identical_parameters_after_broadcast_and_first_step(tiny_run: Run) -> None:
    hashes = events(tiny_run.proc.stdout, "param_hash")
    by_step: dict[int, dict[int, str]] = {}
    for e in hashes:
        by_step.setdefault(e["step"], {})[e["rank"]] = e["hash"]
    assert set(by_step) == {0, 1}, hashes
    assert set(by_step[0]) == {0, 1} and set(by_step[1]) == {0, 1}, hashes
    assert by_step[0][0] == by_step[0][1], "ranks differ right after the broadcast"
    assert by_step[1][0] == by_step[1][1], "ranks differ after the first optimizer step"
    assert by_step[1][0] != by_step[0][0], "the first step did not change the parameters"


def test_metrics_contract_and_final_stdout_line(tiny_run: Run, staged_subset: Path) -> None:
    metrics = tiny_run.metrics
    assert METRICS.check(metrics, "metrics.json")["format"] == "horovod-airflow/metrics-v2"
    for key in (
        "val_accuracy", "val_loss", "val_correct", "val_samples", "epochs", "world_size",
        "history", "config", "dataset", "versions", "param_hash", "train_seconds", "artifacts",
    ):  # fmt: skip
        assert key in metrics, key
    assert metrics["epochs"] == 1 and len(metrics["history"]) == 1
    entry = metrics["history"][0]
    assert set(entry) == {
        "epoch", "train_loss", "val_loss", "val_accuracy", "samples_per_sec", "epoch_seconds"
    }  # fmt: skip
    assert entry["val_accuracy"] == metrics["val_accuracy"]
    assert entry["samples_per_sec"] > 0 and entry["epoch_seconds"] > 0
    assert metrics["config"]["max_train_samples"] == 512
    manifest = json.loads((staged_subset / "manifest.json").read_text())
    assert metrics["dataset"]["content_hash"] == manifest["content_hash"]
    assert set(metrics["versions"]) >= {"torch", "torchvision", "horovod", "trainer", "python"}

    rank0_json = [
        line for line in tiny_run.proc.stdout.splitlines() if line.startswith("[0]<stdout>:{")
    ]
    final = json.loads(rank0_json[-1].partition(":")[2])
    assert final["event"] == "final_metrics"
    assert final["val_correct"] == metrics["val_correct"]
    assert final["param_hash"] == metrics["param_hash"]
    assert len(events(tiny_run.proc.stdout, "final_metrics")) == 1  # rank 0 alone reports

    (epoch_event,) = events(tiny_run.proc.stdout, "epoch")  # one per epoch, rank 0 alone
    assert epoch_event == {
        "event": "epoch",
        **entry,
        "of_epochs": 1,
        "val_correct": metrics["val_correct"],
        "val_samples": VAL_SAMPLES,
    }

    # v2: every one of the 4 steps recorded (a short run keeps them all); progress after the
    # first step and at the epoch's end, from rank 0 alone
    assert metrics["steps"]["every"] == 1 and metrics["steps"]["step"] == [1, 2, 3, 4]
    assert len(metrics["steps"]["loss"]) == 4 and all(v > 0 for v in metrics["steps"]["loss"])
    progress = events(tiny_run.proc.stdout, "progress")
    assert [e["step"] for e in progress] == [1, 4] and progress[-1]["of_steps"] == 4


def test_dataset_is_verified_into_the_node_cache_once(tiny_run: Run, staged_subset: Path) -> None:
    manifest = json.loads((staged_subset / "manifest.json").read_text())
    cached = tiny_run.cache / "datasets" / manifest["content_hash"][:16]
    names = sorted(p.name for p in cached.iterdir())
    assert names == sorted(
        [layout_name.removesuffix(".gz") for layout_name in (e["name"] for e in manifest["files"])]
        + ["manifest.json"]
    )


def test_fp16_allreduce_with_accumulation_and_sgd_keeps_ranks_identical(
    staged_subset: Path, tmp_path: Path
) -> None:
    args = ["--data", str(staged_subset), "--output", str(tmp_path / "out"), "--epochs", "1"]
    args += [*TINY, "--fp16-allreduce", "--backward-passes-per-step", "2"]
    args += ["--optimizer", "sgd", "--lr", "0.01", "--weight-decay", "1e-4", "--debug-param-hash"]
    proc = run_horovod(args, tmp_path / "cache")
    assert proc.returncode == 0, describe(proc)
    after_step_1 = {e["rank"]: e["hash"] for e in events(proc.stdout, "param_hash") if e["step"]}
    assert set(after_step_1) == {0, 1} and after_step_1[0] == after_step_1[1]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["config"]["fp16_allreduce"] is True
    assert metrics["config"]["backward_passes_per_step"] == 2


def test_adasum_on_gloo_is_refused_with_a_clear_message(
    staged_subset: Path, tmp_path: Path
) -> None:
    args = ["--data", str(staged_subset), "--output", str(tmp_path / "out"), "--adasum", *TINY]
    proc = run_horovod(args, tmp_path / "cache", gloo=True)
    assert proc.returncode != 0
    assert "--adasum needs Horovod's MPI controller" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_resume_after_kill_completes_with_full_history(staged_subset: Path, tmp_path: Path) -> None:
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = ["--data", str(staged_subset), "--output", str(out), "--epochs", "2", *TINY]
    # More data per epoch than the other tests, so the run is surely inside epoch 2 when killed.
    args += ["--max-train-samples", "2000"]
    proc = subprocess.Popen(
        horovodrun_command(args),
        env=trainer_env(cache),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    checkpoint = out / "checkpoint.pt"
    try:
        deadline = time.monotonic() + 600
        while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert checkpoint.exists(), f"no checkpoint after epoch 1 (exit {proc.poll()})"
        assert proc.poll() is None, "the run finished before it could be killed"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # horovodrun and both ranks
        proc.wait(timeout=60)
    assert not (out / "metrics.json").exists()

    from horovod_airflow.trainer.resume import load_checkpoint

    interrupted = load_checkpoint(str(checkpoint))
    assert interrupted["epoch"] == 1 and len(interrupted["history"]) == 1

    resumed = run_horovod([*args, "--resume"], cache)
    assert resumed.returncode == 0, describe(resumed)
    assert "resuming from" in resumed.stderr and "after epoch 1" in resumed.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["epochs"] == 2
    assert [h["epoch"] for h in metrics["history"]] == [1, 2]
    assert metrics["history"][0] == interrupted["history"][0]  # history preserved, not re-run
    assert metrics["history"][1]["val_accuracy"] == metrics["val_accuracy"]
    assert load_checkpoint(str(checkpoint))["epoch"] == 2


def test_corrupted_staged_file_stops_every_rank(tmp_path: Path) -> None:
    staged = stage_local(write_subset(MNIST_DIR, tmp_path / "mnist", train=600, test=100))
    victim = staged / "train-labels-idx1-ubyte.gz"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, different content
    victim.write_bytes(bytes(raw))

    out = tmp_path / "out"
    proc = run_horovod(
        ["--data", str(staged), "--output", str(out), "--epochs", "1", *TINY], tmp_path / "cache"
    )
    assert proc.returncode != 0
    combined = proc.stdout + proc.stderr
    assert "DatasetIntegrityError" in combined
    assert f"Exit code: {EXIT_REFUSED}" in combined  # refused: the same data on every retry
    assert "train-labels-idx1-ubyte.gz: sha256" in combined
    assert not (out / "metrics.json").exists() and not (out / "checkpoint.pt").exists()


def test_s3_data_and_output(s3_server, mnist_subset: Path, tmp_path: Path) -> None:
    """The ranks as their own identity (read datasets/, read/write runs/): they train from
    S3 and write their run folder; a rank told to write under models/ is refused by the
    server (AccessDenied, naming the ranks' access key id) and fails loudly."""
    from horovod_airflow.core import layout

    staged_local = stage_local(mnist_subset)
    manifest = json.loads((staged_local / "manifest.json").read_text())
    bucket = s3_server.new_bucket("trainer", ranks=True)
    prefix = layout.staged_prefix(f"s3://{bucket}", manifest)
    for path in staged_local.iterdir():
        storage.upload_file(path, storage.join(prefix, path.name))
    output = f"s3://{bucket}/runs/test/run-1"
    ranks = {"AWS_ACCESS_KEY_ID": s3_server.ranks.access_key,
             "AWS_SECRET_ACCESS_KEY": s3_server.ranks.secret_key}  # fmt: skip

    proc = run_horovod(
        ["--data", prefix, "--output", output, "--epochs", "1", *TINY],
        tmp_path / "cache",
        env=ranks,
    )
    assert proc.returncode == 0, describe(proc)
    assert s3_server.ranks.secret_key not in proc.stdout + proc.stderr

    models = f"s3://{bucket}/models/mnist_cnn/v-by-a-rank"
    refused = run_horovod(
        ["--data", prefix, "--output", models, "--epochs", "1", *TINY],
        tmp_path / "cache",
        env=ranks,
    )
    assert refused.returncode != 0
    said = refused.stdout + refused.stderr
    assert "AccessDenied" in said and s3_server.ranks.access_key in said, describe(refused)
    assert s3_server.ranks.secret_key not in said
    assert not list(storage.list_uris(models + "/"))
    metrics = json.loads(storage.read_text(storage.join(output, "metrics.json")))
    assert metrics["val_samples"] == 500 and metrics["dataset"]["uri"] == prefix
    assert metrics["artifacts"]["checkpoint"] == f"{output}/checkpoint.pt"
    assert storage.exists(f"{output}/checkpoint.pt")
    cached = tmp_path / "cache" / "datasets" / manifest["content_hash"][:16]
    assert (cached / "train-images-idx3-ubyte.gz").is_file()  # downloaded once, verified
    assert s3_server.env["AWS_SECRET_ACCESS_KEY"] not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_target_accuracy_stops_every_rank_at_the_same_epoch(
    staged_subset: Path, tmp_path: Path
) -> None:
    out, cache = tmp_path / "out", tmp_path / "cache"
    target = 0.5  # far above chance (0.1), reached within a few epochs of 2000 images
    args = ["--data", str(staged_subset), "--output", str(out), "--epochs", "4", *TINY]
    args += ["--max-train-samples", "2000", "--target-accuracy", str(target)]
    proc = run_horovod(args, cache)
    assert proc.returncode == 0, describe(proc)
    metrics = json.loads((out / "metrics.json").read_text())
    accuracies = [h["val_accuracy"] for h in metrics["history"]]
    # It stopped at the first epoch that reached the target, not later, and not before.
    assert accuracies[-1] >= target and all(a < target for a in accuracies[:-1]), accuracies
    assert metrics["epochs"] == len(accuracies) < 4, accuracies
    assert metrics["stopped_at_target"] is True
    assert metrics["config"]["target_accuracy"] == target
    assert f"reached --target-accuracy {target}" in proc.stderr
    # Both ranks left the loop together: the job ended cleanly, each rank's last epoch agrees.
    assert proc.stdout.count('"event": "final_metrics"') == 1

    # Resuming a run that stopped at its target trains nothing more.
    resumed = run_horovod([*args, "--resume"], cache)
    assert resumed.returncode == 0, describe(resumed)
    again = json.loads((out / "metrics.json").read_text())
    assert again["history"] == metrics["history"]
    assert again["val_accuracy"] == metrics["val_accuracy"]
