"""Airflow operators that run Horovod training and export jobs (no torch imported here).

from operators import HorovodTrainOperator, HorovodExportOperator
"""

from operators.exceptions import (
    HorovodLaunchError,
    HorovodOperatorError,
    HorovodPreflightError,
    HorovodTimeoutError,
    HorovodTrainingError,
)
from operators.export import HorovodExportOperator
from operators.train import HorovodTrainOperator

__all__ = [
    "HorovodExportOperator",
    "HorovodLaunchError",
    "HorovodOperatorError",
    "HorovodPreflightError",
    "HorovodTimeoutError",
    "HorovodTrainOperator",
    "HorovodTrainingError",
]
