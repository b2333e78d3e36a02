"""Where remotes live: their URLs, the Backend each URL opens, and the local list
of remotes (``remotes.json`` beside the repository's config: name -> url,
endpoint, region; never credentials, which come from each cloud's standard
environment and config files).

URLs (docs/FORMAT.md section 18):
    /path, relative/path, file:///path   a directory (LocalBackend), created on first push
    memory://name                         a bucket-like MemoryBackend kept for the process (tests)
    s3://bucket/prefix, gs://..., az://...  the object-store backend (the ``remote`` extra)
"""

from __future__ import annotations

import importlib
import json
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckvc.errors import InvalidInputError, RemoteSupportMissingError, UnknownRemoteError
from ckvc.storage.backend import Backend
from ckvc.storage.local import LocalBackend
from ckvc.storage.memory import MemoryBackend

REMOTES_KEY = "remotes.json"  # beside config.json; absent until a remote is added
REMOTES_DIR = "remotes"  # .ckvc/remotes/<name>/: each remote's local catalog
OBJECT_STORE_SCHEMES = ("s3", "gs", "az")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*)://")

_memory_remotes: dict[str, MemoryBackend] = {}
_memory_lock = threading.Lock()


REMOTE_TIMEOUT_VARIABLE = "CKVC_REMOTE_TIMEOUT"


def remote_timeout() -> float:
    """Seconds one object-store request may take (default 60): a slow link needs
    more, a test that makes a request hang needs less."""
    text = os.environ.get(REMOTE_TIMEOUT_VARIABLE, "")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0.1 <= seconds <= 3600:
        raise InvalidInputError(f"{REMOTE_TIMEOUT_VARIABLE}={text!r}: give seconds per request, 0.1 to 3600")
    return seconds


def check_remote_name(name: str) -> str:
    """A remote name: one ref-name component of letters, digits, '.', '_' and '-'."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.endswith((".", ".lock")) or ".." in name:
        raise InvalidInputError(f"invalid remote name {name!r}: letters, digits, '.', '_' and '-' only")
    return name


@dataclass(frozen=True)
class RemoteSpec:
    """One configured remote."""

    name: str
    url: str
    endpoint: str | None = None
    region: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "endpoint": self.endpoint, "region": self.region}


def scheme_of(url: str) -> str:
    """The URL's scheme, "file" for a plain path."""
    match = _SCHEME.match(url)
    return match.group(1) if match else "file"


def normalize_url(url: str, base: Path | None = None) -> str:
    """``url`` as stored: a plain relative path made absolute against ``base``
    (the repository's directory), a ``file://`` URL checked; others unchanged."""
    if not isinstance(url, str) or not url or "\0" in url:
        raise InvalidInputError(f"invalid remote URL {url!r}")
    scheme = scheme_of(url)
    if scheme == "file":
        path = Path(url.removeprefix("file://")) if url.startswith("file://") else Path(url)
        if url.startswith("file://") and not path.is_absolute():
            raise InvalidInputError(f"a file:// URL needs an absolute path, got {url!r}")
        return str(path if path.is_absolute() else ((base or Path.cwd()) / path).resolve())
    if scheme == "memory":
        check_remote_name(url.removeprefix("memory://"))
        return url
    if scheme in OBJECT_STORE_SCHEMES:
        if not url.removeprefix(f"{scheme}://").split("/", 1)[0]:
            raise InvalidInputError(f"remote URL {url!r} names no bucket")
        return url
    raise InvalidInputError(f"unsupported remote URL {url!r}: use a path, file://, memory://, s3://, gs:// or az://")


def open_backend(url: str, *, endpoint: str | None = None, region: str | None = None) -> Backend:
    """The Backend a (normalized) remote URL names. A directory is not created
    here: the first push creates it."""
    scheme = scheme_of(url)
    if scheme == "file":
        return LocalBackend(Path(url.removeprefix("file://")))
    if scheme == "memory":
        with _memory_lock:
            return _memory_remotes.setdefault(url, MemoryBackend(object_store_semantics=True))
    if scheme in OBJECT_STORE_SCHEMES:
        return open_object_store_backend(url, endpoint=endpoint, region=region)
    raise InvalidInputError(f"unsupported remote URL {url!r}")


