"""Can N Horovod ranks start here? ``python -m horovod_airflow.trainer doctor [--np N]
[--gpus-per-proc G]``.

Reports torch, horovod, CUDA/NCCL/Gloo/MPI availability and the GPU count, and lists what is
missing for the requested launch. Exit 0 when it can start, 1 otherwise.
"""

from __future__ import annotations

import os
import platform
import shutil
from typing import Any


def diagnose(np_: int = 1, gpus_per_proc: int = 0) -> dict[str, Any]:
    """Facts about this machine plus ``problems`` (each names what is missing)."""
    from horovod_airflow.trainer.runtime import cpu_has_bf16, cuda_has_bf16, resolve_precision

    problems: list[str] = []
    warnings: list[str] = []
    report: dict[str, Any] = {
        "python": platform.python_version(),
        "np": np_,
        "gpus_per_proc": gpus_per_proc,
        "cpu_cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cpu_bf16": cpu_has_bf16(),
    }
    try:
        import torch

        report["torch"] = torch.__version__
        report["cuda_available"] = torch.cuda.is_available()
        report["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        report["torch_cuda"] = torch.version.cuda
        device_type = "cuda" if report["cuda_available"] else "cpu"
        native = cuda_has_bf16() if device_type == "cuda" else report["cpu_bf16"]
        choice = resolve_precision("auto", "auto", device_type, native)
        report["auto_precision"] = choice.precision
        report["auto_channels_last"] = choice.channels_last
        report["auto_reason"] = choice.reason
    except ImportError as e:
        report.update(torch=None, cuda_available=False, gpus=0)
        problems.append(f"torch is not importable ({e}): install the 'trainer' extra")

    try:
        import horovod
        import horovod.torch as hvd

        report.update(
            horovod=horovod.__version__,
            gloo_built=bool(hvd.gloo_built()),
            mpi_built=bool(hvd.mpi_built()),
            nccl_built=bool(hvd.nccl_built()),
            cuda_built=bool(hvd.cuda_built()),
        )
        if not (report["gloo_built"] or report["mpi_built"]):
            problems.append("horovod has no controller: built without Gloo and without MPI")
        if gpus_per_proc > 0 and not report["nccl_built"]:
            warnings.append("horovod was built without NCCL: GPU allreduce goes through the CPU")
    except Exception as e:
        report.update(horovod=None, gloo_built=False, mpi_built=False, nccl_built=False)
        problems.append(f"horovod.torch is not importable ({type(e).__name__}: {e})")

    report["horovodrun"] = shutil.which("horovodrun")
    if report["horovodrun"] is None:
        problems.append("horovodrun is not on PATH (put the environment's bin/ first on PATH)")

    if np_ < 1:
        problems.append(f"--np must be >= 1, got {np_}")
    if gpus_per_proc < 0:
        problems.append(f"--gpus-per-proc must be >= 0, got {gpus_per_proc}")
    if gpus_per_proc > 0 and np_ * gpus_per_proc > report.get("gpus", 0):
        problems.append(
            f"{np_} ranks x {gpus_per_proc} GPU(s) need {np_ * gpus_per_proc} GPUs, "
            f"{report.get('gpus', 0)} visible"
        )
    cores = report["cpu_cores"] or 1
    if gpus_per_proc == 0 and np_ > cores:
        warnings.append(f"{np_} CPU ranks on {cores} cores: ranks will oversubscribe the CPU")
    report["problems"] = problems
    report["warnings"] = warnings
    report["ok"] = not problems
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{k}: {report[k]}" for k in report if k not in ("problems", "warnings", "ok")]
    lines += [f"warning: {w}" for w in report["warnings"]]
    lines += [f"problem: {p}" for p in report["problems"]]
    verdict = "can start" if report["ok"] else "cannot start"
    lines.append(f"{report['np']} rank(s) x {report['gpus_per_proc']} GPU(s): {verdict}")
    return "\n".join(lines)
