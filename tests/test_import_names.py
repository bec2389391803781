"""The project installs one import name, ``horovod_airflow``: ``trainer/`` and ``operators/``
keep their folders but are imported as ``horovod_airflow.trainer`` and
``horovod_airflow.operators``, so nothing generic lands in a user's site-packages."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import horovod_airflow
from horovod_airflow import operators, trainer

REPO = Path(__file__).resolve().parents[1]
BARE = ("trainer", "operators")


def _bare_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.level == 0
            else []
        )
        for name in names:
            if name.split(".")[0] in BARE:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    return found


def test_no_code_imports_the_folders_by_their_bare_names():
    files = [
        p
        for d in ("trainer", "operators", "dags", "scripts", "bench", "examples", "tests", "docker")
        for p in sorted((REPO / d).rglob("*.py"))
    ]
    assert len(files) > 50
    offenders = [hit for p in files for hit in _bare_imports(p)]
    assert not offenders, "import these as horovod_airflow.<...>:\n" + "\n".join(offenders)


def test_the_links_point_at_the_folders_the_layout_keeps():
    for name, module in (("trainer", trainer), ("operators", operators)):
        link = REPO / "horovod_airflow" / name
        assert link.is_symlink() and link.resolve() == REPO / name
        assert Path(module.__file__).resolve() == REPO / name / "__init__.py"
    assert Path(horovod_airflow.__file__).resolve() == REPO / "horovod_airflow" / "__init__.py"


def test_the_wheel_holds_horovod_airflow_alone(tmp_path):
    """Built from this checkout (no network, no build isolation): one top-level name."""
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    (wheel,) = tmp_path.glob("horovod_airflow-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"horovod_airflow"}
    for module in (
        "trainer/contract.py",
        "trainer/__main__.py",
        "operators/launchers/local.py",
        "operators/launchers/kubernetes/launcher.py",  # a package inside the package
    ):
        assert f"horovod_airflow/{module}" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "hvd-trainer = horovod_airflow.trainer.cli:main" in text
