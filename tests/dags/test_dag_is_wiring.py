"""dags/mnist_horovod_retrain.py and dags/bucket_retention.py are wiring: operators and their
settings, no logic of their own.

Read from the file's syntax tree, not by running it: a storage call or a decision hidden in a
task body never runs at parse time, so only the source can show it is absent.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RETRAIN_DAG = REPO / "dags" / "mnist_horovod_retrain.py"
RETENTION_DAG = REPO / "dags" / "bucket_retention.py"

#: Modules whose import means the DAG file does storage, registry or staging work itself.
FORBIDDEN_MODULES = (
    "horovod_airflow.operators.model_registry", "horovod_airflow.operators.staging",
    "horovod_airflow.operators.serving", "horovod_airflow.trainer", "boto3", "botocore",
    "airflow.providers", "airflow.hooks",
)  # fmt: skip
#: What module-level code may call: the DAG's constants and its decorator, and the schema
#: lookups of a trainer option and of a gate setting's deployment bounds (declarations read
#: from the trainer and the settings, not decisions).
MODULE_CALLS = {
    "Asset", "Param", "datetime", "timedelta", "dag", "trainer_param_schema", "gate_param",
}  # fmt: skip
#: What a DAG file may take from the Task SDK (no @task bodies, no context reads).
SDK_NAMES = {"Asset", "Param", "dag", "DAG"}


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    return type(node).__name__


def _is_chain(node: ast.expr) -> bool:
    """``a >> b >> [c, d]``: dependencies between task variables, nothing else."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.RShift | ast.LShift):
        return _is_chain(node.left) and _is_chain(node.right)
    if isinstance(node, ast.List):
        return all(_is_chain(e) for e in node.elts)
    return isinstance(node, ast.Name)


def _operator_call(node: ast.expr, operators: set[str]) -> bool:
    return isinstance(node, ast.Call) and _dotted(node.func) in operators


def business_logic(source: str) -> list[str]:
    """What in a DAG file is more than wiring; empty when it holds only wiring.

    Wiring is: imports of operators and settings, module constants (``Asset``, ``Param``,
    strings), one ``@dag`` function whose body only creates operators imported from
    ``operators`` (keyword arguments: constants, templates, ``task.output``) and chains them
    with ``>>``, and the call that builds the DAG.
    """
    tree = ast.parse(source)
    found: list[str] = []
    operators: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            for module in modules:
                if any(module == m or module.startswith(m + ".") for m in FORBIDDEN_MODULES):
                    found.append(f"line {node.lineno}: imports {module}")
            if isinstance(node, ast.ImportFrom) and node.module == "horovod_airflow.operators":
                operators |= {a.asname or a.name for a in node.names if a.name.endswith("Operator")}
            if isinstance(node, ast.ImportFrom) and node.module == "airflow.sdk":
                for alias in node.names:
                    if alias.name not in SDK_NAMES:
                        found.append(f"line {node.lineno}: imports airflow.sdk.{alias.name}")

    dag_functions = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if [_dotted(d) for d in node.decorator_list] == ["dag"]:
                dag_functions.append(node)
            else:
                found.append(f"line {node.lineno}: defines function {node.name}()")
        elif isinstance(node, ast.ClassDef):
            found.append(f"line {node.lineno}: defines class {node.name}")
        elif not isinstance(node, ast.Import | ast.ImportFrom | ast.Assign | ast.Expr):
            found.append(f"line {node.lineno}: module-level {type(node).__name__}")
    if len(dag_functions) != 1:
        found.append(f"defines {len(dag_functions)} @dag functions, not 1")
    dag_names = {f.name for f in dag_functions}

    for node in tree.body:  # module-level calls: constants, the decorator, building the DAG
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            calls = [c for d in node.decorator_list for c in ast.walk(d) if isinstance(c, ast.Call)]
        else:
            calls = [c for c in ast.walk(node) if isinstance(c, ast.Call)]
        for call in calls:
            if _dotted(call.func) not in MODULE_CALLS | dag_names:
                found.append(f"line {call.lineno}: calls {_dotted(call.func)}()")

    for function in dag_functions:
        for statement in function.body:
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                continue  # a docstring
            if isinstance(statement, ast.Assign | ast.Expr) and _operator_call(
                statement.value, operators
            ):
                value = statement.value
            elif isinstance(statement, ast.Expr) and _is_chain(statement.value):
                continue
            else:
                found.append(
                    f"line {statement.lineno}: {type(statement).__name__} in the DAG body "
                    f"(only operators from `operators` and >> chains belong there)"
                )
                continue
            for inner in ast.walk(value):  # arguments: no calls, no lambdas, no comprehensions
                if inner is not value and isinstance(
                    inner, ast.Call | ast.Lambda | ast.ListComp | ast.DictComp | ast.IfExp
                ):
                    found.append(
                        f"line {inner.lineno}: {type(inner).__name__} in the arguments of "
                        f"{_dotted(value.func)}"
                    )
    return found


