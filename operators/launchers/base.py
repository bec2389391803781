"""The one launcher interface: run a prepared command somewhere and report how it ended.

A launcher gets a :class:`JobSpec` (the command, its environment, the credentials kept
apart) and either returns a :class:`JobResult` for exit code 0 or raises a typed
:mod:`horovod_airflow.operators.exceptions` error carrying the tail of the job's output: every
launcher ends a job with :func:`end_of_job`, which says which. ``kill()`` stops whatever it
started and is a no-op when nothing runs (Airflow may call it twice).
"""

from __future__ import annotations

import abc
import collections
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from horovod_airflow.core.contract import NO_RETRY_EXIT_CODES
from horovod_airflow.operators.command import redact
from horovod_airflow.operators.exceptions import (
    HorovodConfigError,
    HorovodRefusedError,
    HorovodTimeoutError,
    HorovodTrainingError,
)

LOG_TAIL_LINES = 100
#: The label naming the job on what a launcher creates (container, MPIJob, pods, Secret).
JOB_LABEL = "horovod-airflow/job"


@dataclass(frozen=True)
class JobSpec:
    """What to run. ``argv`` never holds a secret; ``secret_env`` never reaches a command line."""

    name: str  # a DNS-safe job name (container / MPIJob name)
    argv: Sequence[str]  # the full command (``horovodrun ...`` or one program)
    env: Mapping[str, str] = field(default_factory=dict)  # non-secret variables
    secret_env: Mapping[str, str] = field(default_factory=dict)  # credentials
    num_proc: int = 1  # ranks
    gpus_per_proc: int = 0  # GPUs each rank needs
    timeout: float | None = None  # seconds before the job is stopped
    distributed: bool = True  # argv is a horovodrun command (ranks source the secrets file)
    preflight_argv: Sequence[str] | None = None  # a doctor command to run first, if any
    controller: str = "gloo"  # horovodrun's controller: gloo, mpi or auto (its own choice)
    labels: Mapping[str, str] = field(default_factory=dict)  # dag_id, task_id, run_id, try_number
    elastic: ElasticSpec | None = None  # elastic Horovod: ranks may leave and join


@dataclass(frozen=True)
class ElasticSpec:
    """An elastic job's bounds (rendered ``ElasticOptions``): horovodrun's ``--min-np``,
    ``--max-np``, ``--elastic-timeout`` (seconds it waits for ``min_np`` slots) and
    ``--blacklist-cooldown-range`` (``cooldown_s``: when a dropped host may return)."""

    min_np: int
    max_np: int
    timeout_s: int
    hosts_file: str | None = None  # host:slots lines the discovery script prints
    cooldown_s: tuple[int, int] | None = None  # None: a dropped host never returns


def check_elastic_bounds(elastic: ElasticSpec, num_proc: int) -> None:
    """Raise :class:`HorovodConfigError` unless ``1 ≤ min_np ≤ num_proc ≤ max_np``."""
    if not 1 <= elastic.min_np <= num_proc <= elastic.max_np:
        raise HorovodConfigError(
            f"elastic: need 1 ≤ min_np ≤ num_proc ≤ max_np, got min_np={elastic.min_np}, "
            f"num_proc={num_proc}, max_np={elastic.max_np}"
        )


def elastic_args(
    elastic: ElasticSpec, script: str, *, slots_per_host: int | None = None
) -> list[str]:
    """horovodrun's elastic arguments (they replace ``-H``): the bounds, the discovery
    script, the timeout, the cooldown of a dropped host where one is set, and
    ``--slots-per-host`` where the script prints bare host names."""
    argv = [
        "--min-np", str(elastic.min_np), "--max-np", str(elastic.max_np),
        "--host-discovery-script", script, "--elastic-timeout", str(elastic.timeout_s),
    ]  # fmt: skip
    if elastic.cooldown_s is not None:
        argv += ["--blacklist-cooldown-range", *map(str, elastic.cooldown_s)]
    if slots_per_host is not None:
        argv += ["--slots-per-host", str(slots_per_host)]
    return argv


NO_ELASTIC_REASON = (
    "elastic Horovod drops a whole host when one of its ranks fails, and the new world is "
    "formed over the hosts that are left; it needs ranks on several hosts and a discovery "
    "script it can re-run"
)


@dataclass(frozen=True)
class JobResult:
    exit_code: int
    log_tail: list[str]


class LogTail:
    """Redacts and forwards each output line to the task log and keeps the last lines;
    ``progress`` (a :class:`~horovod_airflow.operators.progress.ProgressReporter`, or any
    callable) sees each redacted line after it was logged."""

    def __init__(
        self,
        log: Any,
        secrets: Sequence[str] = (),
        keep: int = LOG_TAIL_LINES,
        progress: Callable[[str], Any] | None = None,
    ) -> None:
        # A stdlib or structlog logger (Airflow's ``self.log``), or any callable.
        self._emit: Callable[[str], Any] = log.info if hasattr(log, "info") else log
        self._secrets = [s for s in secrets if s]
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self._progress = progress

    def __call__(self, line: str) -> None:
        line = redact(line.rstrip("\r\n"), self._secrets)
        self.lines.append(line)
        self._emit(line)
        if self._progress is not None:
            self._progress(line)

    def tail(self) -> list[str]:
        return list(self.lines)


