"""Where a training step's time goes: torch.profiler over our trainer's real steps, 2 ranks.

Written for the case the time-to-accuracy target is missed: it profiles rank 0 while every
rank runs ``horovod_airflow.trainer.train.train_one_epoch`` (trainer defaults, full MNIST in
memory) under
``horovodrun``, and tabulates the operators by self CPU time (CUDA time too on a GPU),
grouped into forward/backward convolutions, linear layers, the optimizer, the gradient
allreduce wait and the rest. Then it says what bounds the step: the model's FLOPs per
training sample (counted from its layer shapes), the fp32 matrix-multiply rate every rank
reaches on this machine at the same time (the practical compute peak), the rate the
convolutions and the whole step achieve against it, and the epoch time that peak would allow.
Run from the repository root::

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

from bench.common import (
    add_driver_arguments,
    driver_parsers,
    ranks_from,
    run_rank_program,
    run_timeout,
    write_run,
)
from bench.report import machine, machine_line, md_table

# Operator name fragments → the part of a step they belong to (first match wins).
GROUPS = (
    ("convolution backward", ("convolution_backward", "ConvolutionBackward")),
    ("convolution forward", ("conv2d", "convolution", "mkldnn_convolution")),
    ("batch norm fwd+bwd", ("batch_norm", "BatchNorm")),
    ("linear layers fwd+bwd", ("addmm", "mm", "linear", "AddmmBackward", "MmBackward")),
    ("optimizer (Adam)", ("adam", "Adam", "_foreach", "lerp", "addcdiv", "addcmul", "sqrt")),
    ("gradient allreduce wait (Horovod)", ("Horovod", "horovod", "synchronize", "allreduce")),
    ("data: index_select / copy", ("index_select", "contiguous", "copy_", "clone")),
    ("activations, pooling, dropout, loss", ("relu", "clamp_min", "max_pool", "dropout",
                                             "bernoulli", "cross_entropy",
                                             "nll_loss", "log_softmax", "threshold")),
)  # fmt: skip


def training_flops(model: Any, input_shape: tuple[int, ...]) -> dict[str, float]:
    """FLOPs of one training sample, from the layer shapes: convolutions forward and backward,
    linear layers forward + backward.

    A multiply-add is 2 FLOPs. Forward: 2 × MACs per layer; backward: the weight gradient costs
    the same again, and the input gradient too, except for a layer whose input needs no
    gradient (the first convolution, fed with data). Elementwise work (activations, pooling,
    dropout, Adam) is left out: it is memory-bound, and the profile shows its time.
    """
    import torch
    from torch import nn

    flops = {"conv_forward": 0.0, "conv_backward": 0.0, "linear": 0.0}

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        if isinstance(module, nn.Conv2d):
            per_output = module.in_channels // module.groups
            per_output *= module.kernel_size[0] * module.kernel_size[1]
            forward = 2.0 * out[0].numel() * per_output
        else:
            forward = 2.0 * module.in_features * module.out_features
        backward = forward * (2 if inputs[0].requires_grad else 1)  # weight (+ input) gradient
        if isinstance(module, nn.Conv2d):
            flops["conv_forward"] += forward
            flops["conv_backward"] += backward
        else:
            flops["linear"] += forward + backward

    handles = [
        m.register_forward_hook(hook)
        for m in model.modules()
        if isinstance(m, (nn.Conv2d, nn.Linear))
    ]
    try:
        model(torch.zeros((1, *input_shape)))
    finally:
        for h in handles:
            h.remove()
    return flops


def matmul_gflops(n: int, repeats: int, precision: str = "fp32") -> float:
    """GFLOP/s of an n×n matrix multiply in the step's precision (``fp32`` or ``bf16``) on this
    rank's threads (the trainer's policy, set by ``horovod_airflow.trainer.runtime.setup_runtime``):
    its practical
    peak. A bf16 step is held to a bf16 peak, so no layer can beat "the peak"."""
    import time

    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2.0 * n**3 * repeats / (time.perf_counter() - start) / 1e9


def run_rank(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from bench.train_throughput import our_training_step
    from horovod_airflow.core.train_config import TrainConfig
    from horovod_airflow.trainer import data, runtime, train

    config = TrainConfig(
        data=args.data, output=args.output, cache_dir=args.cache_dir, log_interval=0
    )
    rt, device = runtime.setup_runtime(config)  # hvd.init() and the trainer's thread policy
    dataset = train.fetch_staged_dataset(config, rt)
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
    peak, matmul_n = None, 512 if args.steps < 5 else 2048  # small for the smoke test
    if device.type == "cpu":  # the FLOP bound below is a CPU analysis (a GPU: see its profile)
        hvd.barrier()  # every rank multiplies at once: the peak under the same sharing of cores
        peak = matmul_gflops(matmul_n, 5, rt.precision)
    if not rt.is_primary:
        return
    from horovod_airflow.trainer.model import INPUT_SHAPE, build_model

    flops = training_flops(build_model(config.model), INPUT_SHAPE)
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
        "train_samples": int(x.shape[0]),
        "flops_per_sample": flops,
        "matmul_gflops_per_rank": peak,
        "matmul_n": matmul_n,
        "ops": ops,
    }
    Path(args.result).write_text(json.dumps(summary, indent=2))


def group_of(name: str) -> str:
    for group, fragments in GROUPS:
        if any(f in name for f in fragments):
            return group
    return "other"


def group_ms(summary: dict[str, Any]) -> dict[str, float]:
    """Self CPU milliseconds of all profiled steps, per part of the step."""
    groups: dict[str, float] = {}
    for op in summary["ops"]:
        group = group_of(op["name"])
        groups[group] = groups.get(group, 0.0) + op["self_cpu_ms"]
    return groups


def bound_table(summary: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """Achieved FLOP rates against the machine's matmul rate, and the epoch time that allows."""
    flops, peak = summary["flops_per_sample"], summary["matmul_gflops_per_rank"]
    per_sample = sum(flops.values())
    samples = summary["batch_per_rank"] * summary["steps"]  # per rank, over the profiled steps
    step_s = summary["step_cpu_ms_total"] / summary["steps"] / 1000
    groups = group_ms(summary)

    def rate(flop: float, ms: float) -> float:
        return flop * samples / (ms / 1000) / 1e9 if ms > 0 else float("nan")

    conv_fwd = rate(flops["conv_forward"], groups.get("convolution forward", 0.0))
    conv_bwd = rate(flops["conv_backward"], groups.get("convolution backward", 0.0))
    step = per_sample * summary["batch_per_rank"] / step_s / 1e9
    ranks, n = summary["world_size"], summary["train_samples"]
    floor_s = n * per_sample / (ranks * peak * 1e9)
    measured_s = n / (ranks * summary["batch_per_rank"] / step_s)
    numbers = {
        "mflop_per_sample": per_sample / 1e6,
        "conv_forward_gflops": conv_fwd,
        "conv_backward_gflops": conv_bwd,
        "step_gflops": step,
        "epoch_seconds_at_peak": floor_s,
        "epoch_seconds_at_step_rate": measured_s,
    }
    conv = (flops["conv_forward"] + flops["conv_backward"]) / 1e6

    def of_peak(gflops: float) -> str:
        return f"{gflops:.1f} GFLOP/s ({100 * gflops / peak:.0f} %)"

    rows = [
        ["FLOPs of one training sample (convolutions, linear; fwd + bwd)",
         f"{per_sample / 1e6:.1f} MFLOP ({conv:.1f} + {flops['linear'] / 1e6:.1f})"],
        [f"{summary['precision']} matrix multiply, every rank at once (the practical peak)",
         f"{peak:.1f} GFLOP/s per rank"],
        ["convolution forward, achieved", of_peak(conv_fwd)],
        ["convolution backward, achieved", of_peak(conv_bwd)],
        ["whole step (everything counted as waiting for those FLOPs)", of_peak(step)],
        [f"one epoch ({n:,} samples, {ranks} ranks) if every FLOP ran at the peak",
         f"{floor_s:.1f} s"],
        ["one epoch at the profiled step time", f"{measured_s:.1f} s"],
    ]  # fmt: skip
    note = (
        "Achieved rate = the layers' FLOPs over their self CPU time in the profile; the peak is "
        f"measured after the profile with every rank multiplying {summary['matmul_n']}×"
        f"{summary['matmul_n']} {summary['precision']} matrices on its threads at the same "
        "time. The epoch floor counts only convolution and linear FLOPs — the memory-bound "
        "rest of the step would come on top."
    )
    return md_table(["what bounds a step", "value"], rows) + "\n\n" + note, numbers


