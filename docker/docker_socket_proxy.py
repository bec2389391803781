"""An allowlisting proxy in front of the Docker socket: the engine API calls the docker launcher
makes pass; anything else is refused with 403 before it reaches the engine.

    python docker_socket_proxy.py --listen /run/hva-docker/docker.sock \\
        --upstream /var/run/docker.sock --network horovod-airflow-training --owner 50000:0

The Docker socket is root on the host: whoever may call ``POST /containers/create`` with
``Privileged`` or a bind of ``/`` owns the machine. The scheduler, which runs every DAG
author's code (LocalExecutor), gets this proxy's socket instead. What passes (an optional
``/v1.NN`` prefix, as clients send it): ``GET /_ping``, ``/version``, ``/info``,
``/images/{name}/json``, ``/containers/{id}/json``, ``/networks/{name}``; ``POST
/images/create`` (a pull), ``/containers/{id}/{start,attach,wait,stop,kill}``; ``PUT
/containers/{id}/archive`` (the credentials file); ``DELETE /containers/{id}``; and ``POST
/containers/create`` only for a container on the training network (``--network``) with no
privilege, no added capability, no device but GPU requests, no host bind or mount, no host
PID/network/user namespace and no security-option change. Refused: everything else, e.g.
``/exec``, ``/volumes``, ``/build``, ``/containers/{id}/archive`` reads (``GET``), ``/secrets``,
``/plugins``, ``/swarm``.

One request per upstream connection (``Connection: close`` is set on the way in, so a
keep-alive connection cannot carry an unchecked second request); an upgraded connection
(``attach``) is relayed as raw bytes both ways, which the engine no longer parses as HTTP.
Standard library only: it runs in the Airflow image.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

MAX_HEADER = 64 * 1024
MAX_BODY = 64 * 1024 * 1024  # a credentials archive is a few hundred bytes; a create body, KBs
_VERSION = r"(?:/v1\.\d+)?"
_ID = r"[A-Za-z0-9][A-Za-z0-9_.-]*"  # a container's or network's id or name
_IMAGE = r"[A-Za-z0-9][A-Za-z0-9_.:/@-]*"  # an image reference (registry/repo:tag@digest)
#: path tricks the engine's router could resolve to another route: refused outright
_TRICKS = re.compile(r"(^|/)\.\.?(/|$)|//|%", re.IGNORECASE)
#: (method, path pattern) the launcher and its preflight check use; create is checked further.
ALLOWED: list[tuple[str, re.Pattern[str]]] = [
    (m, re.compile(f"^{_VERSION}{p}$"))
    for m, p in [
        ("GET", r"/_ping"),
        ("HEAD", r"/_ping"),
        ("GET", r"/version"),
        ("GET", r"/info"),
        ("GET", rf"/images/{_IMAGE}/json"),
        ("POST", r"/images/create"),
        ("GET", rf"/containers/{_ID}/json"),
        ("POST", r"/containers/create"),
        ("POST", rf"/containers/{_ID}/(?:start|attach|wait|stop|kill)"),
        ("PUT", rf"/containers/{_ID}/archive"),
        ("DELETE", rf"/containers/{_ID}"),
        ("GET", rf"/networks/{_ID}"),
    ]
]


class Refused(Exception):
    """Why a request may not pass (sent to the client as a 403 body)."""


def check_create(body: dict[str, Any], network: str) -> None:
    """Refuse a container that could reach past its own sandbox."""
    host = body.get("HostConfig") or {}
    if host.get("Privileged"):
        raise Refused("privileged containers are not allowed")
    for key in ("CapAdd", "Devices", "SecurityOpt", "Binds", "VolumesFrom", "Links", "Sysctls"):
        if host.get(key):
            raise Refused(f"HostConfig.{key} is not allowed")
    for mount in host.get("Mounts") or []:
        if mount.get("Type", "volume") != "tmpfs":
            raise Refused(f"mounts of type {mount.get('Type', 'volume')!r} are not allowed")
    for key in ("PidMode", "UsernsMode", "UTSMode", "CgroupnsMode"):
        if str(host.get(key) or "").startswith(("host", "container:")):
            raise Refused(f"HostConfig.{key}={host[key]!r} is not allowed")
    if str(host.get("IpcMode") or "").startswith("container:"):
        raise Refused(f"HostConfig.IpcMode={host['IpcMode']!r} is not allowed")
    for request in host.get("DeviceRequests") or []:
        if ["gpu"] not in (request.get("Capabilities") or []):
            raise Refused("device requests other than GPUs are not allowed")
    if host.get("NetworkMode") != network:
        raise Refused(
            f"containers must join the network {network!r}, not {host.get('NetworkMode')!r}"
        )
    endpoints = (body.get("NetworkingConfig") or {}).get("EndpointsConfig") or {}
    if set(endpoints) - {network}:
        raise Refused(f"containers may join the network {network!r} only")


def check(method: str, path: str, body: bytes, network: str) -> None:
    route = path.split("?", 1)[0]
    if _TRICKS.search(route):
        raise Refused(f"{route!r}: no '..', '.', '//' or %-escapes in API paths")
    if not any(m == method and p.match(route) for m, p in ALLOWED):
        raise Refused(f"{method} {route} is not an API call the docker launcher makes")
    if route.endswith("/containers/create"):
        try:
            document = json.loads(body or b"{}")
        except ValueError as e:
            raise Refused(f"the create request's body is not JSON: {e}") from e
        check_create(document, network)


def read_request(conn: socket.socket) -> tuple[bytes, bytes]:
    """(head through the blank line, body by Content-Length); refuses chunked bodies."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("client closed before a full request")
        data += chunk
        if len(data) > MAX_HEADER:
            raise Refused("request head too large")
    head, _, rest = data.partition(b"\r\n\r\n")
    headers = parse_headers(head)
    if "chunked" in headers.get("transfer-encoding", ""):
        raise Refused("chunked request bodies are not supported")
    length = int(headers.get("content-length", "0") or 0)
    if length > MAX_BODY:
        raise Refused("request body too large")
    while len(rest) < length:
        chunk = conn.recv(min(65536, length - len(rest)))
        if not chunk:
            raise ConnectionError("client closed inside the body")
        rest += chunk
    return head, rest


