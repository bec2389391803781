"""Run the job in one container: ``horovodrun -np N -H localhost:N ...`` inside the image.

The engine client comes from the docker provider's ``DockerHook`` (``docker_url`` or
``$DOCKER_HOST``, default the local socket; ``docker_conn_id`` for registry login), so a
Podman socket works the same. The container is created, attached (``stream=True,
logs=True``: no output lost for fast-exiting containers), started, waited for and removed
in ``finally`` — ``containers.run`` + ``logs(follow=True)`` sometimes hangs instead.

Credentials are never container environment or command line (``docker inspect`` shows
both, to anyone who may use the engine): the container is created without them, the
launcher copies them into it as a file (:data:`SECRET_FILE`, through the engine's archive
API) before it starts, and ``HVA_RANK_ENV_FILE`` names that file, which each rank sources
right before it ``exec``s the program (``RANK_ENV_WRAPPER``; horovodrun copies only the path
onto the ranks' command lines). The file lives in the container's own filesystem, so it goes
with the container, which the launcher always removes when it holds credentials.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from horovod_airflow.operators.command import (
    RANK_ENV_FILE_VAR,
    RANK_ENV_WRAPPER,
    rank_env_file_text,
)
from horovod_airflow.operators.exceptions import (
    HorovodConfigError,
    HorovodImageError,
    HorovodLaunchError,
    JobNotOursError,
)
from horovod_airflow.operators.launchers.base import (
    JOB_LABEL,
    JobResult,
    JobSpec,
    Launcher,
    LogTail,
    end_of_job,
    made_by_this_task,
)

DEFAULT_DOCKER_URL = "unix://var/run/docker.sock"
#: Where the credentials file is copied into the container before it starts (a folder of its
#: own at the root, which every image has; not /run or /tmp, which a runtime may mount over).
SECRET_DIR = "/hva-secrets"
SECRET_FILE = f"{SECRET_DIR}/rank.env"
CLEANUP_POLICIES = ("delete", "keep", "delete_on_success")
COPY_TRIES = 3  # copies of the credentials file into a created container, on engine errors
#: ``create_container`` arguments the launcher owns: the job (image, command, name,
#: environment with the credentials, labels that find the container again) and the ones an
#: option below owns. Refused in ``DockerOptions.container_overrides``.
OWNED_CONTAINER_KEYS = {
    "image": "the operator's image",
    "command": "the job's command",
    "name": "the job name (a retry finds its container by it)",
    "environment": "the operator's env / secret_env / aws_conn_id (credentials: as a file)",
    "labels": "the job's labels (a retry finds its container by them)",
    "detach": "the launcher (it attaches itself)",
    "host_config": "host_config_overrides",
    "working_dir": "DockerOptions.working_dir",
}
#: Host-config arguments an option owns: refused in ``DockerOptions.host_config_overrides``.
OWNED_HOST_CONFIG_KEYS = {
    "binds": "DockerOptions.mounts",
    "mounts": "DockerOptions.mounts",
    "device_requests": "the operator's gpus_per_proc",
    "ipc_mode": "DockerOptions.ipc_mode",
    "shm_size": "DockerOptions.shm_size",
    "network_mode": "DockerOptions.network_mode",
}


def DockerHook(**kwargs: Any) -> Any:
    """The provider's ``DockerHook``, imported when first used (tests patch this name)."""
    from airflow.providers.docker.hooks.docker import DockerHook as _DockerHook

    return _DockerHook(**kwargs)


def split_image(image: str) -> tuple[str, str | None]:
    """``registry:5000/team/trainer:1`` → (``registry:5000/team/trainer``, ``1``); a digest
    (``name@sha256:…``) stays whole, with no tag."""
    if "@" in image:
        return image, None
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:  # no tag, or the colon was a registry port
        return image, "latest"
    return name, tag


def split_mounts(mounts: Sequence[Any]) -> tuple[list[str], list[Any]]:
    """``"host:container[:ro|rw]"`` strings → binds; anything else (docker ``Mount``) → mounts."""
    binds: list[str] = []
    objects: list[Any] = []
    for m in mounts:
        if isinstance(m, str):
            parts = m.split(":")
            if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
                raise ValueError(f"mount {m!r} must be 'host_path:container_path[:ro|rw]'")
            if len(parts) == 3 and parts[2] not in ("ro", "rw"):
                raise ValueError(f"mount {m!r}: mode must be 'ro' or 'rw', got {parts[2]!r}")
            binds.append(m)
        else:
            objects.append(m)
    return binds, objects


