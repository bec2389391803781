"""The example's Horovod training program: ``python -m examples.waveforms.train``.

``--data D --output O [--epochs N] [--batch-size B] [--lr LR] [--seed S] [--resume]``.
Follows the training-program contract of ``docs/design.md``, so ``HorovodTrainOperator`` can
launch it (``entrypoint=("python", "-m", "examples.waveforms.train")``):

- ``--data``: a staged file set (:mod:`horovod_airflow.core.fileset`) holding the ``.npy`` files
of
  :mod:`examples.waveforms.data`; every rank fetches it and checks each file's sha256;
- rank 0 broadcasts the initial weights and optimizer state before the first step
  (``hvd.broadcast_parameters``, ``hvd.broadcast_optimizer_state``); gradients are
  averaged by ``hvd.DistributedOptimizer``; every rank runs the same number of steps;
- the validation metrics are exact: each rank scores a disjoint slice of the test split and
  the sums (loss, correct, count) are allreduced, so ``val_accuracy`` is over the whole split;
- rank 0 alone writes ``<output>/checkpoint.pt`` (each epoch) and, at the end,
  ``<output>/metrics.json`` (``horovod_airflow.core.contract.METRICS``: ``val_accuracy``,
  ``val_loss``,
  ``val_correct``, ``val_samples``, ``epochs``, ``world_size``, ``history``,
  ``preprocessing``, ``dataset``, ``config``, ``versions``, ``artifacts``,
  ``train_seconds``); it prints one JSON line per epoch (``{"event": "epoch", ...}``) and a
  last ``{"event": "final_metrics", ...}``;
- ``--resume`` continues from ``<output>/checkpoint.pt`` when there is one (same dataset
  and world size, else it stops saying why) and starts fresh when there is none.

Preprocessing: ``x = (raw * scale - mean) / std`` with ``scale`` 1 and the train split's
mean and std (:func:`examples.waveforms.model.preprocessing_of`, the contract's
preprocessing document), applied by ``horovod_airflow.core.contract.apply_preprocessing`` as
serving
applies it, recorded in the checkpoint and metrics and written by :mod:`.export` into the
ONNX model's metadata, which serving reads.

``checkpoint.pt`` is the example's own (format :data:`CHECKPOINT_FORMAT`, read only by this
program's ``--resume`` and by :mod:`.export`): its content is not the project trainer's, so it
does not carry ``horovod_airflow.core.contract.CHECKPOINT_FORMAT``.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import sys
import tempfile
import time
from typing import Any

from examples.waveforms.data import load_split
from examples.waveforms.model import MODEL_NAME, build_model, preprocessing_of
from horovod_airflow.core import contract, fileset, storage
from horovod_airflow.core.contract import (
    CHECKPOINT_NAME,
    EVENT_EPOCH,
    EVENT_FINAL_METRICS,
    METRICS,
    METRICS_NAME,
    event_line,
)

#: The example's checkpoint format: private to the example, so outside the project's
#: ``horovod-airflow/`` namespace (which horovod_airflow.core.contract owns).
CHECKPOINT_FORMAT = "waveforms/checkpoint-v1"


class TrainingError(RuntimeError):
    """The run cannot go on (a resume that does not match, a shard count that is off)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m examples.waveforms.train",
        description="Train the example 1-D CNN on staged waveforms with Horovod "
        "(run under horovodrun; rank 0 writes checkpoint.pt and metrics.json at --output).",
    )
    p.add_argument("--data", required=True, help="staged file set URI (s3://... or a folder)")
    p.add_argument("--output", required=True, help="URI for checkpoint.pt and metrics.json")
    p.add_argument("--epochs", type=int, default=12, help="training epochs (default 12)")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size (default 32)")
    p.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate (default 5e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and shuffling")
    p.add_argument(
        "--resume", action="store_true", help=f"continue from <output>/{CHECKPOINT_NAME}"
    )
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    return args


def standardize(raw: Any, pre: dict[str, Any]) -> Any:
    """float32 tensor ``[N, 1, length]`` from raw signals ``[N, length]``, as serving does
    (``horovod_airflow.core.contract.apply_preprocessing`` with the model's preprocessing
    ``pre``)."""
    import torch

    return torch.from_numpy(contract.apply_preprocessing(pre, raw))


def evaluate(model: Any, x: Any, y: Any) -> Any:
    """``[loss_sum, correct, count]`` (float64) of ``model`` on ``x``, ``y``."""
    import torch
    from torch.nn import functional as F

    model.eval()
    with torch.inference_mode():
        logits = model(x)
        return torch.tensor(
            [
                float(F.cross_entropy(logits, y, reduction="sum")),
                float((logits.argmax(1) == y).sum()),
                float(y.numel()),
            ],
            dtype=torch.float64,
        )


def versions() -> dict[str, str]:
    import horovod
    import numpy
    import torch

    return {
        "torch": torch.__version__,
        "horovod": horovod.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Train; return the final metrics on rank 0 (None on the other ranks)."""
    import horovod.torch as hvd
    import torch
    from torch.nn import functional as F

    hvd.init()  # Horovod: join the other ranks
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    start = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix=f"hva-waveforms-{rank}-") as tmp:
        manifest, paths = fileset.fetch_files(args.data, tmp)  # sha256-checked, every rank
        train_raw, train_y = load_split(paths, "train")
        test_raw, test_y = load_split(paths, "test")
    pre = preprocessing_of(train_raw)
    x_train, y_train = standardize(train_raw, pre), torch.from_numpy(train_y)
    x_test, y_test = standardize(test_raw, pre), torch.from_numpy(test_y)
    dataset = {"uri": args.data, "content_hash": manifest["content_hash"]}

    torch.manual_seed(args.seed)
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    ckpt_uri = storage.join(args.output, CHECKPOINT_NAME)
    start_epoch, history = 0, []
    resume_state: Any = None
    if rank == 0 and args.resume and storage.exists(ckpt_uri):
        state = torch.load(
            io.BytesIO(storage.read_bytes(ckpt_uri)), map_location="cpu", weights_only=True
        )
        problems = [
            f"{k}: checkpoint {state.get(k)!r}, this run {v!r}"
            for k, v in (("format", CHECKPOINT_FORMAT), ("world_size", size))
            if state.get(k) != v
        ]
        if state.get("dataset", {}).get("content_hash") != dataset["content_hash"]:
            problems.append("the dataset content hash differs")
        resume_state = {"error": "; ".join(problems)} if problems else state
    resume_state = hvd.broadcast_object(resume_state, root_rank=0, name="resume")  # Horovod
    if resume_state is not None:
        if "error" in resume_state:
            raise TrainingError(f"cannot resume from {ckpt_uri}: {resume_state['error']}")
        model.load_state_dict(resume_state["model"])
        optimizer.load_state_dict(resume_state["optimizer"])
        start_epoch, history = int(resume_state["epoch"]), list(resume_state["history"])
        if rank == 0:
            print(f"resuming from {ckpt_uri} after epoch {start_epoch}", flush=True)

    # Horovod: average gradients in step(); start every rank from rank 0's state.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    n = x_train.shape[0]
    per_rank = n // size  # the same number of samples, so of steps, on every rank
    if per_rank < 1:
        raise TrainingError(f"{n} training samples cannot be shared by {size} ranks")
    t0, t1 = rank * len(x_test) // size, (rank + 1) * len(x_test) // size
    for epoch in range(start_epoch, args.epochs):
        epoch_start = time.perf_counter()
        model.train()
        order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + epoch))
        shard = order[rank * per_rank : (rank + 1) * per_rank]  # this rank's disjoint part
        local = torch.zeros(2, dtype=torch.float64)
        for i in range(0, per_rank, args.batch_size):
            idx = shard[i : i + args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            local += torch.tensor([float(loss.detach()) * len(idx), len(idx)], dtype=torch.float64)
        train = hvd.allreduce(local, op=hvd.Sum, name=f"train.{epoch}")  # Horovod
        val = hvd.allreduce(  # Horovod: exact sums over the whole test split
            evaluate(model, x_test[t0:t1], y_test[t0:t1]), op=hvd.Sum, name=f"val.{epoch}"
        )
        loss_sum, correct, count = (float(v) for v in val)
        if int(count) != len(x_test):
            raise TrainingError(f"scored {int(count)} test samples, the split has {len(x_test)}")
        entry = {
            "epoch": epoch + 1,
            "train_loss": float(train[0] / train[1]),
            "val_loss": loss_sum / count,
            "val_accuracy": correct / count,
            "val_correct": int(correct),
            "val_samples": int(count),
            "epoch_seconds": round(time.perf_counter() - epoch_start, 3),
        }
        history.append(entry)
        if rank == 0:  # rank 0 alone writes
            buf = io.BytesIO()
            torch.save(
                {
                    "format": CHECKPOINT_FORMAT,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch + 1,
                    "history": history,
                    "world_size": size,
                    "dataset": dataset,
                    "preprocessing": pre,
                },
                buf,
            )
            storage.write_bytes(ckpt_uri, buf.getvalue())
            print(event_line(EVENT_EPOCH, {"of_epochs": args.epochs, **entry}), flush=True)

    if rank != 0:
        return None
    last = history[-1] if history else {}
    metrics = {
        "model": MODEL_NAME,
        "val_accuracy": last.get("val_accuracy"),
        "val_loss": last.get("val_loss"),
        "val_correct": last.get("val_correct"),
        "val_samples": last.get("val_samples"),
        "epochs": len(history),
        "world_size": size,
        "history": history,
        "preprocessing": pre,  # what the model expects; the export puts it into the ONNX file
        "dataset": dataset,
        "config": {k: v for k, v in vars(args).items() if k not in ("data", "output", "resume")},
        "versions": versions(),
        "train_seconds": round(time.perf_counter() - start, 3),
        "artifacts": {"checkpoint": ckpt_uri, "metrics": storage.join(args.output, METRICS_NAME)},
    }
    storage.write_text(metrics["artifacts"]["metrics"], METRICS.dumps(metrics))
    print(event_line(EVENT_FINAL_METRICS, metrics), flush=True)
    return metrics


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except Exception as e:  # one line naming the failure, then a non-zero exit
        print(f"examples.waveforms.train: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
