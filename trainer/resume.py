"""Checkpoints and ``--resume``: what a checkpoint must share with this run to be continued
(its identity), the per-rank random state, and rank 0's verdict on a checkpoint it finds."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from horovod_airflow.core import storage
from horovod_airflow.core.contract import CHECKPOINT_FORMAT
from horovod_airflow.core.train_config import ConfigError, TrainConfig, lr_at
from horovod_airflow.trainer.errors import TrainingError
from horovod_airflow.trainer.runtime import Runtime

if TYPE_CHECKING:
    import torch


def load_checkpoint(uri: str) -> dict[str, Any]:
    import torch

    state = torch.load(io.BytesIO(storage.read_bytes(uri)), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise TrainingError(f"{uri} is not a {CHECKPOINT_FORMAT} checkpoint")
    return state


def save_checkpoint(uri: str, state: dict[str, Any]) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    storage.write_bytes(uri, buf.getvalue())


NOT_RECORDED = "<not recorded>"


def run_identity(
    config: TrainConfig, rt: Runtime, content_hash: str, steps_per_epoch: int
) -> dict[str, Any]:
    """What a checkpoint must share with this run for a resume to continue the same run.

    The dataset by content (not URI), the world size, the device type and resolved precision
    (``auto`` may resolve otherwise elsewhere), the steps per epoch, and every setting that
    changes the result (``TrainConfig.result_fields``). An ``--elastic`` run leaves out the
    world size and the steps per epoch (which follows from it): it resumes at any size.
    """
    identity = {
        "dataset_content_hash": content_hash,
        "world_size": rt.size,
        "device_type": rt.device.split(":")[0],
        "resolved_precision": rt.precision,
        "resolved_channels_last": rt.channels_last,
        "steps_per_epoch": steps_per_epoch,
        **config.result_fields(),
    }
    if config.elastic:  # any world size continues it (the checkpoint records the history)
        del identity["world_size"], identity["steps_per_epoch"]
    return identity


def same_lr_so_far(
    saved_epochs: Any, config: TrainConfig, world_factor: int, steps: int, done_epochs: int
) -> bool:
    """True when a run of ``saved_epochs`` set the same lr as this one for every step taken.

    Then a checkpoint of the shorter (or longer) run is this run's too: with a constant
    schedule and no warmup running past the checkpoint, ``--epochs`` may grow on resume.
    """
    if not isinstance(saved_epochs, int) or saved_epochs < done_epochs:
        return False
    try:
        saved = TrainConfig.from_dict({**config.to_dict(), "epochs": saved_epochs})
    except ConfigError:
        return False
    return all(
        lr_at(saved, world_factor, step, steps) == lr_at(config, world_factor, step, steps)
        for step in range(done_epochs * steps)
    )


def resume_mismatches(
    saved: dict[str, Any],
    now: dict[str, Any],
    config: TrainConfig,
    world_factor: int,
    done_epochs: int,
) -> list[str]:
    """One line per field where the checkpoint's ``saved`` identity differs from ``now``."""
    lines = []
    for key in now:
        old, new = saved.get(key, NOT_RECORDED), now[key]
        if old == new:
            continue
        if (
            key == "epochs"
            and "steps_per_epoch" in now
            and same_lr_so_far(old, config, world_factor, now["steps_per_epoch"], done_epochs)
        ):
            continue  # the lr of every step taken is the same: epochs may change
        lines.append(f"{key}: checkpoint {old!r}, now {new!r}")
    return lines


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's random state: torch CPU (dropout on CPU) and the device's CUDA generator.

    Data order needs none: ``epoch_indices`` seeds its own generator per epoch. The trainer
    uses neither Python's ``random`` nor numpy's.
    """
    import torch

    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def read_resume_state(
    ckpt_uri: str, identity: dict[str, Any], config: TrainConfig, world_factor: int
) -> tuple[str, Any]:
    """Rank 0's verdict on ``--resume``: ("resume", checkpoint), ("fresh", why), ("error", why).

    Never raises: every rank must learn the outcome (``hvd.broadcast_object``) and stop, or
    go on, together.
    """
    try:
        if not storage.exists(ckpt_uri):
            return "fresh", f"--resume: no {ckpt_uri} yet, starting from scratch"
        state = load_checkpoint(ckpt_uri)
    except Exception as e:
        return "error", f"--resume: cannot read {ckpt_uri}: {type(e).__name__}: {e}"
    done = int(state.get("epoch", 0))
    saved = state.get("identity") or {}
    differences = resume_mismatches(saved, identity, config, world_factor, done)
    if not isinstance(state.get("rng_states"), list):  # it cannot continue the same streams
        differences.append(f"rng_states: checkpoint {NOT_RECORDED}")
    if not differences and done > config.epochs:
        differences = [f"epoch: checkpoint is after epoch {done}, the run has {config.epochs}"]
    if not differences:
        return "resume", state
    text = f"{ckpt_uri} was not made by this run: " + "; ".join(differences)
    if config.resume_mismatch == "fresh":
        return "fresh", f"{text}; --resume-mismatch fresh: training from scratch"
    return "error", (
        f"{text}. Pass --resume-mismatch fresh to train from scratch over it, or write to "
        "another --output (a new run)"
    )
