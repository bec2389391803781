"""One import name, three layers by process.

``core/``, ``trainer/`` and ``operators/`` keep their folders at the top of the repository and
are installed as ``horovod_airflow.core``, ``horovod_airflow.trainer`` and
``horovod_airflow.operators`` (pyproject.toml's ``package-dir``; no links in the checkout), so
nothing generic lands in a user's site-packages. Each layer imports only what its process has:
the core neither torch nor Airflow, the trainer no Airflow, the operators no torch, no Horovod
and no trainer code.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

import horovod_airflow
from horovod_airflow import apps, core, operators, trainer

REPO = Path(__file__).resolve().parents[1]
BARE = ("core", "trainer", "operators", "apps")
LAYERS = {"core": core, "trainer": trainer, "operators": operators, "apps": apps}


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


def _package_folders() -> list[str]:
    """Every package folder of the three layers, as its import name."""
    return sorted(
        ".".join(("horovod_airflow", *init.parent.relative_to(REPO).parts))
        for layer in LAYERS
        for init in (REPO / layer).rglob("__init__.py")
    )


def test_no_code_imports_the_folders_by_their_bare_names():
    files = [
        p
        for d in (*BARE, "dags", "scripts", "bench", "examples", "tests", "docker")
        for p in sorted((REPO / d).rglob("*.py"))
    ]
    assert len(files) > 50
    offenders = [hit for p in files for hit in _bare_imports(p)]
    assert not offenders, "import these as horovod_airflow.<...>:\n" + "\n".join(offenders)


def test_the_editable_install_maps_the_folders_without_links():
    assert not any(p.is_symlink() for p in (REPO / "horovod_airflow").iterdir())
    for name, module in LAYERS.items():
        assert Path(module.__file__) == REPO / name / "__init__.py"
    assert Path(horovod_airflow.__file__) == REPO / "horovod_airflow" / "__init__.py"
    # `python -m` finds the program through the same mapping, from any directory.
    run = subprocess.run(
        [sys.executable, "-c",
         "import horovod_airflow.operators.launchers as m; print(m.__file__)"],
        capture_output=True, text=True, timeout=120, cwd="/",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(REPO / "operators" / "launchers" / "__init__.py")


def test_pyproject_lists_every_package_folder():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(tool["packages"]) == sorted(["horovod_airflow", *_package_folders()])
    assert tool["package-dir"] == {"horovod_airflow": "horovod_airflow"} | {
        f"horovod_airflow.{layer}": layer for layer in LAYERS
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from this checkout (no network, no build isolation)."""
    out = tmp_path_factory.mktemp("wheel")
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    (built,) = out.glob("horovod_airflow-*.whl")
    return built


def test_the_wheel_holds_horovod_airflow_alone_with_every_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"horovod_airflow"}
    sources = {
        f"horovod_airflow/{p.relative_to(REPO)}"
        for layer in LAYERS
        for p in (REPO / layer).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert sources <= set(names), sorted(sources - set(names))
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "hvd-trainer = horovod_airflow.trainer.cli:main" in text


def test_the_installed_wheel_imports_the_core_without_this_checkout(wheel, tmp_path):
    """Unpacked into a folder of its own and imported by an interpreter without site-packages
    (so neither the editable install nor the checkout is on its path): the core needs only the
    standard library."""
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = (
        "import horovod_airflow.core.contract as c, horovod_airflow.core.train_config as t; "
        "print(c.__file__); print(t.TrainConfig.__name__)"
    )
    run = subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[0].startswith(str(target / "horovod_airflow" / "core"))


def test_the_package_view_imports_without_any_install(tmp_path):
    """scripts/package_view.sh: what mypy and the GPU device (no install of this project)
    import from. An interpreter without site-packages finds the folders through it alone."""
    run = subprocess.run(["bash", str(REPO / "scripts" / "package_view.sh"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    code = (
        "import horovod_airflow.core.contract as c, horovod_airflow.trainer as t; print(c.__file__)"
    )
    run = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
        cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert Path(run.stdout.strip()).resolve() == REPO / "core" / "contract.py"


# Each layer imported in a fresh interpreter in which the names its process must not have are
# refused by an import hook: an import of one of them anywhere on the way fails the test.
_BLOCKED = {
    "core": ("torch", "torchvision", "horovod", "airflow", "horovod_airflow.trainer",
             "horovod_airflow.operators"),
    "trainer": ("airflow", "horovod_airflow.operators"),
    # Module level only: a launcher imports horovod lazily where a rank runs.
    "operators": ("torch", "torchvision", "horovod", "onnx", "horovod_airflow.trainer",
                  "horovod_airflow.apps"),
    "apps": ("torch", "torchvision", "horovod", "onnx", "horovod_airflow.trainer"),
}  # fmt: skip

_IMPORT_LAYER = textwrap.dedent(
    """
    import importlib, importlib.abc, pkgutil, sys
    blocked = tuple(sys.argv[2].split(","))

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in blocked):
                raise ImportError(f"{name} is imported on the way to {sys.argv[1]}")
            return None

    sys.meta_path.insert(0, Refuse())
    package = importlib.import_module(sys.argv[1])
    names = [package.__name__] + [
        m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
        if not m.name.endswith("__main__")
    ]
    for name in names:
        importlib.import_module(name)
    print(len(names))
    """
)


@pytest.mark.parametrize("layer", sorted(_BLOCKED))
def test_each_layer_imports_only_what_its_process_has(layer):
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_LAYER, f"horovod_airflow.{layer}",
         ",".join(_BLOCKED[layer])],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split()[-1]) == sum(
        1 for p in (REPO / layer).rglob("*.py") if p.name != "__main__.py"
    )
