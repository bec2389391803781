"""horovod-airflow: Airflow-native distributed PyTorch training with Horovod.

The one import name the project installs. Its three layers keep their folders at the top of
the repository and are mapped under this name (pyproject.toml's ``package-dir``; an editable
install maps them the same way), so nothing generic like ``trainer`` lands in a user's
site-packages. The folder says which process runs a line:

- :mod:`horovod_airflow.core` (``core/``) — both sides: the file contract, storage, the bucket
  and dataset layout, the trainer's declared options; imports neither torch nor Airflow.
- :mod:`horovod_airflow.trainer` (``trainer/``) — a Horovod rank: the training program
  (``python -m horovod_airflow.trainer``); never imports Airflow.
- :mod:`horovod_airflow.operators` (``operators/``) — the Airflow worker: operators,
  launchers, the model registry; never imports torch, Horovod or the trainer.
"""

__version__ = "0.1.0"
