"""The GPU check (issue #33): one command that builds Horovod with NCCL on a lent GPU, trains,
measures, exports, and writes ``gpu_<card>.md`` and ``.json`` with every figure.

    bash scripts/gpu/check.sh                       # on the device: results into $OUT
    bash scripts/gpu/check.sh --cpu --out DIR       # the rehearsal: same steps, CPU, tiny data

The device has no network: ``scripts/gpu/kit.sh`` builds ``.gpu-kit/`` here first, and the
device call carries it. Steps, in this order (most wanted first), each logged with the seconds
since the start and its own time:

1. ``environment``: card, driver, compute capability, torch / CUDA / cuDNN / NCCL, nvcc, g++,
   the CPU (model and flags), cores.
2. ``kit``: every kit file matches its sha256; its wheels install offline (``pip --target``);
   the carried cmake runs.
3. ``build``: ``scripts/build_horovod.sh`` against this interpreter's torch with the kit's
   sdist and cmake: on the GPU ``HOROVOD_GPU_OPERATIONS=NCCL`` + Gloo for the card's compute
   capability, all cores; with ``--cpu`` the cached Gloo wheel of the project's venv.
4. ``check-build``: ``horovodrun --check-build`` lists PyTorch and Gloo (and NCCL on a GPU).
5. ``doctor``: ``python -m horovod_airflow.trainer doctor`` sees the GPU and says what ``auto``
   resolves to.
6. ``train-1``: one rank trains the trainer's default recipe on the full vendored MNIST
   (``bench.time_to_accuracy.run_ours``: times from launch and in the training loop, the
   allreduced accuracy); the training set is resident on the device and batches are index
   selections (``horovod_airflow.trainer.train.batches``), no DataLoader.
7. ``export``: ``python -m horovod_airflow.trainer export`` of that checkpoint, parity against
   onnxruntime on the CPU.
8. ``seed-demo``: the seed demo's recipe (``bench.demo_baseline``: the demo in
   ``../shared/seed``, run as written but for the fixes that let it be measured) on the same
   device, one rank, 3 epochs: the time ratio.
9. ``train-2``: two ranks on the one device (on a GPU the trainer pins local rank i to GPU i,
   so with one GPU this says why not).

``--cpu`` runs the same steps on tiny subsets (1,024 / 256 samples, 1 epoch; the demo 512 /
256) in a minute or two, so the script cannot rot between GPU loans. A step whose needs failed
is not run; past ``--budget`` seconds the steps left are not started. The result files are
rewritten after every step, so a run stopped at its limit still leaves what it measured.
Exit code 0 when every step that ran passed, 1 otherwise; a missed target is a finding written
in the results, not a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.demo_baseline import TARGET_ACCURACY, run_demo
from bench.report import REPO, load_average, machine, machine_line, md_table, write_results
from bench.time_to_accuracy import in_loop_seconds, run_ours
from horovod_airflow.core.contract import CHECKPOINT_NAME, PARITY_NAME
from scripts.gpu.kit import sha256 as kit_sha256
from scripts.gpu.kit import verified

HOROVOD_VERSION = "0.28.1"
CMAKE_VERSION = "3.31.10"
KIT_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# Targets of issue #33 (one H100/H200, one rank): figures, not failures.
TARGET_LOOP_SECONDS = 5.0
TARGET_DEMO_RATIO = 30.0
TARGET_SETUP_SECONDS = 240.0
# The tiny subsets of --cpu.
CPU_OURS = ["--epochs", "1", "--max-train-samples", "1024", "--max-val-samples", "256"]
CPU_DEMO: dict[str, Any] = {"epochs": 1, "train_samples": 512, "val_samples": 256}


class StepError(RuntimeError):
    """A step's check failed; the message says what was expected and what was found."""


