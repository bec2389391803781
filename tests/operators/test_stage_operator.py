"""StageDatasetOperator: its settings, and staging through the real S3 server."""

from __future__ import annotations

import pytest

from horovod_airflow.core import layout
from horovod_airflow.operators import StageDatasetOperator
from horovod_airflow.operators.data_checks import DataChecks
from horovod_airflow.operators.staging import stage_dataset
from tests.operators.helpers import undocumented_template_fields


def stage_op(**kwargs) -> StageDatasetOperator:
    base = {"task_id": "stage_dataset", "source": "vendored", "bucket_uri": "s3://bucket",
            "dataset_name": "mnist"}  # fmt: skip
    return StageDatasetOperator(**{**base, **kwargs})


def test_template_fields_are_the_settings_a_run_varies_and_are_documented():
    assert set(StageDatasetOperator.template_fields) == {"source", "bucket_uri", "dataset_name"}
    assert undocumented_template_fields(StageDatasetOperator) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source": ""}, "source must be 'vendored'"),
        ({"source": None}, "source must be 'vendored'"),
        ({"bucket_uri": ""}, "bucket_uri must be a URI"),
        ({"dataset_name": "mnist digits"}, "dataset_name must be a name"),
    ],
)
def test_bad_settings_are_named_at_parse_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        stage_op(**kwargs)


def test_init_builds_no_hook():
    op = stage_op(aws_conn_id="no_such_connection", source="{{ params.dataset_source }}")
    assert "s3_hook" not in op.__dict__


def test_stages_through_the_connection_and_a_retry_uploads_nothing(
    s3_server, mnist_subset, monkeypatch
):
    """The S3 server is reachable only through aws_default's endpoint, not the environment."""
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    client = s3_server.client()
    bucket = s3_server.new_bucket("stage")
    op = stage_op(source=str(mnist_subset), bucket_uri=f"s3://{bucket}", dataset_name="digits")
    first = op.execute({})
    manifest = layout.build_manifest("digits", layout.find_source_files(mnist_subset))
    assert first["uri"] == f"s3://{bucket}/datasets/digits/{manifest['content_hash'][:16]}"
    assert first["name"] == "digits" and first["splits"] == {"train": 2000, "test": 500}
    assert layout.MANIFEST_NAME in first["uploaded"]

    again = op.execute({})
    assert again == {**first, "uploaded": []}
    # The operator returns exactly what the staging function returns (with its default checks).
    direct = stage_dataset(str(mnist_subset), f"s3://{bucket}", name="digits", client=client,
                           checks=DataChecks())  # fmt: skip
    assert direct == again


@pytest.mark.parametrize(
    ("source", "allowed"),
    [
        ("vendored", True),
        ("s3://datasets/mnist/2026-12", True),
        ("s3://datasets/mnist-other/x", False),  # a prefix ends in '/': no sibling matches
        ("s3://attacker-bucket/mnist", False),
        ("/etc", False),
        ("s3://datasets/mnist/../secrets", False),
    ],
)
def test_a_run_stages_only_from_the_deployments_sources(tmp_path, source, allowed):
    from airflow.sdk.exceptions import AirflowFailException

    from horovod_airflow.operators import HorovodConfigError
    from horovod_airflow.operators.stage import check_allowed_source

    permitted = ["vendored", "s3://datasets/mnist/"]
    if allowed:
        assert check_allowed_source(source, permitted) == source
        return
    op = StageDatasetOperator(task_id="stage", source="{{ params.src }}", bucket_uri=str(tmp_path),
                              dataset_name="mnist", aws_conn_id=None,
                              allowed_sources=permitted)  # fmt: skip
    ctx = {"params": {"src": source}}
    op.render_template_fields(ctx)
    refusal = r"not one this deployment allows|not a plain"
    with pytest.raises(HorovodConfigError, match=refusal) as e:
        op.execute(ctx)
    assert isinstance(e.value, AirflowFailException)
    assert list(tmp_path.iterdir()) == []  # nothing staged, nothing read
