"""Each benchmark in its tiny ``--quick`` mode, for real (horovodrun, 2 ranks), so none can rot.

The quick modes measure nothing worth reading; these tests check that every benchmark still
runs end to end against the current trainer, writes its Markdown and JSON results, and that
the numbers in them are consistent (positive rates, accuracies in [0, 1], times that add up).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import secrets
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bench import (
    demo_baseline,
    elastic_commit,
    horovod_cycle,
    one_epoch,
    pipeline_overhead,
    precision,
    profile_step,
    s3_servers,
    time_to_accuracy,
    train_throughput,
)
from bench.datasets import prepare_torchvision_root, stage_local_dataset
from bench.report import md_table, rank_env, run_horovod
from tests.conftest import REPO


def _results(results_dir: Path, name: str) -> tuple[str, dict]:
    markdown = (results_dir / f"{name}.md").read_text()
    data = json.loads((results_dir / f"{name}.json").read_text())
    assert "Machine: " in markdown and "load average at start" in markdown
    assert data["machine"]["cores"] >= 1 and data["machine"]["torch"]
    assert len(data["machine"]["load_average_at_start"]) == 3
    return markdown, data


def test_torchvision_root_reads_the_vendored_mnist(tmp_path: Path) -> None:
    from torchvision import datasets

    root = prepare_torchvision_root(tmp_path / "tv")
    train = datasets.MNIST(str(root), train=True, download=False)
    test = datasets.MNIST(str(root), train=False, download=False)
    assert (len(train), len(test)) == (60000, 10000)
    assert [int(train.targets[i]) for i in range(5)] == [5, 0, 4, 1, 9]  # data/mnist/README.md


def test_torchvision_root_names_a_missing_file(tmp_path: Path) -> None:
    source = tmp_path / "partial"
    source.mkdir()
    (source / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"x"))
    with pytest.raises(FileNotFoundError, match=r"train-labels-idx1-ubyte\.gz is missing"):
        prepare_torchvision_root(tmp_path / "tv", source=source)


def test_staged_folder_verifies_with_the_trainer(tmp_path: Path) -> None:
    from horovod_airflow.trainer import data

    staged = stage_local_dataset(tmp_path / "staged")
    local = data.fetch_dataset(str(staged), cache_dir=str(tmp_path / "cache"))
    x, y = data.load_split(local, "test", limit=100)
    assert tuple(x.shape) == (100, 1, 28, 28) and tuple(y.shape) == (100,)


def test_md_table_formats_rows() -> None:
    table = md_table(["a", "b"], [["x", 1234.5678], ["y", 0.5]])
    assert table.splitlines() == ["| a | b |", "| --- | --- |", "| x | 1,234.6 |", "| y | 0.500 |"]


def test_run_horovod_rejects_zero_ranks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"np \(Horovod ranks\) must be >= 1, got 0"):
        run_horovod(0, ["bench.demo_baseline"], log=tmp_path / "x.log", timeout=10)


def test_run_horovod_raises_with_the_log_tail(tmp_path: Path) -> None:
    with pytest.raises(
        RuntimeError, match=r"(?s)exited 1; log tail.*No module named bench\.no_such_module"
    ):
        run_horovod(1, ["bench.no_such_module"], log=tmp_path / "x.log", timeout=300)


def _processes_with(name: str, value: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment has ``name=value``."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(name) == value:
                found.append(p)
    return found


@pytest.mark.slow
def test_run_horovod_timeout_leaves_no_rank_behind(tmp_path: Path) -> None:
    # The ranks' middlemen setsid() out of horovodrun's process group and, on horovodrun's
    # death, signal only the rank itself: killing the group alone left each rank's helper
    # process running. Every process of this run carries the token in its environment.
    token = secrets.token_hex(8)
    env = rank_env({"HVA_BENCH_TIMEOUT_TEST": token})
    log = tmp_path / "sleep.log"
    program = ["tests.programs.sleep_program", "600", "--helper"]
    try:
        with pytest.raises(RuntimeError, match=r"timed out after 20s \(horovodrun and all"):
            run_horovod(2, program, log=log, timeout=20, env=env)
        # All ranks and helpers were running when the timeout struck (else this proves
        # nothing) ...
        started = [json.loads(ln[ln.index("{") :]) for ln in log.read_text().splitlines()
                   if '"event": "sleeping"' in ln]  # fmt: skip
        pids = {pid for event in started for pid in event["pids"]}
        assert len(pids) == 4, f"2 ranks + 2 helpers should start within 20 s:\n{log.read_text()}"
        # ... and nothing of the run is left: no rank, helper, middleman or horovodrun.
        left = _processes_with("HVA_BENCH_TIMEOUT_TEST", token)
        assert not left, f"left running: {[(p.pid, p.cmdline()) for p in left]}"
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"{pid} runs"
    finally:
        for p in _processes_with("HVA_BENCH_TIMEOUT_TEST", token):  # a failed run's leftovers
            with contextlib.suppress(psutil.Error):
                p.kill()


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        (demo_baseline, ["rank", "--root", "r", "--epochs", "0"], "--epochs must be >= 1, got 0"),
        (demo_baseline, ["--train-samples", "-1"], "--train-samples must be >= 0"),
        (train_throughput, ["--repeats", "0"], "--repeats must be an integer >= 1, got 0"),
        (time_to_accuracy, ["--np", "0"], "--np must be an integer >= 1, got 0"),
        (time_to_accuracy, ["--demo-epochs", "0"], "--demo-epochs must be an integer >= 1, got 0"),
        (pipeline_overhead, ["--timeout", "-1"], "--timeout must be > 0 seconds"),
        (pipeline_overhead, ["--repeat", "0"], "--repeat must be an integer >= 1, got 0"),
        (s3_servers, ["--repeat", "0"], "--repeat must be an integer >= 1, got 0"),
        (one_epoch, ["--np", "0"], "--np must be an integer >= 1, got 0"),
        (precision, ["--np", "0"], "--np must be an integer >= 1, got 0"),
        (precision, ["--steps", "0"], "--steps must be an integer >= 1, got 0"),
        (profile_step, ["--steps", "0"], "--steps must be >= 1 and --warmup >= 0, got 0, 3"),
        (horovod_cycle, ["--cycles", "0"], "--cycles takes milliseconds > 0, got [0.0]"),
        (
            horovod_cycle,
            ["--samples", "3"],
            "--samples >= 2 x np, got np 2, --repeats 4, --samples 3",
        ),
        (
            elastic_commit,
            ["--repeats", "0"],
            "--repeats must be >= 1 and --samples >= 64 x np, "
            "got np 2, --repeats 0, --samples 12000",
        ),
        (elastic_commit, ["--samples", "127"], "got np 2, --repeats 3, --samples 127"),
    ],
)
def test_bad_arguments_are_named(module, argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_baseline_quick(tmp_path: Path) -> None:
    demo_baseline.main(["--quick", "--results-dir", str(tmp_path)])
    markdown, data = _results(tmp_path, "demo_baseline_quick")
    result = data["result"]
    assert result["world_size"] == 2
    # The demo's default threads: torch's choice in a new process (other tests in this one
    # may have set theirs).
    fresh = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert result["threads_per_rank"] == int(fresh.stdout.strip())
    (epoch,) = result["epochs"]
    assert epoch["val_samples"] == 256  # allreduced over both ranks, not one rank's half
    assert 0.0 <= epoch["val_accuracy"] <= 1.0
    assert epoch["train_seconds"] > 0 and epoch["train_samples_per_sec"] > 0
    assert 0 < result["startup_seconds"] < result["wall_seconds"]
    assert "| epoch | train s |" in markdown


def test_horovod_cycle_quick(tmp_path: Path) -> None:
    horovod_cycle.main(["--quick", "--cycles", "1", "10", "--results-dir", str(tmp_path)])
    markdown, data = _results(tmp_path, "horovod_cycle_quick")
    default, ours = data["results"]
    assert (default["cycle_ms"], default["horovod_default"]) == (1.0, True)
    assert (ours["cycle_ms"], ours["trainer_default"]) == (10.0, True)
    for r in data["results"]:
        assert len(r["samples_per_sec"]) == 1 and r["median"] == r["samples_per_sec"][0] > 0
    assert "| 1 ms (Horovod default) |" in markdown and "| 10 ms (trainer on CPU) |" in markdown


@pytest.mark.slow
def test_train_throughput_quick(tmp_path: Path) -> None:
    train_throughput.main(["--quick", "--results-dir", str(tmp_path)])
    markdown, data = _results(tmp_path, "train_throughput_quick")
    runs = data["runs"]
    assert sorted(runs) == ["1", "2"]
    names = {r["name"] for r in runs["2"]["results"]}
    assert {
        "demo input pipeline",
        "our data path",
        "demo training step",
        "our training step",
        "model only, fp32",
        "model only, bf16 autocast + channels_last",
    } <= names
    for run in runs.values():
        for r in run["results"]:
            assert r["median"] > 0 and r["steps"] >= 2, r
    assert runs["2"]["our_threads"] * 2 <= max(2, data["machine"]["cores"])  # no oversubscription
    assert all(v > 0 for v in data["ratios"].values())
    assert "scaling efficiency" in markdown


@pytest.mark.slow
def test_precision_quick(tmp_path: Path) -> None:
    from horovod_airflow.trainer.runtime import cpu_has_bf16

    precision.main(["--quick", "--results-dir", str(tmp_path)])
    markdown, data = _results(tmp_path, "precision_quick")
    results = data["run"]["results"]
    assert [(r["precision"], r["channels_last"]) for r in results] == list(precision.COMBOS)
    assert all(r["median"] > 0 and len(r["samples_per_sec"]) == 1 for r in results)
    auto = data["run"]["auto"]  # what auto resolved to in the ranks, on this machine
    assert auto["precision"] == ("bf16" if cpu_has_bf16() else "fp32")
    assert auto["channels_last"] is False
    assert markdown.count("← auto") == 1
    assert "avx512_bf16" in markdown  # the flags that decided it are recorded
    assert data["machine"]["cpu_flags"]


@pytest.mark.slow
def test_time_to_accuracy_quick(tmp_path: Path) -> None:
    time_to_accuracy.main(["--quick", "--seeds", "42", "1", "--results-dir", str(tmp_path)])
    markdown, data = _results(tmp_path, "time_to_accuracy_quick")
    assert [r["config"]["seed"] for r in data["ours_seeds"]] == [42, 1]
    assert data["ours"] == data["ours_seeds"][0]
    for recipe in ("ours", "demo"):
        r = data[recipe]
        (epoch,) = r["epochs"]
        assert 0.0 <= epoch["val_accuracy"] <= 1.0
        assert 0 < epoch["ended_after"] <= r["wall_seconds"]
    assert data["ours"]["config"]["max_train_samples"] == 1024
    assert "| ours (trainer defaults), seed 42 | 1 |" in markdown
    assert "| ours (trainer defaults), seed 1 | 1 |" in markdown
    # --render rebuilds the same Markdown from the saved JSON, without running anything.
    (tmp_path / "time_to_accuracy_quick.md").unlink()
    time_to_accuracy.main(["--render", str(tmp_path / "time_to_accuracy_quick.json")])
    assert (tmp_path / "time_to_accuracy_quick.md").read_text() == markdown


def test_time_to_accuracy_speedups_come_from_the_epoch_times() -> None:
    def recipe(epochs: list[tuple[float, float, float]], wall: float) -> dict:
        rows = [
            {"epoch": i + 1, "val_accuracy": acc, "epoch_seconds": sec, "ended_after": end,
             "train_samples_per_sec": 1.0}
            for i, (acc, sec, end) in enumerate(epochs)
        ]  # fmt: skip
        ttt = time_to_accuracy.first_at_target(rows, "ended_after")
        config = {"batch_size": 128, "optimizer": "adam", "lr": 0.001}
        config |= {"lr_schedule": "cosine", "epochs": 2}
        return {"epochs": rows, "time_to_target": ttt, "wall_seconds": wall, "world_size": 2,
                "threads_per_rank": 2, "runtime": {}, "config": config}  # fmt: skip

    data = {
        "ours": recipe([(0.985, 20.0, 40.0), (0.991, 20.0, 60.0)], 70.0),
        "demo": recipe([(0.98, 200.0, 230.0), (0.985, 200.0, 430.0), (0.9904, 200.0, 630.0)], 640),
        "quick": False,
        "load_average_before_demo": [1.0, 1.0, 1.0],
        "machine": {
            "cores": 2,
            "cpu_model": "x",
            "memory_gib": 1,
            "gpus": 0,
            "torch": "t",
            "torchvision": "v",
            "horovod": "h",
            "python": "p",
            "load_average_at_start": [0.0, 0.0, 0.0],
        },
    }
    assert data["ours"]["time_to_target"] == {"epoch": 2, "seconds": 60.0}
    markdown = time_to_accuracy.render(data)
    assert "**10.5×** from launch (target ≥ 10×: met); 15.0× counting only" in markdown
    data["ours"]["epochs"][1]["ended_after"] = data["ours"]["time_to_target"]["seconds"] = 70.0
    assert "(target ≥ 10×: MISSED)" in time_to_accuracy.render(data)
    assert "Mean epoch (training + validation): ours 20.0 s, the demo 200.0 s (10.0×)" in markdown

    # The demo ends below the target: its wall time is a lower bound on its time to target.
    data["demo"]["epochs"][2]["val_accuracy"] = 0.9879
    data["demo"]["time_to_target"] = time_to_accuracy.first_at_target(
        data["demo"]["epochs"], "ended_after"
    )
    assert data["demo"]["time_to_target"] is None
    markdown = time_to_accuracy.render(data)
    assert "**more than 9.1×** from launch (target ≥ 10×: MISSED)" in markdown
    assert "its 3 epochs ended after 640 s" in markdown
    data["ours"]["time_to_target"] = None
    assert "not computable (not every seed of our recipe reached the target)" in (
        time_to_accuracy.render(data)
    )

    # Several seeds: the speed-up is against the slowest, and every seed must reach 99 %.
    data["demo"] = recipe([(0.98, 200.0, 230.0), (0.9904, 200.0, 630.0)], 640)
    fast = recipe([(0.991, 20.0, 30.0)], 40.0)
    slow = recipe([(0.985, 20.0, 40.0), (0.991, 20.0, 63.0)], 70.0)
    data["ours"], data["ours_seeds"] = fast, [fast, slow]
    markdown = time_to_accuracy.render(data)
    assert "**10.0×** from launch (target ≥ 10×: met)" in markdown
    assert "reached 99.0 % on 2 of 2 seed(s); the speed-up is against the slowest" in markdown
    assert time_to_accuracy.speedup_from_launch(data) == pytest.approx(10.0)
    slow["time_to_target"] = None
    markdown = time_to_accuracy.render(data)
    assert "not computable" in markdown and "on 1 of 2 seed(s)" in markdown
    assert time_to_accuracy.speedup_from_launch(data) is None


@pytest.mark.slow
@pytest.mark.skipif(
    not (REPO / "scripts" / "run_pipeline.py").is_file(), reason="the pipeline runner is absent"
)
def test_pipeline_overhead_quick(tmp_path: Path) -> None:
    pipeline_overhead.main(
        ["--quick", "--repeat", "2", "--results-dir", str(tmp_path), "--workdir", str(tmp_path)]
    )
    markdown, data = _results(tmp_path, "pipeline_overhead_quick")
    # Two runs, each in its own folder; the table is the lower middle one's.
    assert [p.name for p in sorted(tmp_path.glob("pipeline-*"))] == ["pipeline-1", "pipeline-2"]
    runs = sorted(r["orchestration_seconds"] for r in data["runs"])
    assert len(runs) == 2 and data["orchestration_seconds"] == runs[0]
    assert "median of 2 runs" in markdown and "run 2: DAG" in markdown
    tasks = {t["task_id"]: t for t in data["tasks"]}
    assert tasks["train"]["state"] == "success"
    assert 0 < data["train_seconds"] < tasks["train"]["seconds"]  # the task wraps the training
    assert data["export_seconds"] > 0
    assert data["orchestration_seconds"] == pytest.approx(
        data["dag_run_seconds"] - data["train_seconds"] - data["export_seconds"]
    )
    assert "orchestration = DAG run" in markdown


@pytest.mark.slow
def test_s3_servers_quick(tmp_path: Path) -> None:
    """The main job once on each server, moto first: both publish, and the table holds
    each one's figures and their difference."""
    s3_servers.main(
        ["--quick", "--repeat", "1", "--results-dir", str(tmp_path), "--workdir", str(tmp_path)]
    )
    markdown, data = _results(tmp_path, "s3_servers_quick")
    assert [p.name for p in sorted(tmp_path.glob("pipeline-*"))] == ["pipeline-1", "pipeline-2"]
    for kind in ("moto", "seaweedfs"):
        (run,) = data["runs"][kind]
        assert 0 < run["server start-up"] < run["process"]
        assert 0 < run["train"] < run["DAG run"] < run["process"]
    seaweed = data["median"]["seaweedfs"]["process"]
    moto = data["median"]["moto"]["process"]
    assert f"| process | {moto:.1f} | {seaweed:.1f} | {seaweed - moto:+.1f} |" in markdown
    assert (tmp_path / "pipeline-2" / "s3" / "data").is_dir()  # SeaweedFS kept its data


