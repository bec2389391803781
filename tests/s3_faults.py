"""A faulty S3 endpoint for tests: a proxy on loopback in front of the real S3 server that
answers chosen requests itself (``503 SlowDown``, ``500 InternalError``, ``403 AccessDenied``,
...) the way an S3 server does (status, XML error body), and forwards every other request.

The client under test talks to the proxy's endpoint exactly as it would to the store, so the
error travels the whole real path: botocore's retries, its exception, our classification.
"""

from __future__ import annotations

import contextlib
import http.client
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# (method, path) -> (status, S3 error code) to answer instead of the server, or None: forward
Rule = Callable[[str, str], "tuple[int, str] | None"]


@dataclass
class FaultyS3:
    endpoint: str
    answered: list[tuple[str, str, int]] = field(default_factory=list)  # what the proxy faked


@contextlib.contextmanager
def faulty_s3(
    upstream: str, rule: Rule, *, drop_headers: tuple[str, ...] = ()
) -> Iterator[FaultyS3]:
    """Serve a proxy to ``upstream`` (``http://host:port``) on 127.0.0.1 applying ``rule``;
    ``drop_headers`` are removed from every forwarded request (a server that ignores them:
    ``("If-Match", "If-None-Match")`` plays one without conditional writes)."""
    target = urlsplit(upstream)
    state = FaultyS3(endpoint="")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            return None

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            fault = rule(self.command, self.path)
            if fault is not None:
                status, code = fault
                state.answered.append((self.command, self.path, status))
                xml = (
                    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>'
                    f"{code}</Code><Message>injected by tests/s3_faults.py</Message>"
                    f"<Resource>{self.path}</Resource></Error>"
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(xml)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(xml)
                return
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
            dropped = {"connection", *(h.lower() for h in drop_headers)}
            headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
            conn.request(self.command, self.path, body=body or None, headers=headers)
            response = conn.getresponse()
            data = response.read()
            self.send_response(response.status)
            for key, value in response.getheaders():
                if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            conn.close()

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
