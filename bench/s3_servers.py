"""What the real S3 server costs the main job: SeaweedFS against moto, side by side.

Runs the README's main job (``scripts/run_pipeline.py``, as ``bench.pipeline_overhead`` does)
with ``--s3 moto`` and ``--s3 seaweedfs`` alternately (moto first, then SeaweedFS, ``--repeat``
pairs), each in a fresh work folder, and reports per server the median of: the whole
process (server start-up and stop included), the server's start-up alone, the DAG run and
its S3-bound tasks. The difference of the medians is what choosing the real server costs.
Run from the repo root::

    python -m bench.s3_servers --quick --repeat 3
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import add_driver_arguments, write_run
from bench.pipeline_overhead import measure_once
from bench.report import machine, machine_line, md_table

KINDS = ("moto", "seaweedfs")
UP_LINE = re.compile(r"embedded S3 \((\w+)\) on \S+, up in ([\d.]+)s")


def _task(run: dict[str, Any], task_id: str) -> float:
    return next(float(t["seconds"] or 0) for t in run["tasks"] if t["task_id"] == task_id)


def _figures(run: dict[str, Any], log: str) -> dict[str, float]:
    up = UP_LINE.search(log)
    return {
        "process": run["pipeline"]["process_wall_seconds"],
        "server start-up": float(up.group(2)) if up else float("nan"),
        "DAG run": run["dag_run_seconds"],
        "stage_dataset": _task(run, "stage_dataset"),
        "train": _task(run, "train"),
        "publish": _task(run, "publish"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=2, help="pairs of runs (default 2)")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per pipeline run")
    add_driver_arguments(parser, quick="1 epoch on 2,048 train samples", np=False)
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be an integer >= 1, got {args.repeat}")

    m = machine()
    quick = ["--epochs", "1", "--max-train-samples", "2048", "--min-accuracy", "0"]
    figures: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    for i in range(args.repeat):
        for kind in KINDS:
            extra = [*(quick if args.quick else []), "--s3", kind]
            holder: dict[str, str] = {}
            run = measure_once(args.workdir, 2 * i + KINDS.index(kind), extra, args.timeout,
                               log_to=holder)  # fmt: skip
            figures[kind].append(_figures(run, holder.get("log", "")))
    names = list(figures[KINDS[0]][0])
    median = {k: {n: statistics.median(f[n] for f in figures[k]) for n in names} for k in KINDS}
    rows = [
        [n, f"{median['moto'][n]:.1f}", f"{median['seaweedfs'][n]:.1f}",
         f"{median['seaweedfs'][n] - median['moto'][n]:+.1f}"]
        for n in names
    ]  # fmt: skip
    listed = "; ".join(
        f"{kind} run {i + 1}: process {f['process']:.1f} s, DAG {f['DAG run']:.1f} s"
        for kind in KINDS
        for i, f in enumerate(figures[kind])
    )
    title = f"### The main job on moto and on SeaweedFS (median of {args.repeat} runs each)"
    if args.quick:
        title += " (quick: 1 epoch, 2,048 samples)"
    markdown = "\n".join(
        [
            title,
            "",
            md_table(["seconds", "moto", "SeaweedFS", "SeaweedFS − moto"], rows),
            "",
            "Runs alternate (moto, SeaweedFS, moto, ...) so that load drifts hit both. "
            f"Every run: {listed}.",
            "",
            machine_line(m),
        ]
    )
    return write_run(
        "s3_servers", args, markdown, {"machine": m, "runs": figures, "median": median}
    )


if __name__ == "__main__":
    sys.exit(main())
