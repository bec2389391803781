"""Training throughput, the demo's recipe against our trainer, with 1 and 2 Horovod ranks.

One ``horovodrun`` per rank count; each rank, in the same process, on the same data and
model, times a fixed number of steps after warm-up (median of several repeats; samples/s
over all ranks, each repeat timed by its slowest rank):

- the demo's input pipeline alone: torchvision ``MNIST`` + ``DataLoader`` (batch 64,
  ``DistributedSampler``) decoding a PIL image and running ``ToTensor``/``Normalize`` per
  sample, torch's default threads per rank;
- our trainer's data path alone: ``horovod_airflow.trainer.train.batches`` over the normalized
in-memory tensors
  of ``horovod_airflow.trainer.data.load_split`` and the trainer's per-epoch shard
  (``horovod_airflow.trainer.train.epoch_indices``), batch 64 (for the like-for-like ratio) and the
  trainer's
  default batch;
- whole training steps: the demo's (its data + ``Net`` + Adam + ``DistributedOptimizer``, default
  threads, and again at our thread policy to separate the two effects) and ours
  (``horovod_airflow.trainer.train.train_one_epoch`` over 10 batches per rank a call, trainer
  defaults);
- model-only compute on one in-memory batch: fp32 against bf16 autocast + channels_last.

Run from the repository root::

    python -m bench.train_throughput            # 1 and 2 ranks, ~5 minutes on 2 cores
    python -m bench.train_throughput --quick    # seconds per rank count (the smoke test)

Scaling efficiency = throughput(2 ranks) / (2 × throughput(1 rank)). Our trainer gives each
rank cores ÷ local ranks threads, so its 1- and 2-rank runs use the same total CPU threads;
on a 2-core machine that caps the efficiency near 50 % (no more cores come with the second
rank) — it says how much the second rank *costs*, not what a second machine would give.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import (
    add_driver_arguments,
    driver_parsers,
    require_positive,
    run_rank_program,
    run_timeout,
    write_run,
)
from bench.report import default_ranks, machine, machine_line, md_table

if TYPE_CHECKING:
    import torch

    from horovod_airflow.core.train_config import TrainConfig as TrainerConfig
    from horovod_airflow.trainer.runtime import Runtime

DEMO_BATCH = 64
OUR_STEPS_PER_CALL = 10  # trainer steps per timed call of "our training step"
DEFAULT_THREADS = "torch default threads"  # the demo's: one per core in every rank
OUR_THREADS = (
    "cores ÷ ranks"  # the trainer's policy (horovod_airflow.trainer.runtime.setup_runtime)
)


# --- what runs in each Horovod rank -------------------------------------------------------


def our_training_step(
    config: TrainerConfig,
    rt: Runtime,
    device: torch.device,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int = 1,
) -> Callable[[], None]:
    """``steps`` optimizer steps of every rank through
    ``horovod_airflow.trainer.train.train_one_epoch`` itself.

    The trainer's model, optimizer and ``DistributedOptimizer`` wrapping as in
    ``horovod_airflow.trainer.train.run``; an "epoch" over exactly ``steps`` batches per rank. Each
    call also
    pays what the trainer pays once per epoch (the shard permutation and the blocking
    allreduce of the loss sums), so a throughput figure wants ``steps`` > 1 to spread it.
    """
    import horovod.torch as hvd

    from horovod_airflow.core.train_config import lr_at
    from horovod_airflow.trainer import train

    model = train.build_training_model(config, device)
    world_factor = train.lr_world_factor(config, device)
    optimizer = hvd.DistributedOptimizer(  # Horovod: as horovod_airflow.trainer.train.run wraps it
        train.build_optimizer(config, model, lr_at(config, world_factor, 0, 1)),
        named_parameters=model.named_parameters(),
        op=hvd.Average,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # Horovod
    chunk = config.batch_size * rt.size * steps  # `steps` batches for every rank
    x_step, y_step = x[:chunk], y[:chunk]

    def step() -> None:
        train.train_one_epoch(model, optimizer, x_step, y_step, 1, config, rt, world_factor)

    return step


def run_rank(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch
    from torch.nn import functional as F
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from torchvision import datasets

    from bench.demo_baseline import demo_net, demo_transform, quiet_dropout2d_warning
    from horovod_airflow.core.train_config import TrainConfig
    from horovod_airflow.trainer import data, runtime, train
    from horovod_airflow.trainer.model import build_model

    quiet_dropout2d_warning()
    default_threads = torch.get_num_threads()  # the demo's: read before the trainer sets its own
    config = TrainConfig(
        data=args.data, output=args.output, cache_dir=args.cache_dir, log_interval=0
    )
    rt, device = runtime.setup_runtime(config)  # hvd.init() and the trainer's thread policy
    our_threads = torch.get_num_threads()
    cuda = device.type == "cuda"
    dataset = train.fetch_staged_dataset(config, rt)
    x, y = data.load_split(dataset, "train")
    x, y = x.to(device), y.to(device)
    results: list[dict[str, Any]] = []

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def measure(
        name: str,
        batch: int,
        policy: str,
        step: Callable[[], None],
        steps_per_call: int = 1,
        **extra: Any,
    ) -> None:
        """Time ``step`` (``steps_per_call`` batches per rank): warm-up, then ``repeats`` timed
        runs of N calls.

        N is sized from the warm-up so that one repeat lasts about ``--seconds`` (between 2
        and ``--steps`` calls): slow configurations stay affordable, fast ones are not noise.
        """
        threads = default_threads if policy == DEFAULT_THREADS else our_threads
        if not cuda:
            torch.set_num_threads(threads)
        hvd.barrier()
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            step()
        sync()
        per_step = (time.perf_counter() - t0) / max(1, args.warmup)
        per_step = float(hvd.allreduce(torch.tensor([per_step]), op=hvd.Max, name="bench.cal"))
        steps = int(min(args.steps, max(2, args.seconds / max(per_step, 1e-6))))
        rates = []
        for _ in range(args.repeats):
            hvd.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            elapsed = torch.tensor([time.perf_counter() - t0])
            slowest = float(hvd.allreduce(elapsed, op=hvd.Max, name="bench.elapsed"))
            rates.append(rt.size * batch * steps_per_call * steps / slowest)
        results.append(
            {
                "name": name,
                "batch_per_rank": batch,
                "threads_per_rank": threads,
                "threads": policy,
                "steps": steps * steps_per_call,
                "samples_per_sec": rates,
                "median": statistics.median(rates),
                **extra,
            }
        )
        if rt.is_primary:
            print(json.dumps({"event": "bench", **results[-1]}), flush=True)

    # The demo's input pipeline: PIL decode + ToTensor + Normalize per sample, batch 64.
    demo_train = datasets.MNIST(args.root, train=True, download=False, transform=demo_transform())
    sampler: DistributedSampler[Any] = DistributedSampler(
        demo_train, num_replicas=rt.size, rank=rt.rank
    )  # Horovod
    loader = DataLoader(demo_train, batch_size=DEMO_BATCH, sampler=sampler)

    def demo_batches() -> Any:
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            for xb, yb in loader:
                yield (xb.cuda(), yb.cuda()) if cuda else (xb, yb)
            epoch += 1

    demo_stream = demo_batches()

    def demo_data_step() -> None:
        next(demo_stream)

    measure("demo input pipeline", DEMO_BATCH, DEFAULT_THREADS, demo_data_step)

    # Our data path: horovod_airflow.trainer.train.batches over this rank's shard of the epoch
    # permutation.
    memory_format = torch.channels_last if rt.channels_last else torch.contiguous_format
    shard = train.epoch_indices(x.shape[0], rt, config.seed, 0).to(device)

    def our_data_step_of(batch: int) -> Callable[[], None]:
        def endless() -> Any:
            while True:
                yield from train.batches(x, y, shard, batch, memory_format)

        stream = endless()

        def step() -> None:
            next(stream)

        return step

    measure("our data path", DEMO_BATCH, OUR_THREADS, our_data_step_of(DEMO_BATCH))
    if config.batch_size != DEMO_BATCH:
        measure(
            "our data path", config.batch_size, OUR_THREADS, our_data_step_of(config.batch_size)
        )

    # The demo's training step: its data, Net, Adam(lr 0.001 x size), DistributedOptimizer.
    torch.manual_seed(42)
    demo_model = demo_net().to(device)
    demo_optimizer = hvd.DistributedOptimizer(  # Horovod: averaged gradients
        torch.optim.Adam(demo_model.parameters(), lr=0.001 * rt.size),
        named_parameters=[(f"demo.{n}", p) for n, p in demo_model.named_parameters()],
        op=hvd.Average,
    )
    criterion = torch.nn.CrossEntropyLoss()

    def demo_train_step() -> None:
        demo_model.train()
        xb, yb = next(demo_stream)
        demo_optimizer.zero_grad()
        loss = criterion(demo_model(xb), yb)
        loss.backward()
        demo_optimizer.step()

    measure("demo training step", DEMO_BATCH, DEFAULT_THREADS, demo_train_step)
    if not cuda and our_threads != default_threads:
        measure("demo training step", DEMO_BATCH, OUR_THREADS, demo_train_step)

    # Our training steps: horovod_airflow.trainer.train.train_one_epoch over OUR_STEPS_PER_CALL
    # batches per
    # rank a call (its once-per-epoch loss allreduce would otherwise be timed as every step's).
    torch.manual_seed(config.seed)
    our_train_step = our_training_step(config, rt, device, x, y, steps=OUR_STEPS_PER_CALL)

    measure(
        "our training step",
        config.batch_size,
        OUR_THREADS,
        our_train_step,
        steps_per_call=OUR_STEPS_PER_CALL,
        precision=rt.precision,
        channels_last=rt.channels_last,
    )

    # Model-only compute: one in-memory batch, forward + backward + Adam, no data, no allreduce.
    for label, bf16, channels_last in (
        ("model only, fp32", False, False),
        ("model only, bf16 autocast + channels_last", True, True),
    ):
        torch.manual_seed(config.seed)
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        net = build_model(config.model).to(device).to(memory_format=fmt)
        adam = torch.optim.Adam(net.parameters(), lr=1e-3)
        xb = x[: config.batch_size].contiguous(memory_format=fmt)
        yb = y[: config.batch_size]

        def model_step(
            net: torch.nn.Module = net,
            adam: torch.optim.Optimizer = adam,
            xb: torch.Tensor = xb,
            yb: torch.Tensor = yb,
            bf16: bool = bf16,
        ) -> None:
            adam.zero_grad(set_to_none=True)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = net(xb)
            F.cross_entropy(logits.float(), yb).backward()
            adam.step()

        measure(label, config.batch_size, OUR_THREADS, model_step)

    if rt.is_primary:
        summary = {
            "world_size": rt.size,
            "device": rt.device,
            "default_threads": default_threads,
            "our_threads": our_threads,
            "our_precision": rt.precision,
            "our_channels_last": rt.channels_last,
            "results": results,
        }
        Path(args.result).write_text(json.dumps(summary, indent=2))


# --- the driver ---------------------------------------------------------------------------


def rank_counts() -> list[int]:
    """1 and 2 ranks; on CUDA only as many as there are GPUs."""
    return sorted({1, default_ranks(2)})


def run_throughput(
    workdir: Path,
    *,
    np: int,
    steps: int,
    warmup: int,
    repeats: int,
    seconds: float,
    timeout: float = 3600,
) -> dict[str, Any]:
    args = ["--steps", str(steps), "--warmup", str(warmup), "--repeats", str(repeats)]
    args += ["--seconds", str(seconds)]
    summary, run = run_rank_program(
        "bench.train_throughput", np, workdir, args,
        tag=f"throughput-np{np}", timeout=timeout, torchvision_root=True,
    )  # fmt: skip
    summary["wall_seconds"] = round(run.wall_seconds, 1)
    return summary


def _key(r: dict[str, Any]) -> tuple[str, int, int]:
    return (r["name"], r["batch_per_rank"], r["threads_per_rank"])


def tables(runs: dict[int, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The per-configuration table (1 vs 2 ranks) and the ratios that explain it."""
    one, two = runs.get(1), runs.get(2)
    rows = []
    derived: dict[str, Any] = {}
    if one and two:
        # Pair each 2-rank configuration with its 1-rank run: same name, batch and thread
        # policy (at 1 rank the demo's default threads and ours coincide: measured once).
        pairs = []
        for r2 in two["results"]:
            same = [
                r1
                for r1 in one["results"]
                if (r1["name"], r1["batch_per_rank"]) == (r2["name"], r2["batch_per_rank"])
            ]
            exact = [r1 for r1 in same if r1["threads"] == r2["threads"]]
            if exact or same:
                pairs.append(((exact or same)[0], r2))
        for r1, r2 in pairs:
            eff = r2["median"] / (2 * r1["median"])
            rows.append(
                [
                    f"{r2['name']} ({r2['threads']})",
                    r2["batch_per_rank"],
                    f"{r1['threads_per_rank']} → {r2['threads_per_rank']}",
                    _spread(r1),
                    _spread(r2),
                    f"{100 * eff:.0f} %",
                ]
            )
        headers = [
            "configuration",
            "batch/rank",
            "threads/rank (1 → 2 ranks)",
            "1 rank samples/s",
            "2 ranks samples/s",
            "scaling efficiency",
        ]
    else:
        only = one or two
        assert only is not None
        rows = [
            [
                f"{r['name']} ({r['threads']})",
                r["batch_per_rank"],
                r["threads_per_rank"],
                _spread(r),
            ]
            for r in only["results"]
        ]
        headers = [
            "configuration",
            "batch/rank",
            "threads/rank",
            f"{only['world_size']} rank(s) samples/s",
        ]
    table = md_table(headers, rows)

    ref = two or one
    assert ref is not None
    by: dict[str, dict[str, Any]] = {}
    for r in ref["results"]:
        by.setdefault(r["name"], r)  # the first (default-thread) entry of each name
    ours_b64 = next(
        r for r in ref["results"] if r["name"] == "our data path" and r["batch_per_rank"] == 64
    )
    ratio_rows = [
        [
            "our data path / demo input pipeline (batch 64)",
            ours_b64["median"] / by["demo input pipeline"]["median"],
        ],
        [
            "our training step / demo training step",
            by["our training step"]["median"] / by["demo training step"]["median"],
        ],
        [
            "bf16 autocast + channels_last / fp32 (model only)",
            by["model only, bf16 autocast + channels_last"]["median"]
            / by["model only, fp32"]["median"],
        ],
        [
            "our training step / model-only fp32 (share of pure compute reached)",
            by["our training step"]["median"] / by["model only, fp32"]["median"],
        ],
        [
            "demo training step / demo input pipeline alone",
            by["demo training step"]["median"] / by["demo input pipeline"]["median"],
        ],
    ]
    derived = {label: round(v, 3) for label, v in ratio_rows}
    ratios = md_table([f"ratio at {ref['world_size']} rank(s)", "×"], ratio_rows)
    return table + "\n\n" + ratios, derived


