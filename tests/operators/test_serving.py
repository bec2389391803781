"""The serving side and the gate's re-scoring: real ONNX files in onnxruntime, the S3 server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from horovod_airflow.apps.mnist import SCORER, score_published_model, smoke_test_published_model
from horovod_airflow.core import layout, storage
from horovod_airflow.core.contract import GATE, PREPROCESSING_KEY, ContractError
from horovod_airflow.operators.model_registry import gate_challenger, read_latest
from horovod_airflow.operators.serving import (
    ModelIntegrityError,
    ServingCheckError,
    published_from_events,
)
from horovod_airflow.operators.staging import stage_dataset
from tests.operators.helpers import (
    centroid_classifier,
    linear_onnx_model,
    publish_centroid_model,
    publish_fake_model,
)


@pytest.fixture
def staged(s3_server, mnist_subset):
    """The 2000/500-image MNIST subset staged to S3, and its test split as arrays."""
    bucket = s3_server.new_bucket("serving")
    info = stage_dataset(str(mnist_subset), f"s3://{bucket}", client=s3_server.client())
    files = layout.find_source_files(mnist_subset)
    train = (
        layout.read_idx(files[("train", "images")]),
        layout.read_idx(files[("train", "labels")]),
    )
    test = (layout.read_idx(files[("test", "images")]), layout.read_idx(files[("test", "labels")]))
    return bucket, info, train, test


def _expected_accuracy(weights, bias, images, labels) -> float:
    x = ((images.astype(np.float32) / 255.0 - 0.1307) / 0.3081).reshape(len(images), -1)
    return float(((x @ weights + bias).argmax(axis=1) == labels).mean())


def test_the_gate_rescores_a_champion_measured_on_other_data(s3_server, staged):
    bucket, info, (x_train, y_train), (x_test, y_test) = staged
    s3 = s3_server.client()
    weights, bias = centroid_classifier(x_train, y_train)
    expected = _expected_accuracy(weights, bias, x_test, y_test)
    assert 0.5 < expected < 1.0
    publish_fake_model(s3, bucket, version="v-old", onnx_bytes=linear_onnx_model(weights, bias),
                       accuracy=0.999, dataset_hash="f" * 64, dag_run_id="old")  # fmt: skip
    metrics = {"val_accuracy": expected - 0.001, "output": f"s3://{bucket}/runs/new"}

    decision = gate_challenger(bucket_uri=f"s3://{bucket}", model_name="mnist_cnn",
                               metrics=metrics, dataset=info, min_accuracy=0.5,
                               max_regression=0.01, client=s3,
                               champion_scorer=SCORER)  # fmt: skip
    # Against the stored 99.9 % (other data) it would fail; re-scored here it passes.
    assert decision.champion_rescored is True
    assert decision.champion_accuracy == pytest.approx(expected, abs=1e-12)
    assert decision.champion_stored_accuracy == 0.999
    assert decision.passed is True, decision.reason
    assert "re-scored on this run's dataset " + info["content_hash"][:16] in decision.reason
    assert decision.champion_etag == read_latest(f"s3://{bucket}", "mnist_cnn", client=s3)[1]
    gate_json = json.loads(storage.read_text(f"{metrics['output']}/gate.json", client=s3))
    assert gate_json == {"format": GATE.format, **decision.as_dict()}


def test_the_gate_uses_the_stored_accuracy_on_the_same_data(s3_server, staged):
    bucket, info, _, _ = staged
    s3 = s3_server.client()
    same = info["content_hash"]
    publish_fake_model(s3, bucket, version="v-same", onnx_bytes=b"not even onnx",
                       accuracy=0.95, dataset_hash=same, dag_run_id="same")  # fmt: skip
    metrics = {"val_accuracy": 0.90, "output": f"s3://{bucket}/runs/new"}
    decision = gate_challenger(bucket_uri=f"s3://{bucket}", model_name="mnist_cnn",
                               metrics=metrics, dataset=info, min_accuracy=0.5,
                               max_regression=0.01, client=s3,
                               champion_scorer=SCORER)  # fmt: skip
    assert decision.champion_rescored is False and decision.champion_accuracy == 0.95
    assert decision.passed is False and "measured on the same dataset" in decision.reason


def test_the_gate_refuses_when_the_champion_cannot_be_rescored(s3_server, staged):
    bucket, info, _, _ = staged
    s3 = s3_server.client()
    latest = publish_fake_model(s3, bucket, version="v-x", onnx_bytes=b"bytes",
                                accuracy=0.95, dataset_hash="e" * 64, dag_run_id="x")  # fmt: skip
    storage.write_bytes(latest["onnx_uri"], b"tampered", client=s3)  # sha256 no longer matches
    metrics = {"val_accuracy": 0.99, "output": f"s3://{bucket}/runs/new"}
    decision = gate_challenger(bucket_uri=f"s3://{bucket}", model_name="mnist_cnn",
                               metrics=metrics, dataset=info, min_accuracy=0.5,
                               max_regression=0.01, client=s3,
                               champion_scorer=SCORER)  # fmt: skip
    assert decision.passed is False
    assert "not comparable" in decision.reason and "e" * 16 in decision.reason


def test_score_refuses_a_model_whose_sha256_differs(s3_server, staged):
    bucket, info, _, _ = staged
    s3 = s3_server.client()
    latest = publish_fake_model(s3, bucket, version="v-y", onnx_bytes=b"bytes",
                                accuracy=0.95, dataset_hash="e" * 64, dag_run_id="y")  # fmt: skip
    with pytest.raises(ModelIntegrityError, match="the published record says"):
        score_published_model({**latest, "onnx_sha256": "0" * 64}, info["uri"], client=s3)


def test_smoke_test_serves_the_event_version_not_latest(s3_server, staged):
    bucket, info, train, test = staged
    s3 = s3_server.client()
    event = publish_centroid_model(s3, bucket, info, train, test, version="v-event",
                                   dag_run_id="a")  # fmt: skip
    publish_centroid_model(s3, bucket, info, train, test, version="v-later", dag_run_id="b")
    served = smoke_test_published_model(f"s3://{bucket}", "mnist_cnn", client=s3, published=event)
    assert served["version"] == "v-event" and served["source"] == "asset event"
    assert served["served_accuracy"] == event["val_accuracy"]  # the training's number, served
    assert served["samples"] == len(test[1]) and served["dataset_uri"] == info["uri"]
    manual = smoke_test_published_model(f"s3://{bucket}", "mnist_cnn", client=s3)
    assert manual["version"] == "v-later" and manual["source"] == "latest.json"


class _Event:
    def __init__(self, extra, timestamp):
        self.extra, self.timestamp = extra, timestamp


def test_published_from_events_takes_the_newest_event_that_names_a_model():
    asset = object()
    good = {"version": "v2", "onnx_uri": "s3://b/m.onnx", "manifest_uri": "s3://b/m.json"}
    old = {**good, "version": "v1"}
    events = {asset: [_Event(good, "2026-12-02T10:00:02"), _Event(old, "2026-12-02T10:00:01"),
                      _Event({}, "2026-12-02T10:00:03")]}  # fmt: skip
    assert published_from_events(events, asset) == good
    assert published_from_events({}, asset) is None
    assert published_from_events({asset: [_Event({}, "t")]}, asset) is None


def test_serving_refuses_a_model_without_preprocessing_instead_of_guessing(s3_server, staged):
    bucket, info, (x_train, y_train), _ = staged
    s3 = s3_server.client()
    bare = linear_onnx_model(*centroid_classifier(x_train, y_train), preprocessing=False)
    latest = publish_fake_model(s3, bucket, version="v-bare", onnx_bytes=bare, accuracy=0.8,
                                dataset_hash="c" * 64, dag_run_id="bare")  # fmt: skip
    with pytest.raises(ContractError) as refused:
        smoke_test_published_model(f"s3://{bucket}", "mnist_cnn", client=s3)
    message = str(refused.value)
    assert latest["onnx_uri"] in message and "carries no preprocessing" in message
    assert repr(PREPROCESSING_KEY) in message and "does not guess" in message
    # The gate cannot re-score such a champion either: it refuses and says why.
    metrics = {"val_accuracy": 0.9, "output": f"s3://{bucket}/runs/next"}
    decision = gate_challenger(bucket_uri=f"s3://{bucket}", model_name="mnist_cnn",
                               metrics=metrics, dataset=info, min_accuracy=0.5,
                               max_regression=0.01, client=s3,
                               champion_scorer=SCORER)  # fmt: skip
    assert decision.passed is False and "not re-scored" in decision.reason


def test_serving_refuses_a_model_whose_preprocessing_differs_from_its_manifest(s3_server, staged):
    bucket, _, (x_train, y_train), _ = staged
    s3 = s3_server.client()
    onnx_bytes = linear_onnx_model(*centroid_classifier(x_train, y_train))
    latest = publish_fake_model(s3, bucket, version="v-m", onnx_bytes=onnx_bytes, accuracy=0.8,
                                dataset_hash="c" * 64, dag_run_id="m")  # fmt: skip
    manifest = json.loads(storage.read_text(latest["manifest_uri"], client=s3))
    manifest["preprocessing"]["std"] = [1.0]
    storage.write_text(latest["manifest_uri"], json.dumps(manifest), client=s3)
    with pytest.raises(ModelIntegrityError, match=r"carries preprocessing .* but .* records"):
        smoke_test_published_model(f"s3://{bucket}", "mnist_cnn", client=s3)


def _attacker_model(s3_server, x_train, y_train) -> dict:
    """A real model published, with a consistent manifest, in a bucket of someone else's."""
    elsewhere = s3_server.new_bucket("elsewhere")
    onnx_bytes = linear_onnx_model(*centroid_classifier(x_train, y_train))
    return publish_fake_model(s3_server.client(), elsewhere, version="v-theirs",
                              onnx_bytes=onnx_bytes, accuracy=0.8, dataset_hash="d" * 64,
                              dag_run_id="theirs")  # fmt: skip


