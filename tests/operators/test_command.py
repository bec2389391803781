"""The one command builder: argv shape, trainer_args mapping, hosts, env filtering."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from horovod_airflow.operators.command import (
    RANK_ENV_FILE_VAR,
    RANK_ENV_UNREADABLE_EXIT,
    RANK_ENV_WRAPPER,
    TRAINER_ENTRYPOINT,
    Host,
    doctor_argv,
    forwardable_environ,
    horovodrun_argv,
    is_our_trainer,
    parse_hosts,
    program_argv,
    rank_env_file_text,
    redact,
    trainer_args_to_argv,
)


def test_full_horovodrun_command_shape():
    program = program_argv(
        ("python", "-m", "horovod_airflow.trainer", "train"),
        data="s3://b/datasets/mnist/abc",
        output="s3://b/runs/x",
        extra=trainer_args_to_argv({"epochs": 2}),
        resume=True,
    )
    argv = horovodrun_argv(
        program,
        num_proc=4,
        hosts=parse_hosts("node1:2,node2:2", 4),
        ssh_port=2222,
        ssh_identity_file="/keys/id",
        network_interface="eth0",
    )
    assert argv == [
        "horovodrun",
        "--gloo",
        "-np",
        "4",
        "-H",
        "node1:2,node2:2",
        "-p",
        "2222",
        "--ssh-identity-file",
        "/keys/id",
        "--network-interface",
        "eth0",
        *RANK_ENV_WRAPPER,
        "python",
        "-m",
        "horovod_airflow.trainer",
        "train",
        "--data",
        "s3://b/datasets/mnist/abc",
        "--output",
        "s3://b/runs/x",
        "--epochs",
        "2",
        "--resume",
    ]


def test_optional_flags_are_omitted():
    argv = horovodrun_argv(["prog"], num_proc=2, hosts=parse_hosts(None, 2), load_rank_env=False)
    assert argv == ["horovodrun", "--gloo", "-np", "2", "-H", "localhost:2", "prog"]


@pytest.mark.parametrize(
    ("controller", "flags"), [("gloo", ["--gloo"]), ("mpi", ["--mpi"]), ("auto", [])]
)
def test_the_controller_is_named_unless_auto(controller, flags):
    argv = horovodrun_argv(
        ["prog"], num_proc=1, hosts=parse_hosts(None, 1), load_rank_env=False,
        controller=controller,
    )  # fmt: skip
    assert argv == ["horovodrun", *flags, "-np", "1", "-H", "localhost:1", "prog"]


def test_an_unknown_controller_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"controller must be one of \['auto', 'gloo', 'mpi'\]"):
        horovodrun_argv(["prog"], num_proc=1, hosts=parse_hosts(None, 1), controller="nccl")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({"batch_size": 64}, ["--batch-size", "64"]),
        ({"amp": True, "compile": False, "seed": None}, ["--amp"]),
        (
            {"lr": 0.01, "max_train_samples": "2000"},
            ["--lr", "0.01", "--max-train-samples", "2000"],
        ),
        ({"layers": [1, 2]}, ["--layers", "1", "2"]),
        (["--epochs", 3], ["--epochs", "3"]),
        (None, []),
    ],
)
def test_trainer_args_mapping(args, expected):
    assert trainer_args_to_argv(args) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [("--epochs 3", "dict or a list"), ({"--epochs": 3}, "plain name"), ({"": 1}, "plain name")],
)
def test_bad_trainer_args_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        trainer_args_to_argv(args)


def test_trainer_args_keys_are_checked_against_the_trainers_options():
    """For this project's ``trainer train`` a misspelt key fails when the DAG is parsed,
    naming the keys the trainer declares; other entrypoints take any key."""
    args = {"epochs": 2, "batch_size": "{{ params.batch_size }}", "fp16_allreduce": True}
    assert trainer_args_to_argv(args, TRAINER_ENTRYPOINT) == trainer_args_to_argv(args)
    with pytest.raises(ValueError, match=r"'epoch' is not an option .*known: .*epochs") as e:
        trainer_args_to_argv({"epochs": 1, "epoch": 2}, TRAINER_ENTRYPOINT)
    assert "'data'" not in str(e.value) and "max_train_samples" in str(e.value)
    with pytest.raises(ValueError, match="'output' is set by the operator itself"):
        trainer_args_to_argv(
            {"output": "s3://b/x"}, ("python3", "-m", "horovod_airflow.trainer", "train")
        )
    for other in (
        ("python", "my_train.py"),
        ("python", "-m", "horovod_airflow.trainer", "export"),
        None,
    ):
        assert trainer_args_to_argv({"epoch": 2}, other) == ["--epoch", "2"]


@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        (None, [Host("localhost", 3)]),
        ("a:2,b:1", [Host("a", 2), Host("b", 1)]),
        (["a:4", "b"], [Host("a", 4), Host("b", 1)]),
    ],
)
def test_parse_hosts(hosts, expected):
    assert parse_hosts(hosts, 3) == expected


@pytest.mark.parametrize(
    ("hosts", "message"),
    [
        ("a:x", "not an integer"),
        ("a:0", "must be ≥ 1"),
        (":2", "hostname:slots"),
        ("a b:2", "hostname:slots"),
    ],
)
def test_bad_hosts_are_named(hosts, message):
    with pytest.raises(ValueError, match=message):
        parse_hosts(hosts, 2)


def test_doctor_and_trainer_detection():
    assert is_our_trainer(("python", "-m", "horovod_airflow.trainer", "train"))
    assert not is_our_trainer(("python", "-m", "tests.programs.allreduce_program"))
    assert doctor_argv(("python3", "-m", "horovod_airflow.trainer", "train"), 4, 1) == [
        "python3",
        "-m",
        "horovod_airflow.trainer",
        "doctor",
        "--np",
        "4",
        "--gpus-per-proc",
        "1",
    ]


def test_forwardable_environ_is_an_allowlist_that_never_lets_a_secret_through():
    env = {
        "PATH": "/bin",
        "PYTHONPATH": "/repo",
        "AWS_ENDPOINT_URL": "http://s3",
        "AWS_DEFAULT_REGION": "us-east-1",
        "HOROVOD_CYCLE_TIME": "1",
        "NCCL_DEBUG": "INFO",
        "HVA_BUCKET": "b",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SESSION_TOKEN": "t",
        "AIRFLOW_CONN_AWS_DEFAULT": '{"password": "s"}',
        "AIRFLOW__CORE__FERNET_KEY": "f",
        "HVA_S3_SECRET_KEY": "s",  # allowed prefix, secret name: not forwarded
        "DATABASE_URL": "postgresql://u:p@db/x",
        "PIP_INDEX_URL": "https://u:p@pypi/simple",
        "HTTPS_PROXY": "http://u:p@proxy:3128",
        "WANDB_KEY": "w",
        "WANDB_PROJECT": "p",
        "MYAPP_MODE": "fast",
        "GITHUB_TOKEN": "g",
    }
    basics = {
        "PATH": "/bin",
        "PYTHONPATH": "/repo",
        "AWS_ENDPOINT_URL": "http://s3",
        "AWS_DEFAULT_REGION": "us-east-1",
        "HOROVOD_CYCLE_TIME": "1",
        "NCCL_DEBUG": "INFO",
        "HVA_BUCKET": "b",
    }
    assert forwardable_environ(env) == basics
    # a user's own, by name or prefix; a secret-looking one stays out even if asked for
    asked = forwardable_environ(env, ["WANDB_PROJECT", "MYAPP_*", "WANDB_*"])
    assert asked == {**basics, "WANDB_PROJECT": "p", "MYAPP_MODE": "fast"}


@pytest.mark.parametrize(
    ("forward", "says"),
    [
        (["WANDB_API_KEY"], "looks like a secret"),
        (["AIRFLOW__CORE__SQL_ALCHEMY_CONN"], "Airflow's"),
        (["bad name"], "not a variable name"),
        ("MYAPP_*", "must be a list"),
    ],
)
def test_forward_env_refuses_secrets_and_bad_names(forward, says):
    from horovod_airflow.operators.launchers.local import LocalOptions

    with pytest.raises(ValueError, match=says):
        LocalOptions(forward_env=forward)


def test_rank_wrapper_sources_the_file_and_execs(tmp_path):
    """The wrapper really loads awkward values and replaces itself with the program."""
    secrets = {"AWS_SECRET_ACCESS_KEY": "a'b\"c $HOME `x` ;|&", "AWS_ACCESS_KEY_ID": "AKIA1"}
    env_file = tmp_path / "rank.env"
    env_file.write_text(rank_env_file_text(secrets))
    probe = ["python", "-c", "import os; print(os.environ['AWS_SECRET_ACCESS_KEY'])"]
    env = {"PATH": os.environ["PATH"], RANK_ENV_FILE_VAR: str(env_file)}
    out = subprocess.run([*RANK_ENV_WRAPPER, *probe], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == secrets["AWS_SECRET_ACCESS_KEY"]
    # Without the file (e.g. a remote host), the program still runs, without the secret.
    env[RANK_ENV_FILE_VAR] = str(tmp_path / "absent")
    probe = ["python", "-c", "import os; print(os.environ.get('AWS_SECRET_ACCESS_KEY'))"]
    out = subprocess.run([*RANK_ENV_WRAPPER, *probe], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "None"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the wrapper as another uid")
def test_rank_wrapper_stops_when_the_file_exists_but_is_unreadable():
    """A credentials file this user cannot read (a Secret mounted for another uid) must stop
    the rank with a message, not let it run on without credentials."""
    import tempfile

    # A folder every user can enter (pytest's tmp_path is root's alone), holding a file only
    # root can read; the rank below runs as nobody.
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="hva-rank-env-"))
    try:
        folder.chmod(0o755)
        env_file = folder / "rank.env"
        env_file.write_text(rank_env_file_text({"AWS_ACCESS_KEY_ID": "AKIA1"}))
        env_file.chmod(0o600)
        env = {"PATH": os.environ["PATH"], RANK_ENV_FILE_VAR: str(env_file)}
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        out = subprocess.run(
            [*as_nobody, *RANK_ENV_WRAPPER, "echo", "the program ran"],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        assert out.returncode == RANK_ENV_UNREADABLE_EXIT, (out.stdout, out.stderr)
        assert "the program ran" not in out.stdout
        assert f"{RANK_ENV_FILE_VAR}={env_file} exists but uid 65534 cannot read it" in out.stderr
    finally:
        shutil.rmtree(folder)


def test_the_docker_launchers_credentials_file_reaches_the_program(tmp_path: Path) -> None:
    """The file the docker launcher copies into a container (its tar, extracted for real, as
    the engine does at ``/``), sourced by the rank wrapper: the program sees the secret,
    which was never in the environment the container started with."""
    from horovod_airflow.operators.launchers.docker import SECRET_FILE, DockerLauncher

    archive = DockerLauncher.secret_archive({"AWS_SECRET_ACCESS_KEY": "s3cr'et $x"})
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        assert tar.getmember(SECRET_FILE.lstrip("/")).mode == 0o444
        tar.extractall(tmp_path, filter="fully_trusted")  # as the engine extracts it
    env_file = tmp_path / SECRET_FILE.lstrip("/")
    assert oct(env_file.stat().st_mode & 0o777) == "0o444"
    out = subprocess.run(
        [*RANK_ENV_WRAPPER, sys.executable, "-c",
         "import os; print(os.environ['AWS_SECRET_ACCESS_KEY'])"],
        env={"PATH": os.environ["PATH"], RANK_ENV_FILE_VAR: str(env_file)},
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "s3cr'et $x"


def test_the_credentials_archive_ends_at_its_end_of_archive_blocks() -> None:
    """No record padding after the two zero blocks: podman's copier stops reading there, and
    padding still being written fails the copy with a broken pipe (containers/buildah#6573)."""
    from horovod_airflow.operators.launchers.docker import DockerLauncher

    archive = DockerLauncher.secret_archive({"AWS_SECRET_ACCESS_KEY": "x" * 700})
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        last = tar.getmembers()[-1]
        end_of_data = last.offset_data + -(-last.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    assert archive[end_of_data:] == bytes(2 * tarfile.BLOCKSIZE)


def test_redact():
    assert redact("key=abcd1234 and abcd1234", ["abcd1234", ""]) == "key=*** and ***"


def test_failure_message_names_the_rank_and_its_host():
    from horovod_airflow.operators.command import Host
    from horovod_airflow.operators.launchers.base import describe_failure

    lines = [
        "[0]<stdout>:ok",
        "[2]<stderr>:RuntimeError: boom",
        "Process name: 2",
        "Exit code: 7",
    ]
    text = "\n".join(lines)
    hosts = [Host("h1", 2), Host("h2", 2)]
    message = describe_failure("job", 1, text.splitlines(), hosts)
    assert "rank 2 (host h2) failed first (exit code 7)" in message
    assert "[2]<stderr>:RuntimeError: boom" in message


RANK_1_EXITED = ["[1]<stderr>:boom", "Process name: 1", "Exit code: {code}"]


@pytest.mark.parametrize(
    ("exit_code", "rank_code", "how", "error", "final", "says"),
    [
        (0, None, {}, None, False, ""),
        (1, 7, {}, "HorovodTrainingError", False, "job 'j' exited with code 1: rank 1"),
        (1, 2, {}, "HorovodRefusedError", True, "exit code 2: the program refused"),
        (3, None, {}, "HorovodRefusedError", True, "exit code 3: the program refused"),
        (None, 3, {"failure": "MPIJob ml/j failed: X"}, "HorovodRefusedError", True,
         "MPIJob ml/j failed: X; job 'j' failed: rank 1"),
        (None, 137, {"failure": "MPIJob ml/j failed: X"}, "HorovodTrainingError", False,
         "rank 1 failed first (exit code 137)"),
        (-15, None, {"stopped": True}, "HorovodTrainingError", False,
         "job 'j' was stopped (on_kill, exit code -15)"),
        (None, 3, {"timed_out": 5.0}, "HorovodTimeoutError", False,
         "job 'j' ran longer than timeout=5s and was stopped"),
    ],
    ids=["exit 0", "a crash", "rank refused", "refused alone", "mpijob refused",
         "mpijob crash", "on_kill", "timeout"],
)  # fmt: skip
def test_every_launcher_ends_a_job_by_one_matrix(exit_code, rank_code, how, error, final, says):
    """end_of_job: exit code (the job's, or the first failed rank's as horovodrun names it)
    → result or typed error, the same for local, docker and kubernetes."""
    from airflow.sdk.exceptions import AirflowFailException

    from horovod_airflow.operators import exceptions
    from horovod_airflow.operators.launchers.base import end_of_job

    tail = [line.format(code=rank_code) for line in RANK_1_EXITED] if rank_code else ["done"]
    if error is None:
        assert end_of_job("j", exit_code, tail, **how).log_tail == tail
        return
    with pytest.raises(getattr(exceptions, error)) as raised:
        end_of_job("j", exit_code, tail, **how)
    assert type(raised.value).__name__ == error
    assert isinstance(raised.value, AirflowFailException) is final
    assert says in str(raised.value)
    assert raised.value.log_tail == tail
