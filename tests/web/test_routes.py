"""`ckvc serve` without a browser: the JSON API equals the CLI's --json, bad requests
get 4xx JSON and the server keeps serving, nothing but GET/HEAD is allowed, and a
repository being committed to and collected while it serves gives consistent answers."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import torch
from helpers import run
from webrepo import Built, build_repo, serving

import ckvc
from ckvc.web import WebServer, make_server


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_repo(tmp_path_factory.mktemp("web") / "repo")


@pytest.fixture(scope="module")
def server(built: Built) -> Iterator[WebServer]:
    yield from serving(built.path)


def get(server: WebServer, path: str, method: str = "GET", body: bytes | None = None) -> tuple[int, Any]:
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(str(host), int(port), timeout=30)
    try:
        conn.request(method, path, body=body)
        res = conn.getresponse()
        data = res.read()
        ctype = res.getheader("Content-Type") or ""
        return res.status, json.loads(data) if ctype.startswith("application/json") and data else data
    finally:
        conn.close()


def cli_json(path: Path, *args: str) -> Any:
    result = run(path, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_api_answers_what_the_cli_prints(server: WebServer, built: Built) -> None:
    p = built.path
    pairs = [
        ("/api/log?all=1", ("log", "--all")),
        ("/api/log", ("log",)),
        ("/api/log?rev=side&n=2", ("log", "-n", "2", "side")),
        ("/api/commit/v2", ("show", "v2")),
        ("/api/commit/main?no_data=1", ("show", "--no-data", "main")),
        (f"/api/diff?a={built.main[3]}&b=main", ("diff", built.main[3], "main")),
        ("/api/diff?a=main&b=side&stat=1", ("diff", "--stat", "main", "side")),
        ("/api/du", ("du",)),
        ("/api/retain", ("retain", "--dry-run")),
    ]
    for url, args in pairs:
        status, body = get(server, url)
        assert status == 200, (url, body)
        assert body == cli_json(p, *args), url


def test_metrics_series_follow_each_branch(server: WebServer, built: Built) -> None:
    status, body = get(server, "/api/metrics")
    assert status == 200
    assert body["metrics"] == ["acc", "val_loss"]  # "step" is an axis
    lines = {s["branch"]: [pt["commit"] for pt in s["points"]] for s in body["series"]}
    assert lines == {"main": built.main, "side": built.main[:3] + built.side}
    main = body["series"][0]["points"]
    assert [pt["step"] for pt in main] == [0.0, 100.0, 200.0, 300.0, 400.0]
    assert [pt["pruned"] for pt in main] == [True, False, False, False, False]


def test_commit_tensor_table_has_storage_and_lossy_marks(server: WebServer, built: Built) -> None:
    status, body = get(server, "/api/commit/v2/tensors")
    assert status == 200 and body["commit"] == built.lossy
    by_path = {t["path"]: t for t in body["tensors"]}
    show = cli_json(built.path, "show", "v2")
    assert sorted(by_path) == sorted(t["path"] for t in show["tensors"])
    assert by_path["optimizer.state.0.exp_avg"]["lossy"]["codec"] == "q8"
    assert by_path["optimizer.state.0.exp_avg"]["codecs"] == ["quant"]
    assert by_path["model.layers.0.weight"]["lossy"] is None
    assert all(t["stored_bytes"] > 0 for t in body["tensors"])


@pytest.mark.parametrize(
    ("path", "status", "kind"),
    [
        ("/api/commit/nope", 404, "InvalidRevisionError"),
        ("/api/commit/" + quote("../../etc/passwd", safe=""), 404, "InvalidRevisionError"),
        ("/api/commit/main~99", 404, "InvalidRevisionError"),
        ("/api/commit/main%00", 404, "InvalidRevisionError"),
        ("/api/commit/" + "a" * 600, 404, "InvalidRevisionError"),
        ("/api/diff?a=nope&b=main", 404, "InvalidRevisionError"),
        ("/api/diff?b=main", 404, "InvalidRevisionError"),
        ("/api/log?n=-1", 400, "InvalidInputError"),
        ("/api/log?all=maybe", 400, "InvalidInputError"),
        ("/api/log?rev=" + quote("main^^^^^^^^^"), 404, "InvalidRevisionError"),
        ("/static/../../../etc/passwd", 404, "HttpError"),
        ("/static/..%2f..%2fpyproject.toml", 404, "HttpError"),
        ("/static/index.html", 404, "HttpError"),
        ("/api/nothing", 404, "HttpError"),
        ("/api/commit/%ff%fe", 400, "BadRequest"),
        ("/" + "x" * 9000, 414, "HttpError"),
    ],
)
def test_bad_requests_get_4xx_json(server: WebServer, built: Built, path: str, status: int, kind: str) -> None:
    got, body = get(server, path)
    assert (got, body["type"], body["status"]) == (status, kind, status), body
    assert isinstance(body["error"], str) and body["error"]


def test_pruned_commit_is_gone_not_an_error_page(server: WebServer, built: Built) -> None:
    status, body = get(server, f"/api/commit/{built.pruned}")
    assert (status, body["type"]) == (410, "PrunedCommitError")
    status, body = get(server, f"/api/log?rev={built.pruned}&n=1")  # its history stays readable
    assert status == 200 and body[0]["pruned"]["policy"] == "keep-last 3"


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "BREW"])
def test_only_get_and_head(server: WebServer, built: Built, method: str) -> None:
    before = cli_json(built.path, "log", "--all")
    status, body = get(server, "/api/log", method, body=b"{}")
    assert status == 405 and body["type"] == "MethodNotAllowed"
    assert cli_json(built.path, "log", "--all") == before
    status, data = get(server, "/api/du", "HEAD")
    assert status == 200 and data == b""


def test_malformed_requests_do_not_stop_the_server(server: WebServer) -> None:
    host, port = server.server_address[:2]
    junk = [
        b"\x00\x01\x02garbage\r\n\r\n",
        b"GET\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"GET /api/log HTTP/1.1\r\n" + b"X-Long: " + b"a" * 70000 + b"\r\n\r\n",
        b"GET /api/log HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(200)) + b"\r\n",
        b"GET /api/log HTTP/1.1\r\nContent-Length: nope\r\n\r\n",
        b"GET /api/log HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
        b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
    ]
    with socket.create_connection((str(host), int(port)), timeout=30) as sock:
        sock.sendall(b"GET /api/log HTTP/1.1\r\nHost: x")  # never finished: the client hangs up
    for payload in junk:
        with socket.create_connection((str(host), int(port)), timeout=30) as sock:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        if reply.startswith(b"HTTP/"):
            status = int(reply.split(b" ", 2)[1])
            body = json.loads(reply.split(b"\r\n\r\n", 1)[1])  # JSON, not an HTML page
        elif reply:  # a request line that is no HTTP/1.x is answered as HTTP/0.9: the body alone
            body = json.loads(reply)
            status = body["status"]
        if reply:
            assert (400 <= status < 500 or status == 505) and body["status"] == status, (payload[:40], reply[:200])
    assert get(server, "/api/version")[0] == 200


def test_serving_while_commits_and_gc_run(tmp_path: Path) -> None:
    """A commit loop in this process and `gc --now` in another while clients read:
    every answer is 200 and self-consistent (each listed commit resolves). The commits
    start once the readers have an answer and gc has run once, and the run ends once
    the readers have seen the last commit and gc has run again (handshakes, not timing)."""
    path = tmp_path / "r"
    with ckvc.Repo.init(path, chunk_size=64 << 10) as repo:
        repo.commit({"w": torch.zeros(64)}, message="0", metrics={"loss": 1.0})
    srv = make_server(path, "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    stop = threading.Event()
    failures: list[str] = []
    seen: set[int] = set()

    def reader() -> None:
        while not stop.is_set():
            for url in ("/api/log?all=1", "/api/metrics", "/api/du", "/api/version", "/api/commit/HEAD"):
                status, body = get(srv, url)
                if status != 200:
                    failures.append(f"{url}: {status} {body}")
                elif url == "/api/log?all=1":
                    seen.add(len(body))
                    ids = {c["id"] for c in body}
                    if any(p not in ids for c in body for p in c["parents"]):
                        failures.append("a commit without its parent")

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    gc = subprocess.Popen(
        [sys.executable, "-c", GC_LOOP, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    gc_runs: list[str] = []
    gc_reader = threading.Thread(target=lambda: gc_runs.extend(iter(gc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    gc_reader.start()

    def wait_until(done: Any, what: str) -> None:
        deadline = time.monotonic() + 300
        while not done():
            assert time.monotonic() < deadline and gc.poll() is None and not failures, (what, failures[:5])
            time.sleep(0.01)

    try:
        wait_until(lambda: seen and gc_runs, "a first answer and a first gc")
        with ckvc.Repo.open(path) as repo:
            for i in range(1, 25):
                repo.commit({"w": torch.full((64,), float(i))}, message=str(i), metrics={"loss": 1.0 / (i + 1)})
                if i % 6 == 0:
                    repo.retain(ckvc_policy())
        runs_before = len(gc_runs)
        wait_until(lambda: len(gc_runs) > runs_before, "a gc after the last commit")
        wait_until(lambda: max(seen) == 25, "the readers seeing the last commit")
    finally:
        stop.set()
        for t in readers:
            t.join(60)
        gc.terminate()
        _, err = gc.communicate(timeout=60)
        gc_reader.join(60)
        gc_out = "".join(gc_runs)
        srv.shutdown()
        srv.server_close()
        srv.api.close()
    assert not failures, failures[:5]
    assert len(seen) > 1 and max(seen) == 25  # the readers saw the history grow
    assert "Traceback" not in err, err
    assert gc_out.count("gc") >= 2, err  # collections did run while the server answered
    status_final = get_final(path)
    assert status_final == 25


GC_LOOP = """
import sys, time
import ckvc
from ckvc.errors import RepositoryLockedError
while True:
    try:
        with ckvc.Repo.open(sys.argv[1]) as repo:
            repo.gc(now=True)
        print("gc", flush=True)
    except RepositoryLockedError:
        pass
    time.sleep(0.05)
