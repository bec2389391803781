"""The one place that builds the commands a Horovod job runs.

``horovodrun --gloo|--mpi -np N -H host:slots[,host:slots] [-p PORT] [--ssh-identity-file F]
[--network-interface I] <entrypoint> --data D --output O [args] [--resume]``

Why the entrypoint is wrapped (``sh -c '<load rank env>; exec "$@"' hva-rank <entrypoint>``):
``horovodrun`` (Gloo) starts every rank as ``sh -c "env K1=V1 K2=V2 ... <command>"`` and, for
remote hosts, puts that same string on the ``ssh`` command line. Every exported variable of
its environment is copied onto those command lines, where ``ps`` shows it to every user of
the machine. So credentials never enter horovodrun's environment: the launcher writes them
to a private file (mode 0600) named by ``HVA_RANK_ENV_FILE``, and each rank sources that
file right before it ``exec``s the program. Only the file's *path* travels on command lines.

Pure functions; no Airflow, no torch (``horovod_airflow.core.train_config`` is neither):
unit-testable and shared by every launcher.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from horovod_airflow.core.train_config import ConfigError, check_trainer_arg_keys

HOROVODRUN = "horovodrun"
#: The trainer's options the train operator sets from its own arguments (``program_argv``:
#: ``data``, ``output``, ``resume_on_retry``), so never through ``trainer_args``.
TRAINER_SETS = ("data", "output", "resume")
TRAINER_ENTRYPOINT: tuple[str, ...] = ("python", "-m", "horovod_airflow.trainer", "train")
EXPORT_ENTRYPOINT: tuple[str, ...] = ("python", "-m", "horovod_airflow.trainer", "export")

# The variable that names the private file of rank credentials (the path is not a secret).
RANK_ENV_FILE_VAR = "HVA_RANK_ENV_FILE"
# Sources the credentials file and replaces itself with the program, so the rank process is
# the program itself (signals, exit codes unchanged). A host without the file (a remote host
# with credentials of its own) runs the program without it; a file that exists but that this
# user cannot read (a Secret mounted for another uid) stops the rank, saying so, instead of
# letting it run on without credentials.
RANK_ENV_UNREADABLE_EXIT = 126
RANK_ENV_LOADER = (
    f'f="${{{RANK_ENV_FILE_VAR}:-}}"; '
    'if [ -r "$f" ]; then set -a; . "$f"; set +a; '
    'elif [ -e "$f" ]; then '
    f'echo "hva-rank: {RANK_ENV_FILE_VAR}=$f exists but uid $(id -u) cannot read it" >&2; '
    f"exit {RANK_ENV_UNREADABLE_EXIT}; fi; "
    'exec "$@"'
)
RANK_ENV_WRAPPER: tuple[str, ...] = ("sh", "-c", RANK_ENV_LOADER, "hva-rank")

# Standard AWS variables that are secrets (the endpoint and region are not).
AWS_SECRET_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
#: What a local job inherits from the worker's environment: horovodrun copies its whole
#: environment onto every rank's command line, so only what the launch and the ranks need
#: goes: the system basics of horovodrun, ssh and Python; Horovod's, NCCL's and Gloo's
#: settings; thread, CUDA and locale settings; the AWS settings that are not credentials;
#: this project's ``HVA_*``. Anything else reaches a job through the operator's ``env`` /
#: ``secret_env``, or by name through ``LocalOptions(forward_env=...)``. Proxy variables are
#: not forwarded by default (a proxy URL may hold a password).
FORWARDED_NAMES = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR",
        "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONHASHSEED", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
        "SSH_AUTH_SOCK", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
        "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
        "AWS_CA_BUNDLE", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "SSL_CERT_FILE", "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
    }
)  # fmt: skip
FORWARDED_PREFIXES = (
    "HOROVOD_", "NCCL_", "GLOO_", "UCX_", "LC_", "CUDA_", "NVIDIA_", "TORCH_", "PYTORCH_",
    "KMP_", "HVA_",
)  # fmt: skip
# Never handed to horovodrun, allowed or asked for: Airflow config/connections and anything
# that looks secret (those go through secret_env: a private file, not the command line).
_NOT_FORWARDED = re.compile(
    r"^(AIRFLOW.*|_AIRFLOW.*|AWS_ACCESS_KEY_ID|AWS_SECRET_ACCESS_KEY|AWS_SESSION_TOKEN"
    r"|AWS_SECURITY_TOKEN|.*(SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|PRIVATE_KEY|API_KEY).*"
    r"|(.*_)?(KEY|KEYS|PASS|PWD|AUTH)(_.*)?)$",
    re.IGNORECASE,
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HOSTNAME = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class Host:
    """One ``-H`` entry: a host name and how many ranks (slots) it runs."""

    name: str
    slots: int

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"

    @property
    def is_local(self) -> bool:
        return self.name in LOCAL_HOSTS


def parse_hosts(hosts: str | Sequence[str] | None, num_proc: int) -> list[Host]:
    """Parse ``"a:2,b:2"`` or ``["a:2", "b:2"]``; ``None`` means ``localhost:<num_proc>``.

    A host without ``:slots`` gets one slot. Raises ``ValueError`` naming the bad entry.
    """
    if hosts is None or hosts == "" or hosts == []:
        return [Host("localhost", num_proc)]
    items = hosts.split(",") if isinstance(hosts, str) else list(hosts)
    parsed: list[Host] = []
    for raw in items:
        entry = str(raw).strip()
        name, sep, slots_text = entry.rpartition(":")
        if not sep:
            name, slots_text = entry, "1"
        if not name or not _HOSTNAME.match(name):
            raise ValueError(f"hosts entry {raw!r} is not 'hostname:slots' (e.g. 'node1:4')")
        try:
            slots = int(slots_text)
        except ValueError:
            raise ValueError(
                f"hosts entry {raw!r}: slots {slots_text!r} is not an integer ≥ 1"
            ) from None
        if slots < 1:
            raise ValueError(f"hosts entry {raw!r}: slots must be ≥ 1, got {slots}")
        parsed.append(Host(name, slots))
    return parsed


def trainer_args_to_argv(
    args: Mapping[str, Any] | Sequence[Any] | None, entrypoint: Sequence[str] | None = None
) -> list[str]:
    """``{"batch_size": 64, "amp": True, "seed": None}`` → ``["--batch-size", "64", "--amp"]``.

    Underscores become dashes; ``True`` is a bare flag; ``False``/``None`` are omitted; a
    list value repeats its items after one flag. A list/tuple is passed through as strings.
    With an ``entrypoint`` that is this project's ``trainer train``, a dict's keys must be
    options it declares (``horovod_airflow.core.train_config.OPTIONS``) other than those the
    operator sets itself (``TRAINER_SETS``): a misspelt key fails here, at DAG parse time,
    naming the known ones, instead of in the ranks' argparse at run time.
    """
    if args is None:
        return []
    if isinstance(args, str):
        raise ValueError(
            f"trainer_args must be a dict or a list of strings, got the string {args!r}"
        )
    if not isinstance(args, Mapping):
        return [str(a) for a in args]
    if entrypoint is not None and is_our_train(entrypoint):
        try:
            check_trainer_arg_keys(args, set_by_caller=TRAINER_SETS)
        except ConfigError as e:
            raise ValueError(f"trainer_args: {e}") from None
    argv: list[str] = []
    for key, value in args.items():
        if not isinstance(key, str) or not key or key.startswith("-"):
            raise ValueError(f"trainer_args key {key!r} must be a plain name like 'batch_size'")
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, list | tuple):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def program_argv(
    entrypoint: Sequence[str],
    *,
    data: str | None,
    output: str,
    extra: Sequence[str] = (),
    resume: bool = False,
    data_flag: str = "--data",
    output_flag: str = "--output",
) -> list[str]:
    """The program's own command line: ``<entrypoint> --data D --output O [extra] [--resume]``."""
    argv = [str(a) for a in entrypoint]
    if data:
        argv += [data_flag, data]
    argv += [output_flag, output, *extra]
    if resume:
        argv.append("--resume")
    return argv


