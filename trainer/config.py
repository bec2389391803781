"""The one settings object of a training run: typed, frozen, validated, saved with every artifact.

``TrainConfig`` is built from the command line before Horovod starts any work, so a bad value
stops every rank with one clear message (exit code 2). It holds only JSON-able primitives:
it is stored as a plain dict in ``checkpoint.pt`` (loadable with ``weights_only=True``) and in
``metrics.json``, so every artifact says how it was made.

Defaults are the measured recipe for 2 CPU ranks on full MNIST: the BatchNorm CNN
``mnist_bn``, Adam, per-rank batch 64, base lr 3e-3 scaled linearly by world size, a short
linear warmup then cosine decay to 0, one epoch. ``python -m bench.one_epoch`` measures it on
three seeds against the alternatives (the demo's CNN, batch, lr, float32), and
``python -m bench.time_to_accuracy`` against the demo's recipe; the figures are in
``bench/results/``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
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
        "debug_param_hash",
        "target_accuracy",
    )
)


class ConfigError(ValueError):
    """A setting is out of its allowed range; the message names the option and the range."""


@dataclass(frozen=True)
class TrainConfig:
    data: str  # staged dataset URI: s3://bucket/prefix or a local folder holding manifest.json
    output: str  # where checkpoint.pt and metrics.json go: s3://bucket/prefix or a local folder
    model: str = "mnist_bn"  # name in trainer.model.MODELS (mnist_cnn: the demo's CNN)
    epochs: int = 1  # total epochs of the run (a resumed run ends at the same total)
    # stop after the first epoch whose allreduced validation accuracy reaches this (None: off)
    target_accuracy: float | None = None
    batch_size: int = 64  # samples per rank per backward pass
    lr: float = 3e-3  # base learning rate for one rank, before --lr-scaling
    lr_scaling: str = "linear"  # how lr grows with world size: linear (x N), sqrt (x sqrt N), none
    lr_schedule: str = "cosine"  # after warmup: cosine decay to 0 by the last step, or constant
    warmup_epochs: float = 0.1  # linear warmup from ~0 to the scaled lr over this many epochs
    optimizer: str = "adam"  # adam | adamw | sgd (momentum 0.9, nesterov)
    weight_decay: float = 0.0  # L2 (adam, sgd) or decoupled (adamw) weight decay
    seed: int = 42  # seeds weights (rank 0's are broadcast), data order and dropout
    max_train_samples: int = 0  # use only the first N training samples (0 = all)
    max_val_samples: int = 0  # evaluate on only the first N test samples (0 = all)
    resume: bool = False  # continue from <output>/checkpoint.pt when it exists (and matches)
    resume_mismatch: str = "error"  # checkpoint made another way: error | fresh (train anew)
    fp16_allreduce: bool = False  # compress gradients to fp16 for the allreduce
    adasum: bool = False  # reduce gradients with Adasum instead of averaging
    backward_passes_per_step: int = 1  # micro-batches accumulated locally before one allreduce
    precision: str = "auto"  # fp32 | bf16 autocast (fp32 master weights) | auto (by hardware)
    channels_last: str = "auto"  # NHWC memory format for convolutions: on | off | auto
    cache_dir: str = ""  # per-node dataset cache ('' = $HVA_CACHE_DIR or ~/.cache/horovod-airflow)
    eval_batch_size: int = 1000  # samples per rank per evaluation forward pass
    log_interval: int = 50  # rank 0 logs the training loss every N optimizer steps (0 = never)
    debug_param_hash: bool = False  # each rank prints its parameter hash after broadcast and step 1

    def __post_init__(self) -> None:
        from trainer.model import MODELS

        def need(ok: bool, option: str, allowed: str, value: Any) -> None:
            if not ok:
                raise ConfigError(f"--{option}: {allowed}, got {value!r}")

        need(bool(self.data), "data", "a dataset URI (s3://bucket/prefix or a folder)", self.data)
        need(
            bool(self.output),
            "output",
            "an output URI (s3://bucket/prefix or a folder)",
            self.output,
        )
        need(self.model in MODELS, "model", f"one of {', '.join(sorted(MODELS))}", self.model)
        need(1 <= self.epochs <= 1000, "epochs", "an integer in [1, 1000]", self.epochs)
        need(
            self.target_accuracy is None or 0.0 < self.target_accuracy <= 1.0,
            "target-accuracy",
            "a fraction in (0, 1] (e.g. 0.99), or unset",
            self.target_accuracy,
        )
        need(
            1 <= self.batch_size <= 65536, "batch-size", "an integer in [1, 65536]", self.batch_size
        )
        need(math.isfinite(self.lr) and 0 < self.lr <= 10, "lr", "a number in (0, 10]", self.lr)
        need(self.lr_scaling in LR_SCALINGS, "lr-scaling", f"one of {LR_SCALINGS}", self.lr_scaling)
        need(
            self.lr_schedule in LR_SCHEDULES,
            "lr-schedule",
            f"one of {LR_SCHEDULES}",
            self.lr_schedule,
        )
        need(
            math.isfinite(self.warmup_epochs) and 0 <= self.warmup_epochs <= self.epochs,
            "warmup-epochs",
            f"a number in [0, epochs={self.epochs}]",
            self.warmup_epochs,
        )
        need(self.optimizer in OPTIMIZERS, "optimizer", f"one of {OPTIMIZERS}", self.optimizer)
        need(
            math.isfinite(self.weight_decay) and 0 <= self.weight_decay < 1,
            "weight-decay",
            "a number in [0, 1)",
            self.weight_decay,
        )
        need(0 <= self.seed < 2**31, "seed", "an integer in [0, 2**31)", self.seed)
        need(
            self.max_train_samples >= 0,
            "max-train-samples",
            "an integer >= 0 (0 = all)",
            self.max_train_samples,
        )
        need(
            self.max_val_samples >= 0,
            "max-val-samples",
            "an integer >= 0 (0 = all)",
            self.max_val_samples,
        )
        need(
            1 <= self.backward_passes_per_step <= 1024,
            "backward-passes-per-step",
            "an integer in [1, 1024]",
            self.backward_passes_per_step,
        )
        need(
            self.resume_mismatch in RESUME_MISMATCHES,
            "resume-mismatch",
            f"one of {RESUME_MISMATCHES}",
            self.resume_mismatch,
        )
        need(self.precision in PRECISIONS, "precision", f"one of {PRECISIONS}", self.precision)
        need(
            self.channels_last in CHANNELS_LAST,
            "channels-last",
            f"one of {CHANNELS_LAST}",
            self.channels_last,
        )
        need(
            1 <= self.eval_batch_size <= 65536,
            "eval-batch-size",
            "an integer in [1, 65536]",
            self.eval_batch_size,
        )
        need(self.log_interval >= 0, "log-interval", "an integer >= 0", self.log_interval)

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
