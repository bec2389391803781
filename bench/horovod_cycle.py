"""Horovod's background cycle on CPU ranks: its own default against the trainer's 10 ms.

On a CPU node the Horovod background thread (which wakes every ``HOROVOD_CYCLE_TIME`` ms to
negotiate ready tensors) shares the cores that run the ranks' compute.
``horovod_airflow.trainer.runtime.setup_runtime`` therefore sets a 10 ms cycle on CPU unless
``HOROVOD_CYCLE_TIME`` is already set. This benchmark measures that choice: in one invocation
it alternates trainer runs (``horovodrun -np N``, same data, same seed, trainer defaults
otherwise) with ``HOROVOD_CYCLE_TIME`` set to each value under test, and reports rank 0's
training samples/s (from the trainer's epoch event) as the median of the repeats. Alternating
spreads slow spells of a shared machine over every setting instead of one.

Run from the repository root (~6 minutes on 2 cores)::

    python -m bench.horovod_cycle                       # 1 ms (Horovod's default) vs 10 ms
    python -m bench.horovod_cycle --cycles 1 5 10 20 --repeats 3
    python -m bench.horovod_cycle --quick               # 1 repeat on 2,048 samples (smoke test)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    add_sweep_arguments,
    alternated,
    parse_sweep_args,
    sweep_data,
    write_run,
)
from bench.datasets import stage_local_dataset
from bench.report import (
    json_events,
    machine,
    machine_line,
    md_table,
    rank_env,
    run_horovod,
)
from horovod_airflow.core.contract import EVENT_EPOCH
from horovod_airflow.trainer.runtime import CPU_CYCLE_TIME_MS

# Horovod 0.28's own default cycle (horovod/common/operations.cc: the parameter manager starts
# at 1 ms when HOROVOD_CYCLE_TIME is unset); the trainer's CPU choice, read from the trainer.
HOROVOD_DEFAULT_MS = 1.0
TRAINER_CPU_MS = float(CPU_CYCLE_TIME_MS)


def one_run(workdir: Path, np: int, cycle_ms: float, samples: int, tag: str) -> float:
    """Train one epoch on ``samples`` images with the given cycle; rank 0's samples/s."""
    staged = stage_local_dataset(workdir / "staged")
    args = [
        "horovod_airflow.trainer",
        "train",
        "--data",
        str(staged),
        "--output",
        str(workdir / f"out-{tag}"),
    ]
    args += ["--epochs", "1", "--max-train-samples", str(samples), "--max-val-samples", "1000"]
    args += ["--log-interval", "0"]
    env = rank_env({"HVA_CACHE_DIR": str(workdir / "cache"), "HOROVOD_CYCLE_TIME": f"{cycle_ms:g}"})
    run = run_horovod(np, args, log=workdir / f"{tag}.log", timeout=1800, env=env)
    events = json_events(run, EVENT_EPOCH)
    if len(events) != 1:
        raise RuntimeError(f"expected one epoch event in {run.log}, found {len(events)}")
    return float(events[0][1]["samples_per_sec"])


def render(data: dict[str, Any]) -> str:
    base = data["results"][0]
    rows = []
    for r in data["results"]:
        rows.append(
            [
                f"{r['cycle_ms']:g} ms"
                + (" (Horovod default)" if r["horovod_default"] else "")
                + (" (trainer on CPU)" if r["trainer_default"] else ""),
                ", ".join(f"{v:,.0f}" for v in r["samples_per_sec"]),
                f"{r['median']:,.0f}",
                f"{r['median'] / base['median']:.2f}×",
            ]
        )
    table = md_table(
        ["HOROVOD_CYCLE_TIME", "samples/s per repeat (run order)", "median", "vs first row"],
        rows,
    )
    notes = (
        f"{data['np']} ranks, one epoch of {data['samples']:,} training images each run "
        f"(trainer defaults otherwise), settings alternated {data['repeats']} time(s); "
        "samples/s = the trainer's own epoch figure (rank 0, training loop only)."
    )
    title = "### Horovod cycle time on CPU ranks" + (" (quick)" if data["quick"] else "")
    return "\n".join([title, "", table, "", notes, "", machine_line(data["machine"])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cycles",
        type=float,
        nargs="+",
        default=[HOROVOD_DEFAULT_MS, TRAINER_CPU_MS],
        help=f"HOROVOD_CYCLE_TIME values, ms (default {HOROVOD_DEFAULT_MS:g} {TRAINER_CPU_MS:g})",
    )
    add_sweep_arguments(parser, repeats=4, samples=20000)
    args = parse_sweep_args(parser, argv, samples_per_rank=2)
    if any(c <= 0 for c in args.cycles):
        parser.error(f"--cycles takes milliseconds > 0, got {args.cycles}")

    m = machine()
    with tempfile.TemporaryDirectory(prefix="hva-cycle-") as tmp:
        rates = alternated(
            args.cycles,
            args.repeats,
            lambda c, i: one_run(Path(tmp), args.np, c, args.samples, f"{c:g}ms-{i}"),
        )
    data = sweep_data(
        m,
        args,
        rates,
        "cycle_ms",
        horovod_default=lambda c: c == HOROVOD_DEFAULT_MS,
        trainer_default=lambda c: c == TRAINER_CPU_MS,
    )
    return write_run("horovod_cycle", args, render(data), data)


if __name__ == "__main__":
    sys.exit(main())