@pytest.mark.parametrize("field", ["onnx_uri", "manifest_uri", "uri"])
def test_serving_loads_only_from_the_registry_whatever_an_event_names(s3_server, staged, field):
    """An Asset event is anyone's to post: its ``extra`` chooses the version, never where the
    model is read from. One naming a model in another bucket (with its own, consistent
    manifest: the sha256 check alone would pass) is refused, naming the field."""
    bucket, info, train, test = staged
    s3 = s3_server.client()
    ours = publish_centroid_model(s3, bucket, info, train, test, version="v-ours",
                                  dag_run_id="ours")  # fmt: skip
    theirs = _attacker_model(s3_server, *train)
    event = {**ours, field: theirs[field]}
    with pytest.raises(ModelIntegrityError, match=f"the asset event names {field} ") as err:
        smoke_test_published_model(f"s3://{bucket}", "mnist_cnn", client=s3, published=event)
    assert "refusing to load a model from outside the registry" in str(err.value)
    # The version an event names is served from the registry, whatever else it carries.
    served = smoke_test_published_model(
        f"s3://{bucket}", "mnist_cnn", client=s3, published={"version": "v-ours"}
    )
    assert served["version"] == "v-ours" and served["onnx_sha256"] == ours["onnx_sha256"]


@pytest.mark.parametrize(
    ("claim", "says"),
    [
        ({"version": "../v-ours"}, "not a safe version name"),
        ({"version": None}, "not a safe version name"),
        ({"version": "v-ours", "model": "another_model"}, "names model 'another_model'"),
    ],
)
def test_an_event_naming_no_registry_version_is_refused(s3_server, staged, claim, says):
    bucket, _, _, _ = staged
    with pytest.raises(ModelIntegrityError, match=says):
        smoke_test_published_model(
            f"s3://{bucket}", "mnist_cnn", client=s3_server.client(), published=claim
        )


