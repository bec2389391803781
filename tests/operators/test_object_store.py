"""Against a real S3 server that checks credentials (SeaweedFS, the suite's ``s3_server``):
wrong credentials fail at once and say who was refused, an endpoint that is down fails after
the configured retries naming it, the ranks' identity cannot touch ``models/``, and racing
publishers never lose or tear ``latest.json``."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from horovod_airflow.core import storage
from horovod_airflow.core.contract import LATEST
from horovod_airflow.operators.exceptions import ChampionChangedError
from horovod_airflow.operators.model_registry import read_latest, write_latest
from scripts.devstack import Credentials
from tests.conftest import S3Server, free_port


def _client(endpoint: str, creds: Credentials, retries: int = 5) -> tuple[Any, list[str]]:
    """A client as the project builds them (standard retries; botocore's ``max_attempts``
    counts the retries, after the first attempt), and the list of the HTTP requests it sends
    (one entry per attempt)."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=creds.access_key,
        aws_secret_access_key=creds.secret_key,
        region_name="us-east-1",
        config=Config(retries={"max_attempts": retries, "mode": "standard"}, connect_timeout=2),
    )
    sent: list[str] = []
    client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.url))
    return client, sent


@pytest.mark.parametrize(
    ("who", "code"),
    [("wrong secret", "SignatureDoesNotMatch"), ("unknown key", "InvalidAccessKeyId")],
)
def test_wrong_credentials_fail_the_first_call_at_once_naming_who_and_where(
    s3_server: S3Server, who: str, code: str
) -> None:
    bucket = s3_server.new_bucket("creds")
    s3_server.client().put_object(Bucket=bucket, Key="datasets/x", Body=b"x")
    worker = s3_server.worker
    creds = (
        Credentials(worker.access_key, worker.secret_key + "-wrong")
        if who == "wrong secret"
        else Credentials("hva-nobody", worker.secret_key)
    )
    client, sent = _client(s3_server.endpoint, creds)
    uri = f"s3://{bucket}/datasets/x"
    with pytest.raises(storage.StorageError) as err:
        storage.read_bytes(uri, client=client)
    message = str(err.value)
    assert not isinstance(err.value, storage.TransientStorageError)  # a 403: no retry
    assert len(sent) == 1, sent  # and botocore did not retry it either
    assert f"S3 GetObject of {uri} at {s3_server.endpoint} failed: {code}" in message
    assert f"access key id {creds.access_key}" in message
    assert creds.secret_key not in message and worker.secret_key not in message


def test_an_endpoint_that_is_down_fails_after_the_configured_retries_naming_it() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    client, sent = _client(dead, Credentials("hva-any", "any-secret"), retries=2)
    with pytest.raises(storage.TransientStorageError) as err:
        storage.read_bytes("s3://some-bucket/k", client=client)
    assert len(sent) == 1 + 2, sent  # the first attempt and the configured retries
    message = str(err.value)
    assert f"S3 GetObject of s3://some-bucket/k at {dead} failed: Endpoint" in message
    assert "any-secret" not in message


def test_the_ranks_identity_reads_datasets_writes_runs_and_cannot_touch_models(
    s3_server: S3Server,
) -> None:
    assert s3_server.ranks is not None
    bucket = s3_server.new_bucket("least", ranks=True)
    worker = s3_server.client()
    worker.put_object(Bucket=bucket, Key="datasets/mnist/abc/manifest.json", Body=b"{}")
    worker.put_object(Bucket=bucket, Key="models/mnist_cnn/v1/model.onnx", Body=b"onnx")
    ranks, _ = _client(s3_server.endpoint, s3_server.ranks)
    b = f"s3://{bucket}"

    assert storage.read_bytes(f"{b}/datasets/mnist/abc/manifest.json", client=ranks) == b"{}"
    storage.write_bytes(f"{b}/runs/dag/run-1/checkpoint.pt", b"ckpt", client=ranks)
    assert storage.read_bytes(f"{b}/runs/dag/run-1/checkpoint.pt", client=ranks) == b"ckpt"
    for refused in (
        lambda: storage.write_bytes(f"{b}/models/mnist_cnn/v2/model.onnx", b"x", client=ranks),
        lambda: storage.write_bytes(f"{b}/datasets/mnist/abc/manifest.json", b"x", client=ranks),
        lambda: storage.read_bytes(f"{b}/models/mnist_cnn/v1/model.onnx", client=ranks),
        lambda: write_latest(
            b, "mnist_cnn", _latest("by-a-rank"), expected_etag=None, client=ranks
        ),
    ):
        with pytest.raises(storage.StorageError, match="AccessDenied") as err:
            refused()
        assert s3_server.ranks.access_key in str(err.value)
        assert not isinstance(err.value, storage.TransientStorageError)
    assert read_latest(b, "mnist_cnn", client=worker) == (None, None)
    assert (
        worker.get_object(Bucket=bucket, Key="datasets/mnist/abc/manifest.json")["Body"].read()
        == b"{}"
    )
    # A bucket the ranks were not granted: nothing at all.
    other = s3_server.new_bucket("other")
    with pytest.raises(storage.StorageError, match="AccessDenied"):
        storage.write_bytes(f"s3://{other}/runs/x", b"x", client=ranks)


