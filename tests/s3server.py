"""A real S3 server on loopback for the tests and benchmarks: moto's server app in
a subprocess (so its Python does not share our GIL), on 127.0.0.1 and a port the
kernel picks.

moto checks a conditional write's precondition and then writes, in two steps; two
racing ``If-None-Match: *`` PUTs can both pass the check. S3 (and MinIO, GCS,
Azure) decide on the server, atomically. ``--atomic-writes`` (the default here)
runs moto's mutating requests one at a time, so the test server is as atomic as
the stores it stands for and the contract suite's race tests mean something;
reads stay concurrent.

Beside helpers.py, so that every test folder imports it as ``s3server``; the
fixtures ``s3_server`` (session) and ``s3_bucket`` (a fresh bucket per test) are
registered in tests/conftest.py. Run as a script it is the server process itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from ckvc.storage.cloud import ObjectStoreBackend

# Fake credentials for the client only: moto accepts any, and with them set the
# client never looks further (instance metadata, a user's real profile).
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
# Variables that could point the client at real credentials or a real endpoint.
CLEARED = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL")

MUTATING = frozenset({"PUT", "POST", "DELETE"})


def moto_available() -> bool:
    return importlib.util.find_spec("moto") is not None and importlib.util.find_spec("werkzeug") is not None


def obstore_available() -> bool:
    return importlib.util.find_spec("obstore") is not None


def serialized(app: Callable[..., Any], methods: frozenset[str]) -> Callable[..., Any]:
    """``app`` with the requests of ``methods`` run one at a time (moto computes
    its whole response inside the call, so the lock covers check and write)."""
    lock = threading.Lock()

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in methods:
            return app(environ, start_response)
        with lock:
            return list(app(environ, start_response))

    return wrapped


def serve(atomic_writes: bool) -> None:
    """The server process: print the port, serve until killed."""
    import logging

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    app: Any = DomainDispatcherApplication(create_backend_app)
    if atomic_writes:
        app = serialized(app, MUTATING)
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)

    def exit_with_parent() -> None:  # stdin is a pipe from the test process: EOF means it is gone
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    print(server.port, flush=True)
    server.serve_forever()


@dataclass
class S3Server:
    """A running server process; ``endpoint`` is its http://127.0.0.1:PORT."""

    process: subprocess.Popen[str]
    endpoint: str

    @classmethod
    def start(cls, *, atomic_writes: bool = True, timeout: float = 60.0) -> S3Server:
        env = {k: v for k, v in os.environ.items() if k not in CLEARED} | FAKE_CREDENTIALS
        # Objects in memory (moto's default spills those over 5 MiB to temporary files).
        env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(1 << 30)
        args = [sys.executable, os.path.abspath(__file__)] + ([] if atomic_writes else ["--concurrent-writes"])
        process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.strip().isdigit():
            process.kill()
            raise RuntimeError(f"the S3 test server did not start (said {line!r})")
        server = cls(process, f"http://127.0.0.1:{int(line)}")
        deadline = time.monotonic() + timeout
        while True:
            try:
                server.request("GET", "/")  # ListBuckets: answers once the app is up
                return server
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline or process.poll() is not None:
                    server.stop()
                    raise RuntimeError("the S3 test server does not answer") from None
                time.sleep(0.05)

    def request(self, method: str, path: str, data: bytes | None = None) -> bytes:
        """One unsigned request (moto does not check signatures)."""
        req = urllib.request.Request(self.endpoint + path, data=data, method=method)
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.read()

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"ckvc-{uuid.uuid4().hex[:20]}"
        self.request("PUT", f"/{name}")
        return name

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(30)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


def s3_backend(endpoint: str, bucket: str, prefix: str = "repo", **options: Any) -> ObjectStoreBackend:
    """The ObjectStoreBackend of ``bucket``/``prefix`` at ``endpoint`` (the server's,
    or a fault proxy's in front of it), opened as a user would."""
    from ckvc.storage.cloud import open_object_store

    return open_object_store(f"s3://{bucket}/{prefix}", endpoint=endpoint, **options)


@contextlib.contextmanager
def fake_credentials(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in CLEARED:
        monkeypatch.delenv(name, raising=False)
    for name, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    yield


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    if not moto_available():
        pytest.skip("moto[server] is not installed (pip install -e '.[test]'): no S3 test server")
    if not obstore_available():
        pytest.skip("obstore is not installed (pip install -e '.[remote]'): no object-store client")
    server = S3Server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh bucket's name, with the fake credentials in the environment."""
    with fake_credentials(monkeypatch):
        yield s3_server.create_bucket()


if __name__ == "__main__":
    serve(atomic_writes="--concurrent-writes" not in sys.argv[1:])