@pytest.mark.slow
def test_profile_step_quick(tmp_path: Path) -> None:
    profile_step.main(["--quick", "--results-dir", str(tmp_path)])
    markdown, data = _results(tmp_path, "profile_step_quick")
    assert data["world_size"] == 2 and data["steps"] == 2
    names = [op["name"] for op in data["ops"]]
    assert "aten::convolution_backward" in names  # the real backward pass was profiled
    assert any("Horovod" in n for n in names)  # and so was the gradient allreduce
    shares = sum(op["self_cpu_ms"] for op in data["ops"]) / data["step_cpu_ms_total"]
    assert 0.5 < shares <= 1.05  # self times add up to (about) the step's total
    assert "| convolution backward |" in markdown
    # What bounds it: the FLOP rates and the epoch floor come from this run's own numbers.
    bound = data["bound"]
    assert data["matmul_gflops_per_rank"] > 0
    # The default model (mnist_bn): 22,237,440 FLOPs per sample, counted by hand below.
    assert bound["mflop_per_sample"] == pytest.approx(22.23744)
    assert 0 < bound["epoch_seconds_at_peak"] < bound["epoch_seconds_at_step_rate"]
    assert bound["conv_forward_gflops"] > 0 and bound["conv_backward_gflops"] > 0
    # The peak is measured in the step's own precision (a bf16 step against a bf16 matmul).
    peak_row = f"| {data['precision']} matrix multiply, every rank at once (the practical peak) |"
    assert peak_row in markdown


