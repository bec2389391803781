"""The foundation: Horovod built against the pinned torch, with PyTorch + Gloo, runs 2 ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent

ALLREDUCE = """
import torch, horovod.torch as hvd
hvd.init()
value = torch.tensor([float(hvd.rank() + 1), 10.0 ** hvd.rank()])
total = hvd.allreduce(value, op=hvd.Sum, name="sum")
print(f"RESULT rank={hvd.rank()} size={hvd.size()} sum={total.tolist()}", flush=True)
"""


def test_check_build_lists_pytorch_and_gloo():
    out = subprocess.run(
        [str(VENV_BIN / "horovodrun"), "--check-build"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert re.search(r"\[X\] PyTorch", out), out
    assert re.search(r"\[X\] Gloo", out), out


def test_torch_torchvision_and_horovod_import_together():
    code = (
        "import torch, torchvision, horovod.torch as hvd, horovod\n"
        "print(torch.__version__, torchvision.__version__, horovod.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()  # fmt: skip
    assert out[0].startswith("2.14.1") and out[1].startswith("0.29.1") and out[2] == "0.28.1"


def test_two_rank_allreduce(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    proc = subprocess.run(
        [str(VENV_BIN / "horovodrun"), "-np", "2", "-H", "localhost:2",
         sys.executable, str(script)],
        capture_output=True, text=True, timeout=300, env=os.environ.copy(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = sorted(re.findall(r"RESULT rank=(\d) size=(\d) sum=\[(.*)\]", proc.stdout))
    # rank 0 contributes [1, 1], rank 1 contributes [2, 10]: both ranks see the sum [3, 11]
    assert results == [("0", "2", "3.0, 11.0"), ("1", "2", "3.0, 11.0")], proc.stdout
