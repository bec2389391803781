"""The core both sides import: the files they exchange, where those files live, and how.

Neither torch nor Airflow is imported here, so the Airflow worker, the DAG processor, every
Horovod rank and a user's own training program can all import this package:

- :mod:`horovod_airflow.core.contract` — every artifact name, ``format`` and JSON schema.
- :mod:`horovod_airflow.core.storage` — the one module that reads and writes ``s3://`` or
  local URIs.
- :mod:`horovod_airflow.core.layout` — the bucket layout and the staged MNIST-format dataset.
- :mod:`horovod_airflow.core.fileset` — a staged set of any other files.
- :mod:`horovod_airflow.core.train_config` — the built-in trainer's options, declared once:
  the rank builds its ``TrainConfig`` from them, the Airflow side its trigger-form Params.
- :mod:`horovod_airflow.core.startup_savings` — the measured start-up savings (no interpreter
  teardown, horovodrun without its Gloo probe, the interpreter fingerprint of a remembered
  doctor pass), in one place.
"""
