"""A fault-injecting HTTP proxy on 127.0.0.1 in front of the S3 test server.

The client under test talks to the proxy as its endpoint; each request is
matched against the rules in order, and the first rule that fires (by method,
path substring, remaining count and probability) decides what the client gets:

- ``status``: an S3 error reply (500 InternalError, 503 SlowDown, 403 AccessDenied ...)
  instead of forwarding (``after=True``: forward first, so the request takes
  effect and only its answer is replaced);
- ``reset``: the connection dropped with a TCP reset, before forwarding or (``after``) after;
- ``truncate``: the upstream's status and headers with their full Content-Length,
  then ``keep`` bytes of the body (default half), then the connection closes;
- ``slow``: ``delay`` seconds of silence, then the real answer.

``requests`` records (method, path) of every request seen, so tests can count
round trips. Used as a context manager (or the ``s3_proxy`` fixture); stops by
itself on exit. Beside
s3server.py (not in tests/storage/) so that every test folder, tests/remote/
included, imports it as ``fault_proxy``.
"""

from __future__ import annotations

import http.client
import http.server
import random
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import pytest
from s3server import S3Server

Fault = Literal["status", "reset", "truncate", "slow"]
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}
REASONS = {403: "AccessDenied", 404: "NoSuchKey", 500: "InternalError", 503: "SlowDown"}


@dataclass
class Rule:
    fault: Fault
    method: str | None = None  # None: any
    path: str | None = None  # substring of the request path; None: any
    count: int | None = 1  # how many times it fires; None: always
    skip: int = 0  # matching requests let through before it fires (the k-th request: skip=k-1)
    probability: float = 1.0
    status: int = 500
    after: bool = False  # status/reset: forward first (the request lands, its answer is lost)
    keep: int | None = None  # truncate: body bytes sent (default half)
    delay: float = 1.0  # slow: seconds
    fired: int = field(default=0, init=False)

    def matches(self, method: str, path: str) -> bool:
        return (
            (self.method is None or self.method == method)
            and (self.path is None or self.path in path)
            and (self.count is None or self.fired < self.count)
        )

    def take(self) -> bool:
        """A match: fire, or count it as one of those to let through."""
        if self.skip > 0:
            self.skip -= 1
            return False
        self.fired += 1
        return True


class FaultProxy:
    def __init__(self, upstream: str, rules: list[Rule] | None = None, *, seed: int = 0) -> None:
        target = urllib.parse.urlsplit(upstream)
        assert target.hostname in ("127.0.0.1", "localhost"), "the proxy forwards to loopback only"
        self.upstream = (target.hostname, target.port or 80)
        self.rules: list[Rule] = list(rules or [])
        self.requests: list[tuple[str, str]] = []
        self.body_bytes = 0  # response body bytes sent to the client (what a transfer costs on the wire)
        self.in_flight = 0  # requests being answered (a client may stop reading a listing early)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect
            # Headers and body go out in two writes: with Nagle on, each reply waits for
            # the client's delayed ACK (40 ms a request on Linux loopback).
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: object) -> None:
                pass

            def handle_one(self) -> None:
                proxy.serve(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = handle_one

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        # A client that gave up mid-answer (a timeout, a kill) is what faults are for: no traceback.
        self.server.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    def fired(self) -> int:
        return sum(r.fired for r in self.rules)

    def pick(self, method: str, path: str) -> Rule | None:
        with self.lock:
            self.requests.append((method, path))
            for rule in self.rules:
                if rule.matches(method, path) and self.rng.random() < rule.probability and rule.take():
                    return rule
        return None

    def reset_counts(self, timeout: float = 10.0) -> None:
        """Zero ``body_bytes`` and ``requests`` once the requests being answered are
        done, so that what an earlier step left in flight is not counted against the next."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        with self.lock:
            self.body_bytes = 0
            self.requests.clear()

    def serve(self, h: http.server.BaseHTTPRequestHandler) -> None:
        with self.lock:
            self.in_flight += 1
        try:
            self._serve(h)
        finally:
            with self.lock:
                self.in_flight -= 1

    def _serve(self, h: http.server.BaseHTTPRequestHandler) -> None:
        body = read_body(h)
        rule = self.pick(h.command, h.path)
        if rule is not None and not rule.after and rule.fault in ("status", "reset"):
            return reset(h) if rule.fault == "reset" else error_reply(h, rule.status)
        status, reason, headers, payload = self.forward(h, body)
        if rule is not None:
            if rule.fault == "reset":
                return reset(h)
            if rule.fault == "status":
                return error_reply(h, rule.status)
            if rule.fault == "slow":
                time.sleep(rule.delay)
        h.send_response(status, reason)
        for name, value in headers:
            if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                h.send_header(name, value)
        h.send_header(
            "Content-Length", str(len(payload)) if h.command != "HEAD" else dict_get(headers, "content-length")
        )
        if rule is not None and rule.fault == "truncate":
            h.send_header("Connection", "close")
            h.end_headers()
            h.wfile.write(payload[: len(payload) // 2 if rule.keep is None else rule.keep])
            h.wfile.flush()
            h.close_connection = True
            return None
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(payload)
            with self.lock:
                self.body_bytes += len(payload)
        return None

    def forward(
        self, h: http.server.BaseHTTPRequestHandler, body: bytes
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            conn.request(
                h.command, h.path, body=body if body or h.command in ("PUT", "POST") else None, headers=headers
            )
            resp = conn.getresponse()
            payload = resp.read()
            return resp.status, resp.reason, resp.getheaders(), payload
        finally:
            conn.close()


@pytest.fixture
def s3_proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    """A fault proxy in front of the session's S3 server, no rules yet (registered in conftest.py)."""
    with FaultProxy(s3_server.endpoint) as proxy:
        yield proxy


def dict_get(headers: list[tuple[str, str]], name: str) -> str:
    return next((v for k, v in headers if k.lower() == name), "0")


def read_body(h: http.server.BaseHTTPRequestHandler) -> bytes:
    if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
        parts: list[bytes] = []
        while True:
            size = int(h.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(parts)
            parts.append(h.rfile.read(size))
            h.rfile.readline()
    return h.rfile.read(int(h.headers.get("Content-Length") or 0))


def reset(h: http.server.BaseHTTPRequestHandler) -> None:
    """Drop the connection with a TCP RST (SO_LINGER 0), as a crashed peer or load balancer does."""
    h.close_connection = True
    sock: socket.socket = h.connection
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def error_reply(h: http.server.BaseHTTPRequestHandler, status: int) -> None:
    code = REASONS.get(status, "InternalError")
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>injected by the fault proxy</Message><RequestId>fault</RequestId></Error>"
    ).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/xml")
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(body)
