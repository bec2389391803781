"""What a person reads next to a published model: the training curves (PNG) and a Markdown
summary of its metrics, gate decision, ONNX parity, dataset and versions."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

from horovod_airflow.core.contract import METRICS_NAME, STEP_SERIES, ContractError, elastic_summary


def step_series(metrics: Mapping[str, Any], source: str = METRICS_NAME) -> dict[str, Any] | None:
    """The per-step record of ``metrics`` (v2's ``steps``), checked; None when it has none
    (metrics-v1, or a training program that records no steps). A malformed one raises
    :class:`ContractError` naming what is wrong."""
    steps = metrics.get("steps")
    if steps is None:
        return None
    doc = STEP_SERIES.check(steps, f"{source} 'steps'")
    lengths = {key: len(doc[key]) for key in ("step", "epoch", "loss", "lr")}
    if len(set(lengths.values())) != 1:
        raise ContractError(f"{source} 'steps': the lists must have equal lengths, got {lengths}")
    return doc


def moving_average(values: list[float], window: int) -> list[float]:
    """The trailing mean of the last ``window`` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def accuracy_limits(values: list[float]) -> tuple[float, float]:
    """The accuracy axis (percent): around the values, never above 100 nor below 0, at least
    2 points tall so that one epoch's single value sits in a readable band."""
    low, high = min(values), max(values)
    pad = max(1.0, (high - low) * 0.1)
    top = min(100.0, high + pad)
    bottom = max(0.0, min(low - pad, top - 2.0))
    return bottom, min(100.0, max(top, bottom + 2.0))


def render_training_curves(
    history: list[dict[str, Any]], steps: Mapping[str, Any] | None = None
) -> bytes:
    """A PNG of the training: the per-step training loss (``steps``, metrics.json v2) with the
    per-epoch train and validation loss, the per-step learning rate, and the validation
    accuracy per epoch. The x axis is epochs (fractional for steps), so a one-epoch run shows
    its whole loss curve; without ``steps`` (metrics-v1, another program) the loss and
    learning-rate panels show the epochs alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    step_epoch = list(steps.get("epoch", [])) if steps else []
    fig, (ax_loss, ax_lr, ax_acc) = plt.subplots(1, 3, figsize=(15, 4.2), dpi=100)
    if step_epoch:
        every = steps.get("every", 1) if steps else 1
        ax_loss.plot(
            step_epoch,
            steps["loss"] if steps else [],
            "-",
            lw=0.8,
            alpha=0.35,
            color="tab:blue",
            label="train loss (rank 0, "
            + ("every step)" if every == 1 else f"every {every} steps)"),
        )
        window = max(1, len(step_epoch) // 25)
        if window > 1:
            smooth = moving_average(list(steps["loss"] if steps else []), window)
            ax_loss.plot(step_epoch, smooth, "-", lw=1.8, color="tab:blue",
                         label=f"train loss, mean of {window} points")  # fmt: skip
        ax_lr.plot(step_epoch, steps["lr"] if steps else [], "-", color="tab:purple")
    else:
        ax_lr.text(0.5, 0.5, "no per-step record", ha="center", va="center",
                   transform=ax_lr.transAxes)  # fmt: skip
    if history:
        ax_loss.plot(
            epochs, [h["train_loss"] for h in history], "o", color="tab:blue",
            mfc="white", label="train loss (epoch mean, all ranks)",
        )  # fmt: skip
        ax_loss.plot(
            epochs, [h["val_loss"] for h in history], "s--", color="tab:orange",
            label="validation loss",
        )  # fmt: skip
        accuracy = [100 * h["val_accuracy"] for h in history]
        ax_acc.plot(epochs, accuracy, "o-", color="tab:green")
        for x, y in zip(epochs, accuracy, strict=True):
            ax_acc.annotate(f"{y:.2f} %", (x, y), textcoords="offset points", xytext=(0, 6),
                            ha="center", fontsize=8)  # fmt: skip
        ax_acc.set_ylim(*accuracy_limits(accuracy))
    right = max([*epochs, *step_epoch, 1])
    losses = [*(steps["loss"] if step_epoch and steps else [])]
    losses += [h[k] for h in history for k in ("train_loss", "val_loss")]
    if losses and min(losses) > 0:
        ax_loss.set_yscale("log")  # the first steps' loss would flatten the rest
    ax_loss.set_title("Loss")
    ax_loss.set_ylabel("cross-entropy")
    ax_loss.legend(fontsize=8)
    ax_lr.set_title("Learning rate")
    ax_lr.set_ylabel("lr")
    ax_acc.set_title("Validation accuracy (whole set, per epoch)")
    ax_acc.set_ylabel("accuracy (%)")
    for ax in (ax_loss, ax_lr, ax_acc):
        ax.set_xlabel("epoch")
        ax.set_xlim(0 if step_epoch else 0.5, right + (0.1 if step_epoch else 0.5))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def render_summary(
    *,
    model_name: str,
    version: str,
    metrics: dict[str, Any],
    gate: dict[str, Any],
    dataset: dict[str, Any],
    parity: dict[str, Any],
    dag_run_id: str,
    published_at: str,
) -> str:
    """A short Markdown summary a person reads next to the model."""
    versions = metrics.get("versions", {})
    champ = gate.get("champion_accuracy")
    champ_txt = (
        "none (first model)" if champ is None else (f"{champ:.4%} ({gate.get('champion_version')})")
    )
    rows = "\n".join(
        f"| {h['epoch']} | {h['train_loss']:.4f} | {h['val_loss']:.4f} | "
        f"{h['val_accuracy']:.4%} | {h.get('samples_per_sec', 0):,.0f} | "
        f"{h.get('epoch_seconds', 0):.1f} |"
        for h in metrics.get("history", [])
    )
    elastic = elastic_summary(metrics)
    world = ""
    if elastic is not None:
        changes = "\n".join(
            f"| {w.get('epoch')} | {w.get('samples_into_epoch')} | {w.get('from')} → "
            f"{w.get('to')} | {', '.join(w.get('left') or []) or '—'} | "
            f"{', '.join(w.get('joined') or []) or '—'} |"
            for w in elastic["world_history"]
        )
        world = f"""
## Elastic world
- world sizes: {" → ".join(map(str, elastic["world_sizes"]))}; committed every \
{elastic["commit_every"]} steps; trained again after a reset: {elastic["redone_steps"]} \
steps ({elastic["redone_samples"]} samples)

| epoch | samples into it | world | left | joined |
| --- | --- | --- | --- | --- |
{changes}
"""
    return f"""# {model_name} {version}

Published {published_at} by DAG run `{dag_run_id}`.

## Metrics (allreduced over {metrics.get("world_size")} ranks)
- validation accuracy: **{metrics["val_accuracy"]:.4%}** \
({metrics.get("val_correct")}/{metrics.get("val_samples")})
- validation loss: {metrics.get("val_loss", float("nan")):.4f}
- epochs: {metrics.get("epochs")}; training time: {metrics.get("train_seconds", 0):.1f} s

## Gate
- decision: **{"passed" if gate["passed"] else "failed"}** — {gate["reason"]}
- challenger: {gate["challenger_accuracy"]:.4%}; champion: {champ_txt}; \
floor: {gate["min_accuracy"]:.4%}; max regression: {gate["max_regression"]:.4%}

## ONNX export
- onnxruntime vs PyTorch on {parity.get("samples")} held-out images: max abs diff \
{parity.get("max_abs_diff")}, argmax mismatches {parity.get("argmax_mismatches")} \
(tolerance {parity.get("tolerance")})

## Dataset
- `{dataset.get("uri")}` (content hash `{dataset.get("content_hash")}`)

## Versions
- torch {versions.get("torch")}, torchvision {versions.get("torchvision")}, \
horovod {versions.get("horovod")}, trainer {versions.get("trainer")}

## History
| epoch | train loss | val loss | val accuracy | samples/s | seconds |
| --- | --- | --- | --- | --- | --- |
{rows}
{world}"""
