"""The HTTP side of `ckvc serve`: a standard-library ThreadingHTTPServer that answers
GET and HEAD only (every other method is 405), serves the page and its script and
style from package data (nothing from the network), and the JSON of ckvc.web.routes.

Nothing here builds a filesystem path from a request: static files are looked up
by name in a fixed table, revisions go through the repository's own resolve().
Every failure is a JSON object ``{"error", "type", "status"}`` with a 4xx/5xx status
from the error's class; an unexpected exception is a 500 of that shape, never a
traceback page, and the server keeps serving.

With a token (``ckvc serve`` off loopback) every page, file and API route needs it,
as Jupyter's do: an ``Authorization: token T`` header, or ``?token=T`` once, which
sets an HttpOnly cookie and redirects to the same URL without it (so the token
leaves the address bar and the history). None: 401; a wrong one: 403."""

from __future__ import annotations

import hmac
import json
import re
import sys
import traceback
from collections.abc import Callable
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

from ckvc import errors
from ckvc.web.routes import WebApi, count, flag

STATIC_FILES = {"app.js": "text/javascript", "style.css": "text/css", "index.html": "text/html"}
# Paths the single page answers (it routes on location.pathname).
PAGES = re.compile(r"^/(|history|metrics|storage|diff|commit/.+)$")
MAX_URL = 8192  # http.server itself refuses request lines over 64 KiB (414)

# CkvcError class -> HTTP status (the first match in this order).
STATUS_OF: tuple[tuple[type[errors.CkvcError], HTTPStatus], ...] = (
    (errors.PrunedCommitError, HTTPStatus.GONE),
    (errors.InvalidRevisionError, HTTPStatus.NOT_FOUND),
    (errors.RefNotFoundError, HTTPStatus.NOT_FOUND),
    (errors.ObjectNotFoundError, HTTPStatus.NOT_FOUND),
    (errors.InvalidRefNameError, HTTPStatus.BAD_REQUEST),
    (errors.InvalidInputError, HTTPStatus.BAD_REQUEST),
    (errors.UnsafeContentError, HTTPStatus.FORBIDDEN),
    (errors.RepositoryLockedError, HTTPStatus.SERVICE_UNAVAILABLE),
    (errors.StorageError, HTTPStatus.SERVICE_UNAVAILABLE),
)


def status_for(exc: errors.CkvcError) -> HTTPStatus:
    for cls, status in STATUS_OF:
        if isinstance(exc, cls):
            return status
    return HTTPStatus.INTERNAL_SERVER_ERROR


def _static(name: str) -> bytes:
    return resources.files("ckvc.web").joinpath("static", name).read_bytes()


