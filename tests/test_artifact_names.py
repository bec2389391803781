"""Every run and registry file name, every ``format`` string of a file both sides exchange and
the ONNX preprocessing metadata key have one home, ``core/contract.py``: a string literal
that spells one of them anywhere else in the code (trainer, operators, DAGs, scripts,
benchmarks, examples) fails here, and so does any other ``horovod-airflow/<thing>-v<N>``
format invented outside it, so the trainer and the operators cannot drift apart."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from horovod_airflow.core import contract, layout

REPO = Path(__file__).resolve().parents[1]
HOME = REPO / "core" / "contract.py"
NAMES = {
    getattr(contract, n)
    for n in dir(contract)
    if n.endswith("_NAME") and isinstance(getattr(contract, n), str)
}
SCHEMAS = [v for v in vars(contract).values() if isinstance(v, contract.Schema)]
FORMATS = {
    *(f for schema in SCHEMAS for f in schema.supported),
    *(getattr(contract, n) for n in dir(contract) if n.endswith("_FORMAT")),
}
KEYS = {contract.PREPROCESSING_KEY}
FORMAT_LIKE = re.compile(r"horovod-airflow/[a-z-]+-v[0-9]+")


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            value = node.value
            if (
                any(value == n or value.endswith("/" + n) for n in NAMES)
                or value in FORMATS | KEYS
                or FORMAT_LIKE.fullmatch(value)
            ):
                found.append((node.lineno, value))
    return sorted(found)


def test_the_names_are_the_ones_the_contract_lists():
    expected = {"checkpoint.pt", "metrics.json", "model.onnx", "parity.json", "gate.json",
                "manifest.json", "latest.json", "training_curves.png", "summary.md"}  # fmt: skip
    assert expected <= NAMES
    assert {s.name for s in SCHEMAS} >= {"metrics.json", "parity.json", "gate.json",
                                         "manifest.json", "latest.json"}  # fmt: skip
    assert all(FORMAT_LIKE.fullmatch(f) for f in FORMATS), FORMATS
    assert len({s.format for s in SCHEMAS}) == len(SCHEMAS)  # one format per schema


def test_layout_uses_the_contract_names_and_defines_none():
    assert layout.MANIFEST_NAME is contract.MANIFEST_NAME
    assert layout.FORMAT == contract.DATASET_FORMAT
    assert not hasattr(layout, "METRICS_NAME")  # the contract's names have one home


def test_no_artifact_name_is_spelled_outside_its_home():
    files = [p for d in ("core", "trainer", "operators", "apps", "dags", "scripts",
                                                "bench", "examples")
             for p in sorted((REPO / d).rglob("*.py")) if p != HOME]  # fmt: skip
    assert len(files) > 20
    offenders = [f"{p.relative_to(REPO)}:{line}: {value!r}" for p in files
                 for line, value in _literals(p)]  # fmt: skip
    assert not offenders, (
        "name these with horovod_airflow.core.contract's constants:\n" + "\n".join(offenders)
    )


def test_the_check_finds_a_spelled_name(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""Reads metrics.json."""\nuri = base + "/metrics.json"\nx = "gate.json"\n'
        f"f = {contract.METRICS.format!r}\nk = {contract.PREPROCESSING_KEY!r}\n"
        'new = "horovod-airflow/thing-v3"\nlabel = "horovod-airflow/job"\n'
    )
    assert _literals(sample) == [
        (2, "/metrics.json"),
        (3, "gate.json"),
        (4, contract.METRICS.format),
        (5, contract.PREPROCESSING_KEY),
        (6, "horovod-airflow/thing-v3"),
    ]