def test_the_retrain_dag_is_wiring_only():
    assert business_logic(RETRAIN_DAG.read_text()) == []


def test_the_retention_dag_is_wiring_only():
    assert business_logic(RETENTION_DAG.read_text()) == []
    tree = ast.parse(RETENTION_DAG.read_text())
    created = {_dotted(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "BucketRetentionOperator" in created  # not vacuous: the operator is its one task


def test_the_retrain_dag_uses_the_pipeline_operators():
    """Not vacuous: the wiring the check accepts is the whole pipeline."""
    tree = ast.parse(RETRAIN_DAG.read_text())
    created = {
        _dotted(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)
    } & {"StageDatasetOperator", "HorovodTrainOperator", "ModelGateOperator",
         "HorovodExportOperator", "PublishModelOperator"}  # fmt: skip
    assert len(created) == 5, created


# The shapes of logic the check must catch, each as a DAG file once held it.
_TASK_BODY = """
    from airflow.sdk import dag, get_current_context, task
    from horovod_airflow.operators import HorovodTrainOperator

    @dag(schedule=None)
    def retrain():
        @task.short_circuit
        def gate(metrics):
            from horovod_airflow.operators.model_registry import gate_challenger

            params = get_current_context()["params"]
            return gate_challenger(metrics=metrics, min_accuracy=params["min_accuracy"])

        train = HorovodTrainOperator(task_id="train", data="d", output="o")
        gate(train.output)

    retrain_dag = retrain()
"""
_HELPER = """
    from airflow.sdk import dag
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from horovod_airflow.operators import StageDatasetOperator

    def _s3_client():
        return S3Hook(aws_conn_id="aws_default").get_conn()

    @dag(schedule=None)
    def retrain():
        StageDatasetOperator(task_id="stage", source="vendored", bucket_uri="s3://b",
                             dataset_name="mnist")

    retrain_dag = retrain()
"""
_DECISION = """
    import os
    from airflow.sdk import dag
    from horovod_airflow.operators import ModelGateOperator

    @dag(schedule=None)
    def retrain():
        if os.environ.get("STRICT"):
            ModelGateOperator(task_id="gate", bucket_uri="s3://b", model_name="m",
                              metrics={}, dataset={}, min_accuracy=0.99)
        ModelGateOperator(task_id="gate2", bucket_uri="s3://b", model_name="m",
                          metrics={}, dataset={}, min_accuracy=max(0.5, float("0.9")))

    retrain_dag = retrain()
"""


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (_TASK_BODY, ["imports horovod_airflow.operators.model_registry",
                      "imports airflow.sdk.task",
                      "imports airflow.sdk.get_current_context", "FunctionDef in the DAG body"]),
        (_HELPER, ["imports airflow.providers.amazon.aws.hooks.s3",
                   "defines function _s3_client()"]),
        (_DECISION, ["If in the DAG body", "Call in the arguments of ModelGateOperator"]),
    ],
    ids=["task-body", "storage-helper", "decision"],
)  # fmt: skip
def test_the_check_finds_logic_in_a_dag_file(source, expected):
    found = "\n".join(business_logic(textwrap.dedent(source)))
    for what in expected:
        assert what in found, f"{what!r} not reported; found:\n{found}"
