"""What every benchmark records: the machine, Markdown tables, and the results files.

Runs in the benchmark driver process (not in a Horovod rank); imports torch lazily so that
``machine()`` also works where only the versions are wanted.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
MNIST_DIR = REPO / "data" / "mnist"
RANK_PREFIX = re.compile(r"^\[\d+(,\d+)?\]<std(out|err)>:")  # how horovodrun tags rank output


def _cpuinfo(key: str) -> str | None:
    """The value of the first ``key`` line of ``/proc/cpuinfo`` (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or "unknown"


# The flags that decide a CPU's math paths (bf16 native or emulated, vector width).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_flags() -> list[str]:
    """The CPU's feature flags, as ``lscpu`` lists them (from ``/proc/cpuinfo``)."""
    return (_cpuinfo("flags") or "").split()


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _horovod_version() -> str:
    try:
        import horovod

        return str(horovod.__version__)
    except ImportError:
        return "not installed"


def machine() -> dict[str, Any]:
    """The facts a reader needs to compare two results: cores, CPU, versions, load at start."""
    import torch
    import torchvision

    cuda = torch.cuda.is_available()
    return {
        "cores": os.cpu_count(),
        "cpu_model": cpu_model(),
        "cpu_flags": " ".join(cpu_flags()),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpus": torch.cuda.device_count() if cuda else 0,
        "gpu_model": torch.cuda.get_device_name(0) if cuda else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "horovod": _horovod_version(),
        "torch_default_threads": torch.get_num_threads(),
        "load_average_at_start": load_average(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def machine_line(m: dict[str, Any]) -> str:
    gpu = f", {m['gpus']}× {m['gpu_model']}" if m.get("gpus") else ", no GPU"
    load = " / ".join(f"{x:.2f}" for x in m["load_average_at_start"])
    flags = set(m.get("cpu_flags", "").split())
    isa = ", ".join(f if f in flags else f"no {f}" for f in ISA_FLAGS)
    return (
        f"Machine: {m['cores']} cores ({m['cpu_model']}; {isa}), {m['memory_gib']} GiB{gpu}; "
        f"torch {m['torch']}, torchvision {m['torchvision']}, horovod {m['horovod']}, "
        f"Python {m['python']}; load average at start {load} (1/5/15 min)."
    )


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(
    name: str, markdown: str, data: dict[str, Any], results_dir: Path | None = None
) -> Path:
    """Print the Markdown and write ``<results_dir>/<name>.md`` and ``<name>.json``."""
    out = Path(results_dir) if results_dir else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    # Other work on a shared machine skews every figure: say how busy it was at the end too.
    end = data.setdefault("load_average_at_end", load_average())
    markdown = markdown.rstrip() + f"\nLoad average at end: {' / '.join(f'{x:.2f}' for x in end)}."
    print(markdown, flush=True)
    (out / f"{name}.md").write_text(markdown.rstrip() + "\n")
    (out / f"{name}.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return out / f"{name}.md"


def default_ranks(wanted: int = 2) -> int:
    """``wanted`` ranks on CPU; on a CUDA machine one rank per GPU, at most ``wanted``."""
    import torch

    if torch.cuda.is_available():
        return max(1, min(wanted, torch.cuda.device_count()))
    return wanted


def rank_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for ``horovodrun``: this venv's bin first on PATH, the repo on PYTHONPATH."""
    env = os.environ.copy()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


@dataclass
class HorovodRun:
    """A finished ``horovodrun``: wall seconds and each output line with its arrival time."""

    wall_seconds: float
    lines: list[tuple[float, str]]  # (seconds after launch, line), in arrival order
    log: Path


class _StampedLog:
    """The launcher's log: each line (horovodrun's output, and the launcher's own few lines,
    e.g. the pid it started) stamped with its arrival time and written to the log file."""

    def __init__(self, file: IO[str], start: float) -> None:
        self.file = file
        self.start = start
        self.lines: list[tuple[float, str]] = []

    def info(self, message: str, *args: Any) -> None:  # called by one thread at a time
        line = message % args if args else message
        self.lines.append((time.perf_counter() - self.start, line))
        self.file.write(line + "\n")
        self.file.flush()  # so that a long run can be followed with tail -f


def run_horovod(
    np: int,
    module_args: Sequence[str],
    *,
    log: Path,
    timeout: float,
    env: dict[str, str] | None = None,
) -> HorovodRun:
    """Run ``horovodrun -np N -H localhost:N python -m <module_args>`` and time it.

    The run is the product's own: ``horovod_airflow.operators.launchers.local.LocalLauncher``, so a
    timeout stops horovodrun *and* every rank (their middlemen ``setsid()`` out of horovodrun's
    process group; the launcher walks the process tree and the job's environment marker). On a
    trainer-only host (the GPU device image has no Airflow) horovodrun runs directly and a timeout
    kills its process tree (psutil). Each output line is stamped with its arrival time (seconds
    after launch), so a benchmark can tell when a rank printed, e.g., the end of an epoch. The
    combined output also goes to ``log``; on a non-zero exit or a timeout, raise with the log's
    tail.
    """
    if np < 1:
        raise ValueError(f"np (Horovod ranks) must be >= 1, got {np}")
    program = [sys.executable, "-m", *module_args]
    env = env or rank_env()
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("w") as f:
        out = _StampedLog(f, start)
        try:
            command, why = _run_with_local_launcher(np, program, env, timeout, out)
        except ModuleNotFoundError as e:
            if e.name is None or e.name.split(".")[0] != "airflow":
                raise
            out.info("bench: no Airflow here, so no local launcher: horovodrun directly")
            command, why = _run_horovodrun(np, program, env, timeout, out)
    wall = time.perf_counter() - start
    if why:
        # The ranks' own lines say why; horovodrun's traceback after them does not.
        rank_lines = [line for _, line in out.lines if RANK_PREFIX.match(line)]
        tail = "\n".join(rank_lines[-30:] or [line for _, line in out.lines[-40:]])
        raise RuntimeError(f"{command} {why}; log tail ({log}):\n{tail}")
    return HorovodRun(wall_seconds=wall, lines=out.lines, log=log)


def _run_with_local_launcher(
    np: int, program: list[str], env: dict[str, str], timeout: float, out: _StampedLog
) -> tuple[str, str]:
    """The local launcher runs ``horovodrun -np N -H localhost:N`` around ``program``; return
    the command and why it failed ("" when it did not)."""
    # Imported here: the ranks import this module too and need neither Airflow nor psutil.
    from horovod_airflow.operators.exceptions import HorovodTimeoutError, HorovodTrainingError
    from horovod_airflow.operators.launchers.base import JobSpec
    from horovod_airflow.operators.launchers.local import LocalLauncher

    name = f"bench-{program[2] if len(program) > 2 else 'run'}"
    spec = JobSpec(name=name, argv=program, env=env, num_proc=np, timeout=timeout)
    command = f"horovodrun -np {np} {' '.join(program)}"
    try:
        LocalLauncher().run(spec, out)
    except HorovodTimeoutError:
        return command, f"timed out after {timeout:g}s (horovodrun and all its ranks were stopped)"
    except HorovodTrainingError as e:
        return command, f"exited {e.exit_code}"
    return command, ""


def _run_horovodrun(
    np: int, program: list[str], env: dict[str, str], timeout: float, out: _StampedLog
) -> tuple[str, str]:
    """:func:`_run_with_local_launcher` where Airflow (and so the launcher) is absent:
    ``horovodrun --gloo -np N -H localhost:N <program>``; past ``timeout`` horovodrun and every
    process under it are killed."""
    import subprocess
    import threading

    import psutil

    here = Path(sys.executable).parent / "horovodrun"
    horovodrun = str(here) if here.exists() else "horovodrun"
    argv = [horovodrun, "--gloo", "-np", str(np), "-H", f"localhost:{np}", *program]
    out.info("bench: started %s", " ".join(argv))
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    stream = proc.stdout

    def pump() -> None:
        for line in stream:
            out.info(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    why = ""
    try:
        code = proc.wait(timeout=timeout)
        if code != 0:
            why = f"exited {code}"
    except subprocess.TimeoutExpired:
        tree = [proc, *psutil.Process(proc.pid).children(recursive=True)]
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.kill()
        proc.wait()
        why = f"timed out after {timeout:g}s (horovodrun and all its ranks were killed)"
    reader.join(timeout=10)
    return " ".join(argv), why


def json_events(run: HorovodRun, event: str | None = None) -> list[tuple[float, dict[str, Any]]]:
    """The JSON objects printed (by any rank) as whole lines, with their arrival times.

    horovodrun prefixes each rank's line with ``[rank]<stdout>:``; that prefix is skipped.
    """
    found = []
    for t, line in run.lines:
        brace = line.find("{")
        if brace < 0:
            continue
        try:
            obj = json.loads(line[brace:])
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and (event is None or obj.get("event") == event):
            found.append((t, obj))
    return found
