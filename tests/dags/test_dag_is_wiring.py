"""The DAG files are wiring: operators (or the pipeline that builds them) and their settings,
no logic of their own. Both retraining DAGs are built by the one pipeline, so they cannot drift.

Read from the file's syntax tree, not by running it: a storage call or a decision hidden in a
task body never runs at parse time, so only the source can show it is absent.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RETRAIN_DAG = REPO / "dags" / "mnist_horovod_retrain.py"
RETENTION_DAG = REPO / "dags" / "bucket_retention.py"
WAVEFORMS_DAG = REPO / "examples" / "waveforms" / "dags" / "waveforms_retrain.py"
SERVE_DAG = REPO / "dags" / "serve_latest_model.py"
WAVEFORMS_SERVE_DAG = REPO / "examples" / "waveforms" / "dags" / "waveforms_serve.py"
PIPELINE = "horovod_airflow.operators.pipeline"

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
    "ModelApp", "retraining_params", "retraining_dag_args", "serving_dag_args",
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
            if isinstance(node, ast.ImportFrom) and node.module == PIPELINE:
                # The pipeline builds operators the same way for every model.
                operators |= {a.asname or a.name for a in node.names if a.name.endswith("pipeline")}
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


@pytest.mark.parametrize(
    "path",
    [RETRAIN_DAG, WAVEFORMS_DAG, SERVE_DAG, WAVEFORMS_SERVE_DAG],
    ids=["mnist", "waveforms", "mnist-serve", "waveforms-serve"],
)
def test_the_model_dags_are_wiring_only(path):
    assert business_logic(path.read_text()) == []


def test_both_serving_dags_are_the_one_serving_pipeline():
    """MNIST's and the waveforms app's serving DAGs are one task each, built by
    ``serving_pipeline`` from the app: scheduled on the app's own ``latest.json`` Asset, with
    the same run settings, and differing in the check the app declares."""
    mnist, waveforms = (_load_dag(p, "serve_dag") for p in (SERVE_DAG, WAVEFORMS_SERVE_DAG))
    for dag in (mnist, waveforms):
        assert list(dag.task_dict) == ["smoke_test_latest"]
        assert dag.max_active_runs == 1 and dag.catchup is False
    assert mnist.dagrun_timeout == waveforms.dagrun_timeout
    timeouts = [d.task_dict["smoke_test_latest"].execution_timeout for d in (mnist, waveforms)]
    assert timeouts[0] == timeouts[1] is not None
    schedules = [[a.uri for a in d.timetable.asset_condition.objects] for d in (mnist, waveforms)]
    assert schedules[0][0].endswith("/models/mnist_cnn/latest.json")
    assert schedules[1][0].endswith("/models/waveform_cnn/latest.json")


def test_the_retention_dag_is_wiring_only():
    assert business_logic(RETENTION_DAG.read_text()) == []
    tree = ast.parse(RETENTION_DAG.read_text())
    created = {_dotted(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "BucketRetentionOperator" in created  # not vacuous: the operator is its one task


def _load_dag(path: Path, name: str = "retrain_dag"):
    spec = importlib.util.spec_from_file_location(f"dag_{path.stem}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


PIPELINE_TASKS = {
    "stage_dataset": "StageDatasetOperator", "train": "HorovodTrainOperator",
    "gate": "ModelGateOperator", "export_onnx": "HorovodExportOperator",
    "publish": "PublishModelOperator", "record_refused": "RecordRefusedOperator",
}  # fmt: skip
#: What the deployment sets for every model's jobs and gate: none of it may differ per app.
SHARED = {
    "train": ("gpus_per_proc", "aws_conn_id", "rank_aws_conn_id", "execution_timeout",
              "launcher_options", "launcher", "num_proc", "output_uri"),
    "export_onnx": ("gpus_per_proc", "aws_conn_id", "rank_aws_conn_id",
                    "execution_timeout", "launcher_options", "launcher", "output_uri"),
    "gate": ("min_accuracy_floor", "max_regression_ceiling", "on_refused", "stale_after_runs",
             "stale_after_days", "aws_conn_id", "bucket_uri"),
    "publish": ("aws_conn_id", "bucket_uri"),
    "record_refused": ("aws_conn_id", "bucket_uri"),
    "stage_dataset": ("aws_conn_id", "bucket_uri"),
}  # fmt: skip


def test_both_retrain_dags_are_the_one_pipeline():
    """MNIST and the waveforms app get the same six tasks, chained the same way, with the same
    deployment settings — the docker launcher's network and GPUs included (the copy that
    once ran waveforms' docker jobs without them is gone) — and differ only in what the app
    declares: its model, dataset, programs and the image that holds them."""
    mnist, waveforms = _load_dag(RETRAIN_DAG), _load_dag(WAVEFORMS_DAG)
    order = list(PIPELINE_TASKS)[:-1]  # ... export_onnx >> [publish, record_refused]
    for dag in (mnist, waveforms):
        assert {t: type(op).__name__ for t, op in dag.task_dict.items()} == PIPELINE_TASKS
        for before, after in itertools.pairwise(order):
            assert after in dag.task_dict[before].downstream_task_ids, (dag.dag_id, before)
        assert dag.task_dict["export_onnx"].downstream_task_ids == {"publish", "record_refused"}
        assert dag.task_dict["gate"].refused_branch == ("record_refused",)
    edges = [
        {t: op.downstream_task_ids for t, op in d.task_dict.items()} for d in (mnist, waveforms)
    ]
    assert edges[0] == edges[1]  # the XCom inputs (train.output, ...) too
    for task_id, fields in SHARED.items():
        for name in fields:
            ours, theirs = (getattr(d.task_dict[task_id], name) for d in (mnist, waveforms))
            assert ours == theirs, f"{task_id}.{name}: {ours!r} (mnist) != {theirs!r}"
    for task_id in PIPELINE_TASKS:
        callbacks = [d.task_dict[task_id].on_failure_callback for d in (mnist, waveforms)]
        assert callbacks[0] == callbacks[1], task_id
    assert mnist.dagrun_timeout == waveforms.dagrun_timeout
    # What the apps declare does differ.
    assert mnist.task_dict["gate"].model_name != waveforms.task_dict["gate"].model_name
    assert mnist.task_dict["train"].entrypoint != waveforms.task_dict["train"].entrypoint
    from examples.waveforms.settings import IMAGE
    from horovod_airflow.operators.settings import TRAINER_IMAGE

    for task_id in ("train", "export_onnx"):  # MNIST: the deployment's; waveforms: its own
        assert mnist.task_dict[task_id].image == TRAINER_IMAGE
        assert waveforms.task_dict[task_id].image == IMAGE != TRAINER_IMAGE
    outlets = [d.task_dict["publish"].outlets[0].uri for d in (mnist, waveforms)]
    assert outlets[0].endswith("/models/mnist_cnn/latest.json")
    assert outlets[1].endswith("/models/waveform_cnn/latest.json")


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
