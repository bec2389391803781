"""The one settings object of a training run: typed, frozen, validated, saved with every artifact.

``TrainConfig`` is built from the command line before Horovod starts any work, so a bad value
stops every rank with one clear message (exit code 2). It holds only JSON-able primitives:
it is stored as a plain dict in ``checkpoint.pt`` (loadable with ``weights_only=True``) and in
``metrics.json``, so every artifact says how it was made.

Each option is declared once, here: a field of ``TrainConfig`` whose metadata (an ``Option``)
holds its help text, ``--help`` group, choices or bounds and form title. From that one
declaration come the ``trainer train`` command line (``horovod_airflow.trainer.cli``), the checks of
``TrainConfig.__post_init__``, the JSON-schema fragments of the Airflow Params that feed these
options (``param_schema``) and the check of ``trainer_args`` keys
(``check_trainer_arg_keys``, used by ``horovod_airflow.operators.command.trainer_args_to_argv``).
This module imports neither torch nor Airflow (the Airflow image imports it).

Defaults are the recipe chosen by measurement for 2 CPU ranks on full MNIST: the BatchNorm CNN
``mnist_bn``, Adam, per-rank batch 64, base lr 3e-3 scaled linearly by world size, a short
linear warmup then cosine decay to 0, one epoch. ``python -m bench.one_epoch`` compares it with
the alternatives (the demo's CNN, batch, lr, float32) and ``python -m bench.time_to_accuracy``
with the demo's recipe; the figures are in ``bench/results/``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

OPTIMIZERS = ("adam", "adamw", "sgd")
LR_SCALINGS = ("linear", "sqrt", "none")
LR_SCHEDULES = ("cosine", "constant")
PRECISIONS = ("auto", "fp32", "bf16")
CHANNELS_LAST = ("auto", "on", "off")
RESUME_MISMATCHES = ("error", "fresh")
# Settings that do not change what a run computes (where it reads and writes, how it logs):
# a resume compares every other field with the checkpoint's (the dataset by content hash).
# Settings a resume may change: where things are and what is logged, and target_accuracy
# (where to stop, not what any step computes: a resume may raise it to train on).
NOT_RESULT_FIELDS = frozenset(
    (
        "data",
        "output",
        "resume",
        "resume_mismatch",
        "cache_dir",
        "log_interval",
        "progress_seconds",
        "debug_param_hash",
        "target_accuracy",
    )
)

#: The groups of ``python -m horovod_airflow.trainer train --help``, in the order shown.
IO = "data and artifacts"
OPT = "model and optimization"
HVD = "horovod"
SPEED = "speed"
DIAG = "diagnostics"
GROUPS = (IO, OPT, HVD, SPEED, DIAG)


class ConfigError(ValueError):
    """A setting is out of its allowed range; the message names the option and the range."""


def _model_names() -> tuple[str, ...]:
    from horovod_airflow.trainer.model import (
        MODELS,  # torch-free at import; read when a model is checked
    )

    return tuple(sorted(MODELS))


@dataclass(frozen=True)
class Option:
    """The declaration of one ``TrainConfig`` field as an option: everything but its type and
    default (the field's own). ``maximum`` may name another field (``warmup_epochs`` is at most
    ``epochs``); ``choices`` may be a function, read when needed (the model names)."""

    help: str
    group: str
    title: str = ""  # the label of a form field (Airflow Param); default: from the name
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] = ()
    minimum: int | float | None = None
    maximum: int | float | str | None = None
    exclusive_minimum: bool = False  # minimum < value instead of minimum <= value
    exclusive_maximum: bool = False  # value < maximum instead of value <= maximum
    min_length: int = 0  # for strings: at least this many characters
    allowed: str = ""  # what a valid value is, where bounds and choices cannot say it

    def choice_values(self) -> tuple[str, ...]:
        return self.choices() if callable(self.choices) else self.choices


def option(help: str, group: str, **declared: Any) -> dict[str, Option]:
    """A field's metadata: ``field(default=1, metadata=option("...", OPT, minimum=1))``."""
    return {"option": Option(help, group, **declared)}