def test_a_latest_json_pointing_outside_the_registry_is_refused(s3_server, staged):
    """The same for ``latest.json``: a manual serving run, and the gate about to re-score the
    champion on this run's data, refuse a record whose model lives elsewhere."""
    bucket, info, (x_train, y_train), _ = staged
    s3 = s3_server.client()
    ours = publish_fake_model(s3, bucket, version="v-ours",
                              onnx_bytes=linear_onnx_model(*centroid_classifier(x_train, y_train)),
                              accuracy=0.8, dataset_hash="d" * 64, dag_run_id="ours")  # fmt: skip
    theirs = _attacker_model(s3_server, x_train, y_train)
    from horovod_airflow.core.contract import LATEST

    forged = {k: v for k, v in {**ours, "onnx_uri": theirs["onnx_uri"]}.items() if k != "format"}
    s3.put_object(Bucket=bucket, Key="models/mnist_cnn/latest.json", Body=LATEST.dumps(forged))
    with pytest.raises(ModelIntegrityError, match=r"the latest\.json names onnx_uri"):
        smoke_test_published_model(f"s3://{bucket}", "mnist_cnn", client=s3)
    run = f"s3://{bucket}/runs/after-forgery"
    with pytest.raises(ModelIntegrityError, match=r"the latest\.json names onnx_uri"):
        gate_challenger(bucket_uri=f"s3://{bucket}", model_name="mnist_cnn",
                        metrics={"val_accuracy": 0.9, "output": run}, dataset=info,
                        min_accuracy=0.5, max_regression=0.01, client=s3,
                               champion_scorer=SCORER)  # fmt: skip
    assert not storage.exists(f"{run}/gate.json", client=s3)  # no decision on a forged record


@pytest.mark.parametrize(("recorded_off_by", "passes"), [(0.0, True), (0.001, True), (0.05, False)])
def test_serving_fails_unless_it_serves_the_accuracy_training_reported(
    s3_server, staged, recorded_off_by, passes
):
    """The check predicts the raw test images of the recorded dataset through the model's own
    preprocessing; a model serving other than its training reported (beyond 0.2 points) fails
    the serving run, naming both numbers."""
    bucket, info, train, test = staged
    s3 = s3_server.client()
    true = publish_centroid_model(s3, bucket, info, train, test, version="v-true",
                                  dag_run_id="true")["val_accuracy"]  # fmt: skip
    published = publish_centroid_model(
        s3,
        bucket,
        info,
        train,
        test,
        version="v-claimed",
        dag_run_id="claimed",
        accuracy=true + recorded_off_by,
    )
    if passes:
        served = smoke_test_published_model(f"s3://{bucket}", "mnist_cnn", client=s3)
        assert served["version"] == "v-claimed" and served["served_accuracy"] == true
    else:
        with pytest.raises(ServingCheckError, match=f"serves accuracy {true:.4f}") as err:
            smoke_test_published_model(f"s3://{bucket}", "mnist_cnn", client=s3)
        assert f"its training reported {published['val_accuracy']:.4f}" in str(err.value)
