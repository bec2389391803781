"""Airflow operators that run Horovod training and export jobs (no torch imported here).

from operators import HorovodTrainOperator, HorovodExportOperator
"""

from operators.exceptions import (
    HorovodConfigError,
    HorovodLaunchError,
    HorovodOperatorError,
    HorovodPreflightError,
    HorovodTimeoutError,
    HorovodTrainingError,
    TrainingCompletedError,
)
from operators.export import HorovodExportOperator
from operators.gate import ModelGateOperator
from operators.stage import StageDatasetOperator
from operators.train import HorovodTrainOperator

__all__ = [
    "HorovodConfigError",
    "HorovodExportOperator",
    "HorovodLaunchError",
    "HorovodOperatorError",
    "HorovodPreflightError",
    "HorovodTimeoutError",
    "HorovodTrainOperator",
    "HorovodTrainingError",
    "ModelGateOperator",
    "StageDatasetOperator",
    "TrainingCompletedError",
]
