"""horovod-airflow: Airflow-native distributed PyTorch training with Horovod.

The one import name the project installs. Its two packages keep their folders at the top of
the repository (``trainer/`` and ``operators/``, the layout the project was asked for) and are
mapped under this name, so nothing generic like ``trainer`` or ``operators`` lands in a
user's site-packages:

- :mod:`horovod_airflow.trainer` — the Horovod training program (``python -m
  horovod_airflow.trainer``); never imports Airflow.
- :mod:`horovod_airflow.operators` — the Airflow operators; never imports torch or horovod at
  module level.

In a checkout, ``horovod_airflow/trainer`` and ``horovod_airflow/operators`` are symbolic links
to those folders (so the repository root on ``sys.path`` is enough); the wheel packs them
through the links; the images copy the folders to ``/opt/hva/horovod_airflow/``.
"""

__version__ = "0.1.0"
