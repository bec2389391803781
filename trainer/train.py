"""The training loop of one Horovod rank: ``python -m horovod_airflow.trainer train`` (see
``horovod_airflow.trainer.cli``).

Launch (one process per GPU, or per CPU share)::

    horovodrun -np 2 -H localhost:2 python -m horovod_airflow.trainer train \\
        --data s3://bucket/datasets/mnist/<hash16> --output s3://bucket/runs/<dag_id>/<run_id>

Lines that make the job distributed are marked ``# Horovod:``. Rank 0 alone logs, checkpoints
and writes artifacts; every metric is allreduced before anyone reads it.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from horovod_airflow.core import storage
from horovod_airflow.core.contract import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_NAME,
    EVENT_EPOCH,
    EVENT_FINAL_METRICS,
    EVENT_PARAM_HASH,
    METRICS,
    METRICS_NAME,
    event_line,
)
from horovod_airflow.core.layout import DatasetError, DatasetIntegrityError
from horovod_airflow.core.train_config import TrainConfig, lr_at
from horovod_airflow.trainer import data
from horovod_airflow.trainer.errors import RankDivergenceError, ResumeMismatchError, TrainingError
from horovod_airflow.trainer.model import build_model
from horovod_airflow.trainer.progress import Progress
from horovod_airflow.trainer.resume import (
    read_resume_state,
    restore_rng_state,
    rng_state,
    run_identity,
    save_checkpoint,
)
from horovod_airflow.trainer.runtime import Runtime, log, setup_runtime

if TYPE_CHECKING:
    import torch
    from torch import nn


def fetch_staged_dataset(config: TrainConfig, rt: Runtime) -> data.LocalDataset:
    """Local rank 0 fetches and verifies the dataset into the node cache; the others wait.

    Every rank learns every node's outcome, so a corrupted file stops all ranks with the
    same message instead of some training on bad data.
    """
    import horovod.torch as hvd

    outcome: tuple[str, Any] | None = None
    if rt.local_rank == 0:  # Horovod: one fetch per node
        try:
            outcome = ("ok", data.fetch_dataset(config.data, config.cache_dir).manifest)
        except Exception as e:
            outcome = (type(e).__name__, str(e))
    # Horovod: doubles as the barrier for the waiters; the name must match on every rank
    outcomes = hvd.allgather_object(outcome, name="dataset_fetch")
    failures = [(r, o) for r, o in enumerate(outcomes) if o is not None and o[0] != "ok"]
    if failures:
        text = "; ".join(f"rank {r}: {kind}: {msg}" for r, (kind, msg) in failures)
        if any(kind == "DatasetIntegrityError" for _, (kind, _m) in failures):
            raise DatasetIntegrityError(f"dataset {config.data} failed verification: {text}")
        raise DatasetError(f"cannot fetch dataset {config.data}: {text}")
    manifest = next(o[1] for o in outcomes if o is not None)
    return data.dataset_paths(config.data, manifest, config.cache_dir)


def build_training_model(config: TrainConfig, device: torch.device) -> nn.Module:
    """The model on ``device`` with contiguous parameters, whatever ``--channels-last`` says.

    Channels-last is applied to the inputs only (``batches``, ``evaluate``): the convolutions
    then run NHWC, while parameters, their gradients (autograd gives a gradient its
    parameter's strides) and the optimizer state stay contiguous, as Horovod's collectives
    require (``broadcast_parameters``, ``broadcast_optimizer_state``, the gradient allreduce
    all refuse a non-contiguous tensor).
    """
    return build_model(config.model).to(device)


def make_state_contiguous(optimizer: torch.optim.Optimizer) -> None:
    """Give every optimizer state tensor a contiguous layout, in place (values unchanged).

    A checkpoint written by another program may hold channels-last state (``torch.save`` keeps
    strides); Horovod's broadcast of that state would refuse it.
    """
    for state in optimizer.state.values():
        for key, value in state.items():
            if hasattr(value, "is_contiguous") and not value.is_contiguous():
                state[key] = value.contiguous()


def build_optimizer(config: TrainConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    import torch

    params = model.parameters()
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=config.weight_decay)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(
        params, lr=lr, momentum=0.9, nesterov=True, weight_decay=config.weight_decay
    )


def lr_world_factor(config: TrainConfig, device: torch.device) -> int:
    """How many ranks the lr scales for: all of them, or (Adasum) only those averaged by NCCL."""
    import horovod.torch as hvd

    if not config.adasum:
        return int(hvd.size())
    # Adasum combines gradients adaptively across nodes; within a node NCCL still averages.
    return int(hvd.local_size()) if device.type == "cuda" and hvd.nccl_built() else 1


def param_hash(model: nn.Module, buffers: bool = True) -> str:
    """sha256 over every parameter and (``buffers``) buffer, float32, name order.

    Equal iff ranks agree. Mid-epoch only the parameters must agree: BatchNorm statistics
    follow each rank's own shard until ``average_buffers`` at the end of the epoch.
    """
    h = hashlib.sha256()
    tensors = model.state_dict() if buffers else dict(model.named_parameters())
    for name, tensor in sorted(tensors.items()):
        h.update(name.encode())
        h.update(tensor.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def check_ranks_agree(model: nn.Module, rt: Runtime, when: str) -> str:
    """Allgather every rank's parameter hash; raise RankDivergenceError naming ranks that differ."""
    import horovod.torch as hvd
    import torch

    digest = param_hash(model)
    pieces = torch.tensor(
        [
            int.from_bytes(bytes.fromhex(digest[i : i + 16]), "big", signed=True)
            for i in range(0, 64, 16)
        ],
        dtype=torch.int64,
    )
    gathered = hvd.allgather(pieces.unsqueeze(0), name=f"param_hash.{when}")  # Horovod
    rows = [tuple(int(v) for v in row) for row in gathered.tolist()]
    differ = [r for r, row in enumerate(rows) if row != rows[0]]
    if differ:
        raise RankDivergenceError(
            f"parameters differ across ranks {when}: ranks {differ} disagree with rank 0 "
            f"(rank 0 hash {digest[:16]}...); the distributed update is broken"
        )
    return digest


def epoch_indices(n: int, rt: Runtime, seed: int, epoch: int) -> torch.Tensor:
    """This rank's disjoint share of a per-epoch seeded global permutation (n // size samples)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + epoch)  # identical on every rank
    perm = torch.randperm(n, generator=g)
    per_rank = n // rt.size
    return perm[rt.rank * per_rank : (rt.rank + 1) * per_rank]  # Horovod: this rank's shard


def batches(
    x: torch.Tensor,
    y: torch.Tensor,
    idx: torch.Tensor,
    batch_size: int,
    memory_format: torch.memory_format,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The trainer's data path: batches of ``idx`` (in order) gathered from in-memory tensors.

    ``x`` is already normalized float32 on the training device
    (``horovod_airflow.trainer.data.load_split``),
    so a batch is one ``index_select`` per tensor: no decoding, no per-sample transform, no
    worker processes. The last batch may be short.
    """
    for start in range(0, idx.numel(), batch_size):
        b = idx[start : start + batch_size]
        yield x.index_select(0, b).contiguous(memory_format=memory_format), y.index_select(0, b)


def train_one_epoch(
    model: nn.Module,
    optimizer: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    epoch: int,
    config: TrainConfig,
    rt: Runtime,
    world_factor: int,
    on_first_step: Any = None,
    progress: Progress | None = None,
) -> tuple[float, int, float]:
    """One pass over this rank's shard; return (allreduced mean loss, global samples, seconds)."""
    import horovod.torch as hvd
    import torch
    from torch.nn import functional as F

    model.train()
    start = time.perf_counter()
    idx = epoch_indices(x.shape[0], rt, config.seed, epoch).to(x.device)
    k = config.backward_passes_per_step
    n_batches = math.ceil(idx.numel() / config.batch_size)
    steps = n_batches // k
    memory_format = torch.channels_last if rt.channels_last else torch.contiguous_format
    autocast = torch.autocast(
        device_type=x.device.type, dtype=torch.bfloat16, enabled=rt.precision == "bf16"
    )
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    seen = 0
    stream = batches(x, y, idx, config.batch_size, memory_format)
    for step in range(steps):
        global_step = epoch * steps + step
        for group in optimizer.param_groups:
            group["lr"] = lr_at(config, world_factor, global_step, steps)
        optimizer.zero_grad()
        for _micro in range(k):
            xb, yb = next(stream)
            with autocast:
                logits = model(xb)
            loss = F.cross_entropy(logits.float(), yb)
            (loss / k).backward()  # Horovod: allreduce starts once k passes are accumulated
            loss_sum += loss.detach().double() * yb.numel()
            seen += yb.numel()
        optimizer.step()  # Horovod: waits for the averaged gradients, then updates
        if progress is not None:  # rank 0 only: no collective, the loss read when recorded
            lr = optimizer.param_groups[0]["lr"]
            progress.step(epoch, step, loss, lr, yb.numel() * k * rt.size, last=step == steps - 1)
        if on_first_step is not None and epoch == 0 and step == 0:
            on_first_step()
        if config.log_interval and step % config.log_interval == 0:
            log(rt, f"epoch {epoch + 1} step {step}/{steps} loss {loss.item():.4f}")
    totals = hvd.allreduce(  # Horovod: the mean loss over all ranks' samples
        torch.stack([loss_sum, torch.tensor(float(seen), dtype=torch.float64, device=x.device)]),
        op=hvd.Sum,
        name=f"train_loss.{epoch}",
    )
    seconds = time.perf_counter() - start
    return float(totals[0] / totals[1]), int(totals[1]), seconds


def average_buffers(model: nn.Module, epoch: int) -> None:
    """Average every floating-point buffer (BatchNorm running statistics) over the ranks.

    Each rank's BatchNorm tracks the statistics of its own shard, so without this the ranks
    would evaluate, and rank 0 would save, different models. Integer buffers (the batch
    counter) are equal on every rank already. A model without buffers costs nothing.
    """
    import horovod.torch as hvd

    for name, buffer in model.named_buffers():
        if buffer.is_floating_point():
            hvd.allreduce_(buffer, op=hvd.Average, name=f"buffer.{name}.{epoch}")  # Horovod


def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    channels_last: bool = False,
) -> torch.Tensor:
    """float32 evaluation of the given samples: tensor [loss_sum, correct, count] (float64)."""
    import torch
    from torch.nn import functional as F

    model.eval()
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    totals = torch.zeros(3, dtype=torch.float64)
    with torch.inference_mode():
        for i in range(0, x.shape[0], batch_size):
            xb = x[i : i + batch_size].contiguous(memory_format=memory_format)
            yb = y[i : i + batch_size]
            logits = model(xb).float()
            totals[0] += F.cross_entropy(logits, yb, reduction="sum").double().cpu()
            totals[1] += (logits.argmax(dim=1) == yb).sum().double().cpu()
            totals[2] += yb.numel()
    return totals


