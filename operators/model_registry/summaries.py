"""What a person reads next to a published model: the training curves (PNG) and a Markdown
summary of its metrics, gate decision, ONNX parity, dataset and versions."""

from __future__ import annotations

import io
from typing import Any


def render_training_curves(history: list[dict[str, Any]]) -> bytes:
    """A PNG of train/val loss and val accuracy per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    ax_loss.plot(epochs, [h["train_loss"] for h in history], "o-", label="train loss")
    ax_loss.plot(epochs, [h["val_loss"] for h in history], "s-", label="val loss")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("cross-entropy")
    ax_loss.set_title("Loss (allreduced over ranks)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_acc.plot(epochs, [100 * h["val_accuracy"] for h in history], "o-", color="tab:green")
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("accuracy (%)")
    ax_acc.set_title("Validation accuracy (whole set)")
    ax_acc.grid(alpha=0.3)
    for ax in (ax_loss, ax_acc):
        ax.set_xticks(epochs)
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
"""
