"""Bad option values stop the trainer before any rank works: exit 2 and one message naming them."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import subprocess
import sys

import pytest

from horovod_airflow.core import train_config as options
from horovod_airflow.core.train_config import ConfigError, TrainConfig
from horovod_airflow.trainer import cli
from tests import readme
from tests.test_readme_commands import DOCTOR

BASE = ["--data", "/nonexistent/data", "--output", "/nonexistent/out"]


def trainer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "horovod_airflow.trainer", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("extra", "option", "allowed"),
    [
        (["--epochs", "0"], "--epochs", "[1, 1000]"),
        (["--epochs", "two"], "--epochs", "invalid int value"),
        (["--batch-size", "0"], "--batch-size", "[1, 65536]"),
        (["--lr", "-0.1"], "--lr", "(0, 10]"),
        (["--lr", "nan"], "--lr", "(0, 10]"),
        (["--lr-scaling", "cubic"], "--lr-scaling", "linear"),
        (["--warmup-epochs", "3", "--epochs", "2"], "--warmup-epochs", "[0, epochs=2]"),
        (["--optimizer", "lamb"], "--optimizer", "adam"),
        (["--max-train-samples", "-5"], "--max-train-samples", ">= 0"),
        (["--backward-passes-per-step", "0"], "--backward-passes-per-step", "[1, 1024]"),
        (["--precision", "fp8"], "--precision", "bf16"),
        (["--channels-last", "maybe"], "--channels-last", "'on'"),
        (["--model", "resnet9000"], "--model", "mnist_cnn"),
        (["--target-accuracy", "0"], "--target-accuracy", "(0, 1]"),
        (["--target-accuracy", "1.5"], "--target-accuracy", "(0, 1]"),
        (["--resume-mismatch", "ignore"], "--resume-mismatch", "'fresh'"),
    ],
)
def test_bad_train_option_exits_2_naming_option_and_range(
    extra: list[str], option: str, allowed: str
) -> None:
    proc = trainer("train", *BASE, *extra)
    assert proc.returncode == 2, proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert option in message and allowed in message, message
    assert "Traceback" not in proc.stderr


def test_missing_required_option_exits_2() -> None:
    proc = trainer("train", "--output", "/tmp/x")
    assert proc.returncode == 2
    assert "--data" in proc.stderr


def test_help_shows_the_horovodrun_launch_command() -> None:
    proc = trainer("train", "--help")
    assert proc.returncode == 0
    assert "horovodrun -np 2 -H localhost:2 python -m horovod_airflow.trainer train" in proc.stdout
    for option in ("--fp16-allreduce", "--adasum", "--backward-passes-per-step", "--precision"):
        assert option in proc.stdout


def test_doctor_reports_gloo_and_can_start_two_cpu_ranks() -> None:
    """The README's doctor line, as written, with --json."""
    proc = readme.run(DOCTOR, fill={" [--gpus-per-proc 1]": "", "[--json]": "--json"}, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    assert report["gloo_built"] is True
    assert report["horovod"] and report["torch"]


def test_doctor_fails_naming_the_gpu_shortfall() -> None:
    proc = readme.run(
        DOCTOR, fill={"--np 2": "--np 4096", "[--gpus-per-proc 1]": "--gpus-per-proc 1",
                      " [--json]": ""}, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "4096 GPUs" in proc.stdout and "cannot start" in proc.stdout


def test_help_explains_resume_and_its_mismatch_choice() -> None:
    proc = trainer("train", "--help")
    text = " ".join(proc.stdout.split())
    assert "same dataset content, world size and training settings" in text
    assert "--resume-mismatch RESUME_MISMATCH" in text and "error|fresh" in text
    assert "default error" in text


# --- Each option is declared once (horovod_airflow.core.train_config); the parser, the checks
# --- and the DAG's Params are derived from that declaration, so they must agree everywhere.


REQUIRED = {"data": "/nonexistent/data", "output": "/nonexistent/out"}


def _train_actions() -> dict[str, argparse.Action]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices["train"]._actions if a.dest != "help"}


def test_the_train_parser_has_one_flag_per_field_with_the_fields_default() -> None:
    actions = _train_actions()
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    assert set(actions) == set(fields)
    for name, f in fields.items():
        action = actions[name]
        assert action.option_strings == ["--" + name.replace("_", "-")], name
        if f.default is dataclasses.MISSING:
            assert action.required, name
        else:
            assert not action.required and action.default == f.default, name
            assert type(action.default) is type(f.default), name


def test_parsed_defaults_build_the_default_config() -> None:
    args = cli.build_parser().parse_args(["train", "--data", "d", "--output", "o"])
    assert cli.config_from_args(args) == TrainConfig(data="d", output="o")


def test_every_option_has_help_a_group_and_appears_in_help() -> None:
    proc = trainer("train", "--help")
    text = " ".join(proc.stdout.split())
    for name, o in options.OPTIONS.items():
        assert len(o.help) > 10 and o.group in options.GROUPS, name
        assert options.flag(name) in proc.stdout, name
        assert " ".join(o.help.split()) in text, name
        if o.minimum is not None or o.maximum is not None:
            assert options.allowed(name) in text, name  # the range is in --help


def _outside_and_inside(name: str) -> list[tuple[object, object]]:
    """(a value just outside a bound, a value just inside it) for each of an option's bounds."""
    o = options.OPTIONS[name]
    typ, _ = options.TYPES[name]
    step = 1 if typ is int else 0.001
    cases: list[tuple[object, object]] = []
    if o.minimum is not None:
        lo = o.minimum
        cases.append((lo, lo + step) if o.exclusive_minimum else (lo - step, lo))
    hi = o.maximum
    if isinstance(hi, str):
        hi = getattr(TrainConfig(**REQUIRED), hi)
    if hi is not None:
        cases.append((hi, hi - step) if o.exclusive_maximum else (hi + step, hi))
    return [(typ(out), typ(inside)) for out, inside in cases]


BOUNDED = [
    (name, out, inside) for name in options.OPTIONS for out, inside in _outside_and_inside(name)
]


def test_the_bounded_options_are_the_expected_ones() -> None:
    """Not vacuous: the bound tests below cover the numeric options, both ends where declared."""
    names = {name for name, _, _ in BOUNDED}
    assert {"epochs", "batch_size", "lr", "max_train_samples", "target_accuracy"} <= names
    assert {"warmup_epochs", "seed", "weight_decay", "backward_passes_per_step"} <= names
    assert len(BOUNDED) >= 20


@pytest.mark.parametrize(("name", "out", "inside"), BOUNDED)
def test_each_bound_is_enforced_by_direct_construction(
    name: str, out: object, inside: object
) -> None:
    TrainConfig(**REQUIRED, **{name: inside})
    with pytest.raises(ConfigError) as caught:
        TrainConfig(**REQUIRED, **{name: out})
    message = str(caught.value)
    assert message.startswith(options.flag(name) + ": ") and repr(out) in message
    assert options.allowed(name, TrainConfig(**REQUIRED)) in message


@pytest.mark.parametrize(("name", "out", "inside"), BOUNDED)
def test_each_bound_is_enforced_by_the_command_line(
    name: str, out: object, inside: object, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = cli.build_parser()
    base = ["train", *BASE]
    inside_args = parser.parse_args([*base, options.flag(name), str(inside)])
    assert getattr(cli.config_from_args(inside_args), name) == inside
    with pytest.raises(SystemExit) as exited:
        cli.main([*base, options.flag(name), str(out)])
    assert exited.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert options.flag(name) in message and options.allowed(name, TrainConfig(**REQUIRED)) in (
        message
    ), message


@pytest.mark.parametrize("name", [n for n, o in options.OPTIONS.items() if o.choices])
def test_each_choice_option_refuses_other_values_both_ways(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for choice in options.OPTIONS[name].choice_values():
        assert getattr(TrainConfig(**REQUIRED, **{name: choice}), name) == choice
    with pytest.raises(ConfigError, match=options.flag(name)):
        TrainConfig(**REQUIRED, **{name: "no-such-choice"})
    with pytest.raises(SystemExit) as exited:
        cli.main(["train", *BASE, options.flag(name), "no-such-choice"])
    assert exited.value.code == 2
    assert options.allowed(name) in capsys.readouterr().err


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"epochs": "2"}, "--epochs: an integer in [1, 1000], got '2'"),
        ({"epochs": True}, "--epochs: an integer in [1, 1000], got True"),
        ({"lr": float("inf")}, "--lr: a number in (0, 10], got inf"),
        ({"resume": "yes"}, "--resume: true or false, got 'yes'"),
        ({"data": ""}, "--data: a dataset URI"),
        ({"target_accuracy": "0.9"}, "--target-accuracy: a number in (0, 1], or unset"),
    ],
)
def test_direct_construction_refuses_wrong_types(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        TrainConfig(**{**REQUIRED, **values})
    assert str(caught.value).startswith(message)


def test_param_schema_is_the_declaration_as_json_schema() -> None:
    assert options.param_schema("epochs") == {
        "type": "integer",
        "minimum": 1,
        "maximum": 1000,
        "title": "Epochs",
        "description": options.param_schema("epochs")["description"],
    }
    lr = options.param_schema("lr", nullable=True)
    assert lr["type"] == ["null", "number"] and lr["exclusiveMinimum"] == 0 and "minimum" not in lr
    assert "Empty: the trainer's default (0.003)" in lr["description"]
    optimizer = options.param_schema("optimizer", nullable=True)
    assert optimizer["enum"] == [*options.OPTIMIZERS, None]
    assert "maximum" not in options.param_schema("warmup_epochs")  # bounded by another field
    with pytest.raises(KeyError, match="known: data, output"):
        options.param_schema("epoch")


def test_the_retrain_dags_trainer_params_are_the_declaration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loaded as tests/dags load it: its trainer Params hold the declared bounds and titles,
    and a value outside the declared range is refused by the form as by the trainer."""
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    monkeypatch.setenv("HVA_BUCKET", "options-check")
    import horovod_airflow.operators.settings

    importlib.reload(horovod_airflow.operators.settings)
    dag = importlib.reload(importlib.import_module("dags.mnist_horovod_retrain")).retrain_dag
    titles = {
        "epochs": "Epochs",
        "batch_size": "Batch size per rank",
        "lr": "Learning rate",
        "max_train_samples": "Training samples",
    }
    train = dag.get_task("train")
    assert set(train.trainer_args) == set(titles)  # every trainer option the DAG passes
    for name, title in titles.items():
        param = dag.params.get_param(name)
        assert param.value is None
        declared = options.param_schema(name, nullable=True)
        assert param.description == declared.pop("description"), name
        assert param.schema == declared and param.schema["title"] == title, name
        for out, inside in _outside_and_inside(name):
            params = ParamsDict(dag.params)
            params[name] = inside
            with pytest.raises(ParamValidationError, match=f"param {name}"):
                params[name] = out
                params.validate()
