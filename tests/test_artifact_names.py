"""Every run and registry file name has one home, ``trainer/layout.py``: a string literal that
names one of them anywhere else in the code (trainer, operators, DAGs, scripts, benchmarks,
examples) fails here, so the trainer and the operators cannot drift apart."""

from __future__ import annotations

import ast
from pathlib import Path

from trainer import layout

REPO = Path(__file__).resolve().parents[1]
HOME = REPO / "trainer" / "layout.py"
NAMES = {
    getattr(layout, n)
    for n in dir(layout)
    if n.endswith("_NAME") and isinstance(getattr(layout, n), str)
}


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
            if any(value == n or value.endswith("/" + n) for n in NAMES):
                found.append((node.lineno, value))
    return sorted(found)


def test_the_names_are_the_ones_the_contract_lists():
    expected = {"checkpoint.pt", "metrics.json", "model.onnx", "parity.json", "gate.json",
                "manifest.json", "latest.json", "training_curves.png", "summary.md"}  # fmt: skip
    assert expected <= NAMES


def test_no_artifact_name_is_spelled_outside_its_home():
    files = [p for d in ("trainer", "operators", "dags", "scripts", "bench", "examples")
             for p in sorted((REPO / d).rglob("*.py")) if p != HOME]  # fmt: skip
    assert len(files) > 20
    offenders = [f"{p.relative_to(REPO)}:{line}: {value!r}" for p in files
                 for line, value in _literals(p)]  # fmt: skip
    assert not offenders, "name these with trainer.layout's constants:\n" + "\n".join(offenders)


def test_the_check_finds_a_spelled_name(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""Reads metrics.json."""\nuri = base + "/metrics.json"\nx = "gate.json"\n')
    assert _literals(sample) == [(2, "/metrics.json"), (3, "gate.json")]
