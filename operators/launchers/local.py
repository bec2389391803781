"""Run the job as a ``horovodrun`` subprocess on the Airflow worker (or its ssh hosts).

``horovodrun`` starts in its own session (``start_new_session=True``) so that a kill reaches
it and everything below it, never the Airflow worker. Its ranks' middleman processes call
``setsid()`` themselves, so the kill also walks the process tree (psutil), not only the group.
Output is streamed line by line into the task log (horovodrun already prefixes rank lines,
e.g. ``[1]<stdout>:``), redacted, and the last lines are kept for the exception.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from horovod_airflow.core.startup_savings import (
    HOROVODRUN_WITHOUT_GLOO_PROBE,
    INTERPRETER_FINGERPRINT,
)
from horovod_airflow.operators.command import (
    HOROVODRUN,
    RANK_ENV_FILE_VAR,
    Host,
    forwardable_environ,
    horovodrun_argv,
    parse_hosts,
    rank_env_file_text,
)
from horovod_airflow.operators.exceptions import (
    HorovodLaunchError,
    HorovodPreflightError,
)
from horovod_airflow.operators.launchers.base import (
    JobResult,
    JobSpec,
    Launcher,
    end_of_job,
)
from horovod_airflow.operators.launchers.local_elastic import (
    ElasticWatch,
    check_local_elastic,
    discovery_script,
    elastic_args,
)
from horovod_airflow.operators.launchers.local_options import LocalOptions

#: Set in the environment of every job process (not a secret): the clean-up finds by it the
#: processes that left the job's process tree (reparented when horovodrun died abruptly).
JOB_MARKER_VAR = "HVA_LOCAL_JOB"
#: Seconds to wait for the rest of the output once horovodrun has exited.
OUTPUT_GRACE_S = 5.0

#: Folder of remembered doctor passes (``off`` or empty: always run the doctor).
PREFLIGHT_CACHE_VAR = "HVA_PREFLIGHT_CACHE"
DEFAULT_PREFLIGHT_CACHE = Path.home() / ".cache" / "horovod-airflow" / "preflight"
#: Variables that change what the doctor would find (devices, Horovod's own settings).
_PREFLIGHT_ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def _shebang_interpreter(script: str) -> str | None:
    """The interpreter named on a script's ``#!`` line (no arguments), or None."""
    try:
        with open(script, "rb") as f:
            first = f.readline(4096).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if not first.startswith("#!") or " " in first[2:].strip():
        return None
    return first[2:].strip()


def check_slots(
    num_proc: int,
    hosts: Sequence[Host],
    gpus_per_proc: int,
    *,
    cpu_count: int | None,
    gpu_count: int | None,
) -> None:
    """Refuse a job that cannot get ``num_proc`` slots; the error names the numbers."""
    total = sum(h.slots for h in hosts)
    if total < num_proc:
        listed = ",".join(str(h) for h in hosts)
        raise HorovodPreflightError(
            f"num_proc={num_proc} but hosts {listed!r} offer only {total} slots in total; "
            f"add hosts/slots or lower num_proc"
        )
    if not all(h.is_local for h in hosts):
        return  # remote capacity is the remote hosts' business (their doctor/horovodrun)
    if gpus_per_proc > 0:
        need = num_proc * gpus_per_proc
        have = gpu_count or 0
        if have < need:
            raise HorovodPreflightError(
                f"num_proc={num_proc} × gpus_per_proc={gpus_per_proc} needs {need} GPUs, "
                f"but this machine has {have}; lower num_proc/gpus_per_proc or use CPU "
                f"(gpus_per_proc=0)"
            )
    elif cpu_count is not None and num_proc > cpu_count:
        raise HorovodPreflightError(
            f"num_proc={num_proc} CPU ranks on localhost but os.cpu_count()={cpu_count}; "
            f"use num_proc ≤ {cpu_count}, or hosts with more slots"
        )


def visible_gpu_count() -> int:
    """GPUs ``nvidia-smi -L`` lists (0 when there is no driver)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _parent_death_signal() -> Any:
    """A ``preexec_fn`` asking Linux to SIGTERM horovodrun if the Airflow task process dies
    without calling on_kill (e.g. SIGKILL): horovodrun then stops its ranks itself.
    None where ``prctl(PR_SET_PDEATHSIG)`` does not exist."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def set_pdeathsig() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)

    return set_pdeathsig