#: horovodrun's controller flags. ``gloo`` is what this project's wheels and images build
#: (Gloo, plus NCCL on GPUs); naming it spares horovodrun its probe of whether Horovod was
#: built with MPI (a process importing torch: ~2.5 s on 2 cores). ``auto``: horovodrun's
#: own choice (MPI when built, else Gloo).
CONTROLLER_FLAGS = {"gloo": ["--gloo"], "mpi": ["--mpi"], "auto": []}


def check_controller(controller: str) -> str:
    """``controller`` if it is one of ``CONTROLLER_FLAGS``, else ValueError naming them."""
    if controller not in CONTROLLER_FLAGS:
        raise ValueError(
            f"controller must be one of {sorted(CONTROLLER_FLAGS)}, got {controller!r}"
        )
    return controller


def horovodrun_argv(
    program: Sequence[str],
    *,
    num_proc: int,
    hosts: Sequence[Host],
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    network_interface: str | None = None,
    load_rank_env: bool = True,
    horovodrun: str = HOROVODRUN,
    controller: str = "gloo",
) -> list[str]:
    """``horovodrun --gloo|--mpi -np N -H h:s,... [-p P] [--ssh-identity-file F] …``."""
    argv = [horovodrun, *CONTROLLER_FLAGS[check_controller(controller)], "-np", str(num_proc)]
    argv += ["-H", ",".join(str(h) for h in hosts)]
    if ssh_port is not None:
        argv += ["-p", str(ssh_port)]
    if ssh_identity_file:
        argv += ["--ssh-identity-file", ssh_identity_file]
    if network_interface:
        argv += ["--network-interface", network_interface]
    if load_rank_env:
        argv += RANK_ENV_WRAPPER
    return argv + list(program)


