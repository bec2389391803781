"""The example waveform model: its DAG runs end to end on the project's operators and
publishes ``waveform_cnn`` next to ``mnist_cnn`` in the same bucket without touching it.

Real Airflow (``dag.test()``), real ``horovodrun`` with 2 CPU ranks, the moto S3 server,
real ONNX checked by onnxruntime.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from horovod_airflow.core import contract

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_DAGS = REPO / "examples" / "waveforms" / "dags"
HEAVY = ("torch", "horovod", "onnx", "onnxruntime", "matplotlib", "torchvision")
MNIST_SMALL_RUN = {"num_proc": 2, "epochs": 1, "max_train_samples": 3000, "min_accuracy": 0.5}
EXAMPLE_RUN = {"num_proc": 2, "epochs": 12, "min_accuracy": 0.6}
#: A run whose gate passed: everything ran but the refused branch (record_refused).
PUBLISHED_RUN = {
    **dict.fromkeys(("stage_dataset", "train", "gate", "export_onnx", "publish"), "success"),
    "record_refused": "skipped",
}


@pytest.fixture
def bundles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The project's dags/ and the example's DAG folder as two DAG bundles: Airflow 3's
    ``dag.test()`` runs only DAGs that a bundle holds."""
    config = [
        {"name": "dags-folder",
         "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle", "kwargs": {}},
        {"name": "examples-waveforms",
         "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
         "kwargs": {"path": str(EXAMPLE_DAGS), "refresh_interval": 0}},
    ]  # fmt: skip
    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps(config))
    monkeypatch.setenv("HVA_BUCKET", os.environ.get("HVA_BUCKET", "horovod-airflow"))


def _deploy(bucket: str, module: str):
    """Import a DAG module fresh with HVA_BUCKET=bucket (settings are read at import) and
    retire an earlier test's URI of its Asset name, as tests/dags/test_retrain_dag.py does."""
    from airflow.models.asset import AssetActive
    from airflow.utils.session import create_session

    os.environ["HVA_BUCKET"] = bucket
    import horovod_airflow.operators.settings

    importlib.reload(horovod_airflow.operators.settings)
    import examples.waveforms.settings

    importlib.reload(examples.waveforms.settings)
    mod = importlib.reload(importlib.import_module(module))
    # A serving DAG is scheduled on the Asset; a retraining DAG's publish emits it.
    dag = getattr(mod, "serve_dag", None) or mod.retrain_dag
    asset = (
        dag.task_dict["publish"].outlets[0]
        if "publish" in dag.task_dict
        else dag.timetable.asset_condition.objects[0]
    )
    with create_session() as session:
        session.query(AssetActive).filter(
            AssetActive.name == asset.name, AssetActive.uri != asset.uri
        ).delete(synchronize_session=False)
    return mod


def _states(run) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in run.get_task_instances()}


def _get(client, bucket: str, key: str) -> bytes:
    return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def _keys(client, bucket: str, prefix: str = "") -> dict[str, str]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = f"{o['ETag']}@{o['LastModified'].isoformat()}"
    return out


def _check_published(client, bucket: str, model: str) -> dict:
    """latest.json names a complete version whose ONNX bytes match its manifest's sha256."""
    latest = json.loads(_get(client, bucket, f"models/{model}/latest.json"))
    version = latest["version"]
    assert latest["model"] == model
    assert latest["manifest_uri"] == f"s3://{bucket}/models/{model}/{version}/manifest.json"
    assert latest["onnx_uri"] == f"s3://{bucket}/models/{model}/{version}/model.onnx"
    manifest = json.loads(_get(client, bucket, f"models/{model}/{version}/manifest.json"))
    assert manifest["model"] == model and manifest["version"] == version
    for name, entry in manifest["files"].items():
        body = _get(client, bucket, f"models/{model}/{version}/{name}")
        assert hashlib.sha256(body).hexdigest() == entry["sha256"], (model, name)
    assert latest["onnx_sha256"] == manifest["files"]["model.onnx"]["sha256"]
    assert latest["val_accuracy"] == manifest["metrics"]["val_accuracy"]
    return latest