@dataclass(frozen=True)
class TrainConfig:
    data: str = field(
        metadata=option(
            "staged dataset: s3://bucket/prefix or a local folder holding manifest.json",
            IO,
            min_length=1,
            allowed="a dataset URI (s3://bucket/prefix or a folder)",
        )
    )
    output: str = field(
        metadata=option(
            "where checkpoint.pt and metrics.json go: s3://bucket/prefix or a local folder",
            IO,
            min_length=1,
            allowed="an output URI (s3://bucket/prefix or a folder)",
        )
    )
    model: str = field(
        default="mnist_bn",
        metadata=option(
            "the network (horovod_airflow.trainer.model.MODELS; mnist_cnn: the demo's CNN)",
            OPT,
            choices=_model_names,
        ),
    )
    epochs: int = field(
        default=1,
        metadata=option(
            "total epochs of the run (a resumed run ends at the same total)",
            OPT,
            title="Epochs",
            minimum=1,
            maximum=1000,
        ),
    )
    target_accuracy: float | None = field(
        default=None,
        metadata=option(
            "stop after the first epoch whose allreduced validation accuracy is at least this "
            "fraction (e.g. 0.99; unset: run all --epochs); every rank sees the same number, "
            "so all stop together",
            OPT,
            title="Target accuracy",
            minimum=0,
            exclusive_minimum=True,
            maximum=1,
        ),
    )
    batch_size: int = field(
        default=64,
        metadata=option(
            "samples per rank per backward pass",
            OPT,
            title="Batch size per rank",
            minimum=1,
            maximum=65536,
        ),
    )
    lr: float = field(
        default=3e-3,
        metadata=option(
            "base learning rate for one rank, before world-size scaling (--lr-scaling)",
            OPT,
            title="Learning rate",
            minimum=0,
            exclusive_minimum=True,
            maximum=10,
        ),
    )
    lr_scaling: str = field(
        default="linear",
        metadata=option(
            "how the lr grows with world size N: x N (linear), x sqrt N (sqrt) or not (none)",
            OPT,
            choices=LR_SCALINGS,
        ),
    )
    lr_schedule: str = field(
        default="cosine",
        metadata=option(
            "after warmup: cosine decay to 0 by the last step, or constant",
            OPT,
            choices=LR_SCHEDULES,
        ),
    )
    warmup_epochs: float = field(
        default=0.1,
        metadata=option(
            "linear warmup from ~0 to the scaled lr over this many epochs",
            OPT,
            minimum=0,
            maximum="epochs",
        ),
    )
    optimizer: str = field(
        default="adam",
        metadata=option(
            "the optimizer (sgd: momentum 0.9, nesterov)",
            OPT,
            choices=OPTIMIZERS,
        ),
    )
    weight_decay: float = field(
        default=0.0,
        metadata=option(
            "L2 (adam, sgd) or decoupled (adamw) weight decay",
            OPT,
            minimum=0,
            maximum=1,
            exclusive_maximum=True,
        ),
    )
    seed: int = field(
        default=42,
        metadata=option(
            "seeds the weights (rank 0's are broadcast), the data order and dropout",
            OPT,
            minimum=0,
            maximum=2**31,
            exclusive_maximum=True,
        ),
    )
    max_train_samples: int = field(
        default=0,
        metadata=option(
            "train on only the first N training samples, a deterministic subset for smoke "
            "runs (0 = all)",
            IO,
            title="Training samples",
            minimum=0,
        ),
    )
    max_val_samples: int = field(
        default=0,
        metadata=option("evaluate on only the first N test samples (0 = all)", IO, minimum=0),
    )
    resume: bool = field(
        default=False,
        metadata=option(
            "continue from <output>/checkpoint.pt (with every rank's RNG state) when it was "
            "made by this run: same dataset content, world size and training settings",
            IO,
        ),
    )
    resume_mismatch: str = field(
        default="error",
        metadata=option(
            "when --resume finds a checkpoint made another way, stop naming each difference "
            "(error), or ignore it and train from scratch (fresh)",
            IO,
            choices=RESUME_MISMATCHES,
        ),
    )
    fp16_allreduce: bool = field(
        default=False,
        metadata=option("compress gradients to fp16 for the allreduce", HVD),
    )
    adasum: bool = field(
        default=False,
        metadata=option("reduce gradients with Adasum instead of averaging", HVD),
    )
    backward_passes_per_step: int = field(
        default=1,
        metadata=option(
            "micro-batches accumulated locally before each allreduce",
            HVD,
            minimum=1,
            maximum=1024,
        ),
    )
    precision: str = field(
        default="auto",
        metadata=option(
            "bf16 autocast (fp32 master weights) or fp32; auto = bf16 only on hardware with "
            "native bf16",
            SPEED,
            choices=PRECISIONS,
        ),
    )
    channels_last: str = field(
        default="auto",
        metadata=option(
            "NHWC memory format for convolutions; auto = on only for bf16 on CUDA",
            SPEED,
            choices=CHANNELS_LAST,
        ),
    )
    cache_dir: str = field(
        default="",
        metadata=option(
            "per-node dataset cache (default $HVA_CACHE_DIR or ~/.cache/horovod-airflow)", IO
        ),
    )
    eval_batch_size: int = field(
        default=1000,
        metadata=option(
            "samples per rank per evaluation forward pass", SPEED, minimum=1, maximum=65536
        ),
    )
    log_interval: int = field(
        default=50,
        metadata=option(
            "rank 0 logs the training loss every N optimizer steps (0 = never)", DIAG, minimum=0
        ),
    )
    progress_seconds: int = field(
        default=15,
        metadata=option(
            "rank 0 prints a progress event (step, epoch, samples/s, ETA) every N seconds",
            DIAG,
            minimum=1,
            maximum=30,
        ),
    )
    debug_param_hash: bool = field(
        default=False,
        metadata=option(
            "each rank prints its parameter hash after the broadcast and after step 1", DIAG
        ),
    )

    def __post_init__(self) -> None:
        for name in OPTIONS:
            check_option(name, getattr(self, name), self)

    def to_dict(self) -> dict[str, Any]:
        """Plain primitives only (stored in checkpoint.pt and metrics.json)."""
        return dataclasses.asdict(self)

    def result_fields(self) -> dict[str, Any]:
        """The fields that determine what the run computes (all but ``NOT_RESULT_FIELDS``)."""
        return {k: v for k, v in self.to_dict().items() if k not in NOT_RESULT_FIELDS}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Rebuild from a saved dict, ignoring fields this version does not know."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