class LocalLauncher(Launcher):
    """``horovodrun`` (or one process) as a child of the Airflow worker."""

    name = "local"
    options_class = LocalOptions

    def __init__(self, options: LocalOptions | None = None, *, image: str | None = None) -> None:
        if image:
            raise ValueError(f"image={image!r}: the local launcher runs no image")
        self.options = options or LocalOptions()
        self.hosts: list[Host] = []  # the job's -H list, from options.hosts and num_proc
        self.kill_grace_s = self.options.kill_grace_s
        # Where the credentials file is written; must be a path every host can read when
        # the hosts are remote (e.g. a shared filesystem). Default: a private temp dir.
        self.rank_env_dir = self.options.rank_env_dir
        self.cwd = self.options.working_dir
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._killed = False
        self._timed_out = False
        self._known: dict[int, psutil.Process] = {}
        self._marker = ""
        self._doctor_lines: list[str] = []
        self._doctor_python: str | None = None

    # --- the command --------------------------------------------------------------------
    def command(self, spec: JobSpec) -> list[str]:
        """What this launcher starts for ``spec``: ``horovodrun`` over the job's hosts
        (``options.hosts``, or ``localhost:<num_proc>``) with the program, or the one process
        of a job that is not distributed."""
        if not spec.distributed:
            return [str(a) for a in spec.argv]
        self.hosts = parse_hosts(self.options.hosts, spec.num_proc)
        options = self.options
        argv = horovodrun_argv(
            spec.argv,
            num_proc=spec.num_proc,
            hosts=self.hosts,
            ssh_port=options.ssh_port,
            ssh_identity_file=options.ssh_identity_file,
            network_interface=options.network_interface,
            controller=spec.controller,
        )
        at = argv.index("-np")
        argv[at:at] = options.horovodrun_args
        if spec.elastic is not None:  # the discovery script lists the hosts, not -H
            at = argv.index("-H")
            script = discovery_script(self.hosts, spec.elastic.hosts_file)
            argv[at : at + 2] = elastic_args(spec.elastic, str(script))
            # The driver's INFO lines name each failed slot and dropped host (ElasticWatch).
            argv[at:at] = ["--log-level", "INFO"]
        return argv

    def check_elastic(self, spec: JobSpec) -> None:
        assert spec.elastic is not None
        hosts = parse_hosts(self.options.hosts, spec.num_proc)
        check_local_elastic(spec.elastic, hosts, spec.num_proc, self.options)

    # --- preflight --------------------------------------------------------------------
    def preflight(self, spec: JobSpec, log: Any) -> None:
        if spec.distributed:
            check_slots(
                spec.num_proc,
                parse_hosts(self.options.hosts, spec.num_proc),
                spec.gpus_per_proc,
                cpu_count=os.cpu_count(),
                gpu_count=visible_gpu_count() if spec.gpus_per_proc else None,
            )
        if spec.preflight_argv:
            env = self._environ(spec)
            cached = self._preflight_cache_file(spec.preflight_argv, env)
            if cached is not None and cached.is_file():
                self._remember_doctor(spec, env, cached.read_text().splitlines())
                log.info(
                    "preflight: %s passed before with this interpreter, torch and horovod "
                    "(%s); not run again. Delete that file, or set %s=off, to re-run it.",
                    shlex.join(spec.preflight_argv),
                    cached,
                    PREFLIGHT_CACHE_VAR,
                )
                return
            log.info("preflight: %s", shlex.join(spec.preflight_argv))
            try:
                done = subprocess.run(
                    list(spec.preflight_argv),
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=300,
                    cwd=self.cwd,
                )
            except FileNotFoundError as e:
                raise HorovodPreflightError(
                    f"preflight command {spec.preflight_argv[0]!r} not found: {e}"
                ) from e
            except subprocess.TimeoutExpired as e:
                raise HorovodPreflightError("preflight command did not finish in 300 s") from e
            lines = (done.stdout + done.stderr).splitlines()
            for line in lines:
                log.info("preflight | %s", line)
            if done.returncode != 0:
                raise HorovodPreflightError(
                    f"preflight {' '.join(spec.preflight_argv)!r} exited {done.returncode}: "
                    f"the job cannot start here",
                    log_tail=lines[-100:],
                )
            self._remember_doctor(spec, env, lines)
            if cached is not None:
                with contextlib.suppress(OSError):  # a cache that cannot be written: run again
                    cached.parent.mkdir(parents=True, exist_ok=True)
                    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
                    tmp.write_text("\n".join(lines) + "\n")
                    os.replace(tmp, cached)

    def _remember_doctor(self, spec: JobSpec, env: dict[str, str], lines: list[str]) -> None:
        assert spec.preflight_argv
        self._doctor_lines = [line.strip() for line in lines]
        python = shutil.which(str(spec.preflight_argv[0]), path=env.get("PATH"))
        self._doctor_python = os.path.abspath(python) if python else None

    def launch_argv(
        self, spec: JobSpec, env: dict[str, str], command: list[str] | None = None
    ) -> list[str]:
        """The command to start: :meth:`command` (``command`` when already built), or
        horovodrun's entry point run in horovodrun's own interpreter without its Gloo probe
        (``HOROVODRUN_WITHOUT_GLOO_PROBE``) when this job's doctor reported ``gloo_built: True``
        for that same interpreter and that same horovodrun."""
        argv = list(command) if command is not None else self.command(spec)
        python = self._doctor_python
        if not (
            spec.distributed
            and spec.controller == "gloo"
            and argv[:2] == [HOROVODRUN, "--gloo"]
            and python is not None
            and "gloo_built: True" in self._doctor_lines
        ):
            return argv
        found = shutil.which(HOROVODRUN, path=env.get("PATH"))
        horovodrun = os.path.abspath(found) if found else None
        if horovodrun is None or f"horovodrun: {horovodrun}" not in self._doctor_lines:
            return argv  # not the horovodrun the doctor checked
        if _shebang_interpreter(horovodrun) != python:
            return argv  # it runs in another interpreter than the doctor's
        return [python, "-c", HOROVODRUN_WITHOUT_GLOO_PROBE, *argv[1:]]

    def _preflight_cache_file(self, argv: Sequence[str], env: dict[str, str]) -> Path | None:
        """Where a pass of this doctor command in this environment is remembered, or None.

        Keyed by the command, the interpreter's fingerprint (``INTERPRETER_FINGERPRINT``), the
        device variables, the hostname and the working directory: any change runs the doctor
        again. None (always run it) when the cache is off or the fingerprint cannot be taken.
        """
        folder = os.environ.get(PREFLIGHT_CACHE_VAR, str(DEFAULT_PREFLIGHT_CACHE))
        if folder.strip().lower() in ("", "off", "0", "false", "no"):
            return None
        try:
            done = subprocess.run(
                [str(argv[0]), "-c", INTERPRETER_FINGERPRINT],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
                cwd=self.cwd,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        if done.returncode != 0 or not done.stdout.strip().startswith("{"):
            return None
        key = {
            "argv": list(map(str, argv)),
            "fingerprint": done.stdout.strip(),
            "env": {k: env.get(k) for k in _PREFLIGHT_ENV_KEYS},
            "horovod_env": sorted((k, v) for k, v in env.items() if k.startswith("HOROVOD_")),
            "host": os.uname().nodename,
            "cwd": self.cwd or os.getcwd(),
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return Path(folder) / f"{digest}.pass"

    # --- run --------------------------------------------------------------------------
    def _environ(self, spec: JobSpec) -> dict[str, str]:
        env = forwardable_environ(os.environ, self.options.forward_env)
        env.update(spec.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def run(self, spec: JobSpec, log: Any) -> JobResult:
        command = self.command(spec)
        env = self._environ(spec)
        if shutil.which(command[0], path=env.get("PATH")) is None and not os.path.exists(
            command[0]
        ):
            raise HorovodLaunchError(
                f"{command[0]!r} is not on PATH of the Airflow worker; install horovod "
                f"(horovodrun) in the worker's environment or use launcher='docker'/'kubernetes'"
            )
        if spec.distributed and spec.secret_env and not all(h.is_local for h in self.hosts):
            log.warning(
                "hosts %s are remote: the ranks there read credentials from %s only if "
                "rank_env_dir is a folder all hosts share; otherwise they use their own "
                "(instance role, ~/.aws). Secrets are never put on the ssh command line.",
                ",".join(map(str, self.hosts)),
                self.rank_env_dir or "a private temp dir on this worker",
            )
        secret_dir: str | None = None
        if spec.distributed:
            if spec.secret_env:
                # Private file the ranks source (see horovod_airflow.operators.command): 0700 dir,
                # 0600 file.
                secret_dir = tempfile.mkdtemp(prefix="hva-rank-env-", dir=self.rank_env_dir)
                path = Path(secret_dir) / "rank.env"
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(rank_env_file_text(spec.secret_env))
                env[RANK_ENV_FILE_VAR] = str(path)
        else:
            env.update(spec.secret_env)  # one process: its environment is private to it

        self._stop_earlier_try(log)
        self._marker = f"{os.getpid()}-{secrets.token_hex(8)}"
        env[JOB_MARKER_VAR] = self._marker
        argv = self.launch_argv(spec, env, command)
        if argv != command:
            log.info(
                "starting horovodrun as its own entry point in %s, without its Gloo probe "
                "(the preflight doctor verified gloo_built in that interpreter)",
                argv[0],
            )
        out = self.journal.output(log, secrets=list(spec.secret_env.values()))
        watch = ElasticWatch() if spec.elastic is not None else None
        timer: threading.Timer | None = None
        try:
            with self._lock:
                if self._killed:
                    raise HorovodLaunchError("the task was killed before the job started")
                try:
                    self._proc = subprocess.Popen(
                        argv,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=env,
                        cwd=self.cwd,
                        text=True,
                        bufsize=1,
                        errors="replace",
                        start_new_session=True,  # its own process group: kill reaches all
                        preexec_fn=_parent_death_signal(),  # only a prctl call: safe with threads
                    )
                except OSError as e:
                    raise HorovodLaunchError(f"cannot start {command[0]!r}: {e}") from e
            proc = self._proc
            log.info("started pid %s (process group %s)", proc.pid, proc.pid)
            self.journal.record(self.name, host=socket.gethostname(), id=self._marker, pid=proc.pid)
            if spec.timeout:
                timer = threading.Timer(spec.timeout, self._on_timeout)
                timer.daemon = True
                timer.start()
            assert proc.stdout is not None
            stream = proc.stdout

            def pump() -> None:
                for line in stream:
                    out(line)
                    if watch is not None:
                        watch(line)

            reader = threading.Thread(target=pump, name=f"{spec.name}-output", daemon=True)
            reader.start()
            exit_code = proc.wait()
            # Processes that outlived horovodrun may hold the pipe open: after a short grace
            # for the last lines, kill them so that the output reaches its end.
            reader.join(OUTPUT_GRACE_S)
            if reader.is_alive():
                self._reap_leftovers()
                reader.join(OUTPUT_GRACE_S)
        finally:
            if timer is not None:
                timer.cancel()
            if secret_dir is not None:
                shutil.rmtree(secret_dir, ignore_errors=True)
        # A job that stopped must leave nothing behind, even if horovodrun died abruptly.
        self._reap_leftovers()
        return end_of_job(
            spec.name,
            exit_code,
            out.tail(),
            hosts=self.hosts,
            timed_out=float(spec.timeout or 0) if self._timed_out else None,
            stopped=self._killed,
            failure=watch.describe(spec.elastic) if watch and spec.elastic else "",
        )

    # --- stop -------------------------------------------------------------------------
    def _on_timeout(self) -> None:
        self._timed_out = True
        self._terminate()

    def kill(self) -> None:
        with self._lock:
            self._killed = True
        self._terminate()

    def _remember_descendants(self) -> None:
        # psutil.Process objects (not bare pids) so a recycled pid is never signalled.
        proc = self._proc
        if proc is None:
            return
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                self._known.setdefault(child.pid, child)
        except psutil.Error:
            pass

    def _alive(self) -> list[psutil.Process]:
        alive = []
        for p in self._known.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                pass
        return alive

    def _terminate(self) -> None:
        """SIGTERM the group (horovodrun stops its ranks), then SIGKILL what is left."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            self._reap_leftovers()
            return
        self._remember_descendants()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace_s
        while time.monotonic() < deadline:
            self._remember_descendants()
            if proc.poll() is not None and not self._alive():
                return
            time.sleep(0.1)
        self._remember_descendants()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        self._reap_leftovers()

    def _marked(self, marker: str | None = None) -> list[psutil.Process]:
        """Live processes on this host whose environment carries ``marker`` (default: this
        job's)."""
        marker = self._marker if marker is None else marker
        if not marker:
            return []
        found = []
        for p in psutil.process_iter():
            if p.pid == os.getpid():
                continue
            with contextlib.suppress(psutil.Error):
                if p.environ().get(JOB_MARKER_VAR) == marker:
                    found.append(p)
        return found

    def _stop_earlier_try(self, log: Any) -> None:
        """Stop what is left of the job an earlier try of this task instance started (recorded
        in the task state store), so that two jobs never write one output.

        A worker killed outright (SIGKILL, OOM) takes horovodrun with it (its parent-death
        signal), but a rank that ignores SIGTERM or is reparented may live on. Unlike a
        container or an MPIJob, a job whose output pipe has gone cannot be re-attached to: it
        is stopped, and this try resumes from the checkpoint."""
        recorded = self.journal.recorded_by(self.name)
        if recorded is None:
            return
        host = socket.gethostname()
        if recorded.get("host") != host:
            log.warning(
                "try %s of this task instance ran its job on worker %s; this try runs on %s, "
                "where nothing of it can be checked (horovodrun stops with its worker)",
                recorded.get("try_number"),
                recorded.get("host"),
                host,
            )
            return
        left = self._marked(str(recorded.get("id") or ""))
        if not left:
            return
        log.warning(
            "try %s of this task instance left %d process(es) of its job running (pids %s): "
            "stopping them before this try starts",
            recorded.get("try_number"),
            len(left),
            ",".join(str(p.pid) for p in left),
        )
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(left, timeout=self.kill_grace_s)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)

    def _reap_leftovers(self) -> None:
        """SIGKILL any process of this job that outlived horovodrun: its descendants (rank
        middlemen ``setsid``) and, found by the job's environment marker, processes that were
        reparented away from the tree when horovodrun itself died."""
        self._remember_descendants()
        for p in self._marked():
            self._known.setdefault(p.pid, p)
        for p in self._alive():
            with contextlib.suppress(psutil.Error):
                p.kill()
