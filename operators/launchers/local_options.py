"""The options of ``launcher="local"`` (:class:`LocalOptions`), validated on creation;
:mod:`horovod_airflow.operators.launchers.local` runs the job with them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from horovod_airflow.operators.command import check_forward_env, parse_hosts

DEFAULT_KILL_GRACE_S = 15.0
#: horovodrun arguments the launcher sets itself (from num_proc, hosts, controller and the
#: options below): refused in ``LocalOptions.horovodrun_args``.
OWNED_HOROVODRUN_ARGS = frozenset(
    {
        "-np", "--num-proc", "-H", "--hosts", "-hostfile", "--hostfile", "-p", "--ssh-port",
        "--ssh-identity-file", "-i", "--network-interface", "--network-interfaces",
        "--gloo", "--mpi",
    }
)  # fmt: skip


@dataclass(frozen=True)
class LocalOptions:
    """Settings of ``launcher="local"`` (horovodrun as a child of the Airflow worker).

    :param hosts: ``"host:slots,..."`` or a list; None → ``localhost:<num_proc>``. Remote
        hosts are reached by horovodrun over ssh. Training only: an export is one process
        on the worker.
    :param ssh_port / ssh_identity_file / network_interface: horovodrun's ``-p``,
        ``--ssh-identity-file`` and ``--network-interface`` (training only).
    :param horovodrun_args: extra horovodrun arguments placed before ``-np`` (e.g.
        ``["--timeline-filename", "/tmp/t.json"]``); the ones the launcher sets itself
        (``OWNED_HOROVODRUN_ARGS``: ranks, hosts, controller, ssh, interface) are refused.
    :param rank_env_dir: folder of the private credentials file the ranks source; with
        remote hosts it must be a folder all hosts share. None: a private temp dir.
    :param kill_grace_s: seconds between SIGTERM and SIGKILL when the job is stopped.
    :param working_dir: working directory of the job; None: the worker's.
    :param forward_env: variables of the worker's environment the job also inherits, by
        name or prefix ending in ``*`` (e.g. ``["WANDB_PROJECT", "MYAPP_*"]``), beyond
        ``horovod_airflow.operators.command.FORWARDED_NAMES`` / ``FORWARDED_PREFIXES``
        (system basics, ``HOROVOD_*``, ``NCCL_*``, ``GLOO_*``, CUDA and thread settings,
        non-secret ``AWS_*``, ``HVA_*``). Nothing else of the worker's environment is
        forwarded: horovodrun puts it on every rank's command line. Names that look secret
        are refused (use ``secret_env``).
    """

    hosts: str | Sequence[str] | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    network_interface: str | None = None
    horovodrun_args: Sequence[str] = ()
    rank_env_dir: str | None = None
    kill_grace_s: float = DEFAULT_KILL_GRACE_S
    working_dir: str | None = None
    forward_env: Sequence[str] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward_env", check_forward_env(self.forward_env))
        if self.hosts is not None:
            parse_hosts(self.hosts, 1)  # raises ValueError naming the bad entry
        port = self.ssh_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                                 or not 0 < port < 65536):  # fmt: skip
            raise ValueError(f"ssh_port must be a TCP port 1-65535, got {port!r}")
        args = self.horovodrun_args
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"horovodrun_args must be a list of strings, got {args!r}")
        owned = [a for a in args if a.split("=", 1)[0] in OWNED_HOROVODRUN_ARGS]
        if owned:
            raise ValueError(
                f"horovodrun_args {owned}: set by the launcher itself (num_proc, hosts, "
                f"controller, ssh_port, ssh_identity_file, network_interface); use those"
            )
        grace = self.kill_grace_s
        if isinstance(grace, bool) or not isinstance(grace, int | float) or grace < 0:
            raise ValueError(f"kill_grace_s must be seconds ≥ 0, got {grace!r}")
        for name in ("ssh_identity_file", "network_interface", "rank_env_dir", "working_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")


DEFAULT_ELASTIC_TIMEOUT_S = 600  # horovodrun's own default --elastic-timeout
#: The bounds horovodrun 0.28 accepts for ``--blacklist-cooldown-range`` (runner/elastic/
#: discovery.py: DEFAULT_COOLDOWN_LOWER_LIMIT_SECONDS, DEFAULT_COOLDOWN_UPPER_LIMIT_SECONDS).
COOLDOWN_LIMITS_S = (1, 3600)


@dataclass
class ElasticOptions:
    """``HorovodTrainOperator(elastic=ElasticOptions(...))``: elastic Horovod, where the ranks
    of a lost host leave and a new host's join while the run goes on (``horovodrun --min-np
    --max-np --host-discovery-script``, ``trainer train --elastic``).

    ``launcher="local"`` over several hosts and ``launcher="kubernetes"`` with an MPIJob (the
    MPI Operator's ``/etc/mpi/discover_hosts.sh``; worker pods up to ``max_np``) run it:
    Horovod drops a whole host when one of its ranks fails, so ranks that share one host (the
    docker launcher's container, a local launch on localhost, a one-pod MPIJob) would all go
    at once; those are refused, and so is a TrainJob (Trainer v2 has no elastic jobs).

    :param min_np: the fewest ranks the job runs with (templated); below it, after
        ``timeout_s``, the task fails naming the lost host.
    :param max_np: the most ranks (templated); ``num_proc`` ranks start.
    :param timeout_s: seconds horovodrun waits for ``min_np`` slots after a change
        (``--elastic-timeout``).
    :param hosts_file: a file of ``host:slots`` lines that the discovery script reads each
        time horovodrun asks (change it to add or remove hosts); None: the launcher writes
        one from ``LocalOptions.hosts``.
    :param cooldown_s: ``(lower, upper)`` whole seconds: a host dropped after a failure is
        taken back (if discovery still lists it) once its cooldown ends, the cooldown of its
        n-th drop being ``lower * 2**n`` plus up to ``lower`` at random, at least ``lower`` and
        at most ``upper`` (``horovodrun --blacklist-cooldown-range``; ``1 ≤ lower ≤ upper ≤
        3600``). A node that comes back under its old name (a restarted spot VM, a rank's
        process that crashed on a healthy host) rejoins. Needs ``hosts_file``, listing only
        the hosts that are up: a listed host that is down when its cooldown ends gets a
        rank, which fails, and Horovod 0.28.1 then ends the whole job after Gloo's 30 s
        rendezvous timeout. ``launcher="local"`` only (an MPIJob refuses it, saying what was
        measured). None (the default): a dropped host never returns.
    """

    min_np: int | str
    max_np: int | str
    timeout_s: int = DEFAULT_ELASTIC_TIMEOUT_S
    hosts_file: str | None = None
    cooldown_s: tuple[int, int] | None = None
    template_fields = ("min_np", "max_np")  # rendered by Airflow with the operator's fields

    def __post_init__(self) -> None:
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"ElasticOptions.timeout_s must be whole seconds ≥ 1, got {t!r}")
        if self.hosts_file is not None and (
            not isinstance(self.hosts_file, str) or not self.hosts_file
        ):
            raise ValueError(f"ElasticOptions.hosts_file must be a path, got {self.hosts_file!r}")
        if self.cooldown_s is not None:
            self.cooldown_s = check_cooldown(self.cooldown_s)


def check_cooldown(value: object) -> tuple[int, int]:
    """``ElasticOptions.cooldown_s`` as ``(lower, upper)``, or ValueError saying what is
    allowed."""
    low, high = COOLDOWN_LIMITS_S
    pair = tuple(value) if isinstance(value, list | tuple) else ()
    if (
        len(pair) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) for v in pair)
        or not low <= pair[0] <= pair[1] <= high
    ):
        raise ValueError(
            f"ElasticOptions.cooldown_s must be (lower, upper) whole seconds with "
            f"{low} ≤ lower ≤ upper ≤ {high} (horovodrun --blacklist-cooldown-range), "
            f"got {value!r}"
        )
    return int(pair[0]), int(pair[1])