def _refuse_owned(overrides: Any, field_name: str, owned: Mapping[str, str]) -> None:
    if not isinstance(overrides, Mapping) or not all(isinstance(k, str) for k in overrides):
        raise ValueError(f"{field_name} must be a dict of argument → value, got {overrides!r}")
    for key in overrides:
        if key in owned:
            raise ValueError(f"{field_name}[{key!r}]: set by the launcher from {owned[key]}")


@dataclass(frozen=True)
class DockerOptions:
    """Settings of ``launcher="docker"`` (one container; all ranks on localhost in it).

    :param docker_conn_id: Airflow Docker connection for registry login (private images).
    :param docker_url: the engine; None: ``$DOCKER_HOST`` or the local socket (a Podman
        socket works the same).
    :param mounts: bind mounts: ``"host:container[:ro|rw]"`` strings or ``docker.types.Mount``.
    :param ipc_mode: IPC namespace, default ``"host"`` (Gloo/NCCL shared memory).
    :param shm_size: ``/dev/shm`` size when ``ipc_mode`` is not ``"host"``.
    :param network_mode: the container's network (e.g. the compose stack's); None: default.
    :param working_dir: the container's working directory; None: the image's.
    :param cleanup: ``"delete"``, ``"keep"`` or ``"delete_on_success"``; a container that
        holds credentials (:data:`SECRET_FILE`) is removed whatever this says.
    :param force_pull: pull ``image`` before every job; by default only when missing.
    :param container_overrides: extra ``APIClient.create_container`` arguments merged over
        what the launcher builds (e.g. ``{"user": "1000", "hostname": "trainer"}``); the
        keys the launcher owns (``OWNED_CONTAINER_KEYS``) are refused.
    :param host_config_overrides: extra ``create_host_config`` arguments merged over the
        launcher's (e.g. ``{"cpuset_cpus": "0-3", "ulimits": [...]}``); the keys an option
        owns (``OWNED_HOST_CONFIG_KEYS``) are refused.
    """

    docker_conn_id: str | None = None
    docker_url: str | None = None
    mounts: Sequence[Any] = ()
    ipc_mode: str = "host"
    shm_size: str | None = "1g"
    network_mode: str | None = None
    working_dir: str | None = None
    cleanup: str = "delete_on_success"
    force_pull: bool = False
    container_overrides: Mapping[str, Any] = field(default_factory=dict)
    host_config_overrides: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.mounts, str):
            raise ValueError(f"mounts must be a list, got the string {self.mounts!r}")
        split_mounts(self.mounts)  # raises ValueError naming a bad mount
        if self.cleanup not in CLEANUP_POLICIES:
            raise ValueError(
                f"cleanup must be one of {', '.join(CLEANUP_POLICIES)}; got {self.cleanup!r}"
            )
        for name in ("docker_conn_id", "docker_url", "network_mode", "working_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        if not isinstance(self.ipc_mode, str) or not self.ipc_mode:
            raise ValueError(f"ipc_mode must be a string like 'host', got {self.ipc_mode!r}")
        if not isinstance(self.force_pull, bool):
            raise ValueError(f"force_pull must be True or False, got {self.force_pull!r}")
        _refuse_owned(self.container_overrides, "container_overrides", OWNED_CONTAINER_KEYS)
        _refuse_owned(self.host_config_overrides, "host_config_overrides", OWNED_HOST_CONFIG_KEYS)


class DockerLauncher(Launcher):
    """One container per job; all ranks on localhost inside it."""

    name = "docker"
    options_class = DockerOptions
    needs_image = True

    def check_elastic(self, spec: JobSpec) -> None:
        raise HorovodConfigError(
            "elastic=ElasticOptions(...): refused with launcher='docker': every rank runs in "
            "the job's one container, one host, and Horovod drops a whole host when one of "
            "its ranks fails, so a lost rank would end the job all the same; use "
            "launcher='local' with hosts on several machines"
        )

    def __init__(
        self, *, image: str, options: DockerOptions | None = None, client: Any | None = None
    ) -> None:
        self.image = image
        self.options = options = options or DockerOptions()
        self.docker_conn_id = options.docker_conn_id
        self.docker_url = options.docker_url or os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_URL
        self.binds, self.mount_objects = split_mounts(options.mounts)
        self.cleanup = options.cleanup
        self.force_pull = options.force_pull
        self._client = client  # injectable (e.g. a docker.APIClient for a podman socket)
        self._container_id: str | None = None
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def client(self) -> Any:
        if self._client is None:
            hook = DockerHook(docker_conn_id=self.docker_conn_id, base_url=self.docker_url)
            self._client = hook.get_conn()
        return self._client

    def container_command(self, spec: JobSpec) -> list[str]:
        """The container's command: horovodrun for ``localhost:N`` (or the one process). Each
        rank (or the one process) sources the credentials file first; no secret is in it."""
        from horovod_airflow.operators.command import Host, horovodrun_argv

        if not spec.distributed:
            return [*RANK_ENV_WRAPPER, *spec.argv] if spec.secret_env else list(spec.argv)
        return horovodrun_argv(
            spec.argv,
            num_proc=spec.num_proc,
            hosts=[Host("localhost", spec.num_proc)],
            controller=spec.controller,
        )

    @staticmethod
    def secret_archive(secret_env: Mapping[str, str]) -> bytes:
        """A tar of :data:`SECRET_FILE` (``NAME='value'`` lines), for ``put_archive`` at ``/``.
        World-readable inside the container, because the launcher cannot know which uid the
        image runs as; nothing outside the container's processes sees its filesystem but the
        engine's administrators, who see every container's environment too.

        The tar ends at its two end-of-archive blocks, without the padding ``tarfile`` adds
        to a whole 10 KiB record: podman's copier stops reading at those blocks, so padding
        still being sent fails the copy now and then with a 500, "passing bulk input to
        subprocess: write |1: broken pipe" (containers/buildah#6573; seen in our CI)."""
        import io
        import tarfile
        import time

        data = rank_env_file_text(secret_env).encode()
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            folder = tarfile.TarInfo(SECRET_DIR.lstrip("/"))
            folder.type, folder.mode, folder.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
            tar.addfile(folder)
            info = tarfile.TarInfo(SECRET_FILE.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), 0o444, int(time.time())
            tar.addfile(info, io.BytesIO(data))
        # close() has written the two zero blocks (offset counts them), then the padding.
        return buf.getvalue()[: tar.offset]

    def create_kwargs(self, spec: JobSpec) -> dict[str, Any]:
        """``APIClient.create_container`` arguments (host config included); tests assert them."""
        from docker.types import DeviceRequest

        opts = self.options
        gpus = spec.num_proc * spec.gpus_per_proc if spec.distributed else spec.gpus_per_proc
        host_config_kwargs: dict[str, Any] = {
            "binds": self.binds or None,
            "mounts": self.mount_objects or None,
            "device_requests": (
                [DeviceRequest(count=gpus, capabilities=[["gpu"]])] if gpus > 0 else None
            ),
            # Gloo/NCCL use shared memory between the ranks. With host IPC that is the host's
            # /dev/shm, and shm_size does not apply (Docker ignores it, podman refuses it).
            "ipc_mode": opts.ipc_mode,
            "shm_size": None if opts.ipc_mode == "host" else opts.shm_size,
            "init": True,  # horovodrun is not PID 1: SIGTERM on stop reaches it at once
            "network_mode": opts.network_mode,
            **opts.host_config_overrides,
        }
        try:
            host_config = self.client.create_host_config(**host_config_kwargs)
        except TypeError as e:  # docker-py names the unknown argument
            raise ValueError(f"DockerOptions.host_config_overrides: {e}") from e
        return {
            "image": self.image,
            "command": self.container_command(spec),
            "environment": {
                **spec.env,
                "PYTHONUNBUFFERED": "1",
                **({RANK_ENV_FILE_VAR: SECRET_FILE} if spec.secret_env else {}),
            },
            "host_config": host_config,
            "name": spec.name,
            "working_dir": opts.working_dir,
            "labels": {**spec.labels, JOB_LABEL: spec.name},
            "detach": True,
            **opts.container_overrides,
        }

    def run(self, spec: JobSpec, log: Any) -> JobResult:
        from docker.errors import DockerException
        from requests.exceptions import RequestException

        out = self.journal.output(log, secrets=list(spec.secret_env.values()))
        client = self.client
        exit_code: int | None = None
        timed_out: float | None = None
        try:
            self.ensure_image(log)  # outside the lock: on_kill must not wait for a pull
            with self._lock:
                if self._stopped:
                    raise HorovodLaunchError("the task was killed before the container started")
                cid, reattached = self._create_or_reattach(spec, log)
                self._container_id = cid
            # logs=True: a re-attached container's earlier output is replayed too.
            stream = client.attach(cid, stdout=True, stderr=True, stream=True, logs=True)
            if not reattached:
                client.start(cid)
            reader = threading.Thread(target=self._pump, args=(stream, out), daemon=True)
            reader.start()
            try:
                status = client.wait(cid, timeout=spec.timeout)
            except RequestException:  # the wait's read timed out
                self._stop(cid)
                reader.join(10)
                timed_out = float(spec.timeout or 0)
            else:
                reader.join(30)
                exit_code = int(status.get("StatusCode", -1))
                if status.get("Error"):
                    out(f"engine error: {status['Error']}")
        except DockerException as e:
            raise HorovodLaunchError(
                f"docker engine error for {spec.name!r}: {e}", log_tail=out.tail()
            ) from e
        finally:
            self._remove(
                success=exit_code == 0 and not self._stopped,
                holds_secrets=bool(spec.secret_env),
                log=log,
            )
        return end_of_job(
            spec.name,
            exit_code,
            out.tail(),
            what=f"container {spec.name!r}",
            timed_out=timed_out,
            stopped=self._stopped,
        )

    def _create_or_reattach(self, spec: JobSpec, log: Any) -> tuple[str, bool]:
        """(container id, re-attached?). The name is the same for every try of a task
        instance: a container an earlier try left running is waited for, not duplicated; one
        that has exited (kept by ``cleanup``) is removed first; one that appears meanwhile
        (409 on create) is re-attached to."""
        from docker.errors import APIError

        client = self.client
        for attempt in (1, 2):
            state = self._state(spec.name)
            if state is not None:
                made_by = f"try {state['labels'].get('try_number', '?')}"
                recorded = self.journal.recorded_by(self.name)
                if state["running"] and not made_by_this_task(
                    state["id"], state["labels"].get("try_number"), recorded
                ):
                    assert recorded is not None
                    raise JobNotOursError(
                        f"container {spec.name} ({state['id'][:12]}, made by {made_by}) is "
                        f"running, but try {recorded.get('try_number')} of this task instance "
                        f"started {str(recorded.get('id'))[:12]} (task state store): it is "
                        f"not re-attached to, nor removed. Remove it (docker rm -f "
                        f"{spec.name}), then clear the task"
                    )
                if state["running"]:
                    log.info(
                        "container %s (%s) of this task instance (made by %s) is still "
                        "running: re-attaching to it instead of starting a second one",
                        spec.name,
                        state["id"][:12],
                        made_by,
                    )
                    return state["id"], True
                log.info(
                    "removing container %s (made by %s, %s) before starting this try",
                    spec.name,
                    made_by,
                    state["status"],
                )
                client.remove_container(state["id"], force=True)
            try:
                cid = str(client.create_container(**self.create_kwargs(spec))["Id"])
            except APIError as e:
                if e.status_code == 409 and attempt == 1:  # made since the look-up
                    continue
                raise
            log.info("created container %s (%s) from %s", spec.name, cid[:12], self.image)
            # Before it starts: a worker that dies from here on leaves a recorded container.
            self.journal.record(self.name, name=spec.name, id=cid)
            # The credentials, as a file, before the first process runs.
            if spec.secret_env:
                self._copy_credentials(cid, spec, log)
            return cid, False
        raise AssertionError("unreachable")  # pragma: no cover

    def _copy_credentials(self, cid: str, spec: JobSpec, log: Any) -> None:
        """Copy :data:`SECRET_FILE` into the created (not yet started) container.

        The copy writes the same file each time, so an engine's server error (5xx) is tried
        again, up to :data:`COPY_TRIES` times; a refusal, or the last error, removes the
        container and raises :class:`HorovodLaunchError` (a later try of the task starts
        afresh). The engine's answer is about the archive, never its content."""
        import time

        from docker.errors import APIError

        archive = self.secret_archive(spec.secret_env)
        why = "the engine refused it"
        for attempt in range(1, COPY_TRIES + 1):
            try:
                if self.client.put_archive(cid, "/", archive):
                    return
                break
            except APIError as e:
                why = f"{e}"
                if not e.is_server_error() or attempt == COPY_TRIES:
                    break
                log.warning(
                    "copying the credentials file into %s failed (%s): copying again "
                    "(try %d of %d)",
                    spec.name,
                    e,
                    attempt + 1,
                    COPY_TRIES,
                )
                time.sleep(attempt)
        self.client.remove_container(cid, force=True)
        raise HorovodLaunchError(
            f"cannot copy the credentials file into {spec.name} ({why}); the container was "
            f"removed before it started"
        )

    def _state(self, name: str) -> dict[str, Any] | None:
        """Id, running, status and labels of the container ``name``; None if there is none."""
        from docker.errors import NotFound

        try:
            info = self.client.inspect_container(name)
        except NotFound:
            return None
        state = info.get("State") or {}
        return {
            "id": str(info["Id"]),
            "running": bool(state.get("Running")),
            "status": f"{state.get('Status', '?')}, exit code {state.get('ExitCode', '?')}",
            "labels": (info.get("Config") or {}).get("Labels") or {},
        }

    def ensure_image(self, log: Any) -> None:
        """Pull ``image`` when the engine lacks it (or always, with ``force_pull``).

        The client of ``docker_conn_id`` has logged in to its registry (``DockerHook``), so a
        private image pulls with those credentials. A failed pull raises
        :class:`HorovodLaunchError` naming the image and the engine's answer.
        """
        from docker.errors import DockerException, ImageNotFound, NotFound

        client = self.client
        if not self.force_pull:
            try:
                client.inspect_image(self.image)
                return
            except (ImageNotFound, NotFound):
                log.info("image %s is not on the engine: pulling it", self.image)
        repository, tag = split_image(self.image)
        last = ""
        try:
            for event in client.pull(repository, tag=tag, stream=True, decode=True):
                if not isinstance(event, dict):
                    continue
                if event.get("error"):
                    raise HorovodImageError(f"cannot pull image {self.image!r}: {event['error']}")
                status = str(event.get("status", ""))
                if status and status != last and "progress" not in event:
                    log.info("pull %s: %s", self.image, status)
                    last = status
            client.inspect_image(self.image)  # the pull must have produced the image
        except (ImageNotFound, NotFound) as e:  # no such image, or the login may not read it
            raise HorovodImageError(f"cannot pull image {self.image!r}: {e}") from e
        except DockerException as e:  # the engine or the registry failed: a retry may cure it
            raise HorovodLaunchError(f"cannot pull image {self.image!r}: {e}") from e
        log.info("pulled %s", self.image)

    @staticmethod
    def _pump(stream: Any, out: LogTail) -> None:
        """Split the attach stream (bytes chunks) into lines for the task log."""
        pending = ""
        for chunk in stream:
            text = chunk.decode("utf-8", errors="replace") if isinstance(chunk, bytes) else chunk
            pending += text
            *lines, pending = pending.split("\n")
            for line in lines:
                out(line)
        if pending:
            out(pending)

    def _stop(self, cid: str) -> None:
        from docker.errors import NotFound

        with contextlib.suppress(NotFound):  # already gone: nothing to stop
            self.client.stop(cid, timeout=10)

    def _remove(self, success: bool, holds_secrets: bool = False, log: Any = None) -> None:
        """Remove the container as ``cleanup`` says, except that one that holds credentials
        (:data:`SECRET_FILE`) never outlives the job: its output is already in the task log, and its
        final state is logged before it goes."""
        cid = self._container_id
        if cid is None:
            return
        keep = self.cleanup == "keep" or (self.cleanup == "delete_on_success" and not success)
        if keep and not holds_secrets:
            return  # kept for inspection: ``docker logs`` / ``docker inspect``
        from docker.errors import DockerException, NotFound
        from requests.exceptions import RequestException

        if keep and log is not None:
            state: Any = "unknown"
            with contextlib.suppress(DockerException, AttributeError, KeyError, TypeError):
                st = self.client.inspect_container(cid)["State"]
                state = {k: st.get(k) for k in ("Status", "ExitCode", "OOMKilled", "Error")}
            log.warning(
                "removing container %s (%s) despite cleanup=%r: it holds credentials "
                "(%s), which must not outlive the job. Its output is in this log; its "
                "final state: %s",
                self.image,
                cid[:12],
                self.cleanup,
                SECRET_FILE,
                state,
            )

        try:
            self.client.remove_container(cid, force=True)
        except NotFound:
            pass  # already removed
        except (DockerException, RequestException) as e:
            # Never a task failure: after a success the work is done (and a retry would find
            # it), after a failure that failure is what the task must report.
            if log is not None:
                log.warning(
                    "could not remove container %s after the job %s: %s. Remove it by hand "
                    "(docker rm -f %s)%s",
                    cid[:12],
                    "succeeded" if success else "failed",
                    e,
                    cid[:12],
                    f": it holds credentials ({SECRET_FILE})" if holds_secrets else "",
                )

    def kill(self) -> None:
        with self._lock:
            self._stopped = True
            cid = self._container_id
        if cid is not None:
            self._stop(cid)