def _latest(version: str) -> dict[str, Any]:
    return {"format": LATEST.format, "model": "mnist_cnn", "version": version,
            "uri": f"s3://b/models/mnist_cnn/{version}",
            "manifest_uri": f"s3://b/models/mnist_cnn/{version}/manifest.json",
            "onnx_uri": f"s3://b/models/mnist_cnn/{version}/model.onnx",
            "onnx_sha256": "0" * 64, "val_accuracy": 0.9}  # fmt: skip


def test_racing_publishers_lose_nothing_and_tear_nothing(s3_server: S3Server) -> None:
    """100 rounds; in each, 4 publishers read the same champion (ETag), then all write
    ``latest.json`` conditioned on it at once, while a reader reads it throughout. Each round
    exactly one write wins and is what every later read finds; every read parses whole."""
    rounds, publishers = 100, 4
    bucket = s3_server.new_bucket("race")
    b = f"s3://{bucket}"
    read_barrier = threading.Barrier(publishers)
    write_barrier = threading.Barrier(publishers)
    results: dict[int, list[str | None]] = {r: [None] * publishers for r in range(rounds)}
    errors: list[BaseException] = []
    done = threading.Event()
    seen: list[str] = []

    def publisher(i: int) -> None:
        client = s3_server.client()
        try:
            for r in range(rounds):
                read_barrier.wait(timeout=60)
                _, etag = read_latest(b, "mnist_cnn", client=client)
                write_barrier.wait(timeout=60)  # all hold the same ETag: now race
                version = f"r{r}-p{i}"
                try:
                    write_latest(b, "mnist_cnn", _latest(version), expected_etag=etag,
                                 client=client)  # fmt: skip
                    results[r][i] = version
                except ChampionChangedError:
                    results[r][i] = "lost"
        except BaseException as e:  # surfaced below; the barrier is broken for the others
            errors.append(e)
            read_barrier.abort()
            write_barrier.abort()

    def reader() -> None:
        client = s3_server.client()
        while not done.is_set():
            try:
                doc, _ = read_latest(b, "mnist_cnn", client=client)  # parses and checks it
            except BaseException as e:
                errors.append(e)
                return
            if doc is not None:
                seen.append(doc["version"])

    threads = [threading.Thread(target=publisher, args=(i,)) for i in range(publishers)]
    watcher = threading.Thread(target=reader)
    for t in [*threads, watcher]:
        t.start()
    for t in threads:
        t.join(timeout=600)
    done.set()
    watcher.join(timeout=60)
    assert not errors, errors[:3]

    winners = []
    for r in range(rounds):
        won = [v for v in results[r] if v not in (None, "lost")]
        assert len(won) == 1 and results[r].count("lost") == publishers - 1, (r, results[r])
        winners.append(won[0])
    final, _ = read_latest(b, "mnist_cnn", client=s3_server.client())
    assert final is not None and final["version"] == winners[-1]
    # the reader saw only winners' documents, in the order they won
    order = {v: n for n, v in enumerate(winners)}
    assert all(v in order for v in seen)
    assert [order[v] for v in seen] == sorted(order[v] for v in seen)
