"""The contract between the trainer and the Airflow side (``core/contract.py``): formats,
required keys and types of the exchanged JSON files, and the preprocessing a model carries."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from horovod_airflow.core import contract
from horovod_airflow.core.contract import (
    GATE,
    LATEST,
    METRICS,
    PARITY,
    PREPROCESSING_KEY,
    VERSION_MANIFEST,
    ContractError,
)


def _pre(**overrides):
    args = dict(input_name="x", input_shape=[3, 2, 2], mean=[0.5, 0.25, 0.0],
                std=[0.5, 0.25, 1.0], labels=["cat", "dog"], output_name="y",
                scale=1 / 255)  # fmt: skip
    return contract.preprocessing(**{**args, **overrides})


def test_the_contract_imports_without_torch_numpy_or_airflow():
    code = (
        "import sys, horovod_airflow.core.contract, horovod_airflow.core.layout; "
        "print(sorted(m for m in ('torch', 'numpy', 'airflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_written_document_carries_its_format_and_reads_back():
    text = GATE.dumps({"passed": True, "reason": "ok", "challenger_accuracy": 0.9,
                       "min_accuracy": 0.5, "max_regression": 0.1})  # fmt: skip
    doc = json.loads(text)
    assert doc["format"] == GATE.format == "horovod-airflow/gate-v1"
    assert GATE.loads(text, "s3://b/gate.json") == doc
    assert METRICS.stamp({"format": "stale", "val_accuracy": 1})["format"] == METRICS.format


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{}", "s3://b/r/parity.json: parity.json has no 'format'; supported: "
               "horovod-airflow/parity-v1"),
        ('{"format": "horovod-airflow/parity-v2"}', "parity.json has format "
         "'horovod-airflow/parity-v2'; supported: horovod-airflow/parity-v1"),
        ('{"format": "horovod-airflow/parity-v1", "passed": true}',
         "lacks 'max_abs_diff', 'argmax_mismatches', 'samples', 'tolerance', 'preprocessing'"),
        ("[]", "a parity.json must be a JSON object, got list"),
        ("{", "parity.json is not valid JSON"),
    ],
)  # fmt: skip
def test_a_reader_names_the_file_what_it_found_and_what_is_supported(text, says):
    with pytest.raises(ContractError) as refused:
        PARITY.loads(text, "s3://b/r/parity.json")
    assert says in str(refused.value)


def test_types_are_checked_and_a_bool_is_not_a_number():
    base = {"format": METRICS.format}
    METRICS.check({**base, "val_accuracy": 1, "epochs": None}, "m")  # optional null is absent
    with pytest.raises(ContractError, match="key 'val_accuracy' must be number, got True"):
        METRICS.check({**base, "val_accuracy": True}, "m")
    with pytest.raises(ContractError, match=r"key 'epochs' must be int, got 2\.0"):
        METRICS.check({**base, "epochs": 2.0}, "m")


def test_legacy_registry_documents_are_read_and_may_lack_preprocessing():
    assert LATEST.supported == (
        "horovod-airflow/latest-v3",
        contract.LEGACY_LATEST_FORMAT,
        contract.LEGACY_MODEL_FORMAT,
    )
    manifest = {"model": "m", "version": "v", "files": {}, "dataset": {}, "metrics": {},
                "gate": {}, "source_run": "r", "dag_run_id": "d", "published_at": "t"}  # fmt: skip
    VERSION_MANIFEST.check({"format": contract.LEGACY_MODEL_FORMAT, **manifest}, "old")
    with pytest.raises(ContractError, match="lacks 'preprocessing'"):
        VERSION_MANIFEST.check({"format": VERSION_MANIFEST.format, **manifest}, "new")
    # version-v2 (before an elastic run's world history) is still read as it was written.
    v2 = {"format": contract.LEGACY_VERSION_FORMAT, **manifest, "preprocessing": {}}
    assert VERSION_MANIFEST.supported[:2] == (
        "horovod-airflow/version-v3",
        "horovod-airflow/version-v2",
    )
    assert VERSION_MANIFEST.check(v2, "v2") == v2
    with pytest.raises(ContractError, match="key 'elastic' must be dict"):
        VERSION_MANIFEST.check({**v2, "format": VERSION_MANIFEST.format, "elastic": [3, 2]}, "v3")


def test_the_elastic_summary_keeps_what_a_person_reads_after_the_run():
    assert contract.elastic_summary({"val_accuracy": 0.9}) is None  # not an elastic run
    block = {
        "commit_every": 20, "world_sizes": [3, 2], "redone_steps": 4, "redone_samples": 512,
        "commits": 40, "commit_seconds": 1.5,  # one rank's timings: not for the registry
        "world_history": [
            {"time": 1.0, "epoch": 1, "samples_into_epoch": 0, "from": 0, "to": 3, "left": [],
             "joined": ["a", "b", "c"], "redone_steps_so_far": 0},
            {"time": 2.0, "epoch": 1, "samples_into_epoch": 960, "from": 3, "to": 2,
             "left": ["c"], "joined": [], "redone_steps_so_far": 4},
        ],
    }  # fmt: skip
    summary = contract.elastic_summary({"elastic": block})
    assert summary == {
        "world_sizes": [3, 2], "redone_steps": 4, "redone_samples": 512, "commit_every": 20,
        "world_history": [
            {"time": 1.0, "epoch": 1, "samples_into_epoch": 0, "from": 0, "to": 3, "left": [],
             "joined": ["a", "b", "c"]},
            {"time": 2.0, "epoch": 1, "samples_into_epoch": 960, "from": 3, "to": 2,
             "left": ["c"], "joined": []},
        ],
    }  # fmt: skip


def test_preprocessing_is_checked_when_built():
    assert _pre()["format"] == contract.PREPROCESSING.format
    for bad, says in [
        ({"mean": [0.1, 0.2]}, "mean must be 1 or 3 numbers (input_shape[0])"),
        ({"std": [0.0]}, "std must be > 0"),
        ({"channel_axis": 3}, "channel_axis 3 is not an axis of [3, 2, 2]"),
        ({"dtype": "float16"}, "dtype 'float16'; supported: float32"),
        ({"labels": []}, "labels must be a non-empty list of strings"),
        ({"input_shape": [3, 0, 2]}, "input_shape must be positive integers"),
    ]:
        with pytest.raises(ContractError) as refused:
            _pre(**bad)
        assert says in str(refused.value), bad


def test_preprocessing_travels_as_onnx_metadata_and_is_never_guessed():
    pre = _pre()
    meta = contract.preprocessing_metadata(pre)
    assert list(meta) == [PREPROCESSING_KEY]
    assert contract.preprocessing_from_metadata({**meta, "producer": "p"}, "model.onnx") == pre
    with pytest.raises(ContractError) as refused:
        contract.preprocessing_from_metadata({"normalize_mean": "0.1"}, "s3://b/model.onnx")
    assert "s3://b/model.onnx: the model carries no preprocessing" in str(refused.value)
    assert "['normalize_mean']" in str(refused.value)
    broken = {PREPROCESSING_KEY: json.dumps({**pre, "std": "wide"})}
    with pytest.raises(ContractError, match="key 'std' must be list"):
        contract.preprocessing_from_metadata(broken, "model.onnx")


def test_apply_preprocessing_normalizes_each_channel():
    raw = np.arange(2 * 3 * 2 * 2, dtype=np.uint8).reshape(2, 3, 2, 2)
    x = contract.apply_preprocessing(_pre(), raw)
    assert x.dtype == np.float32 and x.shape == (2, 3, 2, 2)
    mean, std = np.array([0.5, 0.25, 0.0]), np.array([0.5, 0.25, 1.0])
    expected = (raw / 255 - mean[None, :, None, None]) / std[None, :, None, None]
    np.testing.assert_allclose(x, expected, rtol=1e-6)
    mono = _pre(input_shape=[1, 2, 2], mean=[0.5], std=[0.5])  # [N, H, W] gains its channel
    assert contract.apply_preprocessing(mono, raw[:, 0]).shape == (2, 1, 2, 2)
    with pytest.raises(ContractError, match=r"raw input of shape \[2, 5\] does not hold"):
        contract.apply_preprocessing(mono, np.zeros((2, 5)))


def test_stdout_events_round_trip_and_unknown_ones_are_refused():
    line = contract.event_line(contract.EVENT_EPOCH, {"epoch": 1, "val_accuracy": 0.99})
    assert contract.parse_event("[0]<stdout>:" + line) == {
        "event": "epoch", "epoch": 1, "val_accuracy": 0.99,
    }  # fmt: skip
    assert contract.parse_event(line, contract.EVENT_FINAL_METRICS) is None
    assert contract.parse_event('{"event": "sleeping"}') is None  # not the contract's
    assert contract.parse_event("epoch 1 done {not json") is None
    with pytest.raises(ValueError, match="unknown event 'export'; the contract's events: epoch"):
        contract.event_line("export", {})


# --- the contract as JSON Schema (core/json_schemas.py, docs/contract/) ----------------------
def test_the_json_schema_files_are_the_ones_the_contract_generates():
    from horovod_airflow.core.json_schemas import SCHEMAS, render
    from tests.conftest import REPO

    folder = REPO / "docs" / "contract"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"{name}.schema.json" for name in SCHEMAS
    )
    for name, schema in SCHEMAS.items():
        assert (folder / f"{name}.schema.json").read_text() == render(schema), (
            f"docs/contract/{name}.schema.json is stale: run "
            "python -m horovod_airflow.core.json_schemas docs/contract"
        )


_SAMPLE = {
    contract.NUMBER: 0.5, int: 3, bool: True, str: "s", list: [1], dict: {"k": 1}, type(None): None
}  # fmt: skip
#: A value of each type that no other declared type accepts (a bool is not a number).
_WRONG = {contract.NUMBER: "0.5", int: 2.5, bool: 1, str: 7, list: {"a": 1}, dict: [1]}


def _kinds(kind):
    return list(kind) if isinstance(kind, tuple) else [kind]


def _documents(schema):
    """Documents around ``schema``'s edges: valid ones, and each way one can break it."""
    full = {k: _SAMPLE[_kinds(t)[0]] for k, t in schema.required.items()}
    yield "minimal", {"format": schema.format, **full}
    yield "optional null", {"format": schema.format, **full, **dict.fromkeys(schema.optional)}
    yield (
        "optional set",
        {
            "format": schema.format,
            **full,
            **{k: _SAMPLE[_kinds(t)[0]] for k, t in schema.optional.items()},
        },
    )
    yield "unknown key kept", {"format": schema.format, **full, "x_extra": [None]}
    yield "no format", full
    yield "null format", {"format": None, **full}
    yield "other format", {"format": "horovod-airflow/other-v9", **full}
    yield "not an object", [full]
    for key in schema.required:
        yield (
            f"lacks {key}",
            {"format": schema.format, **{k: v for k, v in full.items() if k != key}},
        )
        yield f"null {key}", {"format": schema.format, **full, key: None}
    for key, kind in {**schema.required, **schema.optional}.items():
        wrong = [_WRONG[k] for k in _WRONG if k not in _kinds(kind)]
        for value in wrong:
            if not any(contract._is(value, k) for k in _kinds(kind)):
                yield f"{key}={value!r}", {"format": schema.format, **full, key: value}
    for fmt, may_lack in schema.legacy.items():
        yield f"{fmt} lacking what it may", {
            "format": fmt, **{k: v for k, v in full.items() if k not in may_lack}
        }  # fmt: skip


def test_a_json_schema_validator_accepts_exactly_what_the_contract_accepts():
    """For every contract document, on documents at each edge of its schema (keys missing,
    null, of a wrong type, formats unknown or legacy), the published JSON Schema and
    ``Schema.check`` give the same verdict."""
    from jsonschema import Draft202012Validator

    from horovod_airflow.core.json_schemas import SCHEMAS, json_schema

    checked = 0
    for name, schema in SCHEMAS.items():
        published = json_schema(schema)
        Draft202012Validator.check_schema(published)
        validator = Draft202012Validator(published)
        for case, document in _documents(schema):
            try:
                schema.check(document, name)
                accepted = True
            except ContractError:
                accepted = False
            errors = [e.message for e in validator.iter_errors(document)]
            assert accepted == (not errors), (name, case, errors)
            checked += 1
    assert checked > 200  # the cases were made, not skipped