def tables(summary: dict[str, Any], top: int = 15) -> str:
    total = summary["step_cpu_ms_total"]
    steps = summary["steps"]
    groups = group_ms(summary)
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
    parser, rank = driver_parsers(__doc__)
    for p in (parser, rank):
        p.add_argument("--steps", type=int, default=20, help="profiled steps")
        p.add_argument("--warmup", type=int, default=3, help="unprofiled steps first")
    add_driver_arguments(parser, quick="2 profiled steps (smoke test)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps}, {args.warmup}")
    if args.command == "rank":
        run_rank(args)
        return 0
    args.np = ranks_from(parser, args.np)
    if args.quick:
        args.steps, args.warmup = 2, 1

    m = machine()
    with tempfile.TemporaryDirectory(prefix="hva-profile-") as tmp:
        summary, _ = run_rank_program(
            "bench.profile_step", args.np, Path(tmp),
            ["--steps", str(args.steps), "--warmup", str(args.warmup)],
            tag="profile", timeout=run_timeout(args.quick),
        )  # fmt: skip
    title = (
        f"### Where our training step's time goes (torch.profiler, rank 0 of "
        f"{summary['world_size']})" + (" (quick)" if args.quick else "")
    )
    notes = (
        f"{summary['steps']} steps of `horovod_airflow.trainer.train.train_one_epoch`, batch "
        f"{summary['batch_per_rank']}/rank, {summary['threads_per_rank']} thread(s)/rank, "
        f"{summary['precision']}, device {summary['device']}; "
        f"{summary['step_cpu_ms_total'] / summary['steps']:.1f} ms of CPU time per step on "
        "rank 0. Self times: each operator without its children."
    )
    parts = [title, "", tables(summary), "", notes, ""]
    if summary["matmul_gflops_per_rank"] is not None:
        bound, summary["bound"] = bound_table(summary)
        parts += [bound, ""]
    markdown = "\n".join([*parts, machine_line(m)])
    return write_run("profile_step", args, markdown, {"machine": m, "quick": args.quick, **summary})


if __name__ == "__main__":
    sys.exit(main())
