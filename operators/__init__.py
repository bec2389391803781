"""Airflow operators for the retraining chain: stage → train → gate → export → publish (or,
after a refusal, record_refused: the model kept as a refused candidate).

No torch is imported here; training and export run in the processes the launchers start.

from horovod_airflow.operators import (
    StageDatasetOperator, HorovodTrainOperator, ModelGateOperator,
    HorovodExportOperator, PublishModelOperator, RecordRefusedOperator,
)

``DataChecks`` declares the staging's data checks (``StageDatasetOperator(checks=...)``).
``BucketRetentionOperator`` applies the bucket's retention policy (the maintenance DAG's task).

``safe_key`` is the Jinja filter that makes a run id one S3 key segment (run prefixes).
``trainer_param_schema("epochs", nullable=True)`` is the JSON schema of a trainer option as
the trainer declares it (``horovod_airflow.core.train_config.param_schema``), for a DAG's ``Param``.
"""

from horovod_airflow.core.train_config import param_schema as trainer_param_schema
from horovod_airflow.operators.bucket_retention import BucketRetentionOperator
from horovod_airflow.operators.data_checks import DataChecks
from horovod_airflow.operators.exceptions import (
    ChampionChangedError,
    DatasetRefusedError,
    HorovodConfigError,
    HorovodLaunchError,
    HorovodOperatorError,
    HorovodPreflightError,
    HorovodRefusedError,
    HorovodTimeoutError,
    HorovodTrainingError,
    PublishRefusedError,
    RetentionConflictError,
    TrainingCompletedError,
)
from horovod_airflow.operators.export import HorovodExportOperator
from horovod_airflow.operators.gate import ModelGateOperator
from horovod_airflow.operators.model_registry import safe_key
from horovod_airflow.operators.publish import PublishModelOperator, RecordRefusedOperator
from horovod_airflow.operators.stage import StageDatasetOperator
from horovod_airflow.operators.train import HorovodTrainOperator

__all__ = [
    "BucketRetentionOperator",
    "ChampionChangedError",
    "DataChecks",
    "DatasetRefusedError",
    "HorovodConfigError",
    "HorovodExportOperator",
    "HorovodLaunchError",
    "HorovodOperatorError",
    "HorovodPreflightError",
    "HorovodRefusedError",
    "HorovodTimeoutError",
    "HorovodTrainOperator",
    "HorovodTrainingError",
    "ModelGateOperator",
    "PublishModelOperator",
    "PublishRefusedError",
    "RecordRefusedOperator",
    "RetentionConflictError",
    "StageDatasetOperator",
    "TrainingCompletedError",
    "safe_key",
    "trainer_param_schema",
]
