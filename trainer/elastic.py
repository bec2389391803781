"""``trainer train --elastic``: the training loop of an elastic Horovod job (``horovodrun
--min-np/--max-np --host-discovery-script``), where ranks leave with a lost host and join with a
new one while the run goes on.

The state that survives a reset is one ``hvd.elastic.TorchState``: the model, the optimizer,
the epoch, the sampler's position (``consumed``: how many samples of the epoch's seeded
permutation the committed steps have trained on), the epoch's committed loss sums, the
history, the world-size history and the count of redone steps. It is committed every
``--elastic-commit-every`` optimizer steps and at each epoch end; a commit costs a copy of the
model and optimizer state and one small broadcast (Horovod's check for host changes).

How the samples are counted exactly (Horovod's own ``ElasticSampler`` can repeat or drop
samples when hosts change): every rank draws the same seeded permutation of the training set
for the epoch. A step at world size W takes the next ``W x batch`` samples of it (fewer at the
epoch's end, split evenly; a rank with none adds a zero gradient), rank r the r-th slice.
After a reset the rest of the permutation is re-sharded over the ranks alive, so the epoch
trains on each sample once; only the steps since the last commit (rolled back when a rank is
lost) are trained again, and they are counted (``redone_steps``, ``redone_samples``). The
loss is weighted so that each step's gradient is the mean over the samples of that step,
whatever the world size. The learning rate follows the current world size (``--lr-scaling``)
and the epoch's progress in samples.

Nothing here calls a collective before ``hvd.elastic.run``: a joining worker enters the
loop through the state's sync. The dataset is fetched by every rank under a per-node file lock.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from horovod_airflow.core import storage
from horovod_airflow.core.contract import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_NAME,
    EVENT_EPOCH,
    EVENT_FINAL_METRICS,
    METRICS,
    METRICS_NAME,
    SAMPLE_IDS_NAME,
    event_line,
)
from horovod_airflow.core.train_config import TrainConfig, lr_at
from horovod_airflow.trainer import data
from horovod_airflow.trainer.errors import ResumeMismatchError, TrainingError
from horovod_airflow.trainer.progress import Progress
from horovod_airflow.trainer.resume import read_resume_state, run_identity, save_checkpoint
from horovod_airflow.trainer.runtime import Runtime, log, setup_runtime

if TYPE_CHECKING:
    import torch


def fetch_dataset_locked(config: TrainConfig) -> data.LocalDataset:
    """Fetch and verify the staged dataset on this rank, one rank per node at a time.

    No collective: a worker that joins a running job must not wait on ranks that are
    training. The first rank of a node downloads; the others find the verified copy.
    """
    root = data.default_cache_root(config.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return data.fetch_dataset(config.data, config.cache_dir)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def step_slice(n: int, consumed: int, size: int, rank: int, batch: int) -> tuple[int, int, int]:
    """The next step's positions in the epoch's permutation: (lo, hi) for ``rank`` and the
    step's total. ``size x batch`` samples, or what is left of the epoch split evenly."""
    take = min(size * batch, n - consumed)
    return consumed + rank * take // size, consumed + (rank + 1) * take // size, take


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's order of the training samples: the same on every rank at any world size."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return torch.randperm(n, generator=g)


def current_runtime(rt: Runtime) -> Runtime:
    """``rt`` with this rank's place in the world as it is now (it changes at each reset)."""
    import horovod.torch as hvd

    return dataclasses.replace(
        rt,
        rank=hvd.rank(),
        size=hvd.size(),
        local_rank=hvd.local_rank(),
        local_size=hvd.local_size(),
    )


def world_change(old_hosts: list[str], new_hosts: list[str], state: Any) -> dict[str, Any]:
    """One entry of the world-size history: when, from, to, which hosts' ranks left or joined."""
    left, joined = list(old_hosts), []
    for host in new_hosts:
        if host in left:
            left.remove(host)
        else:
            joined.append(host)
    return {
        "time": time.time(),
        "epoch": int(state.epoch) + 1,
        "samples_into_epoch": int(state.consumed),
        "from": len(old_hosts),
        "to": len(new_hosts),
        "left": sorted(left),
        "joined": sorted(joined),
        "redone_steps_so_far": int(state.redone_steps),
    }