def _spread(r: dict[str, Any]) -> str:
    lo, hi = min(r["samples_per_sec"]), max(r["samples_per_sec"])
    if len(r["samples_per_sec"]) == 1:
        return f"{r['median']:,.0f}"
    return f"{r['median']:,.0f} ({lo:,.0f}–{hi:,.0f})"


def main(argv: list[str] | None = None) -> int:
    parser, rank = driver_parsers(__doc__, torchvision_root=True)
    for p in (parser, rank):
        p.add_argument("--steps", type=int, default=200, help="at most this many steps a repeat")
        p.add_argument("--seconds", type=float, default=3.0, help="aim for this long a repeat")
        p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
        p.add_argument("--repeats", type=int, default=5, help="timed repeats (median reported)")
    parser.add_argument("--np", type=int, nargs="+", default=None, help="rank counts (1 2)")
    add_driver_arguments(parser, quick="2 steps, 1 repeat (smoke test)", np=False)
    args = parser.parse_args(argv)
    require_positive(parser, args, ("steps", "warmup", "repeats"))
    if args.seconds <= 0:
        parser.error(f"--seconds must be > 0, got {args.seconds}")

    if args.command == "rank":
        run_rank(args)
        return 0

    if args.quick:
        args.steps, args.warmup, args.repeats, args.seconds = 2, 1, 1, 0.1
    nps = args.np or rank_counts()
    if any(n < 1 for n in nps):
        parser.error(f"--np takes rank counts >= 1, got {nps}")
    m = machine()
    runs: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="hva-throughput-") as tmp:
        for n in nps:
            runs[n] = run_throughput(
                Path(tmp),
                np=n,
                steps=args.steps,
                warmup=args.warmup,
                repeats=args.repeats,
                seconds=args.seconds,
                timeout=run_timeout(args.quick),
            )
    body, derived = tables(runs)
    ref = runs[max(runs)]
    title = "### Training throughput, demo recipe vs our trainer" + (
        " (quick)" if args.quick else ""
    )
    notes = (
        f"Samples/s over all ranks, median (min–max) of {args.repeats} repeat(s), each of up to "
        f"{args.steps} steps after {args.warmup} warm-up step(s), timed by the slowest rank. "
        f"Device {ref['device']}; torch default threads {ref['default_threads']}/rank "
        "(the demo's), "
        f"ours {ref['our_threads']}/rank at {ref['world_size']} ranks; our precision "
        f"{ref['our_precision']}, channels_last {ref['our_channels_last']}. Scaling efficiency = "
        "2-rank / (2 × 1-rank); our ranks share the same cores (threads = cores ÷ ranks)."
    )
    markdown = "\n".join([title, "", body, "", notes, "", machine_line(m)])
    data = {"machine": m, "quick": args.quick, "runs": runs, "ratios": derived}
    return write_run("train_throughput", args, markdown, data)


if __name__ == "__main__":
    sys.exit(main())
