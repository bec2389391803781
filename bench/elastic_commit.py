"""What ``--elastic`` costs when nothing fails: the trainer's non-elastic loop against its
elastic loop committing every N steps (``--elastic-commit-every``), in one invocation.

Each run is ``horovodrun -np N -H localhost:N`` of our trainer (the same launch for every
setting: what is measured is the rank's own work, the state copy and Horovod's host-update
broadcast at each commit; horovodrun's elastic driver polls the discovery script on the
Airflow worker, off the ranks' path). Settings alternate ``--repeats`` times; the figure is
rank 0's training samples/s from the trainer's epoch event (training loop only), median of
the repeats. ``commit every 100000`` commits only at the epoch end: it isolates the elastic
loop from its mid-epoch commits.

Run from the repository root (~4 minutes on 2 cores)::

    python -m bench.elastic_commit                         # non-elastic, N = 100000, 20, 5
    python -m bench.elastic_commit --quick                 # 1 repeat on 2,048 samples
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import add_driver_arguments, ranks_from, write_run
from bench.datasets import stage_local_dataset
from bench.report import json_events, machine, machine_line, md_table, rank_env, run_horovod
from horovod_airflow.core.contract import EVENT_EPOCH
from horovod_airflow.core.train_config import default

DEFAULT_N = int(default("elastic_commit_every"))
SETTINGS: list[int | None] = [None, 100000, DEFAULT_N, 5]  # None: not elastic


def one_run(workdir: Path, np: int, every: int | None, samples: int, tag: str) -> float:
    staged = stage_local_dataset(workdir / "staged")
    args = ["horovod_airflow.trainer", "train", "--data", str(staged)]
    args += ["--output", str(workdir / f"out-{tag}"), "--epochs", "1", "--log-interval", "0"]
    args += ["--max-train-samples", str(samples), "--max-val-samples", "1000"]
    if every is not None:
        args += ["--elastic", "--elastic-commit-every", str(every)]
    env = rank_env({"HVA_CACHE_DIR": str(workdir / "cache")})
    run = run_horovod(np, args, log=workdir / f"{tag}.log", timeout=1800, env=env)
    events = json_events(run, EVENT_EPOCH)
    if len(events) != 1:
        raise RuntimeError(f"expected one epoch event in {run.log}, found {len(events)}")
    return float(events[0][1]["samples_per_sec"])


def label(every: int | None) -> str:
    if every is None:
        return "not elastic"
    return f"--elastic, commit every {every}" + (" (default)" if every == DEFAULT_N else "")


def render(data: dict[str, Any]) -> str:
    base = data["results"][0]
    rows = [
        [
            label(r["commit_every"]),
            ", ".join(f"{v:,.0f}" for v in r["samples_per_sec"]),
            f"{r['median']:,.0f}",
            f"{100 * (1 - r['median'] / base['median']):+.1f} %",
        ]
        for r in data["results"]
    ]
    table = md_table(["setting", "samples/s per repeat", "median", "cost vs not elastic"], rows)
    notes = (
        f"{data['np']} ranks on localhost, one epoch of {data['samples']:,} training images per "
        f"run (batch 64 per rank, trainer defaults otherwise), settings alternated "
        f"{data['repeats']} time(s); samples/s = the trainer's epoch figure (rank 0, training "
        "loop only). Cost: how much lower the median is than the non-elastic one."
    )
    title = "### Elastic commit overhead" + (" (quick)" if data["quick"] else "")
    return "\n".join([title, "", table, "", notes, "", machine_line(data["machine"])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="alternations (median reported)")
    parser.add_argument("--samples", type=int, default=12000, help="training images per run")
    add_driver_arguments(parser, quick="1 repeat on 2,048 samples")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.samples = 1, 2048
    args.np = ranks_from(parser, args.np)
    if args.repeats < 1 or args.samples < 64 * args.np:
        parser.error(f"--repeats must be >= 1 and --samples >= 64 x np, got {args.repeats}, "
                     f"{args.samples}")  # fmt: skip
    m = machine()
    rates: dict[int | None, list[float]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="hva-elastic-bench-") as tmp:
        for i in range(args.repeats):
            for s in SETTINGS:
                rates[s].append(one_run(Path(tmp), args.np, s, args.samples, f"{s}-{i}"))
    data = {
        "machine": m,
        "quick": args.quick,
        "np": args.np,
        "samples": args.samples,
        "repeats": args.repeats,
        "results": [
            {
                "commit_every": s,
                "samples_per_sec": [round(v, 1) for v in rates[s]],
                "median": round(statistics.median(rates[s]), 1),
            }
            for s in SETTINGS
        ],
    }
    return write_run("elastic_commit", args, render(data), data)


if __name__ == "__main__":
    sys.exit(main())
