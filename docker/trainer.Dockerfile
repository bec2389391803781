# syntax=docker/dockerfile:1
# The trainer image: what every Horovod rank runs (`python -m horovod_airflow.trainer train|export|doctor`).
# torch 2.14.1 (CUDA 13.0 build) + torchvision from requirements/lock.txt, Horovod 0.28.1 built
# with NCCL + Gloo by scripts/build_horovod.sh (the one place that knows how to build it against
# torch >= 2.14), then the trainer package. No Airflow in here.
#
#   docker build -f docker/trainer.Dockerfile -t horovod-airflow-trainer:0.1.0 .
#   docker run --rm --gpus all horovod-airflow-trainer:0.1.0 python -m horovod_airflow.trainer doctor --np 1
#
# Base: Debian bookworm's Python 3.11 image for both stages, not nvidia/cuda or pytorch/pytorch:
# the lock is resolved for CPython 3.11 (Ubuntu 24.04 ships 3.12), the torch wheel carries its own
# CUDA runtime, cuDNN and NCCL (nvidia-* wheels), the NVIDIA Container Toolkit mounts the driver,
# and bookworm's g++ 12 and cmake 3.25 are the toolchain the dev machines build Horovod with.
# Only the build stage has a compiler; the runtime stage gets the finished virtualenv.

# ---- build: torch from the lock, a CUDA compiler, Horovod with NCCL -------------------------
FROM python:3.11-slim-bookworm AS build

# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ make cmake \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv

WORKDIR /src
COPY requirements/lock.txt requirements/lock.txt
COPY docker/trainer-requirements.in docker/trainer-requirements.in
RUN pip install "pip==26.3" \
 && pip install -c requirements/lock.txt -r docker/trainer-requirements.in

# nvcc from NVIDIA's PyPI wheels, laid out as /usr/local/cuda-13.0 like on the dev machines.
COPY docker/install_cuda_compiler.sh docker/install_cuda_compiler.sh
RUN bash docker/install_cuda_compiler.sh /usr/local/cuda-13.0 /usr/local/bin

# GPU architectures to compile Horovod's CUDA kernels for: 80 = A100, 90 = H100/H200.
ARG HOROVOD_BUILD_CUDA_CC_LIST=80,90
COPY scripts/build_horovod.sh scripts/build_horovod.sh
COPY scripts/cxx20 scripts/cxx20
RUN HOROVOD_GPU_OPERATIONS=NCCL \
    HOROVOD_BUILD_CUDA_CC_LIST="$HOROVOD_BUILD_CUDA_CC_LIST" \
    HOROVOD_WHEEL_CACHE=/tmp/horovod-wheels \
    bash scripts/build_horovod.sh /opt/venv/bin/python \
 && rm -rf /tmp/horovod-wheels

# ---- runtime: the virtualenv and the trainer package, as a non-root user ---------------------
FROM python:3.11-slim-bookworm AS runtime

# ssh client and server: a Kubeflow MPIJob's launcher reaches its workers over ssh, and each
# worker runs sshd as the image's user (docker/trainer-sshd_config; port 2222, no root needed):
#   /usr/sbin/sshd -De -f /etc/ssh/hva_worker_sshd_config
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends openssh-client openssh-server \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 1000 --user-group --shell /bin/bash trainer
COPY docker/trainer-sshd_config /etc/ssh/hva_worker_sshd_config
COPY --from=build /opt/venv /opt/venv
COPY horovod_airflow/__init__.py /opt/hva/horovod_airflow/__init__.py
COPY core/ /opt/hva/horovod_airflow/core/
COPY trainer/ /opt/hva/horovod_airflow/trainer/

# NVIDIA_*: what the NVIDIA Container Toolkit exposes. LD_LIBRARY_PATH: Horovod's NCCL operations
# load the libnccl.so.2 that the torch wheel installed (build_horovod.sh built against it).
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/hva \
    PYTHONUNBUFFERED=1 \
    LD_LIBRARY_PATH=/opt/venv/lib/python3.11/site-packages/nvidia/nccl/lib \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    OMP_NUM_THREADS=1

# Numeric, so Kubernetes runAsNonRoot can verify it (the kubernetes launcher).
USER 1000:1000
WORKDIR /home/trainer

# Fail the build, not the first training run, if Horovod lost PyTorch, Gloo or NCCL.
RUN horovodrun --check-build >/tmp/check-build.txt \
 && cat /tmp/check-build.txt \
 && grep -q '\[X\] PyTorch' /tmp/check-build.txt \
 && grep -q '\[X\] Gloo' /tmp/check-build.txt \
 && grep -q '\[X\] NCCL' /tmp/check-build.txt \
 && python -c "import horovod_airflow.trainer, horovod_airflow.core.storage, horovod_airflow.core.layout" \
 && rm /tmp/check-build.txt

CMD ["python", "-m", "horovod_airflow.trainer", "doctor"]
