"""Shared helpers for the operator tests: a minimal task context and an eval set on S3."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.operators.fakes import FakeTI, TaskStateStore

PROGRAM = ("python", "-m", "tests.programs.allreduce_program")


def context(
    try_number: int = 1, run_id: str = "manual__test", store: TaskStateStore | None = None
) -> dict[str, Any]:
    ctx: dict[str, Any] = {"ti": FakeTI(try_number), "run_id": run_id}
    if store is not None:
        ctx["task_state_store"] = store
    return ctx


def put_eval_set(s3: Any, bucket: str, prefix: str, n: int = 40) -> tuple[str, float]:
    """Write ``eval.json`` (labels, predictions) and return (data URI, its true accuracy)."""
    labels = [i % 10 for i in range(n)]
    predictions = [lab if i % 4 else (lab + 1) % 10 for i, lab in enumerate(labels)]
    s3.put_object(
        Bucket=bucket,
        Key=f"{prefix}/eval.json",
        Body=json.dumps({"labels": labels, "predictions": predictions}).encode(),
    )
    accuracy = sum(a == b for a, b in zip(labels, predictions, strict=True)) / n
    return f"s3://{bucket}/{prefix}", accuracy


def linear_onnx_model(weights: Any, bias: Any, *, preprocessing: bool = True) -> bytes:
    """A real ONNX classifier ``image [N,1,28,28] → logits [N,10]`` (Flatten + Gemm), no torch.

    It carries the trainer's preprocessing metadata unless ``preprocessing=False``.
    """
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from horovod_airflow.core import contract
    from horovod_airflow.trainer.model import preprocessing as mnist_preprocessing

    w = numpy_helper.from_array(np.asarray(weights, dtype=np.float32), "W")
    b = numpy_helper.from_array(np.asarray(bias, dtype=np.float32), "B")
    graph = helper.make_graph(
        [
            helper.make_node("Flatten", ["image"], ["flat"], axis=1),
            helper.make_node("Gemm", ["flat", "W", "B"], ["logits"]),
        ],
        "linear",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 28, 28])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        initializer=[w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if preprocessing:
        for key, value in contract.preprocessing_metadata(mnist_preprocessing()).items():
            entry = model.metadata_props.add()
            entry.key, entry.value = key, value
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def centroid_classifier(images: Any, labels: Any) -> tuple[Any, Any]:
    """Weights and bias of a nearest-centroid classifier (normalized pixels), as a Gemm."""
    import numpy as np

    from horovod_airflow.core import contract
    from horovod_airflow.trainer.model import preprocessing

    x = contract.apply_preprocessing(preprocessing(), images).reshape(len(images), -1)
    centroids = np.stack([x[labels == c].mean(axis=0) for c in range(10)])
    # argmin |x - c|^2 = argmax (x·c - |c|^2 / 2)
    return centroids.T, -0.5 * (centroids**2).sum(axis=1)


def publish_fake_model(
    s3: Any,
    bucket: str,
    *,
    version: str,
    onnx_bytes: bytes,
    accuracy: float,
    dataset_hash: str,
    dag_run_id: str,
    dataset_uri: str | None = None,
    val_samples: int | None = None,
) -> dict[str, Any]:
    """A run's artifacts around a real ONNX file, published through the real registry.

    ``dataset_uri`` (default: a made-up one under the bucket) and ``val_samples`` are what the
    version records its accuracy was measured on: the serving check predicts there."""
    from horovod_airflow.operators.model_registry import (
        RunModel,
        decide_gate,
        publish_model,
        read_latest,
    )

    run = f"s3://{bucket}/runs/fake/{version}"
    put_run_artifacts(s3, run, accuracy=accuracy, onnx_bytes=onnx_bytes, val_samples=val_samples)
    champion, etag = read_latest(f"s3://{bucket}", "mnist_cnn", client=s3)
    gate = decide_gate(accuracy, min_accuracy=0.0, champion=champion, max_regression=1.0,
                       challenger_dataset_hash=dataset_hash, champion_rescored_accuracy=0.0,
                       champion_etag=etag).as_dict()  # fmt: skip
    return publish_model(f"s3://{bucket}", RunModel(
        model_name="mnist_cnn", run_output=run,
        onnx_uri=f"{run}/onnx/model.onnx", parity_uri=f"{run}/onnx/parity.json",
        dataset={"uri": dataset_uri or f"s3://{bucket}/datasets/mnist/{dataset_hash[:16]}",
                 "content_hash": dataset_hash},
        gate=gate, dag_run_id=dag_run_id, version=version,
    ), client=s3)  # fmt: skip


def undocumented_template_fields(operator_class: type) -> list[str]:
    """Template fields whose ``:param`` in the class docstring does not say ``(templated)``."""
    import re

    doc = operator_class.__doc__ or ""
    params = {
        m.group(1): m.group(2)
        for m in re.finditer(r":param (\w+):(.*?)(?=:param |\Z)", doc, flags=re.DOTALL)
    }
    return [f for f in operator_class.template_fields if "(templated)" not in params.get(f, "")]


def dag_in_bundle(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, dag_id: str, source: str) -> Any:
    """The ``dag`` of ``source``, written as a DAG file into a DAG bundle of its own.

    Airflow 3's ``dag.test()`` runs only DAGs that a bundle holds (it serializes them from
    there), so a test's DAG is added as a second bundle next to the project's dags/.
    """
    import importlib.util
    import textwrap

    folder = tmp_path / f"bundle-{dag_id}"
    folder.mkdir()
    path = folder / f"{dag_id}.py"
    path.write_text(textwrap.dedent(source))
    bundles = [
        {
            "name": "dags-folder",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {},
        },
        {
            "name": f"hva-{dag_id}",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {"path": str(folder), "refresh_interval": 0},
        },
    ]
    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps(bundles))
    spec = importlib.util.spec_from_file_location(dag_id, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dag


def publish_centroid_model(
    s3: Any,
    bucket: str,
    staged: dict[str, Any],
    train: Any,
    test: Any,
    *,
    version: str,
    dag_run_id: str,
    accuracy: float | None = None,
) -> dict[str, Any]:
    """A nearest-centroid ONNX model of ``train`` published as measured on the staged dataset
    ``staged`` (``stage_dataset``'s result; ``test`` its test split as arrays): its recorded
    accuracy is the true one, computed here in numpy, unless ``accuracy`` says otherwise."""
    import numpy as np

    from horovod_airflow.core import contract
    from horovod_airflow.trainer.model import preprocessing

    weights, bias = centroid_classifier(*train)
    images, labels = test
    x = contract.apply_preprocessing(preprocessing(), images).reshape(len(images), -1)
    true = float(((x @ weights + bias).argmax(axis=1) == np.asarray(labels)).mean())
    return publish_fake_model(
        s3, bucket, version=version, onnx_bytes=linear_onnx_model(weights, bias),
        accuracy=true if accuracy is None else accuracy, dataset_hash=staged["content_hash"],
        dag_run_id=dag_run_id, dataset_uri=staged["uri"], val_samples=len(labels),
    )  # fmt: skip


def refused_centroid_candidate(
    s3: Any,
    bucket: str,
    staged: dict[str, Any],
    train: Any,
    test: Any,
    *,
    version: str,
    dag_run_id: str,
    reason: str,
) -> dict[str, Any]:
    """A nearest-centroid ONNX model of ``train`` whose run the gate refused (``reason``),
    kept as a refused candidate by the real registry (``record_refused``); its recorded
    accuracy is the true one on ``test``."""
    import numpy as np

    from horovod_airflow.core import contract, storage
    from horovod_airflow.operators.model_registry import RunModel
    from horovod_airflow.operators.model_registry.refused import record_refused
    from horovod_airflow.trainer.model import preprocessing

    weights, bias = centroid_classifier(*train)
    images, labels = test
    x = contract.apply_preprocessing(preprocessing(), images).reshape(len(images), -1)
    true = float(((x @ weights + bias).argmax(axis=1) == np.asarray(labels)).mean())
    run = f"s3://{bucket}/runs/fake/{version}"
    put_run_artifacts(s3, run, accuracy=true, onnx_bytes=linear_onnx_model(weights, bias),
                      val_samples=len(labels))  # fmt: skip
    gate = {"passed": False, "reason": reason, "challenger_accuracy": true, "min_accuracy": 0.99,
            "max_regression": 0.0}  # fmt: skip
    storage.write_text(f"{run}/gate.json", contract.GATE.dumps(gate), client=s3)
    manifest = record_refused(f"s3://{bucket}", RunModel(
        model_name="mnist_cnn", version=version, run_output=run,
        onnx_uri=f"{run}/onnx/model.onnx", parity_uri=f"{run}/onnx/parity.json",
        dataset={"uri": staged["uri"], "content_hash": staged["content_hash"]}, gate=gate,
        dag_run_id=dag_run_id,
    ), client=s3)  # fmt: skip
    assert manifest is not None
    return manifest


def put_run_artifacts(
    s3: Any,
    run: str,
    *,
    accuracy: float,
    onnx_bytes: bytes = b"onnx-bytes",
    val_samples: int | None = None,
    elastic: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a finished train and export leave under ``run`` (contents opaque to the registry;
    ``elastic``: the ``metrics.json`` block of an elastic run).

    Returns the XComs of the train and export tasks, as those operators return them.
    """
    from horovod_airflow.core import storage
    from horovod_airflow.core.contract import METRICS, PARITY
    from horovod_airflow.trainer.model import preprocessing

    storage.write_bytes(f"{run}/checkpoint.pt", b"checkpoint", client=s3)
    history = [{"epoch": 1, "train_loss": 0.5, "val_loss": 0.4, "val_accuracy": accuracy}]
    metrics = {"val_accuracy": accuracy, "val_loss": 0.4, "epochs": 1, "world_size": 1,
               "history": history}  # fmt: skip
    if val_samples is not None:
        metrics["val_samples"] = val_samples
    if elastic is not None:
        metrics["elastic"] = elastic
    storage.write_text(f"{run}/metrics.json", METRICS.dumps(metrics), client=s3)
    storage.write_bytes(f"{run}/onnx/model.onnx", onnx_bytes, client=s3)
    parity = {"passed": True, "max_abs_diff": 0.0, "argmax_mismatches": 0, "samples": 10,
              "tolerance": 1e-4, "preprocessing": preprocessing()}  # fmt: skip
    storage.write_text(f"{run}/onnx/parity.json", PARITY.dumps(parity), client=s3)
    trained = {"val_accuracy": accuracy, "output": run, "metrics_uri": f"{run}/metrics.json",
               "checkpoint_uri": f"{run}/checkpoint.pt"}  # fmt: skip
    exported = {"onnx_uri": f"{run}/onnx/model.onnx", "parity_uri": f"{run}/onnx/parity.json",
                "passed": True}  # fmt: skip
    return trained, exported


def with_launcher_options(kw: dict[str, Any]) -> dict[str, Any]:
    """The tests' shorthand: loose launcher settings (``namespace="ml"``, ``mounts=[...]``)
    moved into the options object of the launcher they belong to (``kubernetes=
    KubernetesOptions(namespace="ml")``); one both launchers have goes to ``kw["launcher"]``'s."""
    import dataclasses

    from horovod_airflow.operators.job import LAUNCHER_OPTIONS

    out = dict(kw)
    grouped: dict[str, dict[str, Any]] = {}
    for key in list(out):
        owners = [
            name
            for name, cls in LAUNCHER_OPTIONS.items()
            if key in {f.name for f in dataclasses.fields(cls)}
        ]
        if not owners:
            continue
        owner = out.get("launcher") if len(owners) > 1 else owners[0]
        grouped.setdefault(str(owner), {})[key] = out.pop(key)
    for name, values in grouped.items():
        out[name] = LAUNCHER_OPTIONS[name](**values)
    return out