def test_training_flops_of_the_demo_cnn_by_hand() -> None:
    from horovod_airflow.trainer.model import INPUT_SHAPE, build_model

    flops = profile_step.training_flops(build_model("mnist_cnn"), INPUT_SHAPE)
    conv1 = 2 * 32 * 26 * 26 * (1 * 3 * 3)  # forward FLOPs: outputs x MACs each x 2
    conv2 = 2 * 64 * 24 * 24 * (32 * 3 * 3)
    linear = 2 * (9216 * 128 + 128 * 10)
    assert flops["conv_forward"] == conv1 + conv2
    assert flops["conv_backward"] == conv1 + 2 * conv2  # conv1 needs no input gradient
    assert flops["linear"] == 3 * linear


def test_training_flops_of_mnist_bn_by_hand() -> None:
    from horovod_airflow.trainer.model import INPUT_SHAPE, build_model

    flops = profile_step.training_flops(build_model("mnist_bn"), INPUT_SHAPE)
    # "same" padding, a 2x2 max-pool after each block: 28 -> 14 -> 7 -> 3
    conv1 = 2 * 24 * 28 * 28 * (1 * 5 * 5)
    conv2 = 2 * 48 * 14 * 14 * (24 * 3 * 3)
    conv3 = 2 * 64 * 7 * 7 * (48 * 3 * 3)
    linear = 2 * (64 * 3 * 3 * 10)
    assert flops["conv_forward"] == conv1 + conv2 + conv3
    assert flops["conv_backward"] == conv1 + 2 * (conv2 + conv3)
    assert flops["linear"] == 3 * linear
    per_sample = sum(flops.values())
    assert per_sample == 22_237_440


