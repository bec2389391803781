"""A tiny Horovod program that follows the training-program contract (docs/design.md).

It proves an engine can run ranks: every rank reports its host, one allreduce checks the ranks
talk to each other, and rank 0 writes ``<output>/metrics.json``. Seconds, not minutes, so the
engine tests spend their time on the engine rather than on training.

    horovodrun -np 2 -H localhost:2 python -m tests.engines.hvd_probe --data D --output O

``--hold-seconds`` keeps the ranks alive (for on_kill / fault tests); ``--fail-rank R`` makes
rank R exit with code 3 after printing a recognisable line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

PROBE_EXIT_CODE = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hold-seconds", type=float, default=0.0)
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args(argv)

    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()  # distributed
    rank, size = hvd.rank(), hvd.size()
    host = socket.gethostname()
    print(f"probe rank={rank} size={size} host={host} pid={os.getpid()}", flush=True)

    # Every rank contributes rank + 1: the sum proves all ranks joined the same ring.
    total = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum)  # distributed
    hosts = hvd.allgather_object(host)  # distributed
    print(f"probe rank={rank} allreduce_sum={total.item():g}", flush=True)

    if rank == args.fail_rank:
        print(f"probe rank={rank} failing on purpose with exit {PROBE_EXIT_CODE}", flush=True)
        sys.stdout.flush()
        os._exit(PROBE_EXIT_CODE)

    deadline = time.monotonic() + args.hold_seconds
    while time.monotonic() < deadline:
        print(f"probe rank={rank} holding", flush=True)
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    hvd.allreduce(torch.zeros(1), name="barrier")  # distributed: no rank exits before the rest

    if rank == 0:
        from horovod_airflow.core import storage
        from horovod_airflow.core.contract import METRICS, METRICS_NAME

        expected = size * (size + 1) / 2
        metrics = {
            "val_accuracy": 1.0 if total.item() == expected else 0.0,
            "val_loss": 0.0,
            "val_samples": 0,
            "epochs": 0,
            "world_size": size,
            "allreduce_sum": total.item(),
            "hosts": hosts,
            "data": args.data,
        }
        uri = storage.join(args.output, METRICS_NAME)
        storage.write_bytes(uri, METRICS.dumps(metrics).encode())
        print(json.dumps({"event": "final_metrics", **metrics}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
