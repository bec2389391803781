"""What the benchmarks' drivers share: their common options and the run of a ``rank`` program.

Each benchmark is one module: its driver (``main``) parses the options below, stages the
vendored MNIST, and starts ``python -m bench.<name> rank ...`` in every Horovod rank
(:func:`run_rank_program`); rank 0 writes its measurements to ``--result`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from bench.datasets import prepare_torchvision_root, stage_local_dataset
from bench.report import HorovodRun, default_ranks, rank_env, run_horovod, write_results

S = TypeVar("S")
T = TypeVar("T")
NP_HELP = "Horovod ranks (default 2; on CUDA one per GPU, ≤ 2)"


def add_driver_arguments(
    parser: argparse.ArgumentParser, *, quick: str, np: bool = True, np_help: str = NP_HELP
) -> None:
    """The options every driver has: ``--np`` (unless ``np`` is false: the driver declares its
    own), ``--quick`` (``quick`` says what it shrinks the run to) and ``--results-dir``."""
    if np:
        parser.add_argument("--np", type=int, default=None, help=np_help)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--results-dir", type=Path, default=None, help="default bench/results")


def result_name(name: str, quick: bool) -> str:
    """``<name>_quick`` for a ``--quick`` run, so a smoke test never overwrites the figures."""
    return f"{name}_quick" if quick else name


def ranks_from(parser: argparse.ArgumentParser, np: int | None) -> int:
    """``--np``, or :func:`bench.report.default_ranks` when not given; < 1 is a usage error."""
    ranks = default_ranks() if np is None else np
    if ranks < 1:
        parser.error(f"--np must be an integer >= 1, got {ranks}")
    return ranks


def require_positive(
    parser: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]
) -> None:
    """A usage error naming the first of the integer options ``names`` that is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} must be an integer >= 1, got {getattr(args, name)}")


def driver_parsers(
    doc: str | None, *, torchvision_root: bool = False
) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The driver's parser (described by the first line of the module's ``doc``) and its
    ``rank`` subcommand, which :func:`run_rank_program` starts in every rank: the staged dataset
    (``--data``), the trainer's ``--output`` and ``--cache-dir``, rank 0's ``--result`` file, and
    with ``torchvision_root`` the demo's ``--root`` too."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    rank: argparse.ArgumentParser = sub.add_parser(
        "rank", help="the program each Horovod rank runs"
    )
    if torchvision_root:
        rank.add_argument("--root", required=True, help="torchvision root holding MNIST/raw/")
    rank.add_argument("--data", required=True, help="staged dataset folder (manifest.json)")
    rank.add_argument("--output", required=True)
    rank.add_argument("--cache-dir", default="")
    rank.add_argument("--result", required=True, help="rank 0 writes its measurements here")
    return parser, rank


def write_run(name: str, args: argparse.Namespace, markdown: str, data: dict[str, Any]) -> int:
    """Write the driver's results (:func:`bench.report.write_results`) under
    :func:`result_name` into ``--results-dir``; the driver's exit code."""
    write_results(result_name(name, args.quick), markdown, data, args.results_dir)
    return 0


#: ``--quick`` of a sweep (:func:`add_sweep_arguments`): one repeat on this many samples.
QUICK_SWEEP_SAMPLES = 2048


def add_sweep_arguments(parser: argparse.ArgumentParser, *, repeats: int, samples: int) -> None:
    """A sweep driver's ``--repeats`` (the :func:`alternated` repeats) and ``--samples`` (the
    training images of each run), with these defaults, then the common driver options."""
    parser.add_argument(
        "--repeats", type=int, default=repeats, help="alternations (median reported)"
    )
    parser.add_argument("--samples", type=int, default=samples, help="training images per run")
    add_driver_arguments(parser, quick=f"1 repeat on {QUICK_SWEEP_SAMPLES:,} samples")


def parse_sweep_args(
    parser: argparse.ArgumentParser, argv: list[str] | None, *, samples_per_rank: int
) -> argparse.Namespace:
    """The arguments of :func:`add_sweep_arguments`'s parser, ``--quick`` and ``--np``
    applied; a usage error unless ``--repeats`` >= 1 and ``--samples`` >= ``samples_per_rank``
    x np (each rank's share of a run is at least that)."""
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.samples = 1, QUICK_SWEEP_SAMPLES
    args.np = ranks_from(parser, args.np)
    if args.repeats < 1 or args.samples < samples_per_rank * args.np:
        parser.error(
            f"--repeats must be >= 1 and --samples >= {samples_per_rank} x np, got np "
            f"{args.np}, --repeats {args.repeats}, --samples {args.samples}"
        )
    return args


def alternated(settings: Sequence[S], repeats: int, run: Callable[[S, int], T]) -> dict[S, list[T]]:
    """``run(setting, repeat)`` for every setting once per repeat, the settings alternated, so
    that a shared machine's drift spreads over all of them alike; the results per setting."""
    results: dict[S, list[T]] = {s: [] for s in settings}
    for i in range(repeats):
        for s in settings:
            results[s].append(run(s, i))
    return results


def sweep_data(
    m: dict[str, Any], args: argparse.Namespace, rates: dict[Any, list[float]], key: str, **per: Any
) -> dict[str, Any]:
    """A sweep's results JSON: the machine, the run's size (``--quick``, ``--np``,
    ``--samples``, ``--repeats``) and one entry per setting (``key``: the setting) with its
    samples/s per repeat and their median, plus ``per[name](setting)`` for each extra field."""
    return {
        "machine": m,
        "quick": args.quick,
        "np": args.np,
        "samples": args.samples,
        "repeats": args.repeats,
        "results": [
            {
                key: s,
                "samples_per_sec": [round(v, 1) for v in values],
                "median": round(statistics.median(values), 1),
                **{name: field(s) for name, field in per.items()},
            }
            for s, values in rates.items()
        ],
    }


def run_timeout(quick: bool) -> float:
    """Seconds a benchmark's Horovod run may take before it is stopped."""
    return 600 if quick else 3600


def run_rank_program(
    module: str,
    np: int,
    workdir: Path,
    extra_args: Sequence[str],
    *,
    tag: str,
    timeout: float,
    torchvision_root: bool = False,
) -> tuple[dict[str, Any], HorovodRun]:
    """Run ``python -m <module> rank`` (:func:`driver_parsers`) in ``np`` ranks on the
    vendored MNIST staged under ``workdir``; return rank 0's result JSON and the run.

    ``workdir/<tag>.json`` is the result file and ``workdir/<tag>.log`` the output.
    """
    staged = stage_local_dataset(workdir / "staged")
    result = workdir / f"{tag}.json"
    result.unlink(missing_ok=True)
    args = [module, "rank", "--data", str(staged), "--result", str(result)]
    args += ["--output", str(workdir / "unused-output"), "--cache-dir", str(workdir / "cache")]
    if torchvision_root:
        args += ["--root", str(prepare_torchvision_root(workdir / "torchvision-root"))]
    args += list(extra_args)
    run = run_horovod(np, args, log=workdir / f"{tag}.log", timeout=timeout, env=rank_env())
    summary: dict[str, Any] = json.loads(result.read_text())
    return summary, run
