"""The compose stack's one-shot configuration jobs (run with the Airflow image's Python).

    python hva_config.py render   # the `hva-config` service, before anything else starts
    python hva_config.py bucket   # the `seaweedfs-init` service, once the object store answers

``render`` refuses to start the stack while a secret file is missing or empty, or a setting
(secret or not) still holds a published ``change-me`` placeholder of .env.example (named,
never shown), or the Fernet key is not one; then it writes, from the secret files
(``/run/secrets/<name>``) and the non-secret settings of the environment:

- ``$HVA_CONFIG_DIR/s3/identities.json``: SeaweedFS's ``-s3.config``, three identities: the
  stack's administrator (creates the bucket; nobody else's), the Airflow worker's (read,
  write, list and tag in ``HVA_BUCKET`` only), the training ranks' (read ``datasets/``, read
  and write ``runs/``, list; nothing under ``models/``);
- ``$HVA_CONFIG_DIR/airflow/connections.json``: the Airflow connections ``aws_default``,
  ``hva_ranks`` and ``smtp_default``, read by Airflow's LocalFilesystemBackend.

Every secret moves from file to file: none is put on a command line or into a container's
environment (where ``docker inspect`` shows it). ``bucket`` creates ``HVA_BUCKET`` as the
administrator (kept across restarts: an existing bucket is fine).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import sys
import time
from pathlib import Path

SECRETS_DIR = Path(os.environ.get("HVA_SECRETS_MOUNT", "/run/secrets"))
CONFIG_DIR = Path(os.environ.get("HVA_CONFIG_DIR", "/hva-config"))
#: secret file -> what it is (the names of docker-compose.yml's top-level `secrets:`)
SECRETS = {
    "postgres_password": "PostgreSQL's password",
    "airflow_admin_password": "the Airflow UI admin's password",
    "airflow_fernet_key": "Airflow's Fernet key",
    "airflow_jwt_secret": "Airflow's JWT secret",
    "airflow_api_secret_key": "Airflow's API secret key",
    "s3_admin_secret_key": "the object store administrator's secret key",
    "s3_worker_secret_key": "the Airflow worker's S3 secret key",
    "s3_ranks_secret_key": "the training ranks' S3 secret key",
}
#: may be empty (an SMTP server without login)
OPTIONAL_SECRETS = {"smtp_password": "the SMTP password"}
PLACEHOLDER = "change-me"


class ConfigError(Exception):
    """A setting the stack cannot start with; the message names it, never its value."""


def read_secret(name: str, *, optional: bool = False) -> str:
    path = SECRETS_DIR / name
    try:
        value = path.read_text().strip()
    except FileNotFoundError:
        if optional:
            return ""
        raise ConfigError(f"the secret file {name} is missing (scripts/stack_secrets.sh)") from None
    if not value and not optional:
        raise ConfigError(f"the secret file {name} ({SECRETS[name]}) is empty")
    return value


def setting(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if not value:
        raise ConfigError(f"{name} is not set (see .env.example)")
    return value


def check_placeholders(secrets: dict[str, str]) -> None:
    bad = sorted(
        [k for k, v in os.environ.items() if PLACEHOLDER in v]
        + [f"secret {k}" for k, v in secrets.items() if PLACEHOLDER in v]
    )
    if bad:
        raise ConfigError(
            f"refusing to start: {', '.join(bad)} still hold(s) a published placeholder of "
            f".env.example ({PLACEHOLDER}...): set your own values (scripts/stack_secrets.sh "
            "writes random secrets; a random value: openssl rand -hex 24)"
        )


def check_fernet_key(key: str) -> None:
    try:
        raw = base64.urlsafe_b64decode(key.encode())
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ConfigError(
            "the secret file airflow_fernet_key is not a Fernet key (32 url-safe base64 bytes; "
            "scripts/stack_secrets.sh writes one)"
        )


def rank_actions(bucket: str) -> list[str]:
    """The ranks' rights: as scripts/devstack.py's (SeaweedFS matches an action's resource as
    a prefix of ``bucket/key``, so the bucket is named exactly)."""
    return [
        f"Read:{bucket}/datasets/*",
        f"Read:{bucket}/runs/*",
        f"Write:{bucket}/runs/*",
        f"List:{bucket}",
    ]


def identities(secrets: dict[str, str]) -> dict[str, object]:
    bucket = setting("HVA_BUCKET")

    def identity(name: str, key_var: str, secret: str, actions: list[str]) -> dict[str, object]:
        return {
            "name": name,
            "credentials": [{"accessKey": setting(key_var), "secretKey": secrets[secret]}],
            "actions": actions,
        }

    return {
        "identities": [
            identity(
                "stack-admin", "HVA_S3_ADMIN_ACCESS_KEY", "s3_admin_secret_key",
                ["Admin", "Read", "Write", "List", "Tagging"],
            ),
            identity(
                "airflow-worker", "HVA_S3_ACCESS_KEY", "s3_worker_secret_key",
                [f"Read:{bucket}", f"Write:{bucket}", f"List:{bucket}", f"Tagging:{bucket}"],
            ),
            identity(
                "training-ranks", "HVA_RANKS_S3_ACCESS_KEY", "s3_ranks_secret_key",
                rank_actions(bucket),
            ),
        ]
    }  # fmt: skip


def connections(secrets: dict[str, str]) -> dict[str, object]:
    endpoint = setting("HVA_S3_ENDPOINT")
    region = setting("AWS_REGION", "us-east-1")

    def aws(key_var: str, secret: str) -> dict[str, object]:
        return {
            "conn_type": "aws",
            "login": setting(key_var),
            "password": secrets[secret],
            "extra": {"endpoint_url": endpoint, "region_name": region},
        }

    return {
        "aws_default": aws("HVA_S3_ACCESS_KEY", "s3_worker_secret_key"),
        "hva_ranks": aws("HVA_RANKS_S3_ACCESS_KEY", "s3_ranks_secret_key"),
        "smtp_default": {
            "conn_type": "smtp",
            "host": os.environ.get("SMTP_HOST") or "localhost",
            "port": int(os.environ.get("SMTP_PORT") or 25),
            "login": os.environ.get("SMTP_USER", ""),
            "password": secrets["smtp_password"],
            "extra": {"from_email": os.environ.get("HVA_ALERT_FROM") or "airflow@localhost"},
        },
    }


def write_private(path: Path, document: object, uid: int, gid: int, mode: int) -> None:
    """Write JSON readable by ``uid``/``gid`` alone (created with ``mode``, then moved in)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(document, f)
    if os.geteuid() == 0:  # as the stack runs it; a test as another user keeps its own
        os.chown(tmp, uid, gid)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def render() -> None:
    secrets = {name: read_secret(name) for name in SECRETS}
    secrets |= {name: read_secret(name, optional=True) for name in OPTIONAL_SECRETS}
    check_placeholders(secrets)
    check_fernet_key(secrets["airflow_fernet_key"])
    airflow_uid = int(setting("AIRFLOW_UID", "50000"))
    # The object store runs as root; the Airflow services as AIRFLOW_UID, group 0.
    write_private(CONFIG_DIR / "s3" / "identities.json", identities(secrets), 0, 0, 0o400)
    write_private(
        CONFIG_DIR / "airflow" / "connections.json", connections(secrets), airflow_uid, 0, 0o440
    )
    (CONFIG_DIR / "s3").chmod(0o700)
    (CONFIG_DIR / "airflow").chmod(0o750)
    if os.geteuid() == 0:
        os.chown(CONFIG_DIR / "airflow", airflow_uid, 0)
    print(
        "hva-config: wrote the object store's identities (admin "
        f"{setting('HVA_S3_ADMIN_ACCESS_KEY')}, worker {setting('HVA_S3_ACCESS_KEY')}, ranks "
        f"{setting('HVA_RANKS_S3_ACCESS_KEY')}) and Airflow's connections "
        "(aws_default, hva_ranks, smtp_default)"
    )