def parse_headers(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}


def with_connection_close(head: bytes) -> bytes:
    """The request head with ``Connection: close`` (an upgrade keeps its ``Upgrade``)."""
    lines = head.split(b"\r\n")
    upgrade = any(ln.lower().startswith(b"upgrade:") for ln in lines[1:])
    kept = [ln for ln in lines[1:] if not ln.lower().startswith(b"connection:")]
    return b"\r\n".join(
        [lines[0], *kept, b"Connection: Upgrade" if upgrade else b"Connection: close"]
    )


def refuse(conn: socket.socket, reason: str) -> None:
    body = json.dumps({"message": f"refused by the docker socket proxy: {reason}"}).encode()
    conn.sendall(
        b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )


def relay(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(65536):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            with contextlib.suppress(OSError):
                s.shutdown(how)


def handle(conn: socket.socket, upstream: str, network: str, log: Callable[[str], None]) -> None:
    with conn:
        try:
            head, body = read_request(conn)
            method, path = head.split(b" ", 2)[:2]
            check(method.decode(), path.decode(), body, network)
        except Refused as e:
            log(f"refused: {head.split(b' ', 2)[:2] if 'head' in locals() else '?'}: {e}")
            refuse(conn, str(e))
            return
        except (ConnectionError, ValueError, OSError):
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as up:
            up.connect(upstream)
            up.sendall(with_connection_close(head) + b"\r\n\r\n" + body)
            back = threading.Thread(target=relay, args=(up, conn), daemon=True)
            back.start()
            relay(conn, up)
            back.join()


def serve(listen: str, upstream: str, network: str, owner: tuple[int, int] | None = None) -> None:
    if os.path.exists(listen):
        os.unlink(listen)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(listen)
    if owner is not None:  # the one user (and group) that may use the proxy
        os.chown(listen, *owner)
    os.chmod(listen, 0o660)
    server.listen(64)
    print(f"docker-socket-proxy: {listen} -> {upstream} (network {network})", flush=True)

    def log(line: str) -> None:
        print(f"docker-socket-proxy: {line}", flush=True)

    while True:
        conn, _ = server.accept()
        threading.Thread(target=handle, args=(conn, upstream, network, log), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="the proxy's unix socket")
    parser.add_argument("--upstream", default="/var/run/docker.sock", help="the engine's socket")
    parser.add_argument("--network", required=True, help="the one network containers may join")
    parser.add_argument("--owner", help="UID:GID to give the proxy's socket to (mode 0660)")
    args = parser.parse_args(argv)
    owner = tuple(int(x) for x in args.owner.split(":")) if args.owner else None
    serve(args.listen, args.upstream, args.network, owner)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
