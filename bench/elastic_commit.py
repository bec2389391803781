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

from bench.common import (
    add_sweep_arguments,
    alternated,
    parse_sweep_args,
    sweep_data,
    write_run,
)
from bench.datasets import stage_local_dataset
from bench.report import json_events, machine, machine_line, md_table, rank_env, run_horovod
from horovod_airflow.core.contract import EVENT_EPOCH
from horovod_airflow.core.train_config import default

DEFAULT_N = int(default("elastic_commit_every"))
SETTINGS: list[int | None] = [None, 100000, DEFAULT_N, 5]  # None: not elastic


def one_run(
    workdir: Path, np: int, every: int | None, samples: int, tag: str
) -> tuple[float, float | None]:
    """Rank 0's samples/s, and (elastic) the share of its training loop spent in commits."""
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
    epoch = events[0][1]
    rate = float(epoch["samples_per_sec"])
    if every is None:
        return rate, None
    loop_s = float(epoch["train_samples"]) / rate  # the epoch's training loop, seconds
    return rate, float(epoch["commit_seconds"]) / loop_s


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
            "" if r["commit_share"] is None else f"{100 * r['commit_share']:.2f} %",
        ]
        for r in data["results"]
    ]
    headers = ["setting", "samples/s per repeat", "median", "cost vs not elastic", "in commits"]
    table = md_table(headers, rows)
    notes = (
        f"{data['np']} ranks on localhost, one epoch of {data['samples']:,} training images per "
        f"run (batch 64 per rank, trainer defaults otherwise), settings alternated "
        f"{data['repeats']} time(s); samples/s = the trainer's epoch figure (rank 0, training "
        "loop only). Cost: how much lower the median is than the non-elastic one (negative: "
        "faster; on a shared machine the spread of the repeats is the noise). In commits: the "
        "median share of rank 0's training loop spent committing, measured inside the trainer "
        "(`elastic.commit_seconds`): the overhead itself, unaffected by the run-to-run noise."
    )
    title = "### Elastic commit overhead" + (" (quick)" if data["quick"] else "")
    return "\n".join([title, "", table, "", notes, "", machine_line(data["machine"])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_sweep_arguments(parser, repeats=3, samples=12000)
    args = parse_sweep_args(parser, argv, samples_per_rank=64)
    m = machine()
    with tempfile.TemporaryDirectory(prefix="hva-elastic-bench-") as tmp:
        runs = alternated(
            SETTINGS,
            args.repeats,
            lambda s, i: one_run(Path(tmp), args.np, s, args.samples, f"{s}-{i}"),
        )
    shares = {s: [share for _, share in r if share is not None] for s, r in runs.items()}
    data = sweep_data(
        m,
        args,
        {s: [rate for rate, _ in r] for s, r in runs.items()},
        "commit_every",
        commit_share=lambda s: round(statistics.median(shares[s]), 5) if shares[s] else None,
        commit_shares=lambda s: [round(v, 5) for v in shares[s]],
    )
    return write_run("elastic_commit", args, render(data), data)


if __name__ == "__main__":
    sys.exit(main())