def bucket(timeout: float = 120.0) -> None:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    name = setting("HVA_BUCKET")
    endpoint = setting("HVA_S3_ENDPOINT")
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=setting("HVA_S3_ADMIN_ACCESS_KEY"),
        aws_secret_access_key=read_secret("s3_admin_secret_key"),
        region_name=setting("AWS_REGION", "us-east-1"),
        config=Config(retries={"max_attempts": 1}, connect_timeout=3, read_timeout=10),
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.head_bucket(Bucket=name)
            print(f"seaweedfs-init: bucket s3://{name} exists (kept from an earlier start)")
            return
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket", "NotFound"):
                break
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise ConfigError(f"HeadBucket {name} at {endpoint} as the admin: {code}") from e
            error: Exception = e  # 5xx while the filer starts: try again
        except BotoCoreError as e:  # not answering yet
            error = e
        if time.monotonic() > deadline:
            raise ConfigError(f"the object store at {endpoint} did not answer: {error}")
        time.sleep(1)
    client.create_bucket(Bucket=name)
    print(f"seaweedfs-init: created bucket s3://{name}")


def main(argv: list[str]) -> int:
    commands = {"render": render, "bucket": bucket}
    if len(argv) != 1 or argv[0] not in commands:
        print(f"usage: hva_config.py {'|'.join(commands)}", file=sys.stderr)
        return 2
    try:
        commands[argv[0]]()
    except ConfigError as e:
        print(f"hva-config: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