_FIRST_FAILED = re.compile(r"Process name: (\d+)\s*\nExit code: (\d+)")


def rank_host(rank: int, hosts: Sequence[Any]) -> str | None:
    """The ``-H`` host that runs ``rank``: horovodrun fills hosts in order, by slots."""
    first = 0
    for host in hosts:
        if first <= rank < first + host.slots:
            return str(host.name)
        first += host.slots
    return None


def failed_exit_code(error: Any) -> int | None:
    """The program's own exit code behind a failed job: the first failed rank's, as horovodrun
    reports it in the output, else the job's (a single process, or horovodrun's own)."""
    found = _FIRST_FAILED.search("\n".join(getattr(error, "log_tail", ()) or ()))
    if found:
        return int(found.group(2))
    code = getattr(error, "exit_code", None)
    return code if isinstance(code, int) else None


def describe_failure(
    name: str, exit_code: int | None, lines: Sequence[str], hosts: Sequence[Any] = ()
) -> str:
    """``job X exited with code 1: rank 1 (host h2) failed first (exit code 7): <its lines>``.

    horovodrun ends a failed run with "The first process to do so was: Process name: R /
    Exit code: C"; the rank's own last lines say why, so they lead the message. With
    ``hosts`` (the ``-H`` list), the failing rank's host is named too. ``exit_code`` None:
    the job's own code is not known (``job X failed``).
    """
    message = f"job {name!r} " + (
        "failed" if exit_code is None else f"exited with code {exit_code}"
    )
    found = _FIRST_FAILED.search("\n".join(lines))
    if found:
        rank = found.group(1)
        host = rank_host(int(rank), hosts) if rank.isdigit() else None
        where = f" (host {host})" if host else ""
        message += f": rank {rank}{where} failed first (exit code {found.group(2)})"
        own = [ln for ln in lines if ln.startswith(f"[{rank}]<") or ln.startswith(f"[{rank},")]
        if own:
            message += "; its last lines:\n  " + "\n  ".join(own[-10:])
    return message


def end_of_job(
    name: str,
    exit_code: int | None,
    tail: Sequence[str],
    *,
    what: str | None = None,
    hosts: Sequence[Any] = (),
    timed_out: float | None = None,
    stopped: bool = False,
    failure: str = "",
) -> JobResult:
    """How every launcher ends a job that has ended: its :class:`JobResult` for exit code 0,
    else the typed error, carrying ``tail`` (the output's last lines):

    - ``timed_out`` (the deadline in seconds it ran past; it was stopped):
      :class:`HorovodTimeoutError`;
    - ``stopped`` (by ``kill()``, i.e. ``on_kill``): :class:`HorovodTrainingError`;
    - any other ``exit_code`` (None: the job failed without a code of its own, as an MPIJob
      does; ``failure`` then says how): :class:`HorovodTrainingError` whose message leads
      with the first failed rank and its lines (:func:`describe_failure`, ``hosts`` naming
      its host), or :class:`HorovodRefusedError` (not retried) when that rank's code says the
      program refused its inputs or settings (the contract's ``NO_RETRY_EXIT_CODES``).

    ``what`` names the job in the messages (default ``job 'name'``; ``container 'name'``...).
    """
    what = what or f"job {name!r}"
    if timed_out is not None:
        raise HorovodTimeoutError(
            f"{what} ran longer than timeout={timed_out:g}s and was stopped",
            timeout=timed_out,
            log_tail=tail,
        )
    if stopped:
        with_code = "" if exit_code is None else f", exit code {exit_code}"
        raise HorovodTrainingError(
            f"{what} was stopped (on_kill{with_code})", exit_code=exit_code, log_tail=tail
        )
    if exit_code == 0:
        return JobResult(exit_code=0, log_tail=list(tail))
    message = describe_failure(name, exit_code, tail, hosts)
    error = HorovodTrainingError(
        f"{failure}; {message}" if failure else message, exit_code=exit_code, log_tail=tail
    )
    code = failed_exit_code(error)
    if code in NO_RETRY_EXIT_CODES:
        refused = HorovodRefusedError(
            f"{error.args[0]}\n(exit code {code}: the program refused its inputs or settings; "
            f"a retry would meet the same refusal, so none is made)",
            exit_code=exit_code,
        )  # the message already holds the output's tail: not added twice
        refused.log_tail = list(tail)
        raise refused from error
    raise error


#: The key under which a try records the job it started in Airflow's task state store.
JOB_STATE_KEY = "horovod_job"