def run_elastic(config: TrainConfig) -> dict[str, Any]:
    """Train elastically; rank 0 writes checkpoint.pt each epoch and metrics.json at the end."""
    import horovod.torch as hvd
    import torch

    from horovod_airflow.trainer.train import (
        average_buffers,
        build_optimizer,
        build_training_model,
        check_ranks_agree,
        evaluate_distributed,
        metrics_document,
        stop_reason,
        target_reached,
    )

    started = time.perf_counter()
    rt, device = setup_runtime(config)
    ckpt_uri = storage.join(config.output, CHECKPOINT_NAME)
    metrics_uri = storage.join(config.output, METRICS_NAME)
    dataset = fetch_dataset_locked(config)
    x_train, y_train = data.load_split(dataset, "train", config.max_train_samples)
    x_val, y_val = data.load_split(dataset, "test", config.max_val_samples)
    x_train, y_train = x_train.to(device), y_train.to(device)
    x_val, y_val = x_val.to(device), y_val.to(device)
    n = int(x_train.shape[0])
    log(rt, f"elastic: {rt.size} rank(s) at start, train {n}, validation {x_val.shape[0]}")

    torch.manual_seed(config.seed)  # the state's sync gives every rank rank 0's weights anyway
    model = build_training_model(config, device)
    base = build_optimizer(config, model, config.lr)
    identity = run_identity(config, rt, dataset.content_hash, 0)
    start_epoch, history, worlds, hosts = 0, [], [], []
    redone = {"steps": 0, "samples": 0}
    if config.resume:  # every rank reads it: no collective before the elastic loop
        verdict = read_resume_state(ckpt_uri, identity, config, rt.size)
        if verdict[0] == "error":
            raise ResumeMismatchError(verdict[1])
        if verdict[0] == "fresh":
            log(rt, verdict[1])
        else:
            saved = verdict[1]
            model.load_state_dict(saved["model"])
            base.load_state_dict(saved["optimizer"])
            start_epoch, history = int(saved["epoch"]), list(saved["history"])
            worlds = list(saved.get("elastic", {}).get("world_history", []))
            redone = dict(saved.get("elastic", {}).get("redone", redone))
            hosts = list(saved.get("elastic", {}).get("hosts", []))  # the world it ended in
            log(rt, f"resuming from {ckpt_uri} after epoch {start_epoch}")
    optimizer = hvd.DistributedOptimizer(  # Horovod: allreduce gradients in step()
        base,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if config.fp16_allreduce else hvd.Compression.none,
    )
    state = hvd.elastic.TorchState(
        model=model,
        optimizer=optimizer,
        epoch=start_epoch,
        consumed=0,  # the sampler's position in the epoch's permutation
        loss_sum=0.0,  # the epoch's committed steps, summed over all ranks
        loss_count=0,
        history=history,
        worlds=worlds,
        hosts=hosts,
        redone_steps=redone["steps"],
        redone_samples=redone["samples"],
    )
    # Not part of the state: what this process did since the last commit (lost on a reset).
    live = {"steps": 0, "samples": 0, "loss": 0.0, "count": 0}
    # Rank 0's progress events and the per-step record, kept on every rank: whichever is rank
    # 0 at the end writes it. Steps redone after a reset are recorded again.
    progress = Progress(
        is_primary=True,
        steps_per_epoch=math.ceil(n / (rt.size * config.batch_size)),
        epochs=config.epochs,
        start_epoch=start_epoch,
        interval_s=config.progress_seconds,
    )

    def on_reset() -> None:
        # After a lost rank the state was restored to the last commit: the steps since then
        # are trained again. After a host was added the state was just committed: none.
        state.redone_steps += live["steps"]
        state.redone_samples += live["samples"]
        live.update(steps=0, samples=0, loss=0.0, count=0)
        state.save()  # the sync that follows broadcasts the saved state, not the attributes

    state.register_reset_callbacks([on_reset])
    sample_log = None
    if config.debug_sample_ids:
        Path(config.debug_sample_ids).mkdir(parents=True, exist_ok=True)
        name = SAMPLE_IDS_NAME.format(host=socket.gethostname(), pid=os.getpid())
        sample_log = open(Path(config.debug_sample_ids) / name, "a")  # noqa: SIM115

    timing = {"commit_s": 0.0, "commits": 0}  # this rank's time in commits (bench reads it)

    def commit() -> None:
        start = time.perf_counter()
        try:
            commit_now()
        finally:
            timing["commit_s"] += time.perf_counter() - start
            timing["commits"] += 1

    def commit_now() -> None:
        totals = hvd.allreduce(  # Horovod: this commit's loss over the ranks alive
            torch.tensor([live["loss"], float(live["count"])], dtype=torch.float64),
            op=hvd.Sum,
            name="elastic.loss",
        )
        state.loss_sum += float(totals[0])
        state.loss_count += int(totals[1])
        live.update(steps=0, samples=0, loss=0.0, count=0)
        state.commit()  # Horovod: raises HostsUpdatedInterrupt when hosts changed

    @hvd.elastic.run
    def train(state: Any) -> dict[str, Any]:
        from torch.nn import functional as F

        now = current_runtime(rt)
        progress.quiet = not now.is_primary
        hosts = hvd.allgather_object(socket.gethostname(), name="elastic.hosts")
        if hosts != state.hosts:
            # New lists, never in place: the last commit keeps its own (a rollback restores it)
            state.worlds = [*state.worlds, world_change(state.hosts, hosts, state)]
            if state.hosts:
                change = state.worlds[-1]
                log(
                    now,
                    f"world {change['from']} -> {change['to']} at epoch {change['epoch']} "
                    f"sample {change['samples_into_epoch']}/{n} (left {change['left']}, joined "
                    f"{change['joined']}); lr rescaled; {state.redone_steps} step(s) redone so far",
                )
            state.hosts = hosts
            state.save()  # the record survives a later rollback
        evaluation: dict[str, Any] = {}
        fmt = torch.channels_last if rt.channels_last else torch.contiguous_format
        autocast = torch.autocast(
            device_type=device.type, dtype=torch.bfloat16, enabled=rt.precision == "bf16"
        )
        while state.epoch < config.epochs:
            if target_reached(state.history, config.target_accuracy):
                log(
                    now, f"stopping after epoch {state.epoch}: {stop_reason(state.history, config)}"
                )
                break
            epoch = int(state.epoch)
            model.train()
            epoch_start = time.perf_counter()
            perm = epoch_permutation(n, config.seed, epoch).to(device)
            size, rank = now.size, now.rank
            steps = math.ceil(n / (size * config.batch_size))
            progress.resize(steps)
            while state.consumed < n:
                lo, hi, take = step_slice(n, state.consumed, size, rank, config.batch_size)
                step = epoch * steps + state.consumed // (size * config.batch_size)
                for group in optimizer.param_groups:  # Horovod: lr for the world size now
                    group["lr"] = lr_at(config, size, step, steps)
                optimizer.zero_grad()
                if hi > lo:
                    idx = perm[lo:hi]
                    with autocast:
                        logits = model(x_train.index_select(0, idx).contiguous(memory_format=fmt))
                    loss = F.cross_entropy(
                        logits.float(), y_train.index_select(0, idx), reduction="sum"
                    )
                    (loss * size / take).backward()  # the average over ranks: the step's mean
                    live["loss"] += float(loss.detach())
                    live["count"] += hi - lo
                else:  # nothing left for this rank in the epoch's last step: a zero gradient
                    torch.stack([p.sum() for p in model.parameters()]).sum().mul(0.0).backward()
                optimizer.step()  # Horovod: a lost rank raises here (HorovodInternalError)
                in_epoch = state.consumed // (size * config.batch_size)
                state.consumed += take
                mean = loss.detach() / (hi - lo) if hi > lo else torch.zeros(())
                lr = optimizer.param_groups[0]["lr"]
                progress.step(epoch, in_epoch, mean, lr, take, last=state.consumed >= n)
                live["steps"] += 1
                live["samples"] += take
                if sample_log is not None and hi > lo:
                    entry = {"epoch": epoch, "world": size, "ids": perm[lo:hi].tolist()}
                    sample_log.write(json.dumps(entry) + "\n")
                    sample_log.flush()
                if config.log_interval and step % config.log_interval == 0 and hi > lo:
                    log(now, f"epoch {epoch + 1} step {step}/{steps} world {size} loss "
                        f"{float(loss) / (hi - lo):.4f}")  # fmt: skip
                if live["steps"] >= config.elastic_commit_every and state.consumed < n:
                    commit()
            train_s = time.perf_counter() - epoch_start
            average_buffers(model, epoch)
            evaluation = evaluate_distributed(model, x_val, y_val, config, now, epoch)
            totals = hvd.allreduce(
                torch.tensor([live["loss"], float(live["count"])], dtype=torch.float64),
                op=hvd.Sum,
                name="elastic.loss.end",
            )
            loss_sum, loss_count = (
                state.loss_sum + float(totals[0]),
                state.loss_count + int(totals[1]),
            )
            if loss_count != n:
                raise TrainingError(
                    f"elastic epoch {epoch + 1} trained on {loss_count} samples, the training "
                    f"set has {n}: the sample accounting is broken"
                )
            state.history = [
                *state.history,
                {
                    "epoch": epoch + 1,
                    "train_loss": loss_sum / loss_count,
                    "val_loss": evaluation["val_loss"],
                    "val_accuracy": evaluation["val_accuracy"],
                    "samples_per_sec": n / max(train_s, 1e-9),
                    "epoch_seconds": time.perf_counter() - epoch_start,
                    "world_size": size,
                    "train_samples": loss_count,
                    "redone_steps": int(state.redone_steps),
                },
            ]
            log(
                now,
                f"epoch {epoch + 1}/{config.epochs}: world {size}, train_loss "
                f"{loss_sum / loss_count:.4f} val_accuracy {evaluation['val_accuracy']:.4f} "
                f"({evaluation['val_correct']}/{evaluation['val_samples']}), "
                f"{state.redone_steps} step(s) redone so far",
            )
            if now.is_primary:
                event = {**state.history[-1], "of_epochs": config.epochs}
                event.update(commit_seconds=timing["commit_s"], commits=timing["commits"])
                event.update(
                    val_correct=evaluation["val_correct"], val_samples=evaluation["val_samples"]
                )
                print(event_line(EVENT_EPOCH, event), flush=True)
            check_ranks_agree(model, now, f"after epoch {epoch + 1}")
            if now.is_primary:
                save_checkpoint(ckpt_uri, checkpoint(state, epoch + 1))
            state.epoch, state.consumed = epoch + 1, 0
            state.loss_sum, state.loss_count = 0.0, 0
            live.update(steps=0, samples=0, loss=0.0, count=0)
            start = time.perf_counter()
            state.commit()
            timing["commit_s"] += time.perf_counter() - start
            timing["commits"] += 1
        if not evaluation:  # resumed a finished run (or stopped at the target): evaluate it
            evaluation = evaluate_distributed(model, x_val, y_val, config, now, config.epochs)
        evaluation["param_hash"] = check_ranks_agree(model, now, "at the end")
        evaluation["world_size"] = now.size
        evaluation["is_primary"] = now.is_primary
        return evaluation

    def checkpoint(state: Any, epoch: int) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": epoch,
            "config": config.to_dict(),
            "history": state.history,
            "dataset": {"uri": config.data, "content_hash": dataset.content_hash},
            "world_size": hvd.size(),
            "identity": identity,
            "rng_states": [],  # elastic: ranks come and go, no per-rank stream to continue
            "elastic": {
                "world_history": state.worlds,
                "hosts": state.hosts,
                "redone": {"steps": state.redone_steps, "samples": state.redone_samples},
            },
        }

    evaluation = train(state)
    if sample_log is not None:
        sample_log.close()
    is_primary, world = evaluation.pop("is_primary"), evaluation.pop("world_size")
    digest = evaluation.pop("param_hash")
    history = state.history
    metrics = {
        **metrics_document(
            config,
            rt,
            evaluation,
            history,
            world_size=world,
            dataset=dataset,
            digest=digest,
            started=started,
            ckpt_uri=ckpt_uri,
            metrics_uri=metrics_uri,
        ),
        "steps": progress.record(),
        "elastic": {
            "commit_every": config.elastic_commit_every,
            "world_history": state.worlds,
            "world_sizes": [w["to"] for w in state.worlds],
            "redone_steps": int(state.redone_steps),
            "redone_samples": int(state.redone_samples),
            "commits": timing["commits"],  # this process's (rank 0 at the end)
            "commit_seconds": timing["commit_s"],
        },
    }
    if is_primary:
        storage.write_text(metrics_uri, METRICS.dumps(metrics))
        final = {k: metrics[k] for k in ("val_accuracy", "val_loss", "val_correct", "val_samples")}
        final.update(
            epochs=metrics["epochs"],
            world_size=world,
            param_hash=digest,
            train_seconds=metrics["train_seconds"],
            metrics_uri=metrics_uri,
            checkpoint_uri=ckpt_uri,
            elastic=metrics["elastic"],
        )
        print(event_line(EVENT_FINAL_METRICS, final), flush=True)
    return metrics
