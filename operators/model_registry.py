"""The model registry in S3: the champion/challenger gate and publishing a model for serving.

Layout (``<bucket>/models/<model_name>/``)::

    <version>/model.onnx, checkpoint.pt, metrics.json, parity.json,
              training_curves.png, summary.md, manifest.json
    latest.json        # points at the serving version; written last

A version directory is complete before ``latest.json`` names it, so a reader that follows
``latest.json`` never sees a half-published model, and a failed or gated run never touches
what serving uses. Runs in the Airflow worker; needs no torch.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainer import storage

log = logging.getLogger(__name__)

LATEST = "latest.json"
MANIFEST = "manifest.json"
FORMAT = "horovod-airflow/model-v1"
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
#: Characters of the readable part of a key, and of the hash of the exact value after it.
KEY_READABLE_CHARS = 80
KEY_HASH_CHARS = 12


def safe_key(value: str) -> str:
    """One S3 key segment for a run id or conf value: readable, safe and distinct.

    ``manual__2026-12-02T10:00:00+00:00`` → ``manual__2026-12-02T10_00_00_00_00-<12 hex>``:
    the value with unsafe characters replaced (at most 80 of them), then the first 12 hex
    digits of the sha256 of the *exact* value. The readable part alone is not one-to-one
    (``a:b``, ``a+b`` and ``a b`` all read ``a_b``; long ids cut at the same place), the hash
    makes the key so: two runs share a prefix only if their ids are equal (or collide in
    48 bits of sha256). Deterministic, so every try of a run finds the same prefix.
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"cannot make a key segment from {value!r}: need a non-empty string")
    readable = _SAFE.sub("_", value).strip("._-")[:KEY_READABLE_CHARS].rstrip("._-")
    digest = hashlib.sha256(value.encode("utf-8")).hexdigest()[:KEY_HASH_CHARS]
    return f"{readable}-{digest}" if readable else digest


def models_prefix(bucket_uri: str, model_name: str) -> str:
    return storage.join(bucket_uri, "models", model_name)


def read_champion(bucket_uri: str, model_name: str, *, client: Any | None = None) -> dict | None:
    """The published ``latest.json`` of ``model_name``, or None before the first publish."""
    uri = storage.join(models_prefix(bucket_uri, model_name), LATEST)
    if not storage.exists(uri, client=client):
        return None
    return json.loads(storage.read_text(uri, client=client))


@dataclass(frozen=True)
class GateDecision:
    """The outcome of the champion/challenger gate, with both numbers and the reason."""

    passed: bool
    reason: str
    challenger_accuracy: float
    min_accuracy: float
    champion_accuracy: float | None
    champion_version: str | None
    max_regression: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide_gate(
    challenger_accuracy: float,
    *,
    min_accuracy: float,
    champion: dict | None,
    max_regression: float,
) -> GateDecision:
    """Pass when accuracy >= min_accuracy and is not worse than the champion by > max_regression.

    Accuracies are fractions in [0, 1]. The first model has no champion and is judged by the
    floor alone.
    """
    for name, value in (
        ("challenger_accuracy", challenger_accuracy),
        ("min_accuracy", min_accuracy),
        ("max_regression", max_regression),
    ):
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} must be a fraction in [0, 1], got {value!r}")
    champ_acc = None if champion is None else float(champion["val_accuracy"])
    champ_ver = None if champion is None else str(champion.get("version"))
    kwargs = dict(
        challenger_accuracy=float(challenger_accuracy),
        min_accuracy=float(min_accuracy),
        champion_accuracy=champ_acc,
        champion_version=champ_ver,
        max_regression=float(max_regression),
    )
    if challenger_accuracy < min_accuracy:
        return GateDecision(
            passed=False,
            reason=(
                f"accuracy {challenger_accuracy:.4%} is below the floor min_accuracy "
                f"{min_accuracy:.4%}"
            ),
            **kwargs,  # type: ignore[arg-type]
        )
    if champ_acc is not None and challenger_accuracy < champ_acc - max_regression:
        return GateDecision(
            passed=False,
            reason=(
                f"accuracy {challenger_accuracy:.4%} is worse than the champion {champ_ver} "
                f"({champ_acc:.4%}) by more than max_regression {max_regression:.4%}"
            ),
            **kwargs,  # type: ignore[arg-type]
        )
    against = (
        "no champion yet"
        if champ_acc is None
        else f"champion {champ_ver} has {champ_acc:.4%} (max_regression {max_regression:.4%})"
    )
    return GateDecision(
        passed=True,
        reason=(f"accuracy {challenger_accuracy:.4%} >= floor {min_accuracy:.4%}; {against}"),
        **kwargs,  # type: ignore[arg-type]
    )


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