def evaluate_distributed(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, config: TrainConfig, rt: Runtime, epoch: int
) -> dict[str, Any]:
    """Each rank evaluates a disjoint contiguous shard; sums are allreduced; exact, no padding."""
    import horovod.torch as hvd

    n = x.shape[0]
    lo, hi = rt.rank * n // rt.size, (rt.rank + 1) * n // rt.size  # Horovod: this rank's shard
    local = evaluate(model, x[lo:hi], y[lo:hi], config.eval_batch_size, rt.channels_last)
    total = hvd.allreduce(local, op=hvd.Sum, name=f"val.{epoch}")  # Horovod: global sums
    loss_sum, correct, count = (float(v) for v in total)
    if int(count) != n:
        raise TrainingError(f"evaluated {int(count)} samples across ranks, validation set has {n}")
    return {
        "val_loss": loss_sum / n,
        "val_accuracy": correct / n,
        "val_correct": int(correct),
        "val_samples": n,
    }


def versions() -> dict[str, str]:
    import torch

    import horovod_airflow

    out = {"torch": torch.__version__, "trainer": horovod_airflow.__version__}
    out["python"] = platform.python_version()
    for name in ("torchvision", "horovod"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "absent"
    return out


def target_reached(history: list[dict[str, Any]], target: float | None) -> bool:
    """True when the last finished epoch's allreduced validation accuracy reached ``target``.

    ``history`` holds the allreduced numbers, identical on every rank, so every rank takes
    the same decision without another collective.
    """
    return target is not None and bool(history) and history[-1]["val_accuracy"] >= target


def stop_reason(history: list[dict[str, Any]], config: TrainConfig) -> str:
    last = history[-1]
    return (
        f"val_accuracy {last['val_accuracy']:.4f} after epoch {last['epoch']} reached "
        f"--target-accuracy {config.target_accuracy} (of {config.epochs} epochs)"
    )


def metrics_document(
    config: TrainConfig,
    rt: Runtime,
    evaluation: dict[str, Any],
    history: list[dict[str, Any]],
    *,
    world_size: int,
    dataset: data.LocalDataset,
    digest: str,
    started: float,
    ckpt_uri: str,
    metrics_uri: str,
) -> dict[str, Any]:
    """The ``metrics.json`` a run writes at its end (the fixed and elastic loops alike; each
    adds its own record, ``steps`` or ``elastic``): the final allreduced evaluation, the epoch
    history, the settings, what the rank resolved, the dataset, versions and artifacts."""
    return {
        "format": METRICS.format,
        **evaluation,
        "epochs": len(history),
        "stopped_at_target": target_reached(history, config.target_accuracy)
        and len(history) < config.epochs,
        "world_size": world_size,
        "history": history,
        "config": config.to_dict(),
        "runtime": {
            "device": rt.device,
            "threads_per_rank": rt.threads,
            "horovod_cycle_time_ms": os.environ.get("HOROVOD_CYCLE_TIME", "horovod default"),
            "precision": rt.precision,
            "channels_last": rt.channels_last,
            "precision_reason": rt.precision_reason,
        },
        "dataset": {"uri": config.data, "content_hash": dataset.content_hash},
        "versions": versions(),
        "param_hash": digest,
        "train_seconds": time.perf_counter() - started,
        "artifacts": {"checkpoint": ckpt_uri, "metrics": metrics_uri},
    }


def run(config: TrainConfig) -> dict[str, Any]:
    """Train on every rank; on rank 0 write checkpoint.pt each epoch and metrics.json at the end.

    Returns the final metrics (the same dict on every rank).
    """
    import horovod.torch as hvd
    import torch

    if config.elastic:  # ranks may come and go: its own loop (horovod_airflow.trainer.elastic)
        from horovod_airflow.trainer.elastic import run_elastic

        return run_elastic(config)
    started = time.perf_counter()
    rt, device = setup_runtime(config)
    log(
        rt,
        f"{rt.size} rank(s), device {rt.device}, {rt.threads} thread(s)/rank, "
        f"precision {rt.precision}, channels_last {rt.channels_last} ({rt.precision_reason})",
    )
    if config.adasum and not hvd.mpi_enabled():
        # Horovod implements Adasum only over MPI (CPU and GPU); Gloo has no Adasum op.
        raise TrainingError(
            "--adasum needs Horovod's MPI controller (horovodrun --mpi, the operator's "
            "controller='mpi', a Horovod built with MPI); this job runs on Gloo: drop --adasum "
            "to average gradients"
        )
    if config.adasum and rt.size & (rt.size - 1):
        raise TrainingError(f"--adasum needs a power-of-2 number of ranks, this job has {rt.size}")
    ckpt_uri = storage.join(config.output, CHECKPOINT_NAME)
    metrics_uri = storage.join(config.output, METRICS_NAME)

    dataset = fetch_staged_dataset(config, rt)
    x_train, y_train = data.load_split(dataset, "train", config.max_train_samples)
    x_val, y_val = data.load_split(dataset, "test", config.max_val_samples)
    x_train, y_train = x_train.to(device), y_train.to(device)
    x_val, y_val = x_val.to(device), y_val.to(device)
    per_rank = x_train.shape[0] // rt.size
    steps = math.ceil(per_rank / config.batch_size) // config.backward_passes_per_step
    if steps == 0:
        raise TrainingError(
            f"{x_train.shape[0]} training samples over {rt.size} ranks give {per_rank} per rank, "
            f"fewer than --batch-size {config.batch_size} x --backward-passes-per-step "
            f"{config.backward_passes_per_step}: lower them or use more data"
        )
    log(
        rt,
        f"dataset {dataset.content_hash[:16]}: train {x_train.shape[0]} "
        f"({per_rank}/rank, {steps} steps/epoch), validation {x_val.shape[0]}",
    )

    torch.manual_seed(config.seed + rt.rank)  # per-rank dropout; weights come from rank 0 below
    model = build_training_model(config, device)
    world_factor = lr_world_factor(config, device)
    optimizer = build_optimizer(config, model, lr_at(config, world_factor, 0, steps))

    identity = run_identity(config, rt, dataset.content_hash, steps)
    start_epoch, history, rng_states = 0, [], None
    saved_optimizer: dict[str, Any] | None = None
    verdict: tuple[str, Any] = ("none", None)
    if config.resume and rt.is_primary:
        verdict = read_resume_state(ckpt_uri, identity, config, world_factor)
        if verdict[0] == "resume":
            state = verdict[1]
            model.load_state_dict(state["model"])
            saved_optimizer = state["optimizer"]
            start_epoch, history = int(state["epoch"]), list(state["history"])
            rng_states = state["rng_states"]
            log(rt, f"resuming from {ckpt_uri} after epoch {start_epoch}")
            verdict = ("resume", None)
        elif verdict[0] == "fresh":
            log(rt, verdict[1])
    verdict, start_epoch, history, rng_states = hvd.broadcast_object(  # Horovod: rank 0 read it
        (verdict, start_epoch, history, rng_states), root_rank=0, name="resume_state"
    )
    if verdict[0] == "error":  # every rank stops, before any training
        raise ResumeMismatchError(verdict[1])

    optimizer = hvd.DistributedOptimizer(  # Horovod: allreduce gradients in step()
        optimizer,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if config.fp16_allreduce else hvd.Compression.none,
        op=hvd.Adasum if config.adasum else hvd.Average,
        backward_passes_per_step=config.backward_passes_per_step,
    )
    if saved_optimizer is not None:  # into the wrapper: it was built anew from param_groups
        optimizer.load_state_dict(saved_optimizer)
        make_state_contiguous(optimizer)
    # Horovod: start every rank from rank 0's optimizer state and weights (the state first:
    # initializing an empty state takes a zero-gradient step that weight decay would move).
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def print_param_hash(step: int) -> None:
        digest = param_hash(model, buffers=False)  # parameters: buffers agree at epoch ends
        fields = {"rank": rt.rank, "step": step, "hash": digest}
        print(event_line(EVENT_PARAM_HASH, fields), flush=True)

    if config.debug_param_hash:
        print_param_hash(0)

    if rng_states is not None:  # continue each rank's random stream where it was saved
        restore_rng_state(rng_states[rt.rank], device)

    evaluation: dict[str, Any] = {}
    digest = ""
    progress = Progress(
        is_primary=rt.is_primary,
        steps_per_epoch=steps,
        epochs=config.epochs,
        start_epoch=start_epoch,
        interval_s=config.progress_seconds,
    )
    for epoch in range(start_epoch, config.epochs):
        if target_reached(history, config.target_accuracy):
            # The allreduced accuracy is the same number on every rank: all stop here. Also
            # true for a resumed run whose checkpoint had reached the target already.
            log(rt, f"stopping after epoch {epoch}: {stop_reason(history, config)}")
            break
        train_loss, samples, train_s = train_one_epoch(
            model,
            optimizer,
            x_train,
            y_train,
            epoch,
            config,
            rt,
            world_factor,
            on_first_step=(lambda: print_param_hash(1)) if config.debug_param_hash else None,
            progress=progress,
        )
        average_buffers(model, epoch)
        eval_start = time.perf_counter()
        evaluation = evaluate_distributed(model, x_val, y_val, config, rt, epoch)
        eval_s = time.perf_counter() - eval_start
        history.append(
            {
                "epoch": epoch + 1,
                "train_loss": train_loss,
                "val_loss": evaluation["val_loss"],
                "val_accuracy": evaluation["val_accuracy"],
                "samples_per_sec": samples / train_s,
                "epoch_seconds": train_s + eval_s,
            }
        )
        log(
            rt,
            f"epoch {epoch + 1}/{config.epochs}: train_loss {train_loss:.4f} "
            f"val_loss {evaluation['val_loss']:.4f} val_accuracy {evaluation['val_accuracy']:.4f} "
            f"({evaluation['val_correct']}/{evaluation['val_samples']}) "
            f"{samples / train_s:.0f} samples/s, {train_s + eval_s:.1f}s",
        )
        if rt.is_primary:  # one machine-readable line per epoch (benchmarks time these)
            event = {**history[-1], "of_epochs": config.epochs}
            event.update(
                val_correct=evaluation["val_correct"], val_samples=evaluation["val_samples"]
            )
            print(event_line(EVENT_EPOCH, event), flush=True)
        digest = check_ranks_agree(model, rt, f"after epoch {epoch + 1}")
        # Horovod: rank 0 saves every rank's random state, so a resume continues each one
        rng_states = hvd.allgather_object(rng_state(device), name=f"rng_state.{epoch}")
        if rt.is_primary:
            save_checkpoint(
                ckpt_uri,
                {
                    "format": CHECKPOINT_FORMAT,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch + 1,
                    "config": config.to_dict(),
                    "history": history,
                    "dataset": {"uri": config.data, "content_hash": dataset.content_hash},
                    "world_size": rt.size,
                    "identity": identity,
                    "rng_states": rng_states,
                },
            )

    if not evaluation:  # resumed a finished run: nothing to train, report its final model
        evaluation = evaluate_distributed(model, x_val, y_val, config, rt, config.epochs)
        digest = check_ranks_agree(model, rt, "after resuming a finished run")

    metrics = {
        **metrics_document(
            config, rt, evaluation, history, world_size=rt.size, dataset=dataset,
            digest=digest, started=started, ckpt_uri=ckpt_uri, metrics_uri=metrics_uri,
        ),
        "steps": progress.record(),
    }  # fmt: skip
    if rt.is_primary:
        storage.write_text(metrics_uri, METRICS.dumps(metrics))
        final = {k: metrics[k] for k in ("val_accuracy", "val_loss", "val_correct", "val_samples")}
        final.update(
            epochs=metrics["epochs"],
            world_size=rt.size,
            param_hash=digest,
            train_seconds=metrics["train_seconds"],
            metrics_uri=metrics_uri,
            checkpoint_uri=ckpt_uri,
        )
        print(event_line(EVENT_FINAL_METRICS, final), flush=True)
    return metrics
