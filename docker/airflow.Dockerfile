# syntax=docker/dockerfile:1
# The Airflow image of the compose stack (api-server, scheduler, dag-processor, triggerer):
# the official Airflow 3.3.2 image plus our Airflow side — operators/, the torch-free trainer
# modules they import (contract, layout, fileset, storage, config), the DAGs, the pinned
# providers — and the MNIST files the DAG stages to S3. No torch, no horovod: training runs
# in the trainer image.
#
#   docker build -f docker/airflow.Dockerfile -t horovod-airflow-airflow:0.1.0 .
FROM apache/airflow:3.3.2-python3.11

# The official image's airflow user (uid 50000, group 0), numeric as Kubernetes wants it.
USER 50000:0

# The providers at the versions requirements/lock.txt pins; apache-airflow pinned to the image's
# own version so pip cannot move it.
COPY --chown=50000:0 requirements/lock.txt /tmp/hva/lock.txt
COPY --chown=50000:0 docker/airflow-requirements.in docker/pins_from_lock.py /tmp/hva/
RUN python /tmp/hva/pins_from_lock.py /tmp/hva/airflow-requirements.in /tmp/hva/lock.txt \
      >/tmp/hva/pins.txt \
 && pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" -r /tmp/hva/pins.txt \
 && rm -rf /tmp/hva

# Our packages on PYTHONPATH under their import name, horovod_airflow (as the wheel installs
# them): the Airflow side is operators/ and the apps/ built on it, and the torch-free core/ it
# shares with the ranks; the rank program (trainer/) is not here at all, so nothing in this
# image can import torch.
COPY --chown=50000:0 horovod_airflow/__init__.py /opt/hva/horovod_airflow/__init__.py
COPY --chown=50000:0 core/ /opt/hva/horovod_airflow/core/
COPY --chown=50000:0 operators/ /opt/hva/horovod_airflow/operators/
COPY --chown=50000:0 apps/ /opt/hva/horovod_airflow/apps/
COPY --chown=50000:0 docker/check_docker_launcher.py /opt/hva/bin/check_docker_launcher.py
# The vendored MNIST, which the DAG's dataset_source "vendored" stages: HVA_VENDORED_MNIST says
# where (operators/staging.py; in a checkout it is <repo>/data/mnist).
COPY --chown=50000:0 data/mnist/ /opt/hva/data/mnist/
COPY --chown=50000:0 dags/ /opt/airflow/dags/
# The model registry page (operators/registry_plugin.py), loaded from the plugins folder.
COPY --chown=50000:0 docker/airflow-plugins/ /opt/airflow/plugins/
ENV PYTHONPATH=/opt/hva \
    HVA_VENDORED_MNIST=/opt/hva/data/mnist

RUN python -c "import horovod_airflow.operators.registry_plugin, horovod_airflow.operators, horovod_airflow.core.contract, horovod_airflow.core.layout, horovod_airflow.core.fileset, horovod_airflow.core.train_config" \
 && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('horovod_airflow.trainer') is not None)" \
 && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