@pytest.mark.slow
def test_one_epoch_quick(tmp_path: Path) -> None:
    one_epoch.main(["--quick", "--results-dir", str(tmp_path)])
    markdown, data = _results(tmp_path, "one_epoch_quick")
    default, demo_cnn = data["runs"]
    assert default["args"] == ["--seed", "42"] and demo_cnn["args"] == ["--model", "mnist_cnn"]
    for run in data["runs"]:
        assert run["config"]["epochs"] == 1 and run["config"]["max_train_samples"] == 1024
        assert 0.0 <= run["val_accuracy"] <= 1.0 and run["epoch_seconds"] > 0
        assert run["precision"] in ("fp32", "bf16")
    assert default["config"]["model"] == "mnist_bn" and demo_cnn["config"]["model"] == "mnist_cnn"
    assert "| the demo's CNN, same recipe | `--model mnist_cnn` |" in markdown


def test_profile_groups_name_the_step_parts() -> None:
    assert profile_step.group_of("aten::convolution_backward") == "convolution backward"
    assert profile_step.group_of("Optimizer.step#Adam.step") == "optimizer (Adam)"
    assert profile_step.group_of("HorovodAllreduce") == "gradient allreduce wait (Horovod)"
    assert profile_step.group_of("aten::something_new") == "other"


