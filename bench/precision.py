"""What ``--precision auto`` should pick: the trainer's step under fp32/bf16 × channels-last off/on.

One ``horovodrun`` (2 ranks on CPU, one per GPU on CUDA); in every rank, the trainer's own
training step (``horovod_airflow.trainer.train.train_one_epoch`` over ``--steps`` batches per rank,
the model
from ``horovod_airflow.trainer.train.build_training_model``, Horovod's ``DistributedOptimizer``) is
timed under
each of the four forced combinations, in rotating order within every repeat so that a change
in the machine's load hits all four alike. Samples/s over all ranks, median of the repeats,
each repeat timed by its slowest rank. The table says which combination ``auto`` resolves to
on this machine and records the CPU flags that decide it (``avx512_bf16``, ``amx_bf16``).

Run from the repository root::

    python -m bench.precision            # ~3 minutes on 2 cores
    python -m bench.precision --quick    # seconds (the smoke test; measures nothing)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    add_driver_arguments,
    driver_parsers,
    ranks_from,
    require_positive,
    run_rank_program,
    run_timeout,
    write_run,
)
from bench.report import machine, machine_line, md_table

COMBOS = (("fp32", "off"), ("fp32", "on"), ("bf16", "off"), ("bf16", "on"))


def run_rank(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    from bench.train_throughput import our_training_step
    from horovod_airflow.core.train_config import TrainConfig
    from horovod_airflow.trainer import data, runtime, train

    config = TrainConfig(
        data=args.data, output=args.output, cache_dir=args.cache_dir, log_interval=0
    )
    rt, device = runtime.setup_runtime(config)  # hvd.init(), the trainer's threads, auto's choice
    dataset = train.fetch_staged_dataset(config, rt)
    x, y = data.load_split(dataset, "train")
    x, y = x.to(device), y.to(device)

    steps = {}
    for precision, channels_last in COMBOS:
        forced = dataclasses.replace(config, precision=precision, channels_last=channels_last)
        forced_rt = dataclasses.replace(
            rt, precision=precision, channels_last=channels_last == "on"
        )
        torch.manual_seed(config.seed)
        step = our_training_step(forced, forced_rt, device, x, y, steps=args.steps)
        for _ in range(args.warmup):
            step()
        steps[(precision, channels_last)] = step

    rates: dict[tuple[str, str], list[float]] = {combo: [] for combo in COMBOS}
    for repeat in range(args.repeats):
        order = COMBOS[repeat % len(COMBOS) :] + COMBOS[: repeat % len(COMBOS)]
        for combo in order:
            hvd.barrier()
            t0 = time.perf_counter()
            steps[combo]()
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - t0])
            slowest = float(hvd.allreduce(elapsed, op=hvd.Max, name="bench.precision"))
            rates[combo].append(rt.size * config.batch_size * args.steps / slowest)

    if rt.is_primary:
        summary = {
            "model": config.model,
            "world_size": rt.size,
            "device": rt.device,
            "threads_per_rank": rt.threads,
            "batch_per_rank": config.batch_size,
            "steps_per_repeat": args.steps,
            "auto": {
                "precision": rt.precision,
                "channels_last": rt.channels_last,
                "reason": rt.precision_reason,
            },
            "results": [
                {
                    "precision": p,
                    "channels_last": cl,
                    "samples_per_sec": rates[(p, cl)],
                    "median": statistics.median(rates[(p, cl)]),
                }
                for p, cl in COMBOS
            ],
        }
        Path(args.result).write_text(json.dumps(summary, indent=2))


def render(data: dict[str, Any]) -> str:
    run = data["run"]
    by = {(r["precision"], r["channels_last"]): r for r in run["results"]}
    base = by[("fp32", "off")]["median"]
    auto = run["auto"]
    auto_key = (auto["precision"], "on" if auto["channels_last"] else "off")
    rows = []
    for combo in COMBOS:
        r = by[combo]
        lo, hi = min(r["samples_per_sec"]), max(r["samples_per_sec"])
        rows.append(
            [
                f"--precision {combo[0]} --channels-last {combo[1]}",
                f"{r['median']:,.0f} ({lo:,.0f}–{hi:,.0f})",
                f"{r['median'] / base:.2f}×",
                "← auto" if combo == auto_key else "",
            ]
        )
    best = max(COMBOS, key=lambda c: by[c]["median"])
    title = "### The trainer's step under each precision × memory format" + (
        " (quick)" if data["quick"] else ""
    )
    notes = (
        f"Model {run.get('model', 'mnist_cnn')}, "
        f"{run['world_size']} ranks on {run['device']}, {run['threads_per_rank']} thread(s) per "
        f"rank, batch {run['batch_per_rank']} per rank, {run['steps_per_repeat']} steps a "
        f"repeat; samples/s over all ranks, median (min–max) of {data['repeats']} repeats in "
        f"rotating order. auto here: {auto['reason']}. Fastest: --precision {best[0]} "
        f"--channels-last {best[1]}."
    )
    headers = ["trainer flags", "samples/s", "vs fp32 NCHW", ""]
    return "\n".join(
        [title, "", md_table(headers, rows), "", notes, "", machine_line(data["machine"])]
    )


def main(argv: list[str] | None = None) -> int:
    parser, rank = driver_parsers(__doc__)
    for p in (parser, rank):
        p.add_argument("--steps", type=int, default=20, help="trainer steps per timed repeat")
        p.add_argument("--warmup", type=int, default=1, help="untimed calls per combination")
        p.add_argument("--repeats", type=int, default=5, help="timed repeats (median reported)")
    add_driver_arguments(parser, quick="2 steps, 1 repeat (smoke test)")
    args = parser.parse_args(argv)
    require_positive(parser, args, ("steps", "warmup", "repeats"))
    if args.command == "rank":
        run_rank(args)
        return 0

    if args.quick:
        args.steps, args.warmup, args.repeats = 2, 1, 1
    np_ = ranks_from(parser, args.np)
    m = machine()
    with tempfile.TemporaryDirectory(prefix="hva-precision-") as tmp:
        rank_args = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        rank_args += ["--repeats", str(args.repeats)]
        summary, run = run_rank_program(
            "bench.precision", np_, Path(tmp), rank_args,
            tag="precision", timeout=run_timeout(args.quick),
        )  # fmt: skip
    summary["wall_seconds"] = round(run.wall_seconds, 1)
    data = {"machine": m, "quick": args.quick, "repeats": args.repeats, "run": summary}
    return write_run("precision", args, render(data), data)


if __name__ == "__main__":
    sys.exit(main())
