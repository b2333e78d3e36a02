"""`ckvc serve`: a read-only local web UI over one repository (history, metrics,
one commit, a diff of two, storage), each page also JSON under /api/ with the
content of the CLI's --json. Standard library only; imports no torch until a page
asks for tensors (the commit page's table, a diff)."""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import socket
from collections.abc import Callable

from ckvc.errors import InvalidInputError
from ckvc.repo import Repo
from ckvc.web.routes import WebApi
from ckvc.web.server import WebServer

DEFAULT_HOST = "127.0.0.1"
# What may stand in a URL, a header and a cookie unquoted; long enough not to be guessed.
TOKEN_FORM = re.compile(r"[A-Za-z0-9._~-]{16,}")


def new_token() -> str:
    return secrets.token_urlsafe(32)


class WebServer6(WebServer):
    address_family = socket.AF_INET6


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_server(
    directory: str | os.PathLike[str] | Callable[[], Repo],
    host: str = DEFAULT_HOST,
    port: int = 0,
    *,
    verbose: bool = False,
    token: str | None = None,
) -> WebServer:
    """A server bound to ``host:port`` (0: any free port) over the repository at
    ``directory`` (or the Repo ``directory()`` opens); ``serve_forever()`` runs it.
    With ``token`` every request must carry it (ckvc.web.server)."""
    if token is not None and not TOKEN_FORM.fullmatch(token):
        raise InvalidInputError("a serve token is at least 16 of the characters A-Z a-z 0-9 . _ ~ -")
    opener = directory if callable(directory) else (lambda: Repo.open(directory))
    api = WebApi(opener)
    try:
        return (WebServer6 if ":" in host else WebServer)((host, port), api, verbose=verbose, token=token)
    except BaseException:
        api.close()
        raise


__all__ = ["DEFAULT_HOST", "WebApi", "WebServer", "is_loopback", "make_server", "new_token"]