"""


def ckvc_policy() -> Any:
    from ckvc.retention_policy import RetentionPolicy

    return RetentionPolicy(keep_last=3)


def get_final(path: Path) -> int:
    with ckvc.Repo.open(path) as repo:
        return len(repo.log())


def test_cli_serve_binds_loopback_prints_url_and_stops_on_ctrl_c(built: Built) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckvc", "-C", str(built.path), "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("ckvc serve: http://127.0.0.1:"), line
        port = int(line.split("http://127.0.0.1:", 1)[1].split("/", 1)[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/api/log")
        assert json.loads(conn.getresponse().read()) == cli_json(built.path, "log")
        conn.close()
        with pytest.raises(OSError):  # loopback only: not reachable on another address of this host
            socket.create_connection((other_address(), port), timeout=2).close()
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "stopped" in err


def other_address() -> str:
    """A non-loopback address of this machine (the one a default route would use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent
            addr = s.getsockname()[0]
        except OSError:
            addr = "127.0.0.1"
    if addr.startswith("127."):
        pytest.skip("this machine has no non-loopback address")
    return str(addr)


def test_web_module_imports_without_torch() -> None:
    code = "import sys, ckvc.web, ckvc.cli.serve; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_signed_commits_are_marked_with_their_signer(tmp_path: Path) -> None:
    """/api/log carries each commit's signature verdict (as `ckvc log --json` does); the
    page's marks read it."""
    import contextlib

    from ckvc import signing

    key = signing.generate_key(tmp_path / "alice")
    with ckvc.Repo.init(tmp_path / "repo") as repo:
        signing.set_trust(repo.core, "sign_key", str(key.path))
        signed = repo.commit({"w": torch.ones(5)}, message="signed", sign=True)
        plain = repo.commit({"w": torch.ones(6)}, message="plain")
    with contextlib.contextmanager(serving)(tmp_path / "repo") as server:
        status, body = get(server, "/api/log")
        assert status == 200
        by_id = {e["id"]: e["signature"] for e in body}
        assert by_id[signed]["status"] == "untrusted" and by_id[signed]["signer"] == "alice"  # no trusted keys yet
        assert by_id[plain] is None
        assert body == cli_json(tmp_path / "repo", "log")
        with ckvc.Repo.open(tmp_path / "repo") as repo:
            signing.set_trust(repo.core, "trusted_keys", str(key.path) + ".pub")
        status, body = get(server, "/api/log")
        by_id = {e["id"]: e["signature"] for e in body}
        assert by_id[signed]["status"] == "good" and by_id[plain]["status"] == "unsigned"
        assert body == cli_json(tmp_path / "repo", "log")


def test_scrub_status_is_served_as_status_prints_it(tmp_path: Path) -> None:
    import contextlib

    with ckvc.Repo.init(tmp_path / "repo") as repo:
        for i in range(3):
            repo.commit({"w": torch.full((100,), float(i))}, message=f"c{i}")
        repo.scrub(max_bytes=1)
    with contextlib.contextmanager(serving)(tmp_path / "repo") as server:
        status, body = get(server, "/api/scrub")
        assert status == 200 and body == cli_json(tmp_path / "repo", "status")["scrub"]
        assert body["verified_packs"] == 1 and body["last_complete"] is None and 0 < body["coverage"] < 1
