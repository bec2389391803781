"""Command line of the trainer: ``python -m trainer {train,export,doctor}``.

Train with 2 ranks on this machine (CPU or one GPU per rank)::

    horovodrun -np 2 -H localhost:2 python -m trainer train \\
        --data s3://bucket/datasets/mnist/<hash16> --output s3://bucket/runs/<dag_id>/<run_id>

on 2 nodes with 4 GPUs each::

    horovodrun -np 8 -H node1:4,node2:4 python -m trainer train --data ... --output ...

Export the checkpoint to ONNX and check it against PyTorch::

    python -m trainer export --checkpoint s3://.../checkpoint.pt --output s3://.../onnx

Check that N ranks can start here::

    python -m trainer doctor --np 2 [--gpus-per-proc 1] [--json]

``--data`` and ``--output`` take ``s3://bucket/prefix`` (credentials and endpoint from the
standard AWS_* environment variables) or a local folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from trainer.config import (
    CHANNELS_LAST,
    LR_SCALINGS,
    LR_SCHEDULES,
    OPTIMIZERS,
    PRECISIONS,
    RESUME_MISMATCHES,
    ConfigError,
    TrainConfig,
)

_DEFAULTS = {
    f: getattr(TrainConfig, f) for f in TrainConfig.__dataclass_fields__ if hasattr(TrainConfig, f)
}


def _train_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    d = _DEFAULTS
    p = sub.add_parser(
        "train",
        help="train (run under horovodrun: one process per rank)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    io = p.add_argument_group("data and artifacts")
    io.add_argument("--data", required=True, help="staged dataset: s3://bucket/prefix or folder")
    io.add_argument("--output", required=True, help="where checkpoint.pt and metrics.json go")
    io.add_argument(
        "--cache-dir",
        default="",
        help="per-node dataset cache (default $HVA_CACHE_DIR or ~/.cache/horovod-airflow)",
    )
    io.add_argument(
        "--resume",
        action="store_true",
        help="continue from <output>/checkpoint.pt (with every rank's RNG state) when it was "
        "made by this run: same dataset content, world size and training settings",
    )
    io.add_argument(
        "--resume-mismatch",
        default=d["resume_mismatch"],
        help=f"{'|'.join(RESUME_MISMATCHES)}: when --resume finds a checkpoint made another way, "
        "stop naming each difference (error), or ignore it and train from scratch (fresh); "
        "default %(default)s",
    )
    io.add_argument(
        "--max-train-samples",
        type=int,
        default=d["max_train_samples"],
        help="use the first N training samples (0 = all)",
    )
    io.add_argument(
        "--max-val-samples",
        type=int,
        default=d["max_val_samples"],
        help="evaluate on the first N test samples (0 = all)",
    )
    opt = p.add_argument_group("model and optimization")
    opt.add_argument("--model", default=d["model"], help="model name (default %(default)s)")
    opt.add_argument(
        "--epochs", type=int, default=d["epochs"], help="total epochs (default %(default)s)"
    )
    opt.add_argument(
        "--target-accuracy",
        type=float,
        default=None,
        help="stop after the first epoch whose allreduced validation accuracy is at least this "
        "fraction (e.g. 0.99); every rank sees the same number, so all stop together "
        "(default: run all --epochs)",
    )
    opt.add_argument(
        "--batch-size",
        type=int,
        default=d["batch_size"],
        help="per-rank batch (default %(default)s)",
    )
    opt.add_argument(
        "--lr", type=float, default=d["lr"], help="base lr for one rank (default %(default)s)"
    )
    opt.add_argument(
        "--lr-scaling",
        default=d["lr_scaling"],
        help=f"lr x world size: {'|'.join(LR_SCALINGS)} (default %(default)s)",
    )
    opt.add_argument(
        "--lr-schedule",
        default=d["lr_schedule"],
        help=f"{'|'.join(LR_SCHEDULES)} after warmup (default %(default)s)",
    )
    opt.add_argument(
        "--warmup-epochs",
        type=float,
        default=d["warmup_epochs"],
        help="linear warmup length (default %(default)s)",
    )
    opt.add_argument(
        "--optimizer", default=d["optimizer"], help=f"{'|'.join(OPTIMIZERS)} (default %(default)s)"
    )
    opt.add_argument(
        "--weight-decay", type=float, default=d["weight_decay"], help="(default %(default)s)"
    )
    opt.add_argument("--seed", type=int, default=d["seed"], help="(default %(default)s)")
    hv = p.add_argument_group("horovod")
    hv.add_argument(
        "--fp16-allreduce", action="store_true", help="compress gradients to fp16 for the allreduce"
    )
    hv.add_argument(
        "--adasum", action="store_true", help="reduce gradients with Adasum instead of averaging"
    )
    hv.add_argument(
        "--backward-passes-per-step",
        type=int,
        default=d["backward_passes_per_step"],
        help="local accumulation before each allreduce (default %(default)s)",
    )
    sp = p.add_argument_group("speed")
    sp.add_argument(
        "--precision",
        default=d["precision"],
        help=f"{'|'.join(PRECISIONS)}: bf16 autocast, fp32 weights; auto = bf16 only on "
        "hardware with native bf16 (default %(default)s)",
    )
    sp.add_argument(
        "--channels-last",
        default=d["channels_last"],
        help=f"{'|'.join(CHANNELS_LAST)} (default %(default)s)",
    )
    sp.add_argument(
        "--eval-batch-size", type=int, default=d["eval_batch_size"], help="(default %(default)s)"
    )
    dbg = p.add_argument_group("diagnostics")
    dbg.add_argument(
        "--log-interval", type=int, default=d["log_interval"], help="log every N steps (0 = never)"
    )
    dbg.add_argument(
        "--debug-param-hash",
        action="store_true",
        help="each rank prints its parameter hash after the broadcast and after step 1",
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,export,doctor}")
    _train_parser(sub)
    ex = sub.add_parser("export", help="checkpoint -> model.onnx + parity.json")
    ex.add_argument("--checkpoint", required=True, help="checkpoint.pt URI")
    ex.add_argument("--output", required=True, help="folder URI for model.onnx and parity.json")
    ex.add_argument(
        "--data", default="", help="staged dataset for parity images (default: the checkpoint's)"
    )
    ex.add_argument(
        "--samples", type=int, default=1000, help="test images for parity (default %(default)s)"
    )
    ex.add_argument("--cache-dir", default="", help="dataset cache (as for train)")
    dr = sub.add_parser("doctor", help="can N ranks start here?")
    dr.add_argument(
        "--np", type=int, default=1, dest="np_", help="ranks to start (default %(default)s)"
    )
    dr.add_argument(
        "--gpus-per-proc", type=int, default=0, help="GPUs per rank (default %(default)s)"
    )
    dr.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        data=args.data,
        output=args.output,
        model=args.model,
        epochs=args.epochs,
        target_accuracy=args.target_accuracy,
        batch_size=args.batch_size,
        lr=args.lr,
        lr_scaling=args.lr_scaling,
        lr_schedule=args.lr_schedule,
        warmup_epochs=args.warmup_epochs,
        optimizer=args.optimizer,
        weight_decay=args.weight_decay,
        seed=args.seed,
        max_train_samples=args.max_train_samples,
        max_val_samples=args.max_val_samples,
        resume=args.resume,
        resume_mismatch=args.resume_mismatch,
        fp16_allreduce=args.fp16_allreduce,
        adasum=args.adasum,
        backward_passes_per_step=args.backward_passes_per_step,
        precision=args.precision,
        channels_last=args.channels_last,
        cache_dir=args.cache_dir,
        eval_batch_size=args.eval_batch_size,
        log_interval=args.log_interval,
        debug_param_hash=args.debug_param_hash,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        try:
            config = config_from_args(args)
        except ConfigError as e:
            parser.exit(2, f"python -m trainer train: error: {e}\n")
        from trainer.layout import DatasetError
        from trainer.storage import StorageError
        from trainer.train import TrainingError, run

        try:
            run(config)
        except (DatasetError, TrainingError, StorageError) as e:
            print(f"trainer: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return 1
        return 0
    if args.command == "export":
        if args.samples < 1:
            parser.exit(
                2,
                f"python -m trainer export: error: --samples: an integer >= 1, "
                f"got {args.samples}\n",
            )
        from trainer.export import ParityError, run_export
        from trainer.layout import DatasetError
        from trainer.storage import StorageError
        from trainer.train import TrainingError

        try:
            report = run_export(
                args.checkpoint, args.output, args.data, args.samples, args.cache_dir
            )
        except (ParityError, DatasetError, TrainingError, StorageError) as e:
            print(f"trainer export: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return 1
        print(json.dumps({"event": "export", **report}), flush=True)
        return 0
    from trainer.doctor import diagnose, format_report

    report = diagnose(args.np_, args.gpus_per_proc)
    print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
