"""A token for `ckvc serve` off loopback (issue 31): every page, static file and API
route answers 401 without it, 403 with a wrong one and 200 with it (header, or the
cookie a one-time ``?token=`` sets); loopback without a token is unchanged."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from webrepo import Built, build_repo, serving

from ckvc.errors import InvalidInputError
from ckvc.web import WebServer, make_server

TOKEN = "t0k3n-for-the-tests_0123456789"
# Every route the server answers: the page's paths, its files and each API endpoint.
ROUTES = [
    "/",
    "/history",
    "/metrics",
    "/storage",
    "/diff?a=main~1&b=main",
    "/commit/main",
    "/static/app.js",
    "/static/style.css",
    "/favicon.ico",
    "/api/info",
    "/api/version",
    "/api/refs",
    "/api/log?n=2",
    "/api/metrics",
    "/api/commit/main",
    "/api/commit/main/tensors",
    "/api/diff?a=main~1&b=main",
    "/api/du",
    "/api/retain",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_repo(tmp_path_factory.mktemp("web") / "repo")


@pytest.fixture(scope="module")
def server(built: Built) -> Iterator[WebServer]:
    yield from serving(built.path, token=TOKEN)


def request(port: int, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path, headers=headers or {})
    res = conn.getresponse()
    res.read()
    conn.close()
    return res


def port_of(server: WebServer) -> int:
    return int(server.server_address[1])


@pytest.mark.parametrize("path", ROUTES)
def test_every_route_needs_the_token(server: WebServer, path: str) -> None:
    port = port_of(server)
    none = request(port, path)
    assert none.status == 401 and none.getheader("WWW-Authenticate") == "Token"
    assert request(port, path, {"Authorization": "token wrong-token-0123456789"}).status == 403
    assert request(port, path, {"Cookie": f"{server.cookie_name}=wrong-token-0123456789"}).status == 403
    ok = 204 if path == "/favicon.ico" else 200
    assert request(port, path, {"Authorization": f"token {TOKEN}"}).status == ok
    assert request(port, path, {"Cookie": f"other=1; {server.cookie_name}={TOKEN}"}).status == ok


def test_a_token_in_the_url_sets_a_cookie_and_leaves_the_address(server: WebServer) -> None:
    res = request(port_of(server), f"/diff?a=main~1&token={TOKEN}&b=main")
    assert res.status == 303
    assert res.getheader("Location") == "/diff?a=main~1&b=main"
    assert res.getheader("Set-Cookie") == f"{server.cookie_name}={TOKEN}; Path=/; HttpOnly; SameSite=Strict"
    api = request(port_of(server), f"/api/log?n=1&token={TOKEN}")  # a script's call: served, no redirect
    assert api.status == 200 and api.getheader("Set-Cookie") is None
    wrong = request(port_of(server), "/history?token=not-the-token-0123456789")
    assert wrong.status == 403 and wrong.getheader("Set-Cookie") is None


def test_a_401_says_what_to_do_and_gives_nothing_away(server: WebServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port_of(server), timeout=60)
    conn.request("GET", "/api/log")
    res = conn.getresponse()
    body = json.loads(res.read())
    conn.close()
    assert res.status == 401 and body["type"] == "Unauthorized"
    assert "Authorization: token" in body["error"] and "commit" not in json.dumps(body)


def test_tokens_too_short_or_unsafe_in_a_cookie_are_refused(built: Built) -> None:
    for bad in ("short", "x" * 15, "has space in it 0123456789", "semi;colon0123456789"):
        with pytest.raises(InvalidInputError, match="serve token"):
            make_server(built.path, "127.0.0.1", 0, token=bad)


def serve_cli(path: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckvc", "-C", str(path), "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline()


def stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return err


def test_cli_off_loopback_makes_and_prints_a_token(built: Built) -> None:
    proc, line = serve_cli(built.path, "--host", "0.0.0.0")
    try:
        assert line.startswith("ckvc serve: http://0.0.0.0:"), line
        url = line.split()[2]
        port = int(url.split(":")[2].split("/")[0])
        token = url.split("?token=")[1]
        assert len(token) >= 40
        assert request(port, "/api/log").status == 401
        assert request(port, "/api/log", {"Authorization": f"token {token}"}).status == 200
    finally:
        err = stop(proc)
    assert "warning" not in err


def test_cli_no_auth_serves_everyone_and_warns(built: Built) -> None:
    proc, line = serve_cli(built.path, "--host", "0.0.0.0", "--no-auth")
    try:
        assert "token" not in line
        port = int(line.split("http://0.0.0.0:")[1].split("/")[0])
        assert request(port, "/api/log").status == 200
    finally:
        err = stop(proc)
    assert "warning: serving on 0.0.0.0, not loopback, without a token (--no-auth)" in err


def test_cli_loopback_stays_tokenless_unless_given_one(built: Built) -> None:
    proc, line = serve_cli(built.path)
    try:
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        assert "token" not in line and request(port, "/api/log").status == 200
    finally:
        stop(proc)
    proc, line = serve_cli(built.path, "--token", TOKEN)
    try:
        assert line.split()[2].endswith(f"?token={TOKEN}")
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        assert request(port, "/api/log").status == 401
    finally:
        stop(proc)
    both = subprocess.run(
        [sys.executable, "-m", "ckvc", "-C", str(built.path), "serve", "--token", TOKEN, "--no-auth"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert both.returncode == InvalidInputError.exit_code and "contradict" in both.stderr