def is_our_trainer(entrypoint: Sequence[str]) -> bool:
    """True when the entrypoint runs this project's trainer (``python -m horovod_airflow.trainer
    ...``)."""
    ep = [str(a) for a in entrypoint]
    return len(ep) >= 3 and ep[1] == "-m" and ep[2] == "horovod_airflow.trainer"


def is_our_train(entrypoint: Sequence[str]) -> bool:
    """True when the entrypoint is this project's ``python -m horovod_airflow.trainer train``."""
    return is_our_trainer(entrypoint) and [str(a) for a in entrypoint][3:4] == ["train"]


def doctor_argv(entrypoint: Sequence[str], num_proc: int, gpus_per_proc: int) -> list[str]:
    """``python -m horovod_airflow.trainer doctor --np N --gpus-per-proc G`` with the entrypoint's
    python."""
    python = str(entrypoint[0])
    return [
        python,
        "-m",
        "horovod_airflow.trainer",
        "doctor",
        "--np",
        str(num_proc),
        "--gpus-per-proc",
        str(gpus_per_proc),
    ]


def rank_env_file_text(secret_env: Mapping[str, str]) -> str:
    """The credentials file the rank wrapper sources: ``NAME='value'`` lines (sh-quoted)."""
    lines = []
    for name, value in secret_env.items():
        validate_env_name(name, "secret_env")
        lines.append(f"{name}={shlex.quote(str(value))}\n")
    return "".join(lines)


def validate_env_name(name: str, field: str) -> None:
    if not isinstance(name, str) or not _ENV_NAME.match(name):
        raise ValueError(f"{field}: {name!r} is not a valid environment variable name")


def forwardable_environ(environ: Mapping[str, str], extra: Iterable[str] = ()) -> dict[str, str]:
    """The part of an inherited environment that may be handed to horovodrun: the names of
    :data:`FORWARDED_NAMES`, :data:`FORWARDED_PREFIXES` and ``extra`` (names, or prefixes
    ending in ``*``), less Airflow's own variables and anything named like a secret, which
    horovodrun would copy onto every rank's command line."""
    extra = tuple(extra)
    names = FORWARDED_NAMES | {e for e in extra if not e.endswith("*")}
    prefixes = FORWARDED_PREFIXES + tuple(e[:-1] for e in extra if e.endswith("*"))
    return {
        k: v
        for k, v in environ.items()
        if (k in names or k.startswith(prefixes)) and not _NOT_FORWARDED.match(k)
    }


def check_forward_env(patterns: Any) -> tuple[str, ...]:
    """``LocalOptions.forward_env``: variable names or prefixes ending in ``*``, none named
    like a secret; ValueError naming the bad one."""
    if isinstance(patterns, str) or not isinstance(patterns, Iterable):
        raise ValueError(
            f"forward_env must be a list of variable names or prefixes ending in '*', "
            f"got {patterns!r:.80}"
        )
    checked = []
    for p in patterns:
        name = p[:-1] if isinstance(p, str) and p.endswith("*") else p
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise ValueError(
                f"forward_env: {p!r} is not a variable name or a prefix ending in '*' "
                f"(e.g. 'WANDB_PROJECT', 'MYAPP_*')"
            )
        if _NOT_FORWARDED.match(name):
            raise ValueError(
                f"forward_env: {p!r} is Airflow's or looks like a secret, and horovodrun puts "
                f"forwarded variables on every rank's command line; pass it in secret_env"
            )
        checked.append(p)
    return tuple(checked)


def redact(text: str, secrets: Iterable[str]) -> str:
    """Replace each secret value (of 4+ characters) in ``text`` with ``***``."""
    for s in secrets:
        if s and len(s) >= 4:
            text = text.replace(s, "***")
    return text
