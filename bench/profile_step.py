"""Where a training step's time goes: torch.profiler over our trainer's real steps, 2 ranks.

Written for the case the time-to-accuracy target is missed: it profiles rank 0 while every
rank runs ``trainer.train.train_one_epoch`` (trainer defaults, full MNIST in memory) under
``horovodrun``, and tabulates the operators by self CPU time (CUDA time too on a GPU),
grouped into forward/backward convolutions, linear layers, the optimizer, the gradient
allreduce wait and the rest. Run from the repository root::

    python -m bench.profile_step              # 2 ranks, 20 profiled steps after 3 warm-up
    python -m bench.profile_step --quick      # 2 steps (the smoke test)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.datasets import stage_local_dataset
from bench.report import (
    default_ranks,
    machine,
    machine_line,
    md_table,
    rank_env,
    run_horovod,
    write_results,
)

# Operator name fragments → the part of a step they belong to (first match wins).
GROUPS = (
    ("convolution backward", ("convolution_backward", "ConvolutionBackward")),
    ("convolution forward", ("conv2d", "convolution", "mkldnn_convolution")),
    ("linear (fc1, fc2) fwd+bwd", ("addmm", "mm", "linear", "AddmmBackward", "MmBackward")),
    ("optimizer (Adam)", ("adam", "Adam", "_foreach", "lerp", "addcdiv", "addcmul", "sqrt")),
    ("gradient allreduce wait (Horovod)", ("Horovod", "horovod", "synchronize", "allreduce")),
    ("data: index_select / copy", ("index_select", "contiguous", "copy_", "clone")),
    ("activations, pooling, dropout, loss", ("relu", "clamp_min", "max_pool", "dropout",
                                             "bernoulli", "cross_entropy",
                                             "nll_loss", "log_softmax", "threshold")),
)  # fmt: skip


def run_rank(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from bench.train_throughput import our_training_step
    from trainer import data, train
    from trainer.config import TrainConfig

    config = TrainConfig(
        data=args.data, output=args.output, cache_dir=args.cache_dir, log_interval=0
    )
    rt, device = train.setup_runtime(config)  # hvd.init() and the trainer's thread policy
    dataset = train.stage_dataset(config, rt)
    x, y = data.load_split(dataset, "train")
    x, y = x.to(device), y.to(device)
    step = our_training_step(config, rt, device, x, y)
    for _ in range(args.warmup):
        step()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    hvd.barrier()
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            with record_function("train_step"):
                step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    if not rt.is_primary:
        return
    events = prof.key_averages()
    step_event = next(e for e in events if e.key == "train_step")
    ops = []
    for e in events:
        if e.key == "train_step":
            continue
        ops.append(
            {
                "name": e.key,
                "calls": e.count,
                "self_cpu_ms": e.self_cpu_time_total / 1000,
                "self_device_ms": getattr(e, "self_device_time_total", 0) / 1000,
            }
        )
    ops.sort(key=lambda o: o["self_cpu_ms"], reverse=True)
    summary = {
        "world_size": rt.size,
        "device": rt.device,
        "threads_per_rank": rt.threads,
        "precision": rt.precision,
        "batch_per_rank": config.batch_size,
        "steps": args.steps,
        "step_cpu_ms_total": step_event.cpu_time_total / 1000,
        "ops": ops,
    }
    Path(args.result).write_text(json.dumps(summary, indent=2))


def group_of(name: str) -> str:
    for group, fragments in GROUPS:
        if any(f in name for f in fragments):
            return group
    return "other"


def tables(summary: dict[str, Any], top: int = 15) -> str:
    total = summary["step_cpu_ms_total"]
    steps = summary["steps"]
    groups: dict[str, float] = {}
    for op in summary["ops"]:
        group = group_of(op["name"])
        groups[group] = groups.get(group, 0.0) + op["self_cpu_ms"]
    group_rows = [
        [g, f"{ms / steps:.1f}", f"{100 * ms / total:.0f} %"]
        for g, ms in sorted(groups.items(), key=lambda kv: kv[1], reverse=True)
    ]
    op_rows = [
        [f"`{o['name']}`", o["calls"], f"{o['self_cpu_ms'] / steps:.2f}",
         f"{100 * o['self_cpu_ms'] / total:.1f} %", group_of(o["name"])]
        for o in summary["ops"][:top]
    ]  # fmt: skip
    return "\n\n".join(
        [
            md_table(["part of the step", "ms per step (rank 0)", "share"], group_rows),
            md_table(["operator", "calls", "self CPU ms/step", "share", "part"], op_rows),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    rank = sub.add_parser("rank", help="the program each Horovod rank runs")
    rank.add_argument("--data", required=True)
    rank.add_argument("--output", required=True)
    rank.add_argument("--cache-dir", default="")
    rank.add_argument("--result", required=True)
    for p in (parser, rank):
        p.add_argument("--steps", type=int, default=20, help="profiled steps")
        p.add_argument("--warmup", type=int, default=3, help="unprofiled steps first")
    parser.add_argument(
        "--np", type=int, default=None, help="Horovod ranks (default 2; on CUDA one per GPU, ≤ 2)"
    )
    parser.add_argument("--quick", action="store_true", help="2 profiled steps (smoke test)")
    parser.add_argument("--results-dir", type=Path, default=None, help="default bench/results")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps}, {args.warmup}")
    if args.command == "rank":
        run_rank(args)
        return 0
    args.np = default_ranks() if args.np is None else args.np
    if args.np < 1:
        parser.error(f"--np must be >= 1, got {args.np}")
    if args.quick:
        args.steps, args.warmup = 2, 1

    m = machine()
    with tempfile.TemporaryDirectory(prefix="hva-profile-") as tmp:
        work = Path(tmp)
        staged = stage_local_dataset(work / "staged")
        result = work / "profile.json"
        cmd = ["bench.profile_step", "rank", "--data", str(staged), "--output", str(work / "o")]
        cmd += ["--cache-dir", str(work / "cache"), "--result", str(result)]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        run_horovod(
            args.np, cmd, log=work / "profile.log", timeout=600 if args.quick else 3600,
            env=rank_env(),
        )  # fmt: skip
        summary = json.loads(result.read_text())
    title = (
        f"### Where our training step's time goes (torch.profiler, rank 0 of "
        f"{summary['world_size']})" + (" (quick)" if args.quick else "")
    )
    notes = (
        f"{summary['steps']} steps of `trainer.train.train_one_epoch`, batch "
        f"{summary['batch_per_rank']}/rank, {summary['threads_per_rank']} thread(s)/rank, "
        f"{summary['precision']}, device {summary['device']}; "
        f"{summary['step_cpu_ms_total'] / summary['steps']:.1f} ms of CPU time per step on "
        "rank 0. Self times: each operator without its children."
    )
    markdown = "\n".join([title, "", tables(summary), "", notes, "", machine_line(m)])
    name = "profile_step_quick" if args.quick else "profile_step"
    write_results(name, markdown, {"machine": m, "quick": args.quick, **summary}, args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