def card_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``: the results file's name."""
    match = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name.replace("NVIDIA", ""))
    if match:
        return match.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def demo_ratio(ours: dict[str, Any], demo: dict[str, Any]) -> dict[str, Any]:
    """The seed demo's time over ours, from launch and in the training loops (training +
    validation), to 99 %; where the demo never reached 99 %, to the end of its best epoch
    (``basis`` says which). Empty when ours did not reach 99 % or the demo did not run."""
    if not ours.get("reached_target") or not demo:
        return {}
    if demo["time_to_target"]:
        epoch = demo["time_to_target"]["epoch"]
        theirs, basis = demo["time_to_target"]["seconds"], "the demo's time to 99 %"
    else:
        epoch = demo["best"]["epoch"]
        theirs = demo["best"]["ended_after"]
        basis = (
            f"the demo never reached 99 %: its time to its best accuracy, "
            f"{100 * demo['best']['val_accuracy']:.2f} % in epoch {epoch}"
        )
    loop = sum(e["train_seconds"] + e["val_seconds"] for e in demo["epochs"] if e["epoch"] <= epoch)
    out = {"ratio": round(theirs / ours["reached_target"]["seconds"], 1), "basis": basis}
    if ours.get("loop_seconds_to_target"):
        out["loop_ratio"] = round(loop / ours["loop_seconds_to_target"], 1)
    return out


def nccl_version() -> str:
    """The NCCL torch loads: a (major, minor, patch) tuple in torch 2.x, an int before."""
    import torch

    v = torch.cuda.nccl.version()
    return ".".join(str(p) for p in v) if isinstance(v, tuple) else str(v)


