"""What each start-up saving of ``horovod_airflow.core.startup_savings`` saves, against the plain
way, in one invocation (settings alternated ``--repeats`` times, medians):

- leaving without the interpreter's teardown: ``python -m horovod_airflow.trainer doctor`` and
  ``… export`` (of a checkpoint a one-process ``trainer train`` on 256 images makes first),
  which end in ``exit_without_teardown``, against the same commands ending in ``sys.exit``;
- horovodrun without its Gloo probe: ``python -c HOROVODRUN_WITHOUT_GLOO_PROBE --gloo -np 1 …``
  against ``horovodrun --gloo -np 1 …``, both running ``python -c pass`` in the one rank;
- a remembered doctor pass: ``python -c INTERPRETER_FINGERPRINT`` (what the launcher runs to
  find the remembered pass) against the doctor itself.

Each figure is one process's wall time from start to exit, as a task pays it. Run from the
repository root (~2 minutes on 2 cores)::

    python -m bench.startup_savings              # 5 repeats
    python -m bench.startup_savings --quick      # 1 repeat
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import add_driver_arguments, require_positive, write_run
from bench.datasets import stage_local_dataset
from bench.report import machine, machine_line, md_table, rank_env
from horovod_airflow.core.contract import CHECKPOINT_NAME
from horovod_airflow.core.startup_savings import (
    HOROVODRUN_WITHOUT_GLOO_PROBE,
    INTERPRETER_FINGERPRINT,
    VERIFIED_HOROVOD,
)

#: Kept where it saves a task at least this much (the module's rule).
WORTH_S = 0.5
_PLAIN_EXIT = "import sys; from horovod_airflow.trainer.cli import main; sys.exit(main())"


def checkpoint(workdir: Path, python: str, env: dict[str, str]) -> Path:
    """A real ``checkpoint.pt``: one process of ``trainer train`` on 256 images."""
    staged = stage_local_dataset(workdir / "staged")
    out = workdir / "train"
    args = ["train", "--data", str(staged), "--output", str(out), "--epochs", "1"]
    args += ["--max-train-samples", "256", "--max-val-samples", "256", "--log-interval", "0"]
    wall([python, "-m", "horovod_airflow.trainer", *args], env)
    return out / CHECKPOINT_NAME


def pairs(
    python: str, horovodrun: str, ckpt: Path, workdir: Path
) -> list[tuple[str, list[str], list[str]]]:
    """(saving, the plain command, the command with the saving)."""
    trainer = [python, "-m", "horovod_airflow.trainer"]
    plain = [python, "-c", _PLAIN_EXIT]
    doctor = ["doctor", "--np", "1"]
    export = ["export", "--checkpoint", str(ckpt), "--output", str(workdir / "onnx")]
    export += ["--samples", "100"]
    job = ["--gloo", "-np", "1", "-H", "localhost:1", python, "-c", "pass"]
    return [
        ("exit without the interpreter's teardown (doctor)", plain + doctor, trainer + doctor),
        ("exit without the interpreter's teardown (export)", plain + export, trainer + export),
        (
            "horovodrun without its Gloo probe (1 rank)",
            [horovodrun, *job],
            [python, "-c", HOROVODRUN_WITHOUT_GLOO_PROBE, *job],
        ),
        (
            "remembered doctor pass (fingerprint vs doctor)",
            trainer + doctor,
            [python, "-c", INTERPRETER_FINGERPRINT],
        ),
    ]


def wall(argv: Sequence[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(
            f"{argv[0]} … exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
        )
    return seconds


def measure(repeats: int, workdir: Path, warm_up: bool = True) -> list[dict[str, Any]]:
    env = rank_env({"HVA_CACHE_DIR": str(workdir / "cache")})
    python = sys.executable
    horovodrun = shutil.which("horovodrun", path=env["PATH"])
    if horovodrun is None:
        raise RuntimeError("horovodrun is not on PATH (bash scripts/setup.sh installs it)")
    rows = [
        {"saving": name, "plain": plain, "saved": saved, "plain_s": [], "with_s": []}
        for name, plain, saved in pairs(
            python, horovodrun, checkpoint(workdir, python, env), workdir
        )
    ]
    for row in rows if warm_up else []:  # once each, unmeasured: the page cache warm alike
        wall(row["plain"], env)
        wall(row["saved"], env)
    for _ in range(repeats):
        for row in rows:
            row["plain_s"].append(wall(row["plain"], env))
            row["with_s"].append(wall(row["saved"], env))
    for row in rows:
        row["plain_median_s"] = statistics.median(row["plain_s"])
        row["with_median_s"] = statistics.median(row["with_s"])
        row["saved_s"] = row["plain_median_s"] - row["with_median_s"]
        row["worth_keeping"] = row["saved_s"] >= WORTH_S
        for key in ("plain", "saved"):  # the commands, without this machine's paths
            row[key] = [
                Path(a).name if a.startswith(str(workdir)) or a in (python, horovodrun) else a
                for a in row[key]
            ]
    return rows


def markdown(rows: list[dict[str, Any]], repeats: int, warm_up: bool, m: dict[str, Any]) -> str:
    table = md_table(
        ["saving", "plain s (median)", "with it s (median)", "saved per task s", "per repeat"],
        [
            (
                r["saving"],
                r["plain_median_s"],
                r["with_median_s"],
                r["saved_s"],
                "; ".join(
                    f"{p:.2f}→{w:.2f}" for p, w in zip(r["plain_s"], r["with_s"], strict=True)
                ),
            )
            for r in rows
        ],
    )
    warm = " (each run once unmeasured first)" if warm_up else ""
    return (
        "### Start-up savings\n\n"
        f"{table}\n\n"
        f"One process's wall time, start to exit, {repeats} repeat(s), plain and saved "
        f"commands alternated{warm}. Horovod {VERIFIED_HOROVOD} is the version the Gloo-probe "
        f"saving is applied to. A saving is kept where it saves >= {WORTH_S} s per task "
        "(horovod_airflow/core/startup_savings.py). Who pays each: the teardown every rank, "
        "export task and doctor; the Gloo probe each horovodrun; the doctor each job whose "
        "doctor pass is not remembered.\n\n"
        f"{machine_line(m)}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    add_driver_arguments(parser, quick="1 repeat, no warm-up runs", np=False)
    parser.add_argument("--repeats", type=int, default=5, help="alternations (default 5)")
    args = parser.parse_args(argv)
    require_positive(parser, args, ["repeats"])
    repeats = 1 if args.quick else args.repeats
    m = machine()
    with tempfile.TemporaryDirectory(prefix="startup-savings-") as tmp:
        rows = measure(repeats, Path(tmp), warm_up=not args.quick)
    data = {
        "machine": m,
        "quick": args.quick,
        "repeats": repeats,
        "worth_s": WORTH_S,
        "savings": rows,
    }
    return write_run("startup_savings", args, markdown(rows, repeats, not args.quick, m), data)


if __name__ == "__main__":
    sys.exit(main())
