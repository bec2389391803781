"""
### Bucket retention: delete what no run, serving or rollback needs any more

One task, `apply_retention` (`BucketRetentionOperator`), daily. By default it is a **dry
run**: its log and XCom list each prefix it would delete, with its size and why, and each it
keeps and why; set the `dry_run` Param to false (or `HVA_RETENTION_DRY_RUN=false` for the
schedule) to delete.

Kept, always: everything under `models/` (every published version and `latest.json`, so
serving and any rollback still find their files), the datasets a published version or
`latest.json` names, the last `HVA_RETENTION_KEEP_RUNS` run prefixes of each DAG and the
datasets they record, runs still in flight (no refused gate and no published version, and
written to within `HVA_RETENTION_IN_FLIGHT_MINUTES`, or a DAG Airflow reports running) and
recently staged datasets. Deleted: older run prefixes `runs/<dag_id>/<run_key>/` (refused
models, failed runs, runs whose model a published version copied) and datasets nothing kept
names. A `latest.json` that changes between the plan and a deletion makes the task plan again.
Rules: `docs/operators.md`, *Retention*.
"""

from __future__ import annotations

from datetime import UTC, datetime

from airflow.sdk import Param, dag

from horovod_airflow.operators import BucketRetentionOperator
from horovod_airflow.operators.settings import (
    AWS_CONN_ID,
    BUCKET_URI,
    RETENTION_DRY_RUN,
    RETENTION_IN_FLIGHT,
    RETENTION_KEEP_RUNS,
    RUN_TIMEOUT,
    TASK_TIMEOUT,
)


@dag(
    dag_id="horovod_bucket_retention",
    doc_md=__doc__,
    schedule="@daily",
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    dagrun_timeout=RUN_TIMEOUT,
    default_args={"retries": 1, "execution_timeout": TASK_TIMEOUT},
    tags=["maintenance", "retention"],
    params={
        "dry_run": Param(RETENTION_DRY_RUN, type="boolean", title="Dry run",
                         description="List what would be deleted (with sizes); delete nothing."),
        "keep_runs": Param(RETENTION_KEEP_RUNS, type="integer", minimum=1, maximum=100000,
                           title="Runs kept per DAG",
                           description="The newest run prefixes of each DAG kept, whatever "
                                       "their outcome."),
    },
)  # fmt: skip
def horovod_bucket_retention() -> None:
    BucketRetentionOperator(
        task_id="apply_retention",
        bucket_uri=BUCKET_URI,
        keep_runs="{{ params.keep_runs }}",
        list_only="{{ params.dry_run }}",
        in_flight_window=RETENTION_IN_FLIGHT,
        dag_ids=["mnist_horovod_retrain", "waveforms_horovod_retrain"],
        aws_conn_id=AWS_CONN_ID,
    )


retention_dag = horovod_bucket_retention()