def test_elastic_commit_quick(tmp_path: Path) -> None:
    elastic_commit.main(["--quick", "--results-dir", str(tmp_path)])
    markdown, data = _results(tmp_path, "elastic_commit_quick")
    plain, *elastic = data["results"]
    assert plain["commit_every"] is None and plain["commit_share"] is None
    for r in elastic:
        assert r["median"] > 0 and 0 <= r["commit_share"] < 1
    # 2,048 samples at 2 x 64 per step: 16 steps, so only N = 5 commits mid-epoch
    assert [r["commit_share"] > 0 for r in elastic] == [False, False, True]
    assert "| --elastic, commit every 20 (default) |" in markdown


def test_startup_savings_quick(tmp_path: Path) -> None:
    from bench import startup_savings

    startup_savings.main(["--quick", "--results-dir", str(tmp_path)])
    markdown, data = _results(tmp_path, "startup_savings_quick")
    rows = {r["saving"].split(" (")[0]: r for r in data["savings"]}
    assert len(data["savings"]) == 4 and len(rows) == 3
    for r in data["savings"]:
        assert len(r["plain_s"]) == len(r["with_s"]) == 1 and r["plain_s"][0] > 0
        assert r["saved_s"] == r["plain_median_s"] - r["with_median_s"]
        assert str(tmp_path) not in " ".join(r["plain"] + r["saved"])  # no machine paths
    assert "| horovodrun without its Gloo probe (1 rank) |" in markdown