def new_version(now: datetime | None = None) -> str:
    """A sortable, unique-enough version name: ``v20261202T101500Z``."""
    return (now or datetime.now(UTC)).strftime("v%Y%m%dT%H%M%S%fZ")


def publish_model(
    *,
    bucket_uri: str,
    model_name: str,
    run_output: str,
    onnx_uri: str,
    parity_uri: str,
    dataset: dict[str, Any],
    gate: dict[str, Any],
    dag_run_id: str,
    client: Any | None = None,
    version: str | None = None,
) -> dict[str, Any]:
    """Copy a gated run's artifacts to a new version, then point ``latest.json`` at it.

    Returns the ``latest.json`` document. Refuses to publish a run whose gate did not pass.
    """
    if not gate.get("passed"):
        raise ValueError(f"refusing to publish: the gate did not pass ({gate.get('reason')})")
    version = version or new_version()
    prefix = storage.join(models_prefix(bucket_uri, model_name), version)
    published_at = datetime.now(UTC).isoformat(timespec="seconds")
    metrics = json.loads(storage.read_text(storage.join(run_output, "metrics.json"), client=client))
    parity = json.loads(storage.read_text(parity_uri, client=client))
    if not parity.get("passed"):
        raise ValueError(f"refusing to publish: ONNX parity failed ({parity})")
    sources = {
        "model.onnx": onnx_uri,
        "checkpoint.pt": metrics.get("artifacts", {}).get("checkpoint")
        or storage.join(run_output, "checkpoint.pt"),
        "metrics.json": storage.join(run_output, "metrics.json"),
        "parity.json": parity_uri,
    }
    files: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="hva-publish-") as tmp:
        local: dict[str, Path] = {}
        for name, src in sources.items():
            local[name] = storage.download_file(src, Path(tmp) / name, client=client)
        (Path(tmp) / "training_curves.png").write_bytes(
            render_training_curves(metrics.get("history", []))
        )
        local["training_curves.png"] = Path(tmp) / "training_curves.png"
        (Path(tmp) / "summary.md").write_text(
            render_summary(
                model_name=model_name,
                version=version,
                metrics=metrics,
                gate=gate,
                dataset=dataset,
                parity=parity,
                dag_run_id=dag_run_id,
                published_at=published_at,
            )
        )
        local["summary.md"] = Path(tmp) / "summary.md"
        for name, path in local.items():
            uri = storage.upload_file(path, storage.join(prefix, name), client=client)
            files[name] = {
                "uri": uri,
                "sha256": storage.sha256_file(path),
                "size": path.stat().st_size,
            }
    final = {k: metrics.get(k) for k in ("val_accuracy", "val_loss", "val_correct", "val_samples")}
    manifest = {
        "format": FORMAT,
        "model": model_name,
        "version": version,
        "files": files,
        "dataset": {"uri": dataset.get("uri"), "content_hash": dataset.get("content_hash")},
        "metrics": final,
        "epochs": metrics.get("epochs"),
        "world_size": metrics.get("world_size"),
        "versions": metrics.get("versions", {}),
        "gate": gate,
        "source_run": run_output,
        "dag_run_id": dag_run_id,
        "published_at": published_at,
    }
    manifest_uri = storage.write_text(
        storage.join(prefix, MANIFEST), json.dumps(manifest, indent=2), client=client
    )
    latest = {
        "format": FORMAT,
        "model": model_name,
        "version": version,
        "uri": prefix,
        "manifest_uri": manifest_uri,
        "onnx_uri": files["model.onnx"]["uri"],
        "onnx_sha256": files["model.onnx"]["sha256"],
        "val_accuracy": metrics["val_accuracy"],
        "dag_run_id": dag_run_id,
        "published_at": published_at,
    }
    # Last: readers following latest.json only ever see a complete version.
    storage.write_text(
        storage.join(models_prefix(bucket_uri, model_name), LATEST),
        json.dumps(latest, indent=2),
        client=client,
    )
    log.info("published %s %s at %s", model_name, version, prefix)
    return latest
