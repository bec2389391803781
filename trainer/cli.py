"""Command line of the trainer: ``python -m horovod_airflow.trainer {train,export,doctor}``.

Train with 2 ranks on this machine (CPU or one GPU per rank)::

    horovodrun -np 2 -H localhost:2 python -m horovod_airflow.trainer train \\
        --data s3://bucket/datasets/mnist/<hash16> --output s3://bucket/runs/<dag_id>/<run_id>

on 2 nodes with 4 GPUs each::

    horovodrun -np 8 -H node1:4,node2:4 python -m horovod_airflow.trainer train --data ... --output
    ...

Export the checkpoint to ONNX and check it against PyTorch::

    python -m horovod_airflow.trainer export --checkpoint s3://.../checkpoint.pt --output s3://.../onnx

Check that N ranks can start here::

    python -m horovod_airflow.trainer doctor --np 2 [--gpus-per-proc 1] [--json]

``--data`` and ``--output`` take ``s3://bucket/prefix`` (credentials and endpoint from the
standard AWS_* environment variables) or a local folder.

Exit codes (``horovod_airflow.core.contract``): 0 done; 2 a bad command line; 3 refused, no
retry can fix it (a checkpoint of other settings, data or world size; a staged dataset that
fails its checks; an export whose parity fails); 1 any other failure (retried by Airflow).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from horovod_airflow.core import train_config as options
from horovod_airflow.core.contract import EVENT_EXPORTED, EXIT_REFUSED, event_line
from horovod_airflow.core.train_config import ConfigError, TrainConfig


def _help(name: str) -> str:
    """An option's ``--help`` line, from its declaration: choices, what it allows, default."""
    o = options.OPTIONS[name]
    typ, _ = options.TYPES[name]
    text = o.help.replace("%", "%%")
    if typ is bool:
        return text
    choices = o.choice_values()
    if choices:
        text = f"{'|'.join(choices)}: {text}"
    elif typ in (int, float):
        text += f"; {options.allowed(name)}"
    if options.default(name) not in (None, "", dataclasses.MISSING):
        text += " (default %(default)s)"
    return text


def add_train_options(parser: argparse.ArgumentParser) -> None:
    """One flag per ``TrainConfig`` field, in its declared group: ``--batch-size`` for
    ``batch_size``, typed by the field, defaulting to the field's default, required when the
    field has none; a bool field is an on/off switch (off by default). The values are checked
    by ``TrainConfig`` itself, so the command line and direct construction refuse alike."""
    groups = {g: parser.add_argument_group(g) for g in options.GROUPS}
    for name, o in options.OPTIONS.items():
        typ, _ = options.TYPES[name]
        fallback = options.default(name)
        group = groups[o.group]
        if typ is bool:
            if fallback is not False:
                raise TypeError(f"{name}: a switch must default to False, not {fallback!r}")
            group.add_argument(options.flag(name), dest=name, action="store_true", help=_help(name))
        elif fallback is dataclasses.MISSING:
            group.add_argument(
                options.flag(name), dest=name, type=typ, required=True, help=_help(name)
            )
        else:
            group.add_argument(
                options.flag(name), dest=name, type=typ, default=fallback, help=_help(name)
            )


def _train_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="train (run under horovodrun: one process per rank)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_options(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m horovod_airflow.trainer",
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
    """The ``TrainConfig`` of parsed ``train`` arguments; ``ConfigError`` names a bad value."""
    return TrainConfig(**{name: getattr(args, name) for name in options.OPTIONS})


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        try:
            config = config_from_args(args)
        except ConfigError as e:
            parser.exit(2, f"python -m horovod_airflow.trainer train: error: {e}\n")
        from horovod_airflow.core.layout import DatasetError
        from horovod_airflow.core.storage import StorageError
        from horovod_airflow.trainer.errors import ResumeMismatchError, TrainingError
        from horovod_airflow.trainer.train import run

        try:
            run(config)
        except (DatasetError, TrainingError, StorageError) as e:
            print(f"trainer: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            # a retry meets the same checkpoint or data: refuse (the operator does not retry)
            return EXIT_REFUSED if isinstance(e, ResumeMismatchError | DatasetError) else 1
        return 0
    if args.command == "export":
        if args.samples < 1:
            parser.exit(
                2,
                f"python -m horovod_airflow.trainer export: error: --samples: an integer >= 1, "
                f"got {args.samples}\n",
            )
        from horovod_airflow.core.layout import DatasetError
        from horovod_airflow.core.storage import StorageError
        from horovod_airflow.trainer.errors import TrainingError
        from horovod_airflow.trainer.export import ParityError, run_export

        try:
            report = run_export(
                args.checkpoint, args.output, args.data, args.samples, args.cache_dir
            )
        except (ParityError, DatasetError, TrainingError, StorageError) as e:
            print(f"trainer export: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return EXIT_REFUSED if isinstance(e, ParityError | DatasetError) else 1
        print(event_line(EVENT_EXPORTED, report), flush=True)
        return 0
    from horovod_airflow.trainer.doctor import diagnose, format_report

    report = diagnose(args.np_, args.gpus_per_proc)
    print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