@pytest.mark.slow
def test_example_publishes_next_to_mnist_without_touching_it(s3_server, airflow_db, bundles):
    from airflow.sdk import DagRunState

    client = s3_server.client()
    bucket = s3_server.new_bucket("two-models")

    # 1. The MNIST retrain DAG publishes mnist_cnn (a small subset, one epoch).
    mnist = _deploy(bucket, "dags.mnist_horovod_retrain").retrain_dag
    run = mnist.test(run_conf=MNIST_SMALL_RUN)
    assert run.state == DagRunState.SUCCESS, _states(run)
    mnist_latest = _check_published(client, bucket, "mnist_cnn")
    mnist_before = {k: v for k, v in _keys(client, bucket).items() if "mnist" in k}
    mnist_latest_bytes = _get(client, bucket, "models/mnist_cnn/latest.json")

    # 2. The example DAG, same operators, same bucket.
    example = _deploy(bucket, "examples.waveforms.dags.waveforms_retrain")
    run = example.retrain_dag.test(run_conf=EXAMPLE_RUN)
    states = _states(run)
    assert run.state == DagRunState.SUCCESS, states
    assert states == PUBLISHED_RUN, states

    # 3. Both published, each its own version; MNIST's objects untouched by the example.
    wave_latest = _check_published(client, bucket, "waveform_cnn")
    assert wave_latest["version"] != mnist_latest["version"]
    assert wave_latest["dag_run_id"] == run.run_id != mnist_latest["dag_run_id"]
    assert _get(client, bucket, "models/mnist_cnn/latest.json") == mnist_latest_bytes
    keys = _keys(client, bucket)
    assert {k: v for k, v in keys.items() if "mnist" in k} == mnist_before
    assert any(k.startswith("datasets/waveforms/") and k.endswith("/manifest.json") for k in keys)
    staged = json.loads(_get(client, bucket, wave_latest["dataset_uri"][len(f"s3://{bucket}/"):]
                             + "/manifest.json"))  # fmt: skip
    assert staged["format"] == "horovod-airflow/fileset-v2" == contract.FILESET_FORMAT
    assert staged["content_hash"] == wave_latest["dataset_content_hash"]
    assert sorted(f["name"] for f in staged["files"]) == [
        "test_labels.npy", "test_signals.npy", "train_labels.npy", "train_signals.npy"
    ]  # fmt: skip
    version = wave_latest["version"]
    prefix = f"models/waveform_cnn/{version}"
    # The example's run files follow the contract: formats and schemas checked as read.
    metrics = contract.METRICS.loads(_get(client, bucket, f"{prefix}/metrics.json"), "metrics")
    assert metrics["format"] == "horovod-airflow/metrics-v2"
    assert metrics["world_size"] == 2 and metrics["val_samples"] == 400
    assert metrics["val_accuracy"] == wave_latest["val_accuracy"] >= 0.6
    parity = contract.PARITY.loads(_get(client, bucket, f"{prefix}/parity.json"), "parity")
    assert parity["format"] == "horovod-airflow/parity-v1"
    assert parity["passed"] is True and parity["argmax_mismatches"] == 0
    assert parity["onnx_accuracy"] == metrics["val_accuracy"]
    manifest = contract.VERSION_MANIFEST.loads(_get(client, bucket, f"{prefix}/manifest.json"), "m")

    # The ONNX file carries its preprocessing under the contract's key, the train split's
    # statistics and the class names; parity.json and the version manifest record the same.
    import onnxruntime as ort

    from examples.waveforms.data import CLASSES

    onnx_bytes = _get(client, bucket, f"{prefix}/model.onnx")
    meta = ort.InferenceSession(onnx_bytes).get_modelmeta().custom_metadata_map
    assert "horovod-airflow/preprocessing" in meta
    assert not [k for k in meta if k.startswith("horovod_airflow.")]  # the old keys are gone
    pre = contract.preprocessing_from_metadata(dict(meta), "model.onnx")
    assert pre["input_name"] == "signal" and pre["input_shape"] == [1, 128]
    assert pre["output_name"] == "logits" and pre["labels"] == list(CLASSES)
    assert pre["dtype"] == "float32" and pre["scale"] == 1.0 and pre["channel_axis"] == 0
    assert pre == metrics["preprocessing"] == parity["preprocessing"] == manifest["preprocessing"]
    train = np.load(REPO / "examples" / "waveforms" / "dataset" / "train_signals.npy")
    assert pre["mean"] == [pytest.approx(float(train.astype(np.float64).mean()))]
    assert pre["std"] == [pytest.approx(float(train.astype(np.float64).std()))]

    # 4. The serving DAG verifies the published example and predicts fresh waveforms.
    serve = _deploy(bucket, "examples.waveforms.dags.waveforms_serve").serve_dag
    srun = serve.test(run_conf={"sample_count": 64, "min_accuracy": 0.5})
    assert srun.state == DagRunState.SUCCESS, _states(srun)
    from examples.waveforms.serving import serving_check

    served = serving_check(f"s3://{bucket}", "waveform_cnn", client=client, sample_count=64)
    assert served["version"] == version and served["onnx_sha256"] == wave_latest["onnx_sha256"]
    assert served["accuracy"] >= 0.5 and len(served["predictions"]) == 64
    assert set(served["predictions"]) <= set(CLASSES)  # named by the model's own labels

    # 5. The gate's pluggable re-scoring: a challenger on "other" data re-scores the published
    #    champion with the example's scorer (onnxruntime on the staged test split), which
    #    reproduces the allreduced accuracy the training measured; without a scorer it refuses.
    from examples.waveforms.settings import CHAMPION_SCORER
    from horovod_airflow.operators.model_registry import gate_challenger

    other = {"uri": wave_latest["dataset_uri"], "content_hash": "0" * 64}
    challenger = {"val_accuracy": 1.0, "output": f"s3://{bucket}/scratch/gate-check"}
    decision = gate_challenger(
        bucket_uri=f"s3://{bucket}", model_name="waveform_cnn", metrics=challenger,
        dataset=other, min_accuracy=0.0, max_regression=0.0, client=client,
        champion_scorer=CHAMPION_SCORER,
    )  # fmt: skip
    assert decision.passed and decision.champion_rescored, decision
    assert decision.champion_accuracy == metrics["val_accuracy"]
    refused = gate_challenger(
        bucket_uri=f"s3://{bucket}", model_name="waveform_cnn", metrics=challenger,
        dataset=other, min_accuracy=0.0, max_regression=0.0, client=client,
        champion_scorer=None,
    )  # fmt: skip
    assert not refused.passed and "not re-scored" in refused.reason
    # MNIST's scorer cannot read a file set: the gate refuses, naming why.
    mnist_scorer = gate_challenger(
        bucket_uri=f"s3://{bucket}", model_name="waveform_cnn", metrics=challenger,
        dataset=other, min_accuracy=0.0, max_regression=0.0, client=client,
        champion_scorer="horovod_airflow.apps.mnist:score_published_model",
    )  # fmt: skip
    assert not mnist_scorer.passed and "not re-scored" in mnist_scorer.reason
    assert _get(client, bucket, "models/mnist_cnn/latest.json") == mnist_latest_bytes


