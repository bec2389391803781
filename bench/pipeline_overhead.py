"""The price of orchestration: the whole retraining DAG against the work its programs do.

Runs the README's pipeline command (``scripts/run_pipeline.py``: embedded S3 server, SQLite
Airflow, local launcher, 2 CPU ranks, the vendored MNIST, ``dag.test()``) in a fresh work
folder, then reads back

- each task instance's duration from that run's Airflow metadata DB,
- the trainer's own training time (``train_seconds`` of the published ``metrics.json``),
- the export's own time: ``export_seconds`` of ``parity.json`` when the exporter records it,
  else the wall time of the same ``python -m horovod_airflow.trainer export`` run again outside
  Airflow on
  the published checkpoint (process start and imports included: an upper bound),

and reports DAG wall time minus the training and export time: what staging, gating,
publishing, Airflow task start-up and ``horovodrun`` launches add. Run from the repo root::

    python -m bench.pipeline_overhead                   # trainer defaults, full MNIST
    python -m bench.pipeline_overhead --quick           # 1 epoch on 2,048 samples
    python -m bench.pipeline_overhead --repeat 3        # 3 runs in a row: the median's table

With ``--repeat N`` the pipeline runs N times in a row (each in a fresh work folder, as the
same worker: a doctor pass stays remembered after the first); the table is the run with the
median orchestration (the lower middle one for an even N), and every run's figures are listed
under it.
"""

from __future__ import annotations

import argparse
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import add_driver_arguments, write_run
from bench.datasets import stage_local_dataset
from bench.report import REPO, machine, machine_line, md_table, rank_env
from horovod_airflow.core.contract import (
    CHECKPOINT_NAME,
    METRICS,
    METRICS_NAME,
    PARITY,
    PARITY_NAME,
)

PIPELINE = REPO / "scripts" / "run_pipeline.py"
DAG_ID = "mnist_horovod_retrain"
ENDED_LINE = re.compile(r"DAG run (\S+) ended (\w+) in (\d+)s")