def open_object_store_backend(url: str, *, endpoint: str | None, region: str | None) -> Backend:
    """The S3/GCS/Azure backend, behind its retry wrapper: the one place the
    object-store client is imported, so ckvc without the extra still runs."""
    # By name: the module (ckvc.storage.cloud) and its client library come
    # with the remote extra, and typing must not need them.
    try:
        objectstore = importlib.import_module("ckvc.storage.cloud")
    except ImportError as exc:
        raise RemoteSupportMissingError(
            f"{scheme_of(url)}:// remotes need the remote extra (pip install 'ckvc[remote]'): {exc}"
        ) from None
    options = {"timeout": remote_timeout()} if os.environ.get(REMOTE_TIMEOUT_VARIABLE) else {}
    backend: Backend = objectstore.open_object_store(url, endpoint=endpoint, region=region, **options)
    try:
        wrapper = importlib.import_module("ckvc.storage.retry").RetryingBackend
    except ImportError:  # the retry wrapper ships with the backend; an older tree may lack it
        return backend
    wrapped: Backend = backend if isinstance(backend, wrapper) else wrapper(backend)
    return wrapped


def forget_memory_remote(url: str) -> None:
    """Drop a memory:// remote (tests)."""
    with _memory_lock:
        _memory_remotes.pop(url, None)


class RemoteList:
    """The remotes configured in a repository, stored in ``remotes.json`` on its
    backend (the ``.ckvc`` directory): ``repo.remotes``."""

    def __init__(self, backend: Backend, base: Path | None, on_remove: Callable[[str], None] | None = None) -> None:
        self.backend = backend
        self.base = base  # where relative paths are resolved (the working directory)
        self.on_remove = on_remove  # what else goes with a remote (its tracking refs, its catalog)

    def _load(self) -> dict[str, RemoteSpec]:
        data = self.backend.get(REMOTES_KEY)
        if data is None:
            return {}
        try:
            raw = json.loads(data.decode("utf-8"))
            return {
                name: RemoteSpec(name, str(v["url"]), v.get("endpoint"), v.get("region"))
                for name, v in raw["remotes"].items()
            }
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidInputError(f"{REMOTES_KEY} is damaged: {exc}") from None

    def _save(self, remotes: dict[str, RemoteSpec]) -> None:
        body = {"remotes": {n: {k: v for k, v in s.to_json().items() if k != "name"} for n, s in remotes.items()}}
        self.backend.put(REMOTES_KEY, (json.dumps(body, indent=2, sort_keys=True) + "\n").encode())

    def list(self) -> list[RemoteSpec]:
        return [spec for _, spec in sorted(self._load().items())]

    def get(self, name: str) -> RemoteSpec:
        spec = self._load().get(check_remote_name(name))
        if spec is None:
            known = ", ".join(sorted(self._load())) or "none"
            raise UnknownRemoteError(f"no remote named {name!r} (configured: {known})")
        return spec

    def add(self, name: str, url: str, *, endpoint: str | None = None, region: str | None = None) -> RemoteSpec:
        remotes = self._load()
        if check_remote_name(name) in remotes:
            raise InvalidInputError(f"remote {name!r} already exists")
        for where in (url, endpoint or ""):
            scheme, sep, rest = where.partition("://")
            if sep and scheme != "file" and "@" in rest.split("/", 1)[0]:  # user:secret@host
                raise InvalidInputError(
                    "remote URLs and endpoints never hold credentials (they would be stored in the "
                    "repository); use the cloud's environment variables or config files"
                )
        spec = RemoteSpec(name, normalize_url(url, self.base), endpoint, region)
        remotes[name] = spec
        self._save(remotes)
        return spec

    def remove(self, name: str) -> RemoteSpec:
        """Forget a remote, and what ``on_remove`` takes with it."""
        remotes = self._load()
        spec = self.get(name)
        del remotes[name]
        self._save(remotes)
        if self.on_remove is not None:
            self.on_remove(name)
        return spec

    def __iter__(self) -> Any:
        return iter(self.list())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._load()