@pytest.mark.slow
@pytest.mark.engine
def test_the_example_trains_and_exports_in_its_app_image_with_the_docker_launcher(
    s3_server, airflow_db, bundles, stack_images, monkeypatch, capfd
):
    """The trigger form's ``launcher=docker``: train and export run in the app's own image
    (``examples/waveforms/Dockerfile``, built on the project's trainer image), which holds its
    programs, on the real engine (podman's Docker API), as the ranks' own identity; the run
    publishes as it does with the local launcher."""
    from airflow.sdk import DagRunState

    from tests.engine_scripts import podman_cli_env

    image = stack_images["waveforms_inputs"]
    monkeypatch.setenv("DOCKER_HOST", podman_cli_env()["DOCKER_HOST"])
    monkeypatch.setenv("HVA_WAVEFORMS_IMAGE", image)
    monkeypatch.setenv("HVA_DOCKER_NETWORK", "host")  # the S3 server is on the host's loopback
    monkeypatch.setenv("HVA_RANK_AWS_CONN_ID", "hva_ranks")
    client = s3_server.client()
    bucket = s3_server.new_bucket("wave-docker", ranks=True)
    dag = _deploy(bucket, "examples.waveforms.dags.waveforms_retrain").retrain_dag
    assert dag.get_task("train").image == dag.get_task("export_onnx").image == image

    run = dag.test(run_conf={**EXAMPLE_RUN, "launcher": "docker"})
    states = _states(run)
    assert run.state == DagRunState.SUCCESS, states
    assert states == PUBLISHED_RUN, states
    log = capfd.readouterr().out
    assert "launching 2 ranks with docker" in log and "exporting with docker" in log
    assert log.count(f"from {image}") == 2, log[-3000:]  # each created from the app's image
    latest = _check_published(client, bucket, "waveform_cnn")
    prefix = f"models/waveform_cnn/{latest['version']}"
    metrics = contract.METRICS.loads(_get(client, bucket, f"{prefix}/metrics.json"), "metrics")
    assert metrics["world_size"] == 2 and metrics["val_samples"] == 400
    parity = contract.PARITY.loads(_get(client, bucket, f"{prefix}/parity.json"), "parity")
    assert parity["passed"] is True
    for secret in (s3_server.env["AWS_SECRET_ACCESS_KEY"], s3_server.ranks.secret_key):
        assert secret not in log


def test_example_dags_parse_without_heavy_modules(airflow_db):
    code = (
        "import sys, json\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        "bag = DagBag(sys.argv[1])\n"
        "print(json.dumps({'errors': {k: str(v) for k, v in bag.import_errors.items()},\n"
        "  'dags': sorted(bag.dags), 'heavy': [m for m in sys.argv[2:] if m in sys.modules]}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(EXAMPLE_DAGS), *HEAVY],
        capture_output=True, text=True, check=True, env=os.environ.copy(), timeout=300,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}
    assert result["dags"] == ["waveforms_horovod_retrain", "waveforms_serve_latest_model"]
    assert result["heavy"] == [], f"DAG parsing imported {result['heavy']}"


