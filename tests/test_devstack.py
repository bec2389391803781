"""``python scripts/devstack.py s3 --dir D`` (the README's S3 server for an Airflow of your
own): it serves SeaweedFS with the two identities, writes the connections to a private file,
stops on SIGTERM, and what was written survives a restart on the same folder."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO


def _start(data: Path, log: Path) -> tuple[subprocess.Popen[bytes], dict[str, dict]]:
    env_file = data / "connections.env"
    env_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "devstack.py"), "s3", "--dir", str(data),
         "--bucket", "hva-devstack"],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while "hva_ranks" not in (env_file.read_text() if env_file.exists() else ""):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"devstack s3 did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600  # it holds the secrets
    conns = {
        m.group(1): json.loads(m.group(2))
        for m in re.finditer(r"export AIRFLOW_CONN_(\w+)='(.*)'", env_file.read_text())
    }
    return proc, conns


def _client(conn: dict):
    import boto3

    return boto3.client(
        "s3", endpoint_url=conn["extra"]["endpoint_url"], region_name="us-east-1",
        aws_access_key_id=conn["login"], aws_secret_access_key=conn["password"],
    )  # fmt: skip


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_devstack_s3_serves_both_identities_and_keeps_data_across_a_restart(
    tmp_path: Path,
) -> None:
    from botocore.exceptions import ClientError

    data, log = tmp_path / "s3", tmp_path / "devstack.log"
    proc, conns = _start(data, log)
    try:
        assert set(conns) == {"AWS_DEFAULT", "HVA_RANKS"}
        worker, ranks = _client(conns["AWS_DEFAULT"]), _client(conns["HVA_RANKS"])
        worker.put_object(Bucket="hva-devstack", Key="models/m/latest.json", Body=b"{}")
        ranks.put_object(Bucket="hva-devstack", Key="runs/r/metrics.json", Body=b"{}")
        with pytest.raises(ClientError, match="AccessDenied"):
            ranks.put_object(Bucket="hva-devstack", Key="models/m/latest.json", Body=b"x")
        secrets = [c["password"] for c in conns.values()]
    finally:
        _stop(proc)
    assert not any(s in log.read_text() for s in secrets)

    proc, conns = _start(data, log)  # the same folder: new ports, new secrets, same objects
    try:
        worker = _client(conns["AWS_DEFAULT"])
        body = worker.get_object(Bucket="hva-devstack", Key="models/m/latest.json")["Body"]
        assert body.read() == b"{}"
        keys = worker.list_objects_v2(Bucket="hva-devstack")["Contents"]
        assert {k["Key"] for k in keys} == {"models/m/latest.json", "runs/r/metrics.json"}
        # each start makes new secrets: the previous start's no longer signs
        with pytest.raises(ClientError, match="SignatureDoesNotMatch"):
            _client({**conns["AWS_DEFAULT"], "password": secrets[0]}).list_buckets()
    finally:
        _stop(proc)
    assert os.path.isdir(data / "data")