class HttpError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class Handler(BaseHTTPRequestHandler):
    server: WebServer
    protocol_version = "HTTP/1.1"
    server_version = "ckvc-serve"
    timeout = 30  # a client that stops sending is dropped, not waited for forever
    disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    # ---- answering ------------------------------------------------------------------

    def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any, extra: dict[str, str] | None = None) -> None:
        body = json.dumps(obj, allow_nan=False).encode()
        self._send(status, body, "application/json; charset=utf-8", extra)

    def _error(self, status: int, message: str, kind: str, extra: dict[str, str] | None = None) -> None:
        # The connection closes after an error: what is left of a bad request (a body
        # we did not read) must not be taken for the next one.
        self.close_connection = True
        self._json(status, {"error": message, "type": kind, "status": status}, {**(extra or {}), "Connection": "close"})

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (malformed request line, oversized headers) as
        JSON too; the connection closes after them."""
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        self._error(code, message or phrase, "HTTPError")

    def __getattr__(self, name: str) -> Callable[[], None]:
        # Any method but GET and HEAD (POST, PUT, DELETE, PATCH, made-up ones): 405.
        if name.startswith("do_"):
            return self._not_allowed
        raise AttributeError(name)

    def _not_allowed(self) -> None:
        self._error(
            HTTPStatus.METHOD_NOT_ALLOWED,
            f"{self.command} not allowed: ckvc serve is read-only",
            "MethodNotAllowed",
            {"Allow": "GET, HEAD"},
        )

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        try:
            if len(self.path) > MAX_URL:
                raise HttpError(HTTPStatus.REQUEST_URI_TOO_LONG, "URL too long")
            if int(self.headers.get("Content-Length") or 0) > 0:
                raise HttpError(HTTPStatus.BAD_REQUEST, "a GET carries no body")
            if self.server.token is not None and not self._authorized():
                return
            self._route()
        except HttpError as exc:
            self._error(exc.status, str(exc), "HttpError")
        except errors.CkvcError as exc:
            self._error(status_for(exc), str(exc), type(exc).__name__)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except ValueError as exc:  # a bad Content-Length, an undecodable query
            self._error(HTTPStatus.BAD_REQUEST, f"malformed request: {exc}", "BadRequest")
        except Exception as exc:  # a bug: said as JSON, logged, and the server goes on
            if self.server.verbose:
                traceback.print_exc(file=sys.stderr)
            first = (str(exc).splitlines() or [""])[0]
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {first}", "UnexpectedError")

    # ---- the token --------------------------------------------------------------------

    def _authorized(self) -> bool:
        """True when the request carries the server's token; otherwise it has been
        answered (401 without one, 403 with a wrong one, a redirect setting the cookie
        for ``?token=``)."""
        token = self.server.token
        assert token is not None
        url = urlsplit(self.path)
        query = parse_qs(url.query, keep_blank_values=True, errors="strict")
        offered: list[str] = []
        header = self.headers.get("Authorization") or ""
        if header[:6].lower() == "token ":
            offered.append(header[6:].strip())
        try:
            cookie = SimpleCookie(self.headers.get("Cookie") or "").get(self.server.cookie_name)
        except CookieError:
            cookie = None
        if cookie is not None:
            offered.append(cookie.value)
        from_query = query.pop("token", [])
        offered += from_query
        if not offered:
            self._error(
                HTTPStatus.UNAUTHORIZED,
                "this server needs its token: open the URL ckvc serve printed, or send 'Authorization: token T'",
                "Unauthorized",
                {"WWW-Authenticate": "Token"},
            )
            return False
        if not any(hmac.compare_digest(o.encode(), token.encode()) for o in offered):
            self._error(HTTPStatus.FORBIDDEN, "wrong token", "Forbidden")
            return False
        if from_query and PAGES.match(
            url.path
        ):  # a page: keep the token out of its address; a script's call is just served
            rest = urlencode([(k, v) for k, vs in query.items() for v in vs])
            cookie_header = f"{self.server.cookie_name}={token}; Path=/; HttpOnly; SameSite=Strict"
            location = url.path + (f"?{rest}" if rest else "")
            self._send(HTTPStatus.SEE_OTHER, b"", "text/plain", {"Location": location, "Set-Cookie": cookie_header})
            return False
        return True

    # ---- routes ---------------------------------------------------------------------

    def _route(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path, errors="strict")
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True, errors="strict").items()}
        api = self.server.api
        if path == "/metrics" and "text/html" not in (self.headers.get("Accept") or ""):
            # Prometheus's scrape (it asks for text/plain or OpenMetrics; a browser asks
            # for html and gets the metrics page): the token, if any, goes as a header.
            self._send(HTTPStatus.OK, api.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
            return
        if PAGES.match(path):
            self._send(HTTPStatus.OK, _static("index.html"), "text/html; charset=utf-8")
            return
        if path.startswith("/static/"):
            name = path[len("/static/") :]
            if name not in STATIC_FILES or name == "index.html":
                raise HttpError(HTTPStatus.NOT_FOUND, f"no such file: {name[:64]!r}")
            self._send(HTTPStatus.OK, _static(name), f"{STATIC_FILES[name]}; charset=utf-8")
            return
        if path == "/favicon.ico":
            self._send(HTTPStatus.NO_CONTENT, b"", "image/x-icon")
            return
        result: Any
        if path == "/api/info":
            result = api.info()
        elif path == "/api/version":
            result = api.version()
        elif path == "/api/refs":
            result = api.refs()
        elif path == "/api/log":
            result = api.log(query.get("rev"), count(query.get("n"), "n"), flag(query.get("all")))
        elif path == "/api/metrics":
            result = api.metrics()
        elif path.startswith("/api/commit/") and path.endswith("/tensors") and len(path) > len("/api/commit/tensors"):
            result = api.tensors(path[len("/api/commit/") : -len("/tensors")])
        elif path.startswith("/api/commit/"):
            data = not flag(query["no_data"]) if "no_data" in query else True
            result = api.commit(path[len("/api/commit/") :], data=data)
        elif path == "/api/diff":
            result = api.diff(query.get("a", ""), query.get("b", "HEAD"), stat=flag(query.get("stat")))
        elif path == "/api/du":
            result = api.du()
        elif path == "/api/scrub":
            result = api.scrub()
        elif path == "/api/retain":
            result = api.retain()
        else:
            raise HttpError(HTTPStatus.NOT_FOUND, f"no such page or endpoint: {path[:100]!r}")
        self._json(HTTPStatus.OK, result)


class WebServer(ThreadingHTTPServer):
    daemon_threads = True  # Ctrl-C does not wait for a browser's keep-alive connections
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], api: WebApi, *, verbose: bool = False, token: str | None = None
    ) -> None:
        self.api = api
        self.verbose = verbose
        self.token = token  # None: no token asked (loopback, or --no-auth)
        super().__init__(address, Handler)
        # Cookies are not kept apart by port: two servers on one host need two names.
        self.cookie_name = f"ckvc_token_{self.server_address[1]}"

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = str(host)
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A connection that broke mid-answer is no news; anything else is said in one line.
        exc = sys.exc_info()[1]
        if self.verbose and not isinstance(exc, (ConnectionError, TimeoutError)):
            print(f"ckvc serve: error answering {client_address}: {exc!r}", file=sys.stderr)
