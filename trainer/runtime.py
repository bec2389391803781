"""What a rank resolves from the hardware it finds: Horovod's init, the device, the threads it
takes of the node's cores, and what ``--precision auto`` / ``--channels-last auto`` become."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from horovod_airflow.core.train_config import TrainConfig

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Runtime:
    """What this rank resolved from the hardware it found (saved next to the config)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    device: str  # "cpu" or "cuda:<i>"
    threads: int  # torch intra-op threads of this rank
    precision: str  # resolved: fp32 | bf16
    channels_last: bool  # resolved: inputs and activations NHWC (parameters stay contiguous)
    precision_reason: str = ""  # why: the flag given, or what ``auto`` found

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


def log(rt: Runtime, message: str) -> None:
    if rt.is_primary:
        print(f"[trainer] {message}", file=sys.stderr, flush=True)


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU has native bf16 matmul (AVX512-BF16 or AMX); else autocast is emulated.

    ``cpuinfo`` is the text of ``/proc/cpuinfo`` (read when None), so tests can give either
    answer on any machine.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    flags = set(cpuinfo.split())
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cuda_has_bf16() -> bool:
    """True when the current CUDA device computes bf16 natively (compute capability >= 8.0).

    torch's ``is_bf16_supported()`` also counts emulation by default: ask without it.
    """
    import torch

    return bool(torch.cuda.is_bf16_supported(including_emulation=False))


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``--precision`` and ``--channels-last`` resolve to on a device, and why."""

    precision: str  # fp32 | bf16
    channels_last: bool
    reason: str


def resolve_precision(
    precision: str, channels_last: str, device_type: str, native_bf16: bool
) -> PrecisionChoice:
    """Turn ``auto`` into a choice for this hardware; an explicit flag always wins.

    ``auto`` picks bf16 autocast (float32 master weights, float32 evaluation) only where bf16
    is native: CUDA devices of compute capability >= 8.0, CPUs with AVX512-BF16 or AMX
    (``native_bf16``). Emulated bf16 is several times slower than fp32. Channels-last (NHWC
    activations) goes with bf16 on CUDA, where the tensor-core kernels want it; on CPUs it
    is off (``bench/results/precision.md`` has the measurement, per CPU, that set this).
    """
    if precision != "auto":
        why = f"--precision {precision}"
    elif native_bf16:
        precision = "bf16"
        why = f"--precision auto: bf16, {device_type} has native bf16"
    else:
        precision = "fp32"
        why = f"--precision auto: fp32, {device_type} has no native bf16 (it would be emulated)"
    if channels_last != "auto":
        nhwc = channels_last == "on"
        why += f"; --channels-last {channels_last}"
    else:
        nhwc = device_type == "cuda" and precision == "bf16"
        why += f"; --channels-last auto: {'on' if nhwc else 'off'} for {precision} on {device_type}"
    return PrecisionChoice(precision, nhwc, why)


# Horovod's background thread wakes every HOROVOD_CYCLE_TIME ms (Horovod's default: 1) to
# negotiate ready tensors. On CPU ranks it takes its cycles from the cores doing the compute,
# and a CPU step lasts far longer than 10 ms, so a later negotiation costs little: 10 ms was
# the fastest setting measured (bench/horovod_cycle.py; figures in
# bench/results/horovod_cycle*.md). GPU ranks keep Horovod's default (their steps: ms).
CPU_CYCLE_TIME_MS = "10"


def setup_runtime(config: TrainConfig) -> tuple[Runtime, torch.device]:
    import horovod.torch as hvd
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:  # an explicit HOROVOD_CYCLE_TIME (horovodrun --cycle-time-ms) wins
        os.environ.setdefault("HOROVOD_CYCLE_TIME", CPU_CYCLE_TIME_MS)
    hvd.init()  # Horovod: join the other ranks (reads HOROVOD_CYCLE_TIME)
    if cuda:
        torch.cuda.set_device(hvd.local_rank())  # Horovod: pin one GPU per local rank
        device = torch.device("cuda", hvd.local_rank())
        threads = torch.get_num_threads()
    else:
        device = torch.device("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cores or 1) // hvd.local_size())  # Horovod: share the node's cores
        torch.set_num_threads(threads)
    choice = resolve_precision(
        config.precision,
        config.channels_last,
        device.type,
        cuda_has_bf16() if cuda else cpu_has_bf16(),
    )
    rt = Runtime(
        rank=hvd.rank(),
        size=hvd.size(),
        local_rank=hvd.local_rank(),
        local_size=hvd.local_size(),
        device=str(device),
        threads=threads,
        precision=choice.precision,
        channels_last=choice.channels_last,
        precision_reason=choice.reason,
    )
    return rt, device