class JobJournal:
    """The job a try started, recorded for the next try of the same task instance.

    Airflow 3.3's task state store (``context["task_state_store"]``) outlives a worker killed
    mid-job, so a new try knows exactly which job its predecessor started (the container id,
    the MPIJob's uid, the local job's marker) and re-attaches to that one only. Without a store
    (``None``: a launcher used on its own) nothing is recorded and nothing was.
    """

    def __init__(self, store: Any = None, try_number: int = 1, log: Any = None) -> None:
        self.store = store
        self.try_number = try_number
        self.log = log
        recorded = None
        if store is not None:
            try:
                recorded = store.get(JOB_STATE_KEY)
            except Exception as e:  # a store that cannot be read: the labels decide alone
                self._warn("could not read the task state store (%s): %s", JOB_STATE_KEY, e)
        self.recorded = dict(recorded) if isinstance(recorded, dict) else None

    def recorded_by(self, launcher: str) -> dict[str, Any] | None:
        """What an earlier try of ``launcher`` recorded (None: nothing, or another launcher's)."""
        if self.recorded is None or self.recorded.get("launcher") != launcher:
            return None
        return self.recorded

    def record(self, launcher: str, **identity: Any) -> None:
        """Record the job this try started. A store that refuses is a warning: the job runs,
        and the next try falls back to the job's name and labels."""
        if self.store is None:
            return
        doc = {"launcher": launcher, **identity, "try_number": self.try_number}
        try:
            self.store.set(JOB_STATE_KEY, doc)
        except Exception as e:
            self._warn("could not record the job in the task state store: %s", e)
            return
        self.recorded = doc

    def _warn(self, message: str, *args: Any) -> None:
        if self.log is not None:
            self.log.warning(message, *args)

    def output(self, log: Any, secrets: Sequence[str] = ()) -> LogTail:
        """The :class:`LogTail` a launcher forwards its job's output through: to ``log``, and
        each progress event of the trainer to the log and the task state store."""
        from horovod_airflow.operators.progress import ProgressReporter

        return LogTail(log, secrets=secrets, progress=ProgressReporter(self.store, log))


def made_by_this_task(found_id: str, found_try: Any, recorded: Mapping[str, Any] | None) -> bool:
    """Whether a job found under this task instance's (deterministic) name is the one its tries
    started: the one recorded (same id or uid), or one a later try made and died before
    recording. Anything else with that name (re-created by a person or a controller, or a
    leftover of an earlier try than the recorded one) is not re-attached to."""
    if recorded is None:
        return True  # nothing recorded: the name and labels are all there is
    if recorded.get("id") == found_id:
        return True
    try:
        return int(found_try) > int(recorded.get("try_number", 0))
    except (TypeError, ValueError):
        return False


class Launcher(abc.ABC):
    """Runs a :class:`JobSpec`; one launcher instance runs one job.

    The spec says *what* to run (the program, ``num_proc`` ranks, GPUs, environment); the
    launcher builds *how* (the ``horovodrun`` command and its hosts, a container, a manifest)
    and declares what it can do, so that the operator never names a launcher:

    - ``options_class``: its options object (the operator's argument of the same name);
    - ``needs_image``: whether it runs the job from a container image;
    - ``defers``: whether this instance submits and waits in Airflow's triggerer
      (:meth:`submit`, :meth:`trigger`, :meth:`finish`) instead of in :meth:`run`.

    ``journal`` records the job a try starts in Airflow's task state store and says what an
    earlier try recorded (set by the operator; a launcher used on its own records nothing).
    """

    name: str = "base"
    options_class: type[Any] = object
    needs_image: bool = False
    journal: JobJournal = JobJournal()

    @property
    def defers(self) -> bool:
        return False

    def check_elastic(self, spec: JobSpec) -> None:
        """Raise :class:`HorovodConfigError` unless this launcher can run ``spec`` elastically
        (the local launcher over several hosts and the kubernetes one with an MPIJob can)."""
        raise HorovodConfigError(
            f"elastic=ElasticOptions(...): the {self.name} launcher does not run elastic jobs "
            f"({NO_ELASTIC_REASON}); use launcher='local' with hosts on several machines"
        )

    def submit(self, spec: JobSpec, log: Any) -> dict[str, str]:
        """Start the job and return a reference to it (stored in Airflow: never a secret)."""
        raise NotImplementedError(f"the {self.name} launcher does not defer")

    def trigger(self, ref: Mapping[str, str], timeout: float | None) -> Any:
        """The Airflow trigger that waits for the job ``ref`` (``timeout``: its deadline)."""
        raise NotImplementedError(f"the {self.name} launcher does not defer")

    def finish(
        self,
        ref: Mapping[str, str],
        event: Mapping[str, Any],
        log: Any,
        *,
        secrets: Sequence[str] = (),
    ) -> JobResult:
        """After the trigger fired: surface the job's output, clean up, raise on failure."""
        raise NotImplementedError(f"the {self.name} launcher does not defer")

    def preflight(self, spec: JobSpec, log: Any) -> None:  # noqa: B027
        """Refuse early (``HorovodPreflightError``) when the job cannot start; default: no-op."""

    @abc.abstractmethod
    def run(self, spec: JobSpec, log: Any) -> JobResult:
        """Run to completion; return on exit 0, raise a typed error otherwise."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop the running job (idempotent; no-op when nothing runs)."""
