"""The one home of every contract between the trainer and the Airflow side: file names,
the ``format`` of each JSON file they exchange, its required keys and types, and the
preprocessing a model carries with it. Importable without torch, Airflow or numpy.

Every JSON file one side writes and the other reads carries a ``format`` string with a
version. Writers build the document with :meth:`Schema.dumps` (or :meth:`Schema.stamp`);
readers go through :meth:`Schema.loads` (or :meth:`Schema.check` on an already-parsed
object), which raises :class:`ContractError` naming the file, what was found and what is
supported, on a missing or unknown ``format``, a missing required key or a key of the wrong
type.

========================  ===================================  =================================
file                      format (``Schema``)                  written by → read by
========================  ===================================  =================================
``metrics.json``          ``horovod-airflow/metrics-v2``       training program → train operator,
                          (:data:`METRICS`)                    gate, publish, benchmarks
``parity.json``           ``horovod-airflow/parity-v1``        exporter → export operator, publish
                          (:data:`PARITY`)
``gate.json``             ``horovod-airflow/gate-v1``          gate → people, ``run_pipeline``
                          (:data:`GATE`)
``manifest.json``         ``horovod-airflow/version-v3``       publish → publish (retry), serving
(a published version)     (:data:`VERSION_MANIFEST`)
``refused/<v>/manifest``  ``horovod-airflow/version-v3``       record_refused → the registry
(a refused candidate)     (:data:`VERSION_MANIFEST`, gate      page, promote (admin override)
                          ``passed: false``)
``latest.json``           ``horovod-airflow/latest-v3``        publish, promote → gate, serving,
                          (:data:`LATEST`)                     DAGs, the registry page
``history/<stamp>.json``  ``horovod-airflow/promotion-v1``     promote/roll back → the registry
(a model's history)       (:data:`PROMOTION`)                  page, people
``manifest.json``         ``horovod-airflow/dataset-v2``       staging → trainer, gate re-scoring,
(a staged dataset)        (:data:`DATASET_FORMAT`,             the next staging's data checks
                          checked by ``horovod_airflow.core.layout``)
``manifest.json``         ``horovod-airflow/fileset-v2``       staging → a model's own training
(a staged file set)       (:data:`FILESET_FORMAT`,             program and scorer, the next
                          checked by ``horovod_airflow.core.fileset``)  staging's data checks
========================  ===================================  =================================

Legacy: a ``metrics.json`` written before per-step curves and elastic training carries
``horovod-airflow/metrics-v1`` (:data:`LEGACY_METRICS_FORMAT`): the same keys without
``steps`` (v2's bounded per-step record, :data:`STEP_SERIES`) and ``elastic`` (an elastic
run's world-size history). It is still read: a later try returns that training, and publish
draws its per-epoch curves.

Legacy: a staged dataset's or file set's ``manifest.json`` staged before the data checks
carries ``horovod-airflow/dataset-v1`` or ``fileset-v1`` (:data:`LEGACY_DATASET_FORMAT`,
:data:`LEGACY_FILESET_FORMAT`): the same files, without the per-file statistics (classes,
duplicates, dtype) that v2 adds. They are still read: the ranks train on them, and the next
staging compares what such a manifest has (sample counts and shapes).

Legacy: a ``latest.json`` of ``horovod-airflow/latest-v2`` (written before promote and roll
back) lacks ``since`` and ``promotion``; it is still read (and is what serving followed since
its ``published_at``).

Legacy: a published version's ``manifest.json`` and the registry's ``latest.json`` written
before this contract carry ``horovod-airflow/model-v1``. They are still *read* (so the gate
can compare against, and publish can replace, a champion published by an earlier release),
and a ``model-v1`` manifest may lack ``preprocessing``; such a model cannot be *served*: its
ONNX file carries no preprocessing metadata, and serving refuses it with
:class:`ContractError` instead of guessing. Every other file (run outputs, never kept across
releases) must carry its current format; a missing one is an error.

The preprocessing of a model (:data:`PREPROCESSING`) travels in the exported ONNX file, as
the JSON string of the metadata property :data:`PREPROCESSING_KEY`, and is recorded in
``parity.json`` and the version manifest. The model input is
``(raw * scale - mean[c]) / std[c]`` in ``dtype``, shaped ``[batch, *input_shape]``, where
``c`` indexes axis ``channel_axis`` of ``input_shape`` (mean and std have one value per
channel, or one for all); :func:`apply_preprocessing` computes it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# --- file names: the files of a run, of a published version and of a staged dataset ----------
CHECKPOINT_NAME = "checkpoint.pt"  # written by rank 0 after each epoch
METRICS_NAME = "metrics.json"  # written by rank 0 at the end: the allreduced metrics
ONNX_NAME = "model.onnx"  # written by the export, only when parity holds
PARITY_NAME = "parity.json"  # written by the export: onnxruntime against PyTorch
GATE_NAME = "gate.json"  # the gate's decision, next to metrics.json
VERSION_MANIFEST_NAME = "manifest.json"  # a published version's files, sha256 and metrics
LATEST_NAME = "latest.json"  # the registry's pointer to the version serving uses
CURVES_NAME = "training_curves.png"  # a published version's loss and accuracy curves
SUMMARY_NAME = "summary.md"  # a published version's human-readable summary
HISTORY_DIR = "history"  # models/<model>/history/: one PROMOTION document per move
REFUSED_DIR = "refused"  # models/<model>/refused/<version>/: a refused run's candidate
MANIFEST_NAME = "manifest.json"  # a staged dataset's manifest

# --- formats that are not JSON documents checked here -----------------------------------------
DATASET_FORMAT = "horovod-airflow/dataset-v2"  # a staged dataset's manifest (core/layout.py)
FILESET_FORMAT = "horovod-airflow/fileset-v2"  # a staged file set's manifest (core/fileset.py)
#: The staged manifests before the data checks (no per-file statistics); still read.
LEGACY_DATASET_FORMAT = "horovod-airflow/dataset-v1"
LEGACY_FILESET_FORMAT = "horovod-airflow/fileset-v1"
CHECKPOINT_FORMAT = "horovod-airflow/checkpoint-v1"  # checkpoint.pt (trainer/resume.py, torch)
#: ``--debug-sample-ids DIR``: the file each elastic rank appends its trained sample ids to
#: (one JSON line per optimizer step), named by host and process id.
SAMPLE_IDS_NAME = "sample-ids-{host}-{pid}.jsonl"
LEGACY_MODEL_FORMAT = "horovod-airflow/model-v1"  # latest.json and manifest.json before v2

#: The ONNX metadata property holding the model's preprocessing, a JSON :data:`PREPROCESSING`.
PREPROCESSING_KEY = "horovod-airflow/preprocessing"


# --- exit codes of a training or export program ------------------------------------------
#: The command line is wrong (argparse's usage error): no retry can fix it.
EXIT_USAGE = 2
#: The program refuses its inputs or settings: a checkpoint of other settings, data or world
#: size (``--resume``), a staged dataset that fails its checks, an export whose parity fails.
#: No retry can fix it either.
EXIT_REFUSED = 3
#: What the operators treat as final: the task fails without using its retries. Any other
#: non-zero exit (a crash, a lost rank, a storage blip) is retried.
NO_RETRY_EXIT_CODES = frozenset({EXIT_USAGE, EXIT_REFUSED})


# --- stdout events of a training or export program ---------------------------------------
# One JSON object a line, ``{"event": NAME, ...}``, printed by rank 0 (the export's one
# process) as it goes: what a log reader, a benchmark or a progress report follows. The files
# above are the results; these lines only report on the way to them.
#: After each epoch: that epoch's ``history`` entry plus ``of_epochs`` (and, for our trainer,
#: ``val_correct`` and ``val_samples``).
EVENT_EPOCH = "epoch"
#: Once, last: the final metrics, as ``metrics.json`` holds them.
EVENT_FINAL_METRICS = "final_metrics"
#: Once, after an export: the parity report, as ``parity.json`` holds it.
EVENT_EXPORTED = "exported"
#: ``--debug-param-hash``: each rank's hash of its parameters at a step.
EVENT_PARAM_HASH = "param_hash"
#: While training, at least every 30 s (``--progress-seconds``), after the first step and at
#: each epoch's end: :data:`PROGRESS_FIELDS`. The launchers forward it to the task log and
#: Airflow's task state (``horovod_airflow.operators.progress``).
EVENT_PROGRESS = "progress"
EVENTS = (EVENT_EPOCH, EVENT_FINAL_METRICS, EVENT_EXPORTED, EVENT_PARAM_HASH, EVENT_PROGRESS)
#: The fields of a progress event: optimizer ``step`` (1-based, over the whole run) of
#: ``of_steps``, ``epoch`` (1-based) of ``of_epochs``, ``samples_per_sec`` (global, since this
#: try's first step), ``eta_seconds`` (of the training steps left; evaluation not counted),
#: ``loss`` (rank 0's mean batch loss since the last event) and ``lr``.
PROGRESS_FIELDS = (
    "step",
    "of_steps",
    "epoch",
    "of_epochs",
    "samples_per_sec",
    "eta_seconds",
    "loss",
    "lr",
)


def event_line(event: str, fields: Mapping[str, Any]) -> str:
    """The stdout line of ``event`` with ``fields`` (JSON, one line)."""
    if event not in EVENTS:
        raise ValueError(f"unknown event {event!r}; the contract's events: {', '.join(EVENTS)}")
    return json.dumps({"event": event, **fields})


def parse_event(line: str, event: str | None = None) -> dict[str, Any] | None:
    """The event a log line carries (``event``: only that one), else None. A prefix before the
    JSON (horovodrun's ``[0]<stdout>:``, a timestamp) is skipped; other lines are not events."""
    brace = line.find("{")
    if brace < 0:
        return None
    try:
        obj = json.loads(line[brace:])
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("event") not in EVENTS:
        return None
    return obj if event is None or obj["event"] == event else None


class ContractError(ValueError):
    """A file exchanged between the trainer and the Airflow side breaks its contract."""


class _Number:
    """Marker type: an int or float, not a bool."""


NUMBER: Any = _Number


def _type_name(kind: Any) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("number" if k is _Number else k.__name__ for k in kinds)


def _is(value: Any, kind: Any) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for k in kinds:
        if k is _Number:
            if isinstance(value, int | float) and not isinstance(value, bool):
                return True
        elif k is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return True
        elif isinstance(value, k):
            return True
    return False


@dataclass(frozen=True)
class Schema:
    """The contract of one JSON document: its file name, current format and keys.

    ``required`` and ``optional`` map a key to its type (``NUMBER``: int or float, not bool);
    an optional key may be absent or null. ``legacy`` maps an older format that is still
    read to the required keys it may lack.
    """

    name: str
    format: str
    required: Mapping[str, Any]
    optional: Mapping[str, Any] = field(default_factory=dict)
    legacy: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def supported(self) -> tuple[str, ...]:
        return (self.format, *self.legacy)

    def stamp(self, document: Mapping[str, Any]) -> dict[str, Any]:
        """``document`` with this schema's current ``format`` first, checked."""
        doc = {"format": self.format, **{k: v for k, v in document.items() if k != "format"}}
        return self.check(doc, f"the {self.name} being written")

    def dumps(self, document: Mapping[str, Any]) -> str:
        """The JSON text a writer stores: ``document`` stamped and checked."""
        return json.dumps(self.stamp(document), indent=2)

    def loads(self, text: str | bytes, source: str) -> dict[str, Any]:
        """Parse and check the JSON text read from ``source`` (a URI or path, for errors)."""
        try:
            document = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ContractError(f"{source}: {self.name} is not valid JSON: {e}") from e
        return self.check(document, source)

    def check(self, document: Any, source: str) -> dict[str, Any]:
        """Return ``document`` if it follows this schema; else raise :class:`ContractError`."""
        if not isinstance(document, dict):
            raise ContractError(
                f"{source}: a {self.name} must be a JSON object, got {type(document).__name__}"
            )
        found = document.get("format")
        if found is None:
            raise ContractError(
                f"{source}: {self.name} has no 'format'; supported: {', '.join(self.supported)}. "
                f"It was written by a program that does not follow the contract, or before "
                f"formats were versioned: write it with horovod_airflow.core.contract "
                f"({self.format!r})"
            )
        if found not in self.supported:
            raise ContractError(
                f"{source}: {self.name} has format {found!r}; supported: "
                f"{', '.join(self.supported)} (a newer or another program wrote it)"
            )
        may_lack = set(self.legacy.get(found, ()))
        missing = [k for k in self.required if k not in document and k not in may_lack]
        if missing:
            raise ContractError(
                f"{source}: {self.name} ({found}) lacks {', '.join(map(repr, missing))}; "
                f"keys present: {', '.join(sorted(document))}"
            )
        for key, kind in {**self.optional, **self.required}.items():
            if key not in document or (document[key] is None and key not in self.required):
                continue
            if not _is(document[key], kind):
                raise ContractError(
                    f"{source}: {self.name} ({found}) key {key!r} must be "
                    f"{_type_name(kind)}, got {document[key]!r:.80}"
                )
        return document


#: ``metrics.json`` before ``steps`` (per-step loss and learning rate) and ``elastic`` (an
#: elastic run's world-size history and redone steps); still read.
LEGACY_METRICS_FORMAT = "horovod-airflow/metrics-v1"

#: v2's ``steps``: a bounded per-step record written by our trainer, one entry every
#: ``every`` optimizer steps (at most :data:`MAX_STEP_POINTS` entries a run). Lists of equal
#: length: ``step`` (1-based, over the run), ``epoch`` (fractional: 0.5 = half way through
#: the first epoch), ``loss`` (rank 0's mean batch loss over the steps since the previous
#: entry) and ``lr`` (the learning rate of that step). ``from_epoch``: the epoch a resumed try
#: started after (the steps before it are not in this record).
STEP_SERIES = Schema(
    "per-step record (metrics.json 'steps')",
    "horovod-airflow/steps-v1",
    required={"every": int, "step": list, "epoch": list, "loss": list, "lr": list},
    optional={"from_epoch": int},
)
MAX_STEP_POINTS = 1000

METRICS = Schema(
    METRICS_NAME,
    # v2 (one new version for both): ``steps`` (STEP_SERIES) and ``elastic``
    # (``horovod_airflow.trainer.elastic``); v1 documents are still read.
    "horovod-airflow/metrics-v2",
    # The training-program contract asks only for the gate metric (its key is the
    # operator's ``metric_key``); the train operator checks that one.
    required={},
    optional={
        "val_accuracy": NUMBER,
        "val_loss": NUMBER,
        "val_correct": int,
        "val_samples": int,
        "epochs": int,
        "world_size": int,
        "history": list,
        "config": dict,
        "dataset": dict,
        "versions": dict,
        "runtime": dict,
        "param_hash": str,
        "train_seconds": NUMBER,
        "artifacts": dict,
        "steps": dict,  # STEP_SERIES (v2)
        "elastic": dict,  # an elastic run's world history (v2)
    },
    legacy={LEGACY_METRICS_FORMAT: ()},
)

PARITY = Schema(
    PARITY_NAME,
    "horovod-airflow/parity-v1",
    required={
        "passed": bool,
        "max_abs_diff": NUMBER,
        "argmax_mismatches": int,
        "samples": int,
        "tolerance": NUMBER,
        "preprocessing": dict,  # the PREPROCESSING the model carries, copied to the manifest
    },
    optional={
        "onnx_accuracy": NUMBER,
        "torch_accuracy": NUMBER,
        "checkpoint": str,
        "dataset": str,
        "model_bytes": int,
        "model_uri": str,
        "export_seconds": NUMBER,
    },
)

GATE = Schema(
    GATE_NAME,
    "horovod-airflow/gate-v1",
    required={
        "passed": bool,
        "reason": str,
        "challenger_accuracy": NUMBER,
        "min_accuracy": NUMBER,
        "max_regression": NUMBER,
    },
    optional={
        "champion_accuracy": NUMBER,
        "champion_version": str,
        "challenger_dataset_hash": str,
        "champion_dataset_hash": str,
        "champion_stored_accuracy": NUMBER,
        "champion_rescored": bool,
        "champion_etag": str,
    },
)

#: ``manifest.json`` before an elastic run's world history (no ``elastic``); still read.
LEGACY_VERSION_FORMAT = "horovod-airflow/version-v2"

VERSION_MANIFEST = Schema(
    VERSION_MANIFEST_NAME,
    # v3: ``elastic`` (:func:`elastic_summary`) where the run trained elastic.
    "horovod-airflow/version-v3",
    required={
        "model": str,
        "version": str,
        "files": dict,  # file name -> {"uri", "sha256", "size"}
        "dataset": dict,
        "metrics": dict,
        "gate": dict,
        "source_run": str,
        "dag_run_id": str,
        "published_at": str,
        "preprocessing": dict,
    },
    optional={"epochs": int, "world_size": int, "versions": dict, "elastic": dict},
    legacy={LEGACY_VERSION_FORMAT: (), LEGACY_MODEL_FORMAT: ("preprocessing",)},
)


def elastic_summary(metrics: Mapping[str, Any]) -> dict[str, Any] | None:
    """What an elastic run's ``metrics.json`` ``elastic`` block tells a person after the run
    (the train task's XCom, a version's manifest and summary): the world sizes in order, each
    change (when, epoch, samples into it, from, to, hosts left or joined), the steps and
    samples trained again after a reset and the commit interval. None for a run that did not
    train elastic."""
    block = metrics.get("elastic")
    if not isinstance(block, Mapping):
        return None
    keep = ("time", "epoch", "samples_into_epoch", "from", "to", "left", "joined")
    return {
        "world_sizes": list(block.get("world_sizes") or []),
        "world_history": [
            {k: w.get(k) for k in keep if k in w}
            for w in block.get("world_history") or []
            if isinstance(w, Mapping)
        ],
        "redone_steps": block.get("redone_steps"),
        "redone_samples": block.get("redone_samples"),
        "commit_every": block.get("commit_every"),
    }


#: ``latest.json`` before promote / roll back (no ``since``, no ``promotion``); still read.
LEGACY_LATEST_FORMAT = "horovod-airflow/latest-v2"

LATEST = Schema(
    LATEST_NAME,
    "horovod-airflow/latest-v3",
    required={
        "model": str,
        "version": str,
        "uri": str,
        "manifest_uri": str,
        "onnx_uri": str,
        "onnx_sha256": str,
        "val_accuracy": NUMBER,
    },
    optional={
        "dataset_uri": str,
        "dataset_content_hash": str,
        "dag_run_id": str,
        "published_at": str,
        # v3: when latest.json started naming this version (a publish or a promotion), and
        # for a promotion or roll back, who moved it, why, and whether an admin override
        # allowed it (the PROMOTION document of the move, less the versions).
        "since": str,
        "promotion": dict,
    },
    legacy={LEGACY_LATEST_FORMAT: (), LEGACY_MODEL_FORMAT: ()},
)

#: One move of ``latest.json`` by hand (promote / roll back), ``models/<model>/history/``.
PROMOTION = Schema(
    "promotion record",
    "horovod-airflow/promotion-v1",
    required={
        "model": str,
        "version": str,  # the version latest.json names after the move
        "previous_version": (str, type(None)),
        "action": str,  # "rollback" (to an older version) or "promote" (to a newer one)
        "actor": str,  # who: the Airflow user, or the CLI's --actor
        "reason": str,
        "override": bool,  # an admin override allowed what the rules refuse
        "at": str,
    },
    optional={"override_reason": str, "checks": list, "asset_event": str},
)

PREPROCESSING = Schema(
    "preprocessing metadata",
    "horovod-airflow/preprocessing-v1",
    required={
        "input_name": str,
        "input_shape": list,  # per sample, without the batch axis
        "dtype": str,
        "channel_axis": int,  # the axis of input_shape that mean and std index
        "scale": NUMBER,
        "mean": list,
        "std": list,
        "output_name": str,
        "labels": list,  # the name of each output class, by index
    },
)

SUPPORTED_DTYPES = ("float32",)


def check_preprocessing(document: Any, source: str) -> dict[str, Any]:
    """:data:`PREPROCESSING`'s schema plus its consistency (shape, channels, std > 0)."""
    pre = PREPROCESSING.check(document, source)
    shape, axis = pre["input_shape"], pre["channel_axis"]
    if not shape or not all(_is(d, int) and d > 0 for d in shape):
        raise ContractError(f"{source}: input_shape must be positive integers, got {shape}")
    if not 0 <= axis < len(shape):
        raise ContractError(f"{source}: channel_axis {axis} is not an axis of {shape}")
    for key in ("mean", "std"):
        values = pre[key]
        if len(values) not in (1, shape[axis]) or not all(_is(v, NUMBER) for v in values):
            raise ContractError(
                f"{source}: {key} must be 1 or {shape[axis]} numbers (input_shape[{axis}]), "
                f"got {values}"
            )
    if not all(v > 0 for v in pre["std"]):
        raise ContractError(f"{source}: std must be > 0, got {pre['std']}")
    if pre["dtype"] not in SUPPORTED_DTYPES:
        raise ContractError(
            f"{source}: dtype {pre['dtype']!r}; supported: {', '.join(SUPPORTED_DTYPES)}"
        )
    if not pre["labels"] or not all(isinstance(x, str) for x in pre["labels"]):
        raise ContractError(f"{source}: labels must be a non-empty list of strings")
    return pre


def preprocessing(
    *,
    input_name: str,
    input_shape: tuple[int, ...] | list[int],
    mean: tuple[float, ...] | list[float],
    std: tuple[float, ...] | list[float],
    labels: tuple[str, ...] | list[str],
    output_name: str,
    scale: float = 1.0,
    channel_axis: int = 0,
    dtype: str = "float32",
) -> dict[str, Any]:
    """A checked :data:`PREPROCESSING` document (what an exporter stores with its model)."""
    document = {
        "format": PREPROCESSING.format,
        "input_name": input_name,
        "input_shape": [int(d) for d in input_shape],
        "dtype": dtype,
        "channel_axis": channel_axis,
        "scale": float(scale),
        "mean": [float(v) for v in mean],
        "std": [float(v) for v in std],
        "output_name": output_name,
        "labels": [str(x) for x in labels],
    }
    return check_preprocessing(document, "the preprocessing being written")


def preprocessing_metadata(pre: Mapping[str, Any]) -> dict[str, str]:
    """The ONNX ``metadata_props`` entry carrying ``pre``: ``{PREPROCESSING_KEY: json}``."""
    return {PREPROCESSING_KEY: json.dumps(check_preprocessing(dict(pre), "preprocessing"))}


def preprocessing_from_metadata(metadata: Mapping[str, str], source: str) -> dict[str, Any]:
    """The preprocessing an ONNX model carries (its custom metadata map); never a guess.

    Raises :class:`ContractError` when the model has none (exported before preprocessing
    travelled with the model, or by another exporter) or when it is malformed.
    """
    text = metadata.get(PREPROCESSING_KEY)
    if text is None:
        raise ContractError(
            f"{source}: the model carries no preprocessing (ONNX metadata property "
            f"{PREPROCESSING_KEY!r} is missing; it has {sorted(metadata) or 'none'}). Serving "
            f"does not guess the input normalization: re-export the model with this release"
        )
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise ContractError(f"{source}: {PREPROCESSING_KEY} is not valid JSON: {e}") from e
    return check_preprocessing(document, f"{source} ({PREPROCESSING_KEY})")


def apply_preprocessing(pre: Mapping[str, Any], raw: Any) -> Any:
    """The model input for ``raw`` samples: ``(raw * scale - mean[c]) / std[c]``.

    ``raw`` is a numpy array ``[N, *input_shape]``, or any ``[N, ...]`` with as many values
    per sample (e.g. MNIST's ``[N, 28, 28]`` for ``input_shape [1, 28, 28]``). Needs numpy.
    """
    import numpy as np

    shape = [int(d) for d in pre["input_shape"]]
    dtype = np.dtype(pre["dtype"])
    array = np.asarray(raw)
    per_sample = int(np.prod(shape))
    if array.ndim == 0 or (array.size and array.size != len(array) * per_sample):
        raise ContractError(
            f"raw input of shape {list(array.shape)} does not hold [N, {shape}] samples"
        )
    x = array.reshape(len(array), *shape).astype(dtype) * dtype.type(pre["scale"])
    broadcast = [1] * (len(shape) + 1)
    broadcast[1 + int(pre["channel_axis"])] = -1
    mean = np.asarray(pre["mean"], dtype=dtype).reshape(broadcast)
    std = np.asarray(pre["std"], dtype=dtype).reshape(broadcast)
    return ((x - mean) / std).astype(dtype)