def _seconds(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


def task_durations(airflow_db: Path) -> tuple[list[dict[str, Any]], float | None]:
    """Each task instance of the (only) DAG run, in start order, and the run's own duration."""
    with sqlite3.connect(airflow_db) as db:
        rows = db.execute(
            "SELECT task_id, state, start_date, end_date, try_number FROM task_instance "
            "WHERE dag_id = ? ORDER BY start_date",
            (DAG_ID,),
        ).fetchall()
        run = db.execute(
            "SELECT start_date, end_date FROM dag_run WHERE dag_id = ? ORDER BY start_date DESC",
            (DAG_ID,),
        ).fetchone()
    tasks = [
        {"task_id": t, "state": s, "seconds": _seconds(a, b), "try_number": n}
        for t, s, a, b, n in rows
    ]
    return tasks, (_seconds(*run) if run else None)


def export_seconds(published: Path, workdir: Path) -> tuple[float, str]:
    """The exporter's own time: recorded in parity.json, else a standalone re-run's wall."""
    parity = PARITY.loads((published / PARITY_NAME).read_text(), str(published / PARITY_NAME))
    for key in ("export_seconds", "seconds"):
        if isinstance(parity.get(key), int | float):
            return float(parity[key]), f"parity.json {key}"
    # The pipeline's S3 server is gone: re-run on the vendored MNIST, staged locally.
    data_dir = stage_local_dataset(workdir / "export-data")
    cmd = [sys.executable, "-m", "horovod_airflow.trainer", "export", "--checkpoint"]
    cmd += [str(published / CHECKPOINT_NAME), "--output", str(workdir / "export-rerun")]
    cmd += ["--data", str(data_dir)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall, "standalone re-run of trainer export (process wall, an upper bound)"


def run_pipeline(out: Path, extra: list[str], timeout: float) -> dict[str, Any]:
    if not PIPELINE.is_file():
        raise FileNotFoundError(f"{PIPELINE} is missing: the pipeline runner has not landed")
    cmd = [sys.executable, str(PIPELINE), "--out", str(out), *extra]
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, env=rank_env(), capture_output=True, text=True, timeout=timeout, errors="replace"
    )
    wall = time.perf_counter() - start
    (out / "run_pipeline.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {proc.returncode}; see {out / 'run_pipeline.log'}:\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    match = ENDED_LINE.search(proc.stdout)
    return {
        "command": " ".join(cmd),
        "process_wall_seconds": round(wall, 1),
        "dag_test_seconds_printed": float(match.group(3)) if match else None,
    }


def measure_once(
    workdir: Path | None,
    index: int,
    extra: list[str],
    timeout: float,
    log_to: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One pipeline run in a fresh work folder, and its times; ``log_to["log"]`` receives
    the pipeline's output when given."""
    with tempfile.TemporaryDirectory(prefix="hva-pipeline-") as tmp:
        out = (workdir or Path(tmp)) / f"pipeline-{index + 1}"
        out.mkdir(parents=True, exist_ok=True)
        pipeline = run_pipeline(out, extra, timeout)
        if log_to is not None:
            log_to["log"] = (out / "run_pipeline.log").read_text()
        tasks, dag_seconds = task_durations(out / "airflow" / "airflow.db")
        versions = [p for p in (out / "published").iterdir() if p.is_dir()]
        if not versions:
            raise RuntimeError(f"the pipeline published nothing under {out / 'published'}")
        published = versions[0]
        metrics = METRICS.loads((published / METRICS_NAME).read_text(), str(published))
        export_s, export_source = export_seconds(published, Path(out))
    dag_wall = dag_seconds or pipeline["dag_test_seconds_printed"]
    if dag_wall is None:
        raise RuntimeError("found neither the DAG run's times in Airflow's DB nor its log line")
    train_s = float(metrics["train_seconds"])
    return {
        "pipeline": pipeline,
        "tasks": tasks,
        "metrics": metrics,
        "dag_run_seconds": dag_wall,
        "train_seconds": train_s,
        "export_seconds": export_s,
        "export_seconds_source": export_source,
        "orchestration_seconds": dag_wall - train_s - export_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for the pipeline")
    parser.add_argument("--repeat", type=int, default=1, help="runs in a row (default 1)")
    add_driver_arguments(parser, quick="1 epoch on 2,048 train samples", np=False)
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.repeat < 1:
        parser.error(f"--repeat must be an integer >= 1, got {args.repeat}")

    m = machine()
    # Quick: the 1-epoch model cannot pass the default gate floor; let it publish anyway.
    quick = ["--epochs", "1", "--max-train-samples", "2048", "--min-accuracy", "0"]
    extra = quick if args.quick else []
    runs = [measure_once(args.workdir, i, extra, args.timeout) for i in range(args.repeat)]
    median = sorted(runs, key=lambda r: r["orchestration_seconds"])[(len(runs) - 1) // 2]
    pipeline, tasks, metrics = median["pipeline"], median["tasks"], median["metrics"]
    dag_wall, train_s = median["dag_run_seconds"], median["train_seconds"]
    export_s, export_source = median["export_seconds"], median["export_seconds_source"]
    overhead = median["orchestration_seconds"]
    rows: list[list[Any]] = [
        [
            "`run_pipeline.py` process (Airflow DB migrate, S3 server, DAG)",
            pipeline["process_wall_seconds"],
        ],
        ["DAG run (`dag.test()`, its start → end in Airflow's DB)", round(dag_wall, 1)],
    ]
    rows += [
        [f"— task `{t['task_id']}` ({t['state']})", round(t["seconds"], 1) if t["seconds"] else "—"]
        for t in tasks
    ]
    rows += [
        ["trainer's own training (`metrics.json` train_seconds)", round(train_s, 1)],
        [f"export + parity check ({export_source})", round(export_s, 1)],
        ["**orchestration = DAG run − training − export**", f"**{overhead:.1f}**"],
        ["orchestration share of the DAG run", f"{100 * overhead / dag_wall:.0f} %"],
    ]
    title = "### Orchestration overhead of the full DAG (embedded defaults)"
    if args.quick:
        title += " (quick: 1 epoch, 2,048 samples)"
    notes = (
        f"{metrics['world_size']} ranks, {metrics['epochs']} epoch(s), val accuracy "
        f"{100 * metrics['val_accuracy']:.2f} %. Orchestration includes Airflow task start-up, "
        "dataset staging to S3, each rank's fetch of it, `horovodrun` launches and Python/torch "
        "imports in the ranks, the gate, and publishing."
    )
    if len(runs) > 1:
        title += f" (median of {len(runs)} runs in a row)"
        listed = "; ".join(
            f"run {i + 1}: DAG {r['dag_run_seconds']:.1f} s, training {r['train_seconds']:.1f} "
            f"s, export {r['export_seconds']:.1f} s, orchestration "
            f"**{r['orchestration_seconds']:.1f} s**"
            for i, r in enumerate(runs)
        )
        notes += f" Every run, in order: {listed}."
    markdown = "\n".join(
        [title, "", md_table(["what", "seconds"], rows), "", notes, "", machine_line(m)]
    )
    data = {
        "machine": m,
        "quick": args.quick,
        "pipeline": pipeline,
        "tasks": tasks,
        "dag_run_seconds": dag_wall,
        "train_seconds": train_s,
        "export_seconds": export_s,
        "export_seconds_source": export_source,
        "orchestration_seconds": overhead,
        "metrics": {k: metrics[k] for k in ("val_accuracy", "epochs", "world_size")},
        "runs": [{k: v for k, v in r.items() if k != "metrics"} for r in runs],
    }
    return write_run("pipeline_overhead", args, markdown, data)


if __name__ == "__main__":
    sys.exit(main())
