"""The model registry in S3: the champion/challenger gate and publishing a model for serving.

Layout (``<bucket>/models/<model_name>/``)::

    <version>/model.onnx, checkpoint.pt, metrics.json, parity.json,
              training_curves.png, summary.md, manifest.json   # manifest written last
    latest.json        # points at the serving version; written last

Every document read or written here follows its schema in ``horovod_airflow.core.contract``
(``LATEST``, ``VERSION_MANIFEST``, ``GATE``, ``METRICS``, ``PARITY``); the version manifest
records the preprocessing the model carries (from ``parity.json``).

A version directory is complete before ``latest.json`` names it, so a reader that follows
``latest.json`` never sees a half-published model, and a failed or gated run never touches
what serving uses. The version is named by the run (:func:`run_version`), so a retried
publish finds its own version instead of adding one. ``latest.json`` is written with a
conditional put on the ETag the gate read: a champion that changed in between fails the
publish (:class:`ChampionChangedError`) and is never overwritten. The gate compares
accuracies measured on the same dataset content, re-scoring the champion when they differ.
Runs in the Airflow worker; needs no torch (re-scoring uses onnxruntime).

The package, by concern: :mod:`.latest` (``latest.json``: read with its ETag, the
compare-and-swap write, key segments and version names), :mod:`.gate` (the
champion/challenger decision and re-scoring the champion), :mod:`.publish` (copying a
version, moving ``latest.json`` forward) and :mod:`.summaries` (the curves and the summary
of a version).
"""

from horovod_airflow.operators.model_registry.gate import (
    GateDecision,
    champion_dataset_hash,
    decide_gate,
    gate_challenger,
    resolve_champion_scorer,
)
from horovod_airflow.operators.model_registry.latest import (
    KEY_HASH_CHARS,
    KEY_READABLE_CHARS,
    ConditionalWritesUnsupportedError,
    check_conditional_writes,
    check_version,
    latest_asset_name,
    latest_uri,
    models_prefix,
    read_champion,
    read_latest,
    safe_key,
    write_latest,
)
from horovod_airflow.operators.model_registry.publish import (
    RunModel,
    asset_event_extra,
    check_forward,
    publish_model,
    run_version,
)
from horovod_airflow.operators.model_registry.summaries import (
    render_summary,
    render_training_curves,
)

__all__ = [
    "KEY_HASH_CHARS",
    "KEY_READABLE_CHARS",
    "ConditionalWritesUnsupportedError",
    "GateDecision",
    "RunModel",
    "asset_event_extra",
    "champion_dataset_hash",
    "check_conditional_writes",
    "check_forward",
    "check_version",
    "decide_gate",
    "gate_challenger",
    "latest_asset_name",
    "latest_uri",
    "models_prefix",
    "publish_model",
    "read_champion",
    "read_latest",
    "render_summary",
    "render_training_curves",
    "resolve_champion_scorer",
    "run_version",
    "safe_key",
    "write_latest",
]
