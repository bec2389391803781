"""``BucketRetentionOperator``: apply the retention policy to a pipeline bucket.

Runs in the Airflow worker; needs no torch. What is kept and why, the in-flight rule and the
safety of deleting under concurrency are :mod:`horovod_airflow.operators.retention`'s; this
module wires them to Airflow: templated settings, the connection's S3 client, Airflow's own
word on which DAGs have a run in flight, and the XCom.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from horovod_airflow.operators.connection import AwsConnectionMixin
from horovod_airflow.operators.exceptions import HorovodConfigError
from horovod_airflow.operators.job import check_uri
from horovod_airflow.operators.retention import RetentionPolicy, apply_retention
from horovod_airflow.operators.retry import with_retry_policy

if TYPE_CHECKING:
    from airflow.sdk import Context

#: The DAG run states in which a run may still write to its prefix or stage a dataset.
ACTIVE_STATES = ("queued", "running")


def as_flag(value: Any, field: str) -> bool:
    """A bool, or its rendered text (``true``/``false``, any case); ValueError otherwise."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return text == "true"
    raise ValueError(f"{field} must be true or false, got {value!r}")


def as_keep_runs(value: Any) -> int:
    """``keep_runs`` rendered: a whole number (or its text) the policy accepts."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    RetentionPolicy(keep_runs=value)  # its error names the value and what is allowed
    return int(value)


class BucketRetentionOperator(AwsConnectionMixin, BaseOperator):
    """Delete what the retention policy lets go from a pipeline bucket, or (``list_only``, a dry
    run) list it.

    Keeps every published version and ``latest.json`` (nothing under ``models/`` is deleted),
    the datasets they name, the last ``keep_runs`` run prefixes of each DAG and the datasets
    those record, in-flight runs and recently staged datasets; deletes the other run prefixes
    (``runs/<dag_id>/<run_key>/``: refused, published-and-copied, failed) and datasets
    (``datasets/<name>/<hash16>/``). A DAG that Airflow reports a queued or running run of
    keeps all its runs, and dataset deletions wait, in that pass. See
    :mod:`horovod_airflow.operators.retention` for the rules, the in-flight window and why a
    deletion never runs past a ``latest.json`` that changed after the plan.

    Returns (as XCom) the plan and what was done: ``delete`` and ``keep`` (each prefix with
    ``kind``, ``reason``, ``objects``, ``bytes``), ``delete_objects``, ``delete_bytes``,
    ``notes``, ``dry_run``, ``deleted`` (empty on a dry run), ``deleted_objects``,
    ``deleted_bytes`` and ``left`` (prefixes that changed since the plan, not deleted).
    Each prefix is also logged, with its size and reason.

    :param bucket_uri: the pipeline bucket, ``s3://bucket`` or a local folder (templated).
    :param keep_runs: run prefixes kept per DAG, newest first, whatever their outcome: a whole
        number from 1 to 100000 (templated).
    :param list_only: true (the default): a dry run, listing what would be deleted and its
        size, deleting nothing; false: delete (templated). The maintenance DAG renders its
        ``dry_run`` Param here, whose default is ``HVA_RETENTION_DRY_RUN`` (true). Not named
        ``dry_run``: that is ``BaseOperator``'s method.
    :param in_flight_window: a run without a terminal marker (a refused gate, a published
        version) written to more recently than this is in flight, and a dataset staged more
        recently may be in use: neither is deleted. At least the DAG run timeout of the DAGs
        whose runs the bucket holds.
    :param dag_ids: the DAGs that stage datasets into this bucket, asked about even before
        they have a run prefix (a first run stages, perhaps reusing an old dataset, before it
        writes one); every DAG with runs under ``runs/`` is asked about anyway.
    :param aws_conn_id: the Airflow AWS connection; None: the standard ``AWS_*`` environment.
    """

    template_fields: Sequence[str] = ("bucket_uri", "keep_runs", "list_only")
    ui_color = "#f3efe0"

    def __init__(
        self,
        *,
        bucket_uri: str,
        keep_runs: int | str = 10,
        list_only: bool | str = True,
        in_flight_window: timedelta = timedelta(days=2),
        dag_ids: Sequence[str] = (),
        aws_conn_id: str | None = "aws_default",
        **kwargs: Any,
    ) -> None:
        super().__init__(**with_retry_policy(kwargs))
        check_uri(bucket_uri, "bucket_uri")
        if not (isinstance(keep_runs, str) and "{{" in keep_runs):
            as_keep_runs(keep_runs)
        if not (isinstance(list_only, str) and "{{" in list_only):
            as_flag(list_only, "list_only")
        RetentionPolicy(in_flight_window=in_flight_window)
        self.bucket_uri = bucket_uri
        self.keep_runs = keep_runs
        self.list_only = list_only
        self.in_flight_window = in_flight_window
        self.dag_ids = list(dag_ids)
        self.aws_conn_id = aws_conn_id

    def execute(self, context: Context) -> dict[str, Any]:
        try:
            bucket_uri = check_uri(self.bucket_uri, "bucket_uri")
            policy = RetentionPolicy(
                keep_runs=as_keep_runs(self.keep_runs), in_flight_window=self.in_flight_window
            )
            dry_run = as_flag(self.list_only, "list_only")
        except ValueError as e:
            raise HorovodConfigError(f"{self.task_id}: {e}") from e
        ti = context["ti"]

        def dag_is_active(dag_id: str) -> bool:
            """Whether Airflow has a queued or running run of ``dag_id``."""
            return bool(ti.get_dr_count(dag_id=dag_id, states=list(ACTIVE_STATES)))

        result = apply_retention(
            bucket_uri,
            policy,
            dry_run=dry_run,
            client=self.s3_client_for(bucket_uri),
            dag_is_active=dag_is_active,
            dag_ids=self.dag_ids,
        )
        return result.as_dict()
