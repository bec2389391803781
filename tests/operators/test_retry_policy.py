"""The retry policy: which failures use the task's retries, which fail at once, which back off.

Real exceptions from the libraries that raise them (botocore, the Kubernetes client) go
through :func:`classify`; a real Airflow run shows the policy deciding the task's state.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from kubernetes.client.exceptions import ApiException

from horovod_airflow.core import storage
from horovod_airflow.operators.exceptions import (
    HorovodImageError,
    HorovodLaunchError,
    HorovodTimeoutError,
    HorovodTrainingError,
)
from horovod_airflow.operators.retry import HorovodRetryPolicy, classify
from tests.operators.helpers import dag_in_bundle


def _client_error(status: int, code: str) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "GetObject",
    )


def _wrapped(outer: Exception, inner: BaseException) -> Exception:
    """``outer`` raised ``from inner``, as the launchers and storage wrap what they catch."""
    try:
        raise outer from inner
    except Exception as e:
        return e


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (_wrapped(storage.StorageError("read"), _client_error(503, "SlowDown")), "transient"),
        (_client_error(500, "InternalError"), "transient"),
        (EndpointConnectionError(endpoint_url="http://s3:9000"), "transient"),
        (_wrapped(HorovodLaunchError("create"), ApiException(status=503)), "transient"),
        (_wrapped(HorovodLaunchError("create"), ApiException(status=429)), "transient"),
        (_wrapped(HorovodLaunchError("create"), ApiException(status=403)), "fail"),
        (_wrapped(HorovodLaunchError("create"), ApiException(status=404)), "fail"),
        (HorovodImageError("cannot pull image x:1"), "fail"),
        (ValueError("num_proc must be >= 1"), "fail"),
        (_wrapped(storage.StorageError("read"), _client_error(403, "AccessDenied")), "default"),
        (HorovodTrainingError("rank 1 failed", exit_code=1), "retry"),
        (HorovodTimeoutError("too long", timeout=60.0), "default"),
        (RuntimeError("something else"), "default"),
    ],
)
def test_each_failure_gets_the_decision_its_cause_calls_for(error, kind):
    assert classify(error)[0] == kind


def test_transient_failures_back_off_doubling_up_to_the_cap():
    policy = HorovodRetryPolicy(backoff=timedelta(seconds=30), max_backoff=timedelta(minutes=2))
    slow = _client_error(503, "SlowDown")
    delays = [policy.evaluate(slow, try_number=n, max_tries=9).retry_delay for n in (1, 2, 3, 4)]
    assert delays == [timedelta(seconds=s) for s in (30, 60, 120, 120)]
    decision = policy.evaluate(ValueError("bad"), try_number=1, max_tries=9)
    assert decision.action.value == "fail" and "invalid input" in str(decision.reason)
    assert HorovodRetryPolicy.deserialize(policy.serialize()).max_backoff == policy.max_backoff
    with pytest.raises(ValueError, match="backoff must be > 0"):
        HorovodRetryPolicy(backoff=timedelta(0))


def test_every_operator_of_the_package_uses_it_unless_told_otherwise():
    from horovod_airflow.operators import HorovodTrainOperator

    train = HorovodTrainOperator(task_id="t", data="s3://b/d", output="s3://b/o")
    assert isinstance(train.retry_policy, HorovodRetryPolicy)
    from tests.operators.test_gate_operator import gate_op

    gate = gate_op(retry_policy=None)
    assert gate.retry_policy is None  # the user's choice stands, None included
    from datetime import UTC, datetime

    from airflow.sdk import DAG

    theirs = HorovodRetryPolicy(backoff=timedelta(minutes=5))
    with DAG("d", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=UTC),
             default_args={"retry_policy": theirs}):  # fmt: skip
        train = HorovodTrainOperator(task_id="t", data="s3://b/d", output="s3://b/o")
    assert train.retry_policy is theirs  # the DAG's default_args stand too


RETRY_DAG = """
from datetime import UTC, datetime, timedelta

from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG

from horovod_airflow.operators.exceptions import HorovodTrainingError
from horovod_airflow.operators.retry import HorovodRetryPolicy

TRIES = []

def bad_setting():
    TRIES.append("bad_setting")
    raise ValueError("num_proc must be >= 1, got 0")

def lost_rank():
    TRIES.append("lost_rank")
    raise HorovodTrainingError("rank 1 exited with code 137", exit_code=137)

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=UTC),
         default_args={{"retries": 2, "retry_delay": timedelta(seconds=0),
                       "retry_policy": HorovodRetryPolicy()}}) as dag:
    PythonOperator(task_id="bad_setting", python_callable=bad_setting)
    PythonOperator(task_id="lost_rank", python_callable=lost_rank)
"""


def test_in_a_real_run_a_bad_setting_fails_at_once_and_a_lost_rank_is_retried(
    airflow_db, tmp_path, monkeypatch
):
    dag_id = f"retry_{uuid.uuid4().hex[:8]}"
    dag = dag_in_bundle(tmp_path, monkeypatch, dag_id, RETRY_DAG.format(dag_id=dag_id))
    run = dag.test()
    tis = {ti.task_id: ti for ti in run.get_task_instances()}
    assert str(tis["bad_setting"].state) == "failed"
    assert tis["bad_setting"].try_number == 1  # its two retries were not used
    assert str(tis["lost_rank"].state) == "failed"
    assert tis["lost_rank"].try_number == 3  # both retries were used
