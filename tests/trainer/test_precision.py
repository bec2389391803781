"""Every path the hardware may pick, forced by flags, so it runs on whatever CPU the tests get.

``--precision auto`` and ``--channels-last auto`` pick by hardware (native bf16 or not, CPU or
CUDA). The choice itself is tested for every hardware answer with the detection given as
input; each of the four paths it can pick (fp32/bf16 × channels-last off/on) is then run for
real with 2 Horovod ranks: training with identical ranks after the broadcast and the first
step, a resume from its checkpoint, and an ONNX export with parity.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from horovod_airflow.trainer.runtime import PrecisionChoice, cpu_has_bf16, resolve_precision
from tests.trainer.conftest import TINY, describe, events, run_horovod

# /proc/cpuinfo flag lines of the CPUs this project's machines have had.
EPYC_AVX2 = "flags\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni"
EPYC_ZEN4 = "flags\t: fpu sse2 avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni"
XEON_AMX = "flags\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8"


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [
        (EPYC_AVX2, False),
        (EPYC_ZEN4, True),
        (XEON_AMX, True),
        ("flags\t: avx512f avx512_bf16x", False),  # a whole flag, not a prefix
        ("", False),
    ],
)
def test_cpu_bf16_detection(cpuinfo: str, native: bool) -> None:
    assert cpu_has_bf16(cpuinfo) is native


@pytest.mark.parametrize(
    ("flags", "device", "native", "expected"),
    [
        # auto on the CPUs seen so far, and on GPUs with and without native bf16
        (("auto", "auto"), "cpu", False, ("fp32", False)),
        (("auto", "auto"), "cpu", True, ("bf16", False)),
        (("auto", "auto"), "cuda", True, ("bf16", True)),
        (("auto", "auto"), "cuda", False, ("fp32", False)),
        # an explicit flag always wins, whatever the hardware
        (("fp32", "auto"), "cpu", True, ("fp32", False)),
        (("bf16", "auto"), "cpu", False, ("bf16", False)),
        (("fp32", "auto"), "cuda", True, ("fp32", False)),
        (("auto", "on"), "cpu", False, ("fp32", True)),
        (("auto", "off"), "cuda", True, ("bf16", False)),
        (("bf16", "on"), "cpu", False, ("bf16", True)),
    ],
)
def test_auto_resolution_for_every_hardware(
    flags: tuple[str, str], device: str, native: bool, expected: tuple[str, bool]
) -> None:
    choice = resolve_precision(*flags, device, native)
    assert isinstance(choice, PrecisionChoice)
    assert (choice.precision, choice.channels_last) == expected
    for flag, value in zip(("--precision", "--channels-last"), flags, strict=True):
        assert f"{flag} {value}" in choice.reason  # says which flag decided, and how


def test_cuda_bf16_check_excludes_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's is_bf16_supported() counts emulation unless told not to (no GPU needed)."""
    import torch

    from horovod_airflow.trainer import runtime

    seen: list[dict[str, object]] = []

    def is_bf16_supported(**kwargs: object) -> bool:
        seen.append(kwargs)
        return not kwargs.get("including_emulation", True)

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert runtime.cuda_has_bf16() is True
    assert seen == [{"including_emulation": False}]


def test_channels_last_optimizer_state_is_made_contiguous() -> None:
    """A checkpoint written by a channels-last model holds state Horovod cannot broadcast."""
    import torch

    from horovod_airflow.trainer.model import build_model
    from horovod_airflow.trainer.train import make_state_contiguous

    torch.manual_seed(0)
    model = build_model("mnist_cnn").to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(4, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    model(x).sum().backward()
    optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values() if v.dim() == 4]
    assert any(not t.is_contiguous() for t in state), "the premise: channels-last Adam state"
    before = [t.clone() for s in optimizer.state.values() for t in s.values()]

    make_state_contiguous(optimizer)

    after = [t for s in optimizer.state.values() for t in s.values()]
    assert all(t.is_contiguous() for t in after)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


# Each path with the default model (BatchNorm) and, on two of them, the demo's CNN.
PATHS = [
    ("fp32", "off", "mnist_bn"),
    ("fp32", "on", "mnist_bn"),
    ("bf16", "off", "mnist_bn"),
    ("bf16", "on", "mnist_bn"),
    ("fp32", "off", "mnist_cnn"),
    ("bf16", "on", "mnist_cnn"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "channels_last", "model"), PATHS)
def test_forced_path_trains_resumes_and_exports(
    precision: str, channels_last: str, model: str, staged_subset: Path, tmp_path: Path
) -> None:
    from horovod_airflow.trainer.export import run_export
    from horovod_airflow.trainer.resume import load_checkpoint

    flags = ["--precision", precision, "--channels-last", channels_last, "--model", model]
    # Constant lr, no warmup: 1 epoch + a resumed 2nd epoch follows the 2-epoch schedule.
    flags += ["--lr-schedule", "constant", "--warmup-epochs", "0", *TINY]
    out, cache = tmp_path / "out", tmp_path / "cache"
    base = ["--data", str(staged_subset), "--output", str(out), *flags]

    first = run_horovod([*base, "--epochs", "1", "--debug-param-hash"], cache)
    assert first.returncode == 0, describe(first)
    by_step: dict[int, dict[int, str]] = {}
    for e in events(first.stdout, "param_hash"):
        by_step.setdefault(e["step"], {})[e["rank"]] = e["hash"]
    assert set(by_step) == {0, 1} and all(set(h) == {0, 1} for h in by_step.values()), by_step
    assert by_step[0][0] == by_step[0][1], "ranks differ right after the broadcast"
    assert by_step[1][0] == by_step[1][1], "ranks differ after the first step"
    assert by_step[1][0] != by_step[0][0], "the first step changed nothing"
    runtime = json.loads((out / "metrics.json").read_text())["runtime"]
    assert runtime["precision"] == precision
    assert json.loads((out / "metrics.json").read_text())["config"]["model"] == model
    assert runtime["channels_last"] is (channels_last == "on")
    assert f"--precision {precision}" in runtime["precision_reason"]
    epoch_1 = load_checkpoint(str(out / "checkpoint.pt"))
    assert epoch_1["epoch"] == 1
    assert all(t.is_contiguous() for t in epoch_1["model"].values())
    shutil.copy(out / "checkpoint.pt", tmp_path / "epoch1.pt")

    resumed = run_horovod([*base, "--epochs", "2", "--resume"], cache)
    assert resumed.returncode == 0, describe(resumed)
    assert "resuming from" in resumed.stderr and "after epoch 1" in resumed.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == [1, 2]
    assert metrics["history"][0] == epoch_1["history"][0]
    assert metrics["val_samples"] == 500 and 0.2 < metrics["val_accuracy"] <= 1.0

    report = run_export(
        str(out / "checkpoint.pt"), str(tmp_path / "onnx"), samples=200, cache_dir=str(cache)
    )
    assert report["passed"] is True, report
    assert report["argmax_mismatches"] == 0 and report["max_abs_diff"] <= 1e-4
    assert (tmp_path / "onnx" / "model.onnx").stat().st_size == report["model_bytes"] > 0