def run_command(
    argv: list[str], *, log: Path, timeout: float, env: dict[str, str] | None = None
) -> str:
    """Run ``argv`` with its output to ``log``; return the output; StepError on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            timeout=timeout, cwd=REPO,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode()
        log.write_text(out)
        why = f"{' '.join(argv)} timed out after {timeout:g}s; tail:\n{out[-1500:]}"
        raise StepError(why) from None
    log.write_text(done.stdout)
    if done.returncode != 0:
        raise StepError(f"{' '.join(argv)} exited {done.returncode}; tail:\n{done.stdout[-2500:]}")
    return done.stdout


class Check:
    """The steps, their log and the results files."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cpu: bool = args.cpu
        self.out: Path = args.out
        self.work: Path = args.work
        self.kit: Path = args.kit
        self.site = self.work / "kit-site"
        self.start = time.perf_counter()
        self.steps: list[dict[str, Any]] = []
        self.facts: dict[str, Any] = {}
        self.card = "cpu-rehearsal" if self.cpu else "gpu"
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.log_file = self.out / "check.log"
        self.log_file.write_text("")

    # --- the frame: timing, logging, needs, budget -----------------------------------------
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, line: str) -> None:
        text = f"[check +{self.elapsed():6.1f}s] {line}"
        print(text, flush=True)
        with self.log_file.open("a") as f:
            f.write(text + "\n")

    def status(self, name: str) -> str:
        return next((s["status"] for s in self.steps if s["name"] == name), "not run")

    def step(
        self,
        name: str,
        fn: Callable[[], dict[str, Any]],
        *,
        needs: tuple[str, ...] = (),
        estimate: float = 0.0,
    ) -> None:
        record: dict[str, Any] = {"name": name, "started_at": None}
        blocked = [n for n in needs if self.status(n) != "ok"]
        if blocked:
            record.update(status="not run", detail=f"needs {', '.join(blocked)}")
        elif self.elapsed() + estimate > self.args.budget:
            record.update(
                status="not run",
                detail=f"time budget: {self.elapsed():.0f} s + ~{estimate:.0f} s would pass "
                f"--budget {self.args.budget:g} s",
            )
        if "status" in record:
            self.log(f"step {name}: NOT RUN ({record['detail']})")
            self.steps.append(record)
            self.write()
            return
        self.log(f"step {name}: start")
        began = self.elapsed()
        record["started_at"] = round(began, 1)
        try:
            figures = fn()
            record.update(status="ok", detail="", figures=figures)
        except Exception as e:  # a step's failure is recorded; the others still run
            record.update(status="failed", detail=f"{type(e).__name__}: {e}", figures={})
            with (self.work / "tracebacks.log").open("a") as f:
                f.write(f"--- {name}\n{traceback.format_exc()}\n")
        record["seconds"] = round(self.elapsed() - began, 1)
        word = "ok" if record["status"] == "ok" else "FAILED"
        self.log(f"step {name}: {word} in {record['seconds']} s")
        if record["status"] != "ok":
            for line in record["detail"].splitlines()[-25:]:
                self.log(f"    {line}")
        self.steps.append(record)
        self.write()

    def figures(self, name: str) -> dict[str, Any]:
        return next((s.get("figures") or {} for s in self.steps if s["name"] == name), {})

    def env(self) -> dict[str, str]:
        """The environment of every command: the kit's packages on the path (on the GPU)."""
        env = os.environ.copy()
        env["PYTHONUNBUFFERED"] = "1"
        env["PIP_NO_INDEX"] = "1"  # the device has no network: never wait on an index
        # horovodrun and the trainer's doctor are found beside this interpreter
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env

    def timeout(self, wanted: float) -> float:
        """``wanted``, or less: no command runs past ``--deadline`` seconds from the start."""
        return max(10.0, min(wanted, self.args.deadline - self.elapsed()))

    # --- the steps ---------------------------------------------------------------------------
    def environment(self) -> dict[str, Any]:
        import torch

        cuda = torch.cuda.is_available()
        if not self.cpu and not cuda:
            raise StepError("torch sees no CUDA device: on a machine without one, run --cpu")
        facts: dict[str, Any] = {
            "mode": "cpu rehearsal" if self.cpu else "gpu",
            "python": platform.python_version(),
            "python_executable": sys.executable,
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
            "machine": machine(),
        }
        if cuda:
            props = torch.cuda.get_device_properties(0)
            facts.update(
                gpu=props.name,
                gpu_memory_mib=props.total_memory // 2**20,
                compute_capability=f"{props.major}.{props.minor}",
                multiprocessors=props.multi_processor_count,
                nccl=nccl_version(),
                bf16_native=bool(torch.cuda.is_bf16_supported(including_emulation=False)),
            )
            self.card = card_slug(props.name)
        for key, argv in {
            "driver": ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            "nvcc": ["nvcc", "--version"],
            "gxx": ["g++", "--version"],
            "image_cmake": ["cmake", "--version"],
        }.items():
            exe = shutil.which(argv[0]) or (
                "/usr/local/cuda/bin/nvcc" if argv[0] == "nvcc" else None
            )
            if exe is None or not os.path.exists(exe):
                facts[key] = "absent"
                continue
            done = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=30)
            lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
            facts[key] = (lines[-1] if key == "nvcc" else lines[0]) if lines else "?"
        self.facts = facts
        return {k: v for k, v in facts.items() if k != "machine"}

    def install_kit(self) -> dict[str, Any]:
        manifest_file = self.kit / "kit.json"
        if not manifest_file.is_file():
            raise StepError(f"no {manifest_file}: run scripts/gpu/kit.sh here and carry .gpu-kit")
        manifest = json.loads(manifest_file.read_text())
        if verified(self.kit, manifest["key"]) is None:
            bad = [
                e["path"]
                for e in manifest["files"]
                if not (self.kit / e["path"]).is_file()
                or kit_sha256(self.kit / e["path"]) != e["sha256"]
            ]
            raise StepError(f"kit files missing or not matching their sha256: {bad or 'extra'}")
        wheels = sorted(str(p) for p in (self.kit / "wheels").glob("*.whl"))
        shutil.rmtree(self.site, ignore_errors=True)
        argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        argv += ["--no-compile", "--disable-pip-version-check", "--target", str(self.site)]
        if self.cpu:  # cp312 wheels into a 3.11 rehearsal: installed as the device would
            argv += ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
            for p in KIT_PLATFORMS:
                argv += ["--platform", p]
        began = time.perf_counter()
        run_command([*argv, *wheels], log=self.work / "kit-install.log", timeout=180)
        installed = time.perf_counter() - began
        cmake = self.site / "cmake" / "data" / "bin" / "cmake"
        version = subprocess.run([str(cmake), "--version"], capture_output=True, text=True)
        first = version.stdout.splitlines()[0] if version.stdout else version.stderr
        if f"cmake version {CMAKE_VERSION}" not in first:
            raise StepError(f"the kit's cmake ({cmake}) says {first!r}, not {CMAKE_VERSION}")
        figures: dict[str, Any] = {
            "wheels": [Path(w).name for w in wheels],
            "install_seconds": round(installed, 1),
            "cmake": first,
            "kit_bytes": sum(e["bytes"] for e in manifest["files"]),
        }
        if not self.cpu:
            # What the build and the trainer import from the kit, imported the device's way.
            env = self.env()
            env["PYTHONPATH"] = os.pathsep.join([str(self.site), env.get("PYTHONPATH", "")])
            code = "import cffi, pycparser, boto3; print(cffi.__version__, boto3.__version__)"
            figures["imports"] = run_command(
                [sys.executable, "-c", code], log=self.work / "kit-imports.log", timeout=60,
                env=env,
            ).strip()  # fmt: skip
            # From here on every process (the build, ranks, export) finds the kit's packages.
            os.environ["PYTHONPATH"] = env["PYTHONPATH"]
        self.facts["kit_cmake"] = str(cmake)
        return figures

    def build(self) -> dict[str, Any]:
        env = self.env()
        env["HOROVOD_SDIST"] = str(self.kit / f"horovod-{HOROVOD_VERSION}.tar.gz")
        env["HOROVOD_CMAKE"] = self.facts["kit_cmake"]
        if not self.cpu:
            major, minor = self.facts["compute_capability"].split(".")
            env.update(
                HOROVOD_GPU_OPERATIONS="NCCL",
                HOROVOD_BUILD_CUDA_CC_LIST=f"{major}{minor}",
                HOROVOD_WHEEL_CACHE=str(self.work / "horovod-wheels"),
            )
        log = self.work / "build.log"
        try:
            out = run_command(
                ["bash", str(REPO / "scripts" / "build_horovod.sh"), sys.executable],
                log=log, timeout=self.timeout(self.args.build_timeout), env=env,
            )  # fmt: skip
        finally:
            if log.exists():
                shutil.copy(log, self.out / "build.log")
        lines = [ln for ln in out.splitlines() if ln.startswith("build_horovod:")]
        built = next((ln for ln in lines if " built in " in ln), "")
        return {
            "gpu_operations": env.get("HOROVOD_GPU_OPERATIONS", "none (Gloo, CPU)"),
            "cuda_cc_list": env.get("HOROVOD_BUILD_CUDA_CC_LIST", ""),
            "cores": os.cpu_count(),
            "built": built or "reused the cached wheel",
            "lines": lines,
        }

    def check_build(self) -> dict[str, Any]:
        horovodrun = Path(sys.executable).parent / "horovodrun"
        out = run_command(
            [str(horovodrun), "--check-build"], log=self.work / "check-build.log", timeout=120,
            env=self.env(),
        )  # fmt: skip
        sections: dict[str, list[str]] = {}
        current = ""
        for line in out.splitlines():
            if line.startswith("Available "):
                current = line[len("Available ") :].rstrip(":").lower().replace(" ", "_")
            elif "[X]" in line and current:
                sections.setdefault(current, []).append(line.split("[X]", 1)[1].strip())
        wanted = {"frameworks": ["PyTorch"], "controllers": ["Gloo"]}
        wanted["tensor_operations"] = ["Gloo"] if self.cpu else ["NCCL", "Gloo"]
        missing = [f"{w} ({k})" for k, ws in wanted.items() for w in ws
                   if w not in sections.get(k, [])]  # fmt: skip
        if missing:
            raise StepError(f"horovodrun --check-build does not list {missing}:\n{out}")
        return sections

    def doctor(self) -> dict[str, Any]:
        argv = [sys.executable, "-m", "horovod_airflow.trainer", "doctor", "--np", "1", "--json"]
        if not self.cpu:
            argv += ["--gpus-per-proc", "1"]
        out = run_command(argv, log=self.work / "doctor.log", timeout=120, env=self.env())
        report = json.loads(out[out.index("{") :])
        keep = ["ok", "gpus", "cuda_available", "torch_cuda", "nccl_built", "gloo_built"]
        keep += ["auto_precision", "auto_channels_last", "auto_reason", "warnings"]
        return {k: report.get(k) for k in keep}

    def train(self, np: int, tag: str) -> dict[str, Any]:
        extra = ["--seed", "42", *(CPU_OURS if self.cpu else [])]
        timeout = self.timeout(self.args.run_timeout)
        result = run_ours(self.work / tag, np=np, extra_args=extra, timeout=timeout)
        epochs = result["epochs"]
        reached = result["time_to_target"]
        figures = {
            "world_size": result["world_size"],
            "val_accuracy": result["val_accuracy"],
            "epochs": epochs,
            "train_seconds": result["train_seconds"],
            "wall_seconds": result["wall_seconds"],
            "loop_seconds": round(in_loop_seconds(epochs, len(epochs)), 2),
            "reached_target": reached,
            "loop_seconds_to_target": (
                round(in_loop_seconds(epochs, reached["epoch"]), 2) if reached else None
            ),
            "samples_per_sec": max(e["train_samples_per_sec"] for e in epochs),
            "runtime": result["runtime"],
            "config": {k: result["config"][k] for k in ("model", "batch_size", "lr", "epochs")},
            "output": str(self.work / tag / "ours-output"),
            "staged": str(self.work / tag / "staged"),
        }
        return figures

    def export(self) -> dict[str, Any]:
        trained = self.figures("train-1")
        output = Path(trained["output"])
        argv = [sys.executable, "-m", "horovod_airflow.trainer", "export"]
        argv += ["--checkpoint", str(output / CHECKPOINT_NAME), "--output", str(output / "onnx")]
        argv += ["--data", trained["staged"], "--cache-dir", str(self.work / "export-cache")]
        if self.cpu:
            argv += ["--samples", "256"]
        run_command(argv, log=self.work / "export.log", timeout=self.timeout(240), env=self.env())
        parity = json.loads((output / "onnx" / PARITY_NAME).read_text())
        if not parity["passed"]:
            raise StepError(f"parity failed: {parity}")
        keep = ["passed", "max_abs_diff", "argmax_mismatches", "samples", "onnx_accuracy"]
        keep += ["torch_accuracy", "export_seconds", "model_bytes"]
        return {k: parity[k] for k in keep}

    def seed_demo(self) -> dict[str, Any]:
        sizes = CPU_DEMO if self.cpu else {"epochs": 3}
        timeout = self.timeout(self.args.run_timeout * 2)
        result = run_demo(self.work / "demo", np=1, timeout=timeout, **sizes)
        epochs = result["epochs"]
        best = max(epochs, key=lambda e: e["val_accuracy"])
        return {
            "world_size": result["world_size"],
            "device": result["device"],
            "threads_per_rank": result["threads_per_rank"],
            "epochs": [
                {k: e[k] for k in ("epoch", "train_seconds", "val_seconds", "val_accuracy")}
                | {
                    "train_samples_per_sec": e["train_samples_per_sec"],
                    "ended_after": round(e["ended_at"] - result["launched"], 1),
                }
                for e in epochs
            ],
            "time_to_target": result["time_to_target"],
            "best": {
                "epoch": best["epoch"],
                "val_accuracy": best["val_accuracy"],
                "ended_after": round(best["ended_at"] - result["launched"], 1),
                "loop_seconds": round(
                    sum(e["epoch_seconds"] for e in epochs if e["epoch"] <= best["epoch"]), 2
                ),
            },
            "wall_seconds": result["wall_seconds"],
            "startup_seconds": result["startup_seconds"],
        }

    def two_ranks(self) -> dict[str, Any]:
        try:
            return self.train(2, "ours-2")
        except RuntimeError as e:
            if self.cpu:
                raise
            # One GPU: say why two ranks could not share it (the ranks' own words).
            lines = [ln for ln in str(e).splitlines() if "Error" in ln or "error" in ln]
            return {"refused": True, "why": lines[-3:] or str(e).splitlines()[-3:]}

    # --- the results ---------------------------------------------------------------------------
    def data(self) -> dict[str, Any]:
        return {
            "card": self.card,
            "mode": "cpu rehearsal" if self.cpu else "gpu",
            "elapsed_seconds": round(self.elapsed(), 1),
            "environment": self.facts,
            "steps": self.steps,
            "targets": self.targets(),
            "load_average_now": load_average(),
        }

    def targets(self) -> list[dict[str, Any]]:
        """Issue #33's targets, each with its figure and verdict (GPU runs only)."""
        out: list[dict[str, Any]] = []

        def add(what: str, value: Any, target: str, met: bool | None, unit: str = "") -> None:
            verdict = "not measured" if met is None else ("met" if met else "MISSED")
            if self.cpu:
                verdict = "— (CPU rehearsal: not a measurement)"
            shown = "—" if value is None else f"{value:g}{unit}"
            if unit == "%" and value is not None:
                shown = f"{100 * value:.2f} %"
            out.append(
                {"what": what, "value": value, "shown": shown, "target": target, "verdict": verdict}
            )

        kit, build = self.figures("kit"), self.steps_named("build")
        setup = None
        if kit and build and build["status"] == "ok":
            setup = round(kit["install_seconds"] + build["seconds"], 1)
        add("set-up: kit install + Horovod build", setup, f"<= {TARGET_SETUP_SECONDS:g} s",
            None if setup is None else setup <= TARGET_SETUP_SECONDS, " s")  # fmt: skip
        ours = self.figures("train-1")
        acc = ours.get("val_accuracy")
        add("1 rank: allreduced validation accuracy", acc, f">= {100 * TARGET_ACCURACY:.1f} %",
            None if acc is None else acc >= TARGET_ACCURACY, "%")  # fmt: skip
        loop = ours.get("loop_seconds_to_target")
        add("1 rank: time in the training loop to 99 %", loop, f"<= {TARGET_LOOP_SECONDS:g} s",
            None if loop is None else loop <= TARGET_LOOP_SECONDS, " s")  # fmt: skip
        ratio = self.demo_ratio()
        add("seed demo's time / ours, from launch", ratio.get("ratio"),
            f">= {TARGET_DEMO_RATIO:g}×" + (f" ({ratio['basis']})" if "basis" in ratio else ""),
            None if "ratio" not in ratio else ratio["ratio"] >= TARGET_DEMO_RATIO, "×")  # fmt: skip
        loop_ratio = ratio.get("loop_ratio")
        add("seed demo's time / ours, training loops only (no start-up, imports, data load)",
            loop_ratio, f">= {TARGET_DEMO_RATIO:g}×",
            None if loop_ratio is None else loop_ratio >= TARGET_DEMO_RATIO, "×")  # fmt: skip
        return out

    def steps_named(self, name: str) -> dict[str, Any] | None:
        return next((s for s in self.steps if s["name"] == name), None)

    def demo_ratio(self) -> dict[str, Any]:
        return demo_ratio(self.figures("train-1"), self.figures("seed-demo"))

    def render(self) -> str:
        f = self.facts
        when = time.strftime("%Y-%m-%d")
        if self.cpu:
            title = f"# GPU check, CPU rehearsal ({when}): `scripts/gpu/check.sh --cpu`"
        else:
            title = f"# GPU check on one {f.get('gpu', '?')} ({when}): `scripts/gpu/check.sh`"
        failed = [s["name"] for s in self.steps if s["status"] == "failed"]
        not_run = [s["name"] for s in self.steps if s["status"] == "not run"]
        verdict = "every step passed" if not failed and not not_run else (
            f"failed: {', '.join(failed) or 'none'}; not run: {', '.join(not_run) or 'none'}"
        )  # fmt: skip
        lines = [title, "", f"**Result: {verdict}** ({self.elapsed():.0f} s in all).", ""]
        if self.cpu:
            lines += [
                "Tiny subsets on CPU (quick: the script's rehearsal, **not a measurement**).",
                "",
            ]
        env_rows = [
            ["card", f"{f.get('gpu', 'none (CPU)')}"
             + (f", {f['gpu_memory_mib']} MiB, compute capability {f['compute_capability']}, "
                f"{f['multiprocessors']} SMs, native bf16 {f['bf16_native']}"
                if "gpu" in f else "")],
            ["driver", f.get("driver", "?")],
            ["torch", f"{f.get('torch')} (CUDA {f.get('torch_cuda')}, cuDNN {f.get('cudnn')}, "
                      f"NCCL {f.get('nccl', '—')})"],
            ["Python", f"{f.get('python')} ({f.get('python_executable')})"],
            ["nvcc / g++ / the image's cmake",
             f"{f.get('nvcc')} / {f.get('gxx')} / {f.get('image_cmake')}"],
        ]  # fmt: skip
        lines += ["## Environment", "", md_table(["", ""], env_rows), ""]
        step_rows = []
        for s in self.steps:
            step_rows.append(
                [s["name"], s["status"], f"{s['seconds']:.1f}" if "seconds" in s else "—",
                 "—" if s.get("started_at") is None else f"{s['started_at']:.1f}",
                 self.summary(s)]
            )  # fmt: skip
        lines += ["## Steps", "", "Seconds: the step's own; started: seconds after the start.", ""]
        lines += [md_table(["step", "result", "seconds", "started", "what it found"], step_rows)]
        lines += ["", "## Targets (issue #33; one rank on one GPU)", ""]
        lines += [
            md_table(
                ["figure", "value", "target", "verdict"],
                [[t["what"], t["shown"], t["target"], t["verdict"]] for t in self.targets()],
            )
        ]
        if "machine" in f:
            lines += ["", machine_line(f["machine"])]
        return "\n".join(lines) + "\n"

    def summary(self, s: dict[str, Any]) -> str:
        """One cell: the step's main figures, or why it failed or did not run."""
        if s["status"] != "ok":
            return s["detail"].splitlines()[0][:300] if s["detail"] else ""
        g = s.get("figures") or {}
        name = s["name"]
        if name == "environment":
            return f"{g.get('gpu', 'CPU')}; torch {g['torch']}"
        if name == "kit":
            return f"{len(g['wheels'])} wheels in {g['install_seconds']} s; {g['cmake']}"
        if name == "build":
            return f"{g['gpu_operations']} {g['cuda_cc_list']}; {g['built']}"
        if name == "check-build":
            return "; ".join(f"{k.replace('_', ' ')}: {', '.join(v)}" for k, v in g.items())
        if name == "doctor":
            return (
                f"ok {g['ok']}, {g['gpus']} GPU(s), auto: {g['auto_precision']}, "
                f"channels_last {g['auto_channels_last']} ({g['auto_reason']})"
            )
        if name in ("train-1", "train-2"):
            if g.get("refused"):
                return "refused: " + " / ".join(g["why"])[:300]
            rt = g["runtime"]
            reached = g["reached_target"]
            to = (
                f"99 % after {reached['seconds']} s from launch, {g['loop_seconds_to_target']} s "
                "in the loop"
                if reached
                else "99 % not reached"
            )
            return (
                f"{g['world_size']} rank(s), {100 * g['val_accuracy']:.2f} % allreduced; {to}; "
                f"trainer's run {g['train_seconds']} s, wall {g['wall_seconds']} s; "
                f"{g['samples_per_sec']:,.0f} samples/s; {rt.get('device')} "
                f"{rt.get('precision')} channels_last {rt.get('channels_last')}"
            )
        if name == "export":
            return (
                f"parity {g['passed']}: largest logit difference {g['max_abs_diff']:.2g}, "
                f"{g['argmax_mismatches']} argmax mismatches on {g['samples']}; onnx accuracy "
                f"{100 * g['onnx_accuracy']:.2f} %; {g['export_seconds']} s"
            )
        if name == "seed-demo":
            accs = ", ".join(f"{100 * e['val_accuracy']:.2f}" for e in g["epochs"])
            ttt = g["time_to_target"]
            to = f"99 % after {ttt['seconds']} s" if ttt else "99 % not reached"
            return (
                f"{g['device']}, {len(g['epochs'])} epoch(s): {accs} %; {to}; wall "
                f"{g['wall_seconds']} s"
            )
        return ""

    def write(self) -> None:
        """The results so far (rewritten after every step)."""
        name = f"gpu_{self.card}"
        (self.out / f"{name}.json").write_text(json.dumps(self.data(), indent=1, default=str))
        (self.out / f"{name}.md").write_text(self.markdown())

    def markdown(self) -> str:
        """:meth:`render`, or, should it fail on figures nobody has seen yet, the error and the
        JSON's name: the figures are never lost to a bug in their formatting."""
        try:
            return self.render()
        except Exception:
            return (
                f"# GPU check ({self.card}): the Markdown could not be rendered\n\n"
                f"Every figure is in gpu_{self.card}.json.\n\n```\n{traceback.format_exc()}```\n"
            )

    def finish(self) -> int:
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
            for path in sorted(self.work.rglob("*")):
                rel = path.relative_to(self.work)
                if rel.parts[0] == self.site.name or path.suffix not in (".log", ".json"):
                    continue  # the kit's packages (botocore's data is JSON) are not logs
                if path.is_file() and path.stat().st_size < (8 << 20):
                    tar.add(path, arcname=str(rel))
        name = f"gpu_{self.card}"
        for stale in self.out.glob("gpu_*.*"):  # the name was "gpu" until the card was known
            if stale.stem != name:
                stale.unlink()
        write_results(name, self.markdown(), self.data(), self.out)
        failed = [s["name"] for s in self.steps if s["status"] == "failed"]
        self.log(f"done in {self.elapsed():.1f} s; failed: {', '.join(failed) or 'none'}")
        return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU rehearsal on tiny subsets")
    parser.add_argument("--out", type=Path, required=True, help="results and logs ($OUT)")
    parser.add_argument("--kit", type=Path, default=REPO / ".gpu-kit", help="default .gpu-kit")
    parser.add_argument("--work", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument(
        "--budget", type=float, default=None,
        help="seconds after which no step starts (default 450 on a GPU, 300 with --cpu)",
    )  # fmt: skip
    parser.add_argument("--build-timeout", type=float, default=330.0, help="default 330")
    parser.add_argument("--run-timeout", type=float, default=150.0, help="default 150")
    parser.add_argument(
        "--deadline", type=float, default=None,
        help="seconds after which every command is stopped (default: the budget + 90)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.budget is None:
        args.budget = 300.0 if args.cpu else 450.0
    if args.deadline is None:
        args.deadline = args.budget + 90.0
    if args.cpu:
        # The device has no Airflow: the rehearsal takes the path the device takes
        # (bench.report.run_horovod's horovodrun without the local launcher).
        sys.modules.setdefault("airflow", None)  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory(prefix="hva-gpu-check-") as tmp:
        args.work = args.work or Path(tmp)
        check = Check(args)
        check.log(f"GPU check ({'--cpu rehearsal' if args.cpu else 'GPU'}): out {args.out}")
        check.step("environment", check.environment)
        check.step("kit", check.install_kit, needs=("environment",))
        check.step("build", check.build, needs=("kit",))
        check.step("check-build", check.check_build, needs=("build",))
        check.step("doctor", check.doctor, needs=("build",))
        check.step("train-1", lambda: check.train(1, "ours-1"), needs=("check-build",))
        check.step("export", check.export, needs=("train-1",))
        check.step("seed-demo", check.seed_demo, needs=("check-build",), estimate=60)
        check.step("train-2", check.two_ranks, needs=("check-build",), estimate=30)
        return check.finish()


if __name__ == "__main__":
    sys.exit(main())