#: Every option of ``trainer train``, by field name, in declaration order.
OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in dataclasses.fields(TrainConfig)}
#: Each option's dataclass field (its default, or MISSING when the option is required).
FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _value_type(annotation: Any) -> tuple[type, bool]:
    """``int`` → (int, False); ``float | None`` → (float, True)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


#: Each option's value type and whether it may be None (unset).
TYPES: dict[str, tuple[type, bool]] = {
    name: _value_type(hint) for name, hint in typing.get_type_hints(TrainConfig).items()
}
_NOUNS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def flag(name: str) -> str:
    """The command-line flag of an option: ``batch_size`` → ``--batch-size``."""
    return "--" + name.replace("_", "-")


def default(name: str) -> Any:
    """An option's default (``dataclasses.MISSING`` for a required one)."""
    return FIELDS[name].default


def _number(x: int | float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def allowed(name: str, config: TrainConfig | None = None) -> str:
    """What values an option allows, in words: ``an integer in [1, 1000]``. A bound that names
    another field shows that field's value when ``config`` is given (``[0, epochs=2]``)."""
    o = OPTIONS[name]
    typ, nullable = TYPES[name]
    choices = o.choice_values()
    if o.allowed:
        text = o.allowed
    elif choices:
        text = "one of " + ", ".join(repr(c) for c in choices)
    elif typ in (int, float) and (o.minimum is not None or o.maximum is not None):
        hi: str | None = None
        if isinstance(o.maximum, str):
            hi = o.maximum if config is None else f"{o.maximum}={getattr(config, o.maximum)}"
        elif o.maximum is not None:
            hi = _number(o.maximum)
        lo = None if o.minimum is None else _number(o.minimum)
        if lo is not None and hi is not None:
            left = "(" if o.exclusive_minimum else "["
            right = ")" if o.exclusive_maximum else "]"
            text = f"{_NOUNS[typ]} in {left}{lo}, {hi}{right}"
        elif lo is not None:
            text = f"{_NOUNS[typ]} {'>' if o.exclusive_minimum else '>='} {lo}"
        else:
            text = f"{_NOUNS[typ]} {'<' if o.exclusive_maximum else '<='} {hi}"
    elif typ is str and o.min_length:
        text = f"a string of at least {o.min_length} characters"
    else:
        text = _NOUNS[typ]
    return text + (", or unset" if nullable else "")


def _within(name: str, value: Any, config: TrainConfig | None) -> bool:
    o = OPTIONS[name]
    typ, nullable = TYPES[name]
    if value is None:
        return nullable
    if typ is bool:
        return isinstance(value, bool)
    if typ is str:
        if not isinstance(value, str) or len(value) < o.min_length:
            return False
        choices = o.choice_values()
        return not choices or value in choices
    if isinstance(value, bool) or not isinstance(value, int if typ is int else int | float):
        return False
    if not math.isfinite(value):
        return False
    lo = o.minimum
    if lo is not None and (value < lo or (o.exclusive_minimum and value == lo)):
        return False
    hi = o.maximum
    if isinstance(hi, str):
        hi = None if config is None else getattr(config, hi)
    return hi is None or not (value > hi or (o.exclusive_maximum and value == hi))


def check_option(name: str, value: Any, config: TrainConfig | None = None) -> None:
    """Raise ``ConfigError`` naming the option and what it allows unless ``value`` is allowed.
    A bound naming another field is checked only with ``config``."""
    if not _within(name, value, config):
        raise ConfigError(f"{flag(name)}: {allowed(name, config)}, got {value!r}")


def param_schema(name: str, *, nullable: bool = False) -> dict[str, Any]:
    """The JSON schema of one option for a form field (an Airflow ``Param``): type, bounds or
    ``enum``, ``title`` and ``description``. ``nullable``: the field may be left empty (the
    trainer's default then applies, and the form says so). A bound that names another field
    is left to the trainer. ``Param(None, **param_schema("epochs", nullable=True))``."""
    if name not in OPTIONS:
        raise KeyError(f"{name!r} is not an option of trainer train; known: {', '.join(OPTIONS)}")
    o = OPTIONS[name]
    typ, _ = TYPES[name]
    kind = _JSON_TYPES[typ]
    schema: dict[str, Any] = {"type": ["null", kind] if nullable else kind}
    choices = o.choice_values()
    if choices:
        schema["enum"] = [*choices, None] if nullable else list(choices)
    if o.minimum is not None:
        schema["exclusiveMinimum" if o.exclusive_minimum else "minimum"] = o.minimum
    if o.maximum is not None and not isinstance(o.maximum, str):
        schema["exclusiveMaximum" if o.exclusive_maximum else "maximum"] = o.maximum
    if o.min_length:
        schema["minLength"] = o.min_length
    schema["title"] = o.title or name.replace("_", " ").capitalize()
    description = o.help[0].upper() + o.help[1:] + "."
    if nullable:
        fallback = default(name)
        shown = "" if fallback in (None, "", dataclasses.MISSING) else f" ({fallback})"
        description += f" Empty: the trainer's default{shown}."
    schema["description"] = description
    return schema


def check_trainer_arg_keys(keys: Iterable[str], *, set_by_caller: Iterable[str] = ()) -> None:
    """Raise ``ConfigError`` for a key that is not an option name (``batch_size``), naming
    the known ones; ``set_by_caller``: options the caller sets itself, refused as keys."""
    reserved = set(set_by_caller)
    known = [n for n in OPTIONS if n not in reserved]
    for key in keys:
        if key in reserved:
            raise ConfigError(
                f"{key!r} is set by the operator itself, not through trainer_args "
                f"(the keys it sets: {', '.join(sorted(reserved))})"
            )
        if key not in OPTIONS:
            raise ConfigError(
                f"{key!r} is not an option of `python -m horovod_airflow.trainer train`; "
                f"known: {', '.join(known)}"
            )


def scaled_lr(config: TrainConfig, world_size: int) -> float:
    """The peak learning rate: the base lr scaled by world size per ``lr_scaling``."""
    if config.lr_scaling == "linear":
        return config.lr * world_size
    if config.lr_scaling == "sqrt":
        return config.lr * math.sqrt(world_size)
    return config.lr


def lr_at(config: TrainConfig, world_size: int, step: int, steps_per_epoch: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then the schedule."""
    peak = scaled_lr(config, world_size)
    total = max(1, config.epochs * steps_per_epoch)
    warmup = round(config.warmup_epochs * steps_per_epoch)
    if step < warmup:
        return peak * (step + 1) / warmup
    if config.lr_schedule == "constant" or total <= warmup:
        return peak
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