def test_example_dag_uses_the_project_operators_with_its_own_pieces(bundles):
    mod = _deploy("shape-check", "examples.waveforms.dags.waveforms_retrain")
    dag = mod.retrain_dag
    assert [t.task_id for t in dag.topological_sort()] == [
        "stage_dataset", "train", "gate", "export_onnx", "publish", "record_refused"
    ]  # fmt: skip
    stage, train, gate = dag.get_task("stage_dataset"), dag.get_task("train"), dag.get_task("gate")
    assert stage.files == ["*.npy"] and stage.dataset_name == "waveforms"
    assert train.entrypoint == ("python", "-m", "examples.waveforms.train")
    assert dag.get_task("export_onnx").entrypoint == ("python", "-m", "examples.waveforms.export")
    assert gate.model_name == "waveform_cnn"
    assert gate.champion_scorer == "examples.waveforms.serving:score_published_model"
    publish = dag.get_task("publish")
    assert publish.model_name == "waveform_cnn"
    assert [o.uri for o in publish.outlets] == ["s3://shape-check/models/waveform_cnn/latest.json"]
    assert publish.outlets[0].name != "mnist_cnn_latest"


def test_the_example_dag_is_wiring_only():
    """The same check as the MNIST DAG's: operators and settings, no logic of its own."""
    from tests.dags.test_dag_is_wiring import business_logic

    assert business_logic((EXAMPLE_DAGS / "waveforms_retrain.py").read_text()) == []


def test_shipped_dataset_is_the_generator_output(tmp_path):
    from examples.waveforms import data
    from examples.waveforms.settings import DATASET_DIR

    written = data.write_dataset(tmp_path)
    assert sorted(p.name for p in written) == sorted(p.name for p in DATASET_DIR.glob("*.npy"))
    for path in written:
        np.testing.assert_array_equal(np.load(path), np.load(DATASET_DIR / path.name))
    paths = {p.name: p for p in written}
    signals, labels = data.load_split(paths, "train")
    assert signals.shape == (data.TRAIN_SAMPLES, data.LENGTH) and signals.dtype == np.float32
    assert np.bincount(labels).tolist() == [data.TRAIN_SAMPLES // 4] * 4


def test_bad_example_data_and_preprocessing_are_refused_naming_what(tmp_path):
    from examples.waveforms import data
    from examples.waveforms.model import preprocessing_of
    from horovod_airflow.core.layout import DatasetError

    paths = {p.name: p for p in data.write_dataset(tmp_path)}
    signals, _ = data.load_split(paths, "train")
    np.save(paths["test_labels.npy"], np.full(data.TEST_SAMPLES, 7))
    with pytest.raises(DatasetError, match=r"labels must be in \[0, 4\)"):
        data.load_split(paths, "test")
    del paths["train_signals.npy"]
    with pytest.raises(DatasetError, match=r"lacks train_signals\.npy"):
        data.load_split(paths, "train")

    # The example's preprocessing is the contract's document, applied by the contract.
    pre = preprocessing_of(signals)
    assert contract.check_preprocessing(pre, "example") == pre
    assert pre["input_shape"] == [1, data.LENGTH] and pre["labels"] == list(data.CLASSES)
    x = contract.apply_preprocessing(pre, signals)
    assert x.shape == (len(signals), 1, data.LENGTH) and x.dtype == np.float32
    assert abs(float(x.mean())) < 1e-3 and abs(float(x.std()) - 1.0) < 1e-3
    with pytest.raises(ValueError, match=r"constant \(std 0\)"):
        preprocessing_of(np.ones((3, 4), dtype=np.float32))
    with pytest.raises(ValueError, match=r"non-empty \[N, length\] array, got shape \[4\]"):
        preprocessing_of(np.ones(4, dtype=np.float32))
    with pytest.raises(contract.ContractError, match=r"does not hold \[N, \[1, 128\]\]"):
        contract.apply_preprocessing(pre, np.ones((3, 5)))
    # A model without the contract's metadata is refused, never guessed at.
    with pytest.raises(contract.ContractError, match="carries no preprocessing"):
        contract.preprocessing_from_metadata({"horovod_airflow.preprocessing": "{}"}, "old")


def test_the_export_reads_only_the_examples_own_checkpoint_format(tmp_path):
    import torch

    from examples.waveforms.export import run_export
    from examples.waveforms.train import CHECKPOINT_FORMAT

    assert CHECKPOINT_FORMAT == "waveforms/checkpoint-v1" != contract.CHECKPOINT_FORMAT
    bad = tmp_path / "checkpoint.pt"
    torch.save({"format": contract.CHECKPOINT_FORMAT}, bad)
    with pytest.raises(ValueError, match=r"format 'horovod-airflow/checkpoint-v1'; this export "
                                         r"reads 'waveforms/checkpoint-v1'"):  # fmt: skip
        run_export(str(bad), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
