"""``StageDatasetOperator``: upload a dataset to S3, content-addressed: the first task.

Runs in the Airflow worker; needs no torch. What is staged and where is
:func:`horovod_airflow.operators.staging.stage_dataset`'s (MNIST-format) or
:func:`horovod_airflow.operators.staging.stage_files`'s (any files); this module wires them to
Airflow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from horovod_airflow.core.fileset import check_patterns
from horovod_airflow.operators.connection import AwsConnectionMixin
from horovod_airflow.operators.data_checks import DataCheckError, DataChecks
from horovod_airflow.operators.exceptions import DatasetRefusedError, HorovodConfigError
from horovod_airflow.operators.job import check_name, check_uri, is_templated
from horovod_airflow.operators.retry import with_retry_policy
from horovod_airflow.operators.staging import stage_dataset, stage_files

if TYPE_CHECKING:
    from airflow.sdk import Context

#: The data checks a StageDatasetOperator runs unless given others (or None).
DEFAULT_CHECKS = DataChecks()


def check_allowed_source(source: str, allowed: Sequence[str]) -> str:
    """``source`` if ``allowed`` is empty or holds it (an exact value, or a prefix ending in
    ``/`` that it starts with, ``..`` segments refused), else ValueError naming both."""
    if not allowed:
        return source
    if "/../" in f"{source}/" or any(c in source for c in "\n\r\x00"):
        raise ValueError(f"source {source!r} is not a plain URI or path")
    for entry in allowed:
        if source == entry or (entry.endswith("/") and source.startswith(entry)):
            return source
    raise ValueError(
        f"source {source!r} is not one this deployment allows; allowed: {', '.join(allowed)} "
        "(exact values, or prefixes ending in '/')"
    )


class StageDatasetOperator(AwsConnectionMixin, BaseOperator):
    """Stage a dataset at ``<bucket_uri>/datasets/<dataset_name>/<hash16>/``: MNIST-format
    IDX files, or any files (``files=``, a content-addressed file set).

    Uploads the four IDX files (plain or ``.gz``) and a ``manifest.json`` (written last) to a
    prefix named by the content hash, creating the bucket if it is missing. Idempotent: a
    prefix that already holds the same manifest and files is not uploaded again. The ranks
    verify the files against the manifest before they train.

    Before anything is uploaded, the dataset is compared with the previous staged dataset of
    the same name (``checks``, :mod:`horovod_airflow.operators.data_checks`: samples per
    split, class balance, shapes and dtypes, duplicates): a change beyond the thresholds fails
    the task without a retry (:class:`DatasetRefusedError`, naming each change), uploads
    nothing, and so trains nothing and never becomes the baseline of a later run.

    Returns (as XCom) ``{"uri", "name", "content_hash", "splits", "uploaded", "checks"}``: the
    staged prefix (hand it to the trainer as ``data``), the dataset name, its content hash, the
    samples per split, the file names uploaded by this try (empty when already staged) and
    the checks' report (``passed``, ``previous``: the prefix compared against, None on a first
    staging; None without checks).

    :param source: ``"vendored"`` (the project's real MNIST), an ``s3://`` prefix or a local
        folder holding the files (templated).
    :param bucket_uri: where to stage, ``s3://bucket`` or a local folder (templated).
    :param dataset_name: the dataset's name in the staged prefix, e.g. ``mnist`` (templated).
    :param aws_conn_id: the Airflow AWS connection; None: the standard ``AWS_*`` environment.
    :param files: stage any files instead of the MNIST layout: the file names or glob
        patterns (``["*.npy"]``) of the files directly in ``source`` (an ``s3://`` prefix or a
        local folder; not ``"vendored"``) to stage, each pattern matching at least one file.
        The manifest is then a file set's (:mod:`horovod_airflow.core.fileset`: name, size and
        sha256 per
        file, and the content hash naming the prefix) and the XCom holds ``files`` (the
        staged names) instead of ``splits``. None (default): the MNIST-format IDX files.
    :param allowed_sources: the sources this deployment lets a run stage from: exact values
        (``"vendored"``) or prefixes ending in ``/`` (``"s3://datasets-bucket/mnist/"``,
        ``"/data/"``). A rendered ``source`` outside them fails the task without retry,
        naming both, before anything is read. None or empty (default): any source.
    :param checks: the data checks' thresholds (:class:`DataChecks`; default ``DataChecks()``:
        a split may lose at most 50 % of its samples, a class's share move at most 5 points, at
        most 5 % of samples be duplicates). Not templated: a run's conf cannot loosen them.
        A file set declares its label files (``class_labels``) and its own check function
        (``check``) in it. None: no checks.
    """

    template_fields: Sequence[str] = ("source", "bucket_uri", "dataset_name")
    ui_color = "#eef3fb"

    def __init__(
        self,
        *,
        source: str,
        bucket_uri: str,
        dataset_name: str,
        aws_conn_id: str | None = "aws_default",
        files: Sequence[str] | None = None,
        allowed_sources: Sequence[str] | None = None,
        checks: DataChecks | None = DEFAULT_CHECKS,
        **kwargs: Any,
    ) -> None:
        super().__init__(**with_retry_policy(kwargs))
        if isinstance(allowed_sources, str) or not all(
            isinstance(a, str) and a for a in (allowed_sources or ())
        ):
            raise ValueError(
                f"allowed_sources must be a list of sources or prefixes ending in '/', "
                f"got {allowed_sources!r}"
            )
        self.allowed_sources = tuple(allowed_sources or ())
        if checks is not None and not isinstance(checks, DataChecks):
            raise ValueError(f"checks must be a DataChecks or None, got {checks!r}")
        if checks is not None and checks.class_labels and files is None:
            raise ValueError(
                "checks.class_labels names label files of a file set (files=); an MNIST-format "
                "dataset's labels are its labels files"
            )
        self.checks = checks
        if files is not None:
            files = check_patterns(files)
            if source == "vendored":
                raise ValueError(
                    "source 'vendored' is the bundled MNIST; with files=, use an s3:// prefix "
                    "or a local folder"
                )
        if not isinstance(source, str) or not source:
            raise ValueError(
                f"source must be 'vendored', an s3:// prefix or a local folder, got {source!r}"
            )
        check_uri(bucket_uri, "bucket_uri")
        if not is_templated(dataset_name):
            check_name(dataset_name, "dataset_name")
        self.source = source
        self.bucket_uri = bucket_uri
        self.dataset_name = dataset_name
        self.aws_conn_id = aws_conn_id
        self.files = files

    def execute(self, context: Context) -> dict[str, Any]:
        try:
            source = str(self.source)
            if not source:
                raise ValueError("source rendered empty: use 'vendored' for the bundled MNIST")
            bucket_uri = check_uri(self.bucket_uri, "bucket_uri")
            name = check_name(self.dataset_name, "dataset_name")
            check_allowed_source(source, self.allowed_sources)
        except ValueError as e:
            raise HorovodConfigError(f"{self.task_id}: {e}") from e
        client = self.s3_client_for(source, bucket_uri)
        try:
            if self.files is not None:
                return stage_files(
                    source, bucket_uri, name=name, patterns=self.files, client=client,
                    checks=self.checks,
                )  # fmt: skip
            return stage_dataset(source, bucket_uri, name=name, client=client, checks=self.checks)
        except DataCheckError as e:
            raise DatasetRefusedError(f"{self.task_id}: {e}") from e
