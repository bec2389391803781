"""A tiny Horovod program that follows the training-program contract (docs/design.md).

It proves an operator can launch *any* such program, not only our trainer::

    horovodrun -np 2 -H localhost:2 python -m tests.programs.allreduce_program \\
        --data s3://bucket/eval --output s3://bucket/runs/x

``<data>/eval.json`` holds ``{"labels": [...], "predictions": [...]}``. Each rank scores
its shard (``rank::size``), the counts are allreduced, and rank 0 writes
``<output>/metrics.json`` with ``val_accuracy = correct / total``. Knobs for tests:
``--sleep S`` (before the allreduce, to be killed), ``--fail-rank R --exit-code C`` (that
rank prints a message and exits C), ``--print-env NAME`` (rank 0 says whether it is set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from horovod_airflow.core import storage
from horovod_airflow.core.contract import METRICS, METRICS_NAME


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--print-env", action="append", default=[])
    p.add_argument("--epochs", type=int, default=1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()  # distributed: join the Gloo ring
    rank, size = hvd.rank(), hvd.size()
    is_primary = rank == 0
    print(f"rank {rank}/{size} pid {os.getpid()} started resume={args.resume}", flush=True)

    if args.fail_rank is not None and rank == args.fail_rank:
        print(f"rank {rank}: failing on purpose with exit code {args.exit_code}", flush=True)
        sys.stderr.write(f"rank {rank}: simulated failure\n")
        return args.exit_code
    if args.sleep:
        print(f"rank {rank}: sleeping {args.sleep}s", flush=True)
        time.sleep(args.sleep)

    evalset = json.loads(storage.read_text(storage.join(args.data, "eval.json")))
    labels, preds = evalset["labels"][rank::size], evalset["predictions"][rank::size]
    local = torch.tensor(
        [sum(int(a == b) for a, b in zip(labels, preds, strict=True)), len(labels)],
        dtype=torch.float64,
    )
    correct, total = hvd.allreduce(local, op=hvd.Sum, name="eval_counts").tolist()  # distributed
    for name in args.print_env:
        if is_primary:
            print(f"env {name} is {'set' if os.environ.get(name) else 'unset'}", flush=True)

    if is_primary:
        metrics = {
            "val_accuracy": correct / total,
            "val_loss": 1.0 - correct / total,
            "val_correct": int(correct),
            "val_samples": int(total),
            "epochs": args.epochs,
            "world_size": size,
            "resumed": args.resume,
            # what a retry checks before it reuses this training (HorovodTrainOperator)
            "dataset": {"uri": args.data},
            "config": {"epochs": args.epochs},
            "artifacts": {"metrics": storage.join(args.output, METRICS_NAME)},
        }
        storage.write_text(storage.join(args.output, METRICS_NAME), METRICS.dumps(metrics))
        print(json.dumps({"event": "final_metrics", **metrics}), flush=True)
    hvd.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
