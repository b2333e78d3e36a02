"""A Backend on an object store (S3 and S3-compatible servers, GCS, Azure) through
obstore, the Python binding of Rust's object_store (docs/DESIGN.md, "Object-store
client": why obstore and not boto3).

Keys live under the URL's prefix (``s3://bucket/prefix`` -> ``prefix/<key>``).
What an object store does natively maps one to one: a sink is a multipart upload
completed by ``publish`` (invisible until then, aborted by ``abort``), ``put_if_absent``
and ``compare_and_swap`` are conditional writes (``If-None-Match: *``, ``If-Match`` on
the ETag) decided by the server, ``read_ranges`` merges neighbouring ranges into
few ranged GETs issued in parallel. Locks are lease objects (storage/leases.py).

Every client error leaves as a ckvc error: a missing key ObjectNotFoundError, a
key shorter than the read CorruptObjectError, a lost conditional write
RefConflictError, and anything else BackendError naming the URL and key, with
``transient`` set for what is worth retrying (5xx, throttling, connection resets,
timeouts, bodies cut short). Retrying is RetryingBackend's (storage/retry.py);
this module retries only the parts of a sink's upload, which are idempotent and
whose bytes are gone from the caller once written.

obstore is imported when a store is opened, never by ``import ckvc.storage``.
Its runtime is not fork-safe: a process that forks after using a store must
start its workers with ``spawn``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ipaddress
import os
import queue
import re
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckvc.errors import CkvcError, CorruptObjectError, InvalidInputError, ObjectNotFoundError, RefConflictError
from ckvc.ids import Buffer
from ckvc.storage.backend import (
    STREAM_PIECE,
    Backend,
    BackendError,
    KeyInfo,
    Sink,
    Version,
    check_key,
    describe_key,
)
from ckvc.storage.leases import LeaseLocks
from ckvc.storage.memory import OBJECT_STORE_CAPABILITIES

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB  # S3's smallest part (all but the last)
DEFAULT_PART_SIZE = 8 * MiB
DEFAULT_CONNECTIONS = 16
COALESCE_GAP = 1 * MiB  # ranges this close are read by one request (the gap costs less than a request)
MAX_REQUEST = 16 * MiB  # ... up to this size, so that a run still spreads over connections
SCHEMES = ("s3", "gs", "az", "memory")

# Error codes an S3-compatible server sends for load or its own trouble (retry),
# whatever the status code it sends them with.
TRANSIENT_CODES = frozenset(
    {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling", "ThrottlingException"}
)
# Client-side failures with no HTTP status: the connection, not the request, failed.
TRANSIENT_PHRASES = (
    "connection reset",
    "connection closed",
    "connection refused",
    "broken pipe",
    "timed out",
    "timeout",
    "error decoding response body",
    "error sending request",
    "incomplete",
    "unexpected eof",
    "end of file",
)
_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")


@dataclass(frozen=True)
class ClientFailure:
    """What a client error says, read from its message (obstore puts the status
    and the server's XML body in it)."""

    status: int | None
    code: str | None
    summary: str

    @property
    def transient(self) -> bool:
        if self.code in TRANSIENT_CODES:
            return True
        if self.status is not None:
            # 409 ConditionalRequestConflict: S3 says retry (a racing conditional write);
            # the retry wrapper then finds out whether ours landed.
            return self.status >= 500 or self.status in (408, 409, 429)
        low = self.summary.lower()
        return any(p in low for p in TRANSIENT_PHRASES)


def read_failure(exc: BaseException) -> ClientFailure:
    text = str(exc)
    status = _STATUS.search(text)
    code = _CODE.search(text)
    if status:
        summary = f"HTTP {status.group(1)}" + (f" {code.group(1)}" if code else "")
    else:
        # The first line, without the request URL obstore repeats and the debug dump.
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        summary = re.sub(r"https?://\S+", "", first).strip()[:200]
        low = text.lower()
        cause = next((p for p in TRANSIENT_PHRASES if p in low), None)
        if cause and cause not in summary.lower():
            summary = f"{summary} ({cause})"
    return ClientFailure(int(status.group(1)) if status else None, code.group(1) if code else None, summary)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ObjectStoreSink(Sink):
    """Parts of ``part_size`` buffered here; the first full part starts a multipart
    upload that a worker thread feeds to obstore (``max_concurrency`` parts in
    flight, ``queue_parts`` waiting: bounded memory), and ``publish`` completes it.
    A sink that never fills a part is one PUT at ``publish``. ``abort`` (or any
    error) makes the feed raise, which aborts the upload: nothing is left under the
    key, and the parts go with the upload."""

    _END = object()

    def __init__(self, backend: ObjectStoreBackend, key: str, part_size: int, queue_parts: int = 2) -> None:
        self._backend = backend
        self.key = key
        self._part_size = part_size
        self._buf = bytearray()
        self._size = 0
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_parts)
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        self._aborting = threading.Event()
        self._done = False

    @property
    def size(self) -> int:
        return self._size

    def _check_open(self, what: str) -> None:
        if self._done:
            raise ValueError(f"{what} a sink that was published or aborted")
        if self._error is not None:
            raise self._failure()

    def _failure(self) -> BaseException:
        err = self._error
        assert err is not None
        if isinstance(err, CkvcError):
            return err
        mapped = self._backend.map_error(err, "upload", self.key)
        if isinstance(mapped, ObjectNotFoundError):
            # NoSuchUpload: the store no longer knows the upload (completed while its
            # answer was lost, then aborted; or expired by a lifecycle rule).
            return BackendError(
                f"{self._backend.url}: upload {self.key} failed: the store lost the multipart upload (NoSuchUpload)",
                key=self.key,
                transient=True,
            )
        return mapped

    def _landed(self) -> bool:
        """Whether the key holds an object of this sink's size: a completion whose
        answer was lost (obstore then aborts the finished upload, which fails) still
        published it. Pack keys are unique to their writer, so that object is ours."""
        try:
            info = self._backend.stat(self.key)
        except CkvcError:
            return False
        return info is not None and info.size == self._size

    def write(self, data: Buffer) -> None:
        self._check_open("write to")
        view = memoryview(data).cast("B")
        self._size += len(view)
        while view:
            room = self._part_size - len(self._buf)
            self._buf += view[:room]
            view = view[room:]
            if len(self._buf) == self._part_size:
                self._send(self._buf)
                self._buf = bytearray()

    def _send(self, item: object) -> None:
        """Queue a part (or the end) for the worker, started by the first part."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._upload, name=f"ckvc-upload {self.key}", daemon=True)
            self._worker.start()
        while True:  # put with a timeout, so that a failed upload does not block the writer forever
            if self._error is not None:
                raise self._failure()
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=0.1)
                return

    def _feed(self) -> Iterator[Buffer]:
        while True:
            item = self._queue.get()
            if item is self._END:
                return
            if self._aborting.is_set():
                raise RuntimeError("sink aborted")
            assert isinstance(item, bytearray)
            yield item

    def _upload(self) -> None:
        try:
            self._backend.upload(self.key, self._feed(), multipart=True)
        except BaseException as exc:  # kept for the writer: publish or the next write raises it
            self._error = exc
            while not self._queue.empty():  # unblock a writer waiting for room
                with contextlib.suppress(Exception):
                    self._queue.get_nowait()

    def publish(self) -> None:
        self._check_open("publish of")
        self._done = True
        if self._worker is None:
            self._backend.upload(self.key, self._buf, multipart=False)
            self._buf = bytearray()
            return
        if self._buf:
            self._send(self._buf)
            self._buf = bytearray()
        self._send(self._END)
        self._worker.join()
        if self._error is not None and not self._landed():
            raise self._failure()

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._buf = bytearray()
        if self._worker is not None:
            self._aborting.set()
            with contextlib.suppress(CkvcError):  # the upload failed already: nothing to abort
                self._send(None)  # wakes the feed, which raises: obstore aborts the upload
            self._worker.join()


class ObjectStoreBackend(Backend):
    """``store``: an obstore store for the bucket (no prefix of its own); ``url``
    names it in messages; keys are stored under ``prefix``. ``upload_store``: the
    same bucket with obstore's retries on, used only for a sink's parts (default:
    ``store``)."""

    def __init__(
        self,
        store: Any,
        *,
        url: str,
        prefix: str = "",
        upload_store: Any = None,
        max_connections: int = DEFAULT_CONNECTIONS,
        part_size: int = DEFAULT_PART_SIZE,
        coalesce_gap: int = COALESCE_GAP,
        max_request: int = MAX_REQUEST,
        lease_seconds: float = 60.0,
    ) -> None:
        import obstore

        if part_size < MIN_PART_SIZE:
            raise InvalidInputError(f"part size {part_size} is below the object stores' minimum of 5 MiB")
        self.obs: Any = obstore
        self.client_errors = (obstore.exceptions.BaseError, OSError, ValueError, RuntimeError)
        self.store, self.upload_store = store, store if upload_store is None else upload_store
        self.url = url.rstrip("/")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.part_size, self.coalesce_gap, self.max_request = part_size, coalesce_gap, max(max_request, 1)
        self.capabilities = replace(OBJECT_STORE_CAPABILITIES, latency="remote", max_connections=max_connections)
        self.readonly = False
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._leases = LeaseLocks(self, term=lease_seconds)

    def __repr__(self) -> str:
        return f"ObjectStoreBackend({self.url!r})"

    # ---- plumbing ---------------------------------------------------------------
    def path(self, key: str) -> str:
        return self.prefix + check_key(key)

    def map_error(self, exc: BaseException, op: str, key: str, offset: int | None = None) -> Exception:
        """The ckvc error for a client error of ``op`` on ``key`` (``offset``: of a ranged GET)."""
        text = str(exc)
        if isinstance(exc, FileNotFoundError) and "NoSuchBucket" not in text:
            return ObjectNotFoundError(f"{describe_key(key)} is missing")
        failure = read_failure(exc)
        if failure.status == 416 and offset is not None:  # the range starts at or past the end
            return CorruptObjectError(f"{describe_key(key)} is truncated at offset {offset}")
        denied = isinstance(exc, self.obs.exceptions.PermissionDeniedError | self.obs.exceptions.UnauthenticatedError)
        if "NoSuchBucket" in text:
            what = "the bucket does not exist"
        elif denied or failure.status in (401, 403):
            what = f"access denied ({failure.summary})"
        else:
            what = failure.summary
        transient = failure.transient and not denied
        return BackendError(f"{self.url}: {op} {key} failed: {what}", key=key, transient=transient)

    @contextlib.contextmanager
    def failing(self, op: str, key: str, offset: int | None = None) -> Iterator[None]:
        """Client errors inside the block leave as ckvc errors (:meth:`map_error`)."""
        try:
            yield
        except CkvcError:  # ours (a bad key is InvalidInputError, a ValueError too)
            raise
        except self.client_errors as exc:
            raise self.map_error(exc, op, key, offset) from exc

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                connections = self.capabilities.max_connections
                self._pool = concurrent.futures.ThreadPoolExecutor(connections, thread_name_prefix="ckvc-objectstore")
            return self._pool

    def upload(self, key: str, data: Any, *, multipart: bool) -> None:
        """Write ``data`` (a buffer, or an iterator of parts) under ``key``,
        unconditionally; a multipart upload goes through ``upload_store``."""
        store = self.upload_store if multipart else self.store
        with self.failing("PUT", key):
            self.obs.put(
                store,
                self.path(key),
                data,
                use_multipart=multipart,
                chunk_size=self.part_size,
                max_concurrency=self.capabilities.max_connections,
            )

    def _range(self, key: str, offset: int, size: int) -> memoryview:
        """[offset, offset + size) of the key; CorruptObjectError when it ends first."""
        if size == 0:  # no request for nothing, but the key must exist and reach offset
            if not 0 <= offset <= self.size(key):
                raise CorruptObjectError(f"{describe_key(key)} is truncated at offset {offset}")
            return memoryview(b"")
        if offset < 0:
            raise CorruptObjectError(f"{describe_key(key)} is truncated at offset {offset}")
        with self.failing("GET", key, offset):
            got = memoryview(self.obs.get_range(self.store, self.path(key), start=offset, length=size))
        if len(got) < size:
            raise CorruptObjectError(f"{describe_key(key)} is truncated at offset {offset}")
        return got

    # ---- reads --------------------------------------------------------------------
    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self.readv_into(key, offset, [out])

    def readv_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """One ranged GET scattered into ``buffers``; a read over ``max_request`` is
        GETs of that size in parallel (a request stays short enough for the
        per-request timeout on a slow link, and the pieces use the connections)."""
        total = sum(b.nbytes for b in buffers)
        starts = range(offset, offset + total, self.max_request)
        if len(starts) <= 1:
            pieces = [self._range(key, offset, total)]
        else:
            end = offset + total
            pieces = list(self.pool().map(lambda at: self._range(key, at, min(self.max_request, end - at)), starts))
        piece = 0
        got = pieces[0]
        for buf in buffers:
            out = buf.cast("B")
            while out.nbytes:
                if not got.nbytes:
                    piece += 1
                    got = pieces[piece]
                n = min(out.nbytes, got.nbytes)
                out[:n] = got[:n]
                out, got = out[n:], got[n:]

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[int, memoryview]]:
        """Neighbouring ranges (``coalesce_gap`` apart or less, ``max_request`` at
        most per request) become one GET; the GETs run in parallel; each range
        is a view of its request's bytes."""
        runs: list[tuple[int, int]] = []  # (start, end)
        run_of = [0] * len(ranges)
        for i in sorted(range(len(ranges)), key=lambda i: ranges[i][0]):
            off, end = ranges[i][0], ranges[i][0] + ranges[i][1]
            if (
                runs
                and off - runs[-1][1] <= self.coalesce_gap
                and max(runs[-1][1], end) - runs[-1][0] <= self.max_request
            ):
                runs[-1] = (runs[-1][0], max(runs[-1][1], end))
            else:
                runs.append((off, end))
            run_of[i] = len(runs) - 1

        def fetch(run: tuple[int, int]) -> memoryview:
            return self._range(key, run[0], run[1] - run[0])

        bodies = [fetch(run) for run in runs] if len(runs) == 1 else list(self.pool().map(fetch, runs))
        for i, (off, size) in enumerate(ranges):
            at = off - runs[run_of[i]][0]
            yield off, bodies[run_of[i]][at : at + size]

    def read_stream(self, key: str, offset: int, size: int, piece: int = STREAM_PIECE) -> Iterator[memoryview]:
        """One GET of the range, its body handed over as it arrives (a server that
        copies the object per ranged request, as moto does, copies it once)."""
        if size <= 0 or offset < 0:
            self._range(key, offset, max(size, 0))  # no request for nothing; _range's checks
            return
        # From the start (a clone's stream of a whole pack but its TOC): a plain GET,
        # cut off at ``size``. Some servers (moto) copy the object once more to
        # answer a range; S3 serves both alike.
        options: dict[str, Any] = {} if offset == 0 else {"range": (offset, offset + size)}
        with self.failing("GET", key, offset):
            result = self.obs.get(self.store, self.path(key), options=options)
        got = 0
        stream = result.stream(min_chunk_size=piece)
        while True:
            with self.failing("GET", key, offset + got):
                body = next(stream, None)
            if body is None:
                break
            view = memoryview(body)[: size - got]
            got += len(view)
            if len(view):
                yield view
            if got >= size:
                break
        if got < size:
            raise CorruptObjectError(f"{describe_key(key)} is truncated at offset {offset + got}")

    def read_tail(self, key: str, size: int) -> tuple[int, memoryview]:
        """One GET of a suffix range: the size comes with the bytes (no HEAD)."""
        if size <= 0:
            return self.size(key), memoryview(b"")
        try:
            with self.failing("GET", key):
                result = self.obs.get(self.store, self.path(key), options={"range": {"suffix": size}})
                data = memoryview(result.bytes())
        except BackendError:
            if self.size(key) == 0:  # an empty object has no suffix: servers answer 416 or a whole 200
                return 0, memoryview(b"")
            raise
        total = int(result.meta["size"])
        if len(data) != min(size, total):
            raise CorruptObjectError(f"{describe_key(key)} is truncated at offset {total - len(data)}")
        return total, data

    def get(self, key: str) -> bytes | None:
        found = self.get_versioned(key)
        return None if found is None else found[0]

    def get_versioned(self, key: str) -> tuple[bytes, Version] | None:
        try:
            with self.failing("GET", key):
                result = self.obs.get(self.store, self.path(key))
                data = bytes(result.bytes())
        except ObjectNotFoundError:
            return None
        return data, version_token(result.meta)

    # ---- writes -------------------------------------------------------------------
    def open_sink(self, key: str) -> ObjectStoreSink:
        return ObjectStoreSink(self, check_key(key), self.part_size)

    def put(self, key: str, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        self.upload(check_key(key), view, multipart=len(view) > self.part_size)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        try:
            self.compare_and_swap(key, None, data)
        except RefConflictError:
            return False
        return True

    def compare_and_swap(self, key: str, expected: Version | None, data: Buffer) -> Version:
        mode = "create" if expected is None else update_version(expected)
        try:
            with self.failing("conditional PUT", key):
                result = self.obs.put(self.store, self.path(key), memoryview(data).cast("B"), mode=mode)
        except BackendError as exc:
            if not isinstance(
                exc.__cause__, self.obs.exceptions.AlreadyExistsError | self.obs.exceptions.PreconditionError
            ):
                raise
            state = "was created" if expected is None else "was changed or deleted"
            raise RefConflictError(f"{key} {state} by another writer; nothing was written") from exc.__cause__
        return version_token(result)

    def delete(self, key: str) -> None:
        with contextlib.suppress(ObjectNotFoundError), self.failing("DELETE", key):  # GCS, Azure: a missing key fails
            self.obs.delete(self.store, self.path(key))

    # ---- listing --------------------------------------------------------------------
    def stat(self, key: str) -> KeyInfo | None:
        try:
            with self.failing("HEAD", key):
                meta = self.obs.head(self.store, self.path(key))
        except ObjectNotFoundError:
            return None
        return KeyInfo(key, int(meta["size"]), version_token(meta), meta["last_modified"].timestamp())

    def list(self, prefix: str = "", *, recursive: bool = True) -> Iterator[str]:
        return iter(sorted(self.list_sizes(prefix, recursive=recursive)))

    def list_sizes(self, prefix: str = "", *, recursive: bool = True) -> dict[str, int]:
        """obstore lists whole path segments (prefix "a" means "a/..."), so this
        lists ``prefix``'s folder and filters by the string prefix."""
        where = (self.prefix + prefix.rpartition("/")[0]).rstrip("/") or None
        with self.failing("LIST", prefix or "/"):
            if recursive:
                metas = [m for chunk in self.obs.list(self.store, prefix=where) for m in chunk]
            else:
                metas = self.obs.list_with_delimiter(self.store, prefix=where)["objects"]
        cut = len(self.prefix)
        return {k: int(m["size"]) for m in metas if (k := m["path"][cut:]).startswith(prefix)}

    # ---- coordination -----------------------------------------------------------------
    def lock(
        self, name: str, *, shared: bool = False, timeout: float = 30.0
    ) -> contextlib.AbstractContextManager[None]:
        return self._leases.hold(check_key(name), shared=shared, timeout=timeout)

    def check_locks_held(self) -> None:
        self._leases.check_held()

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def version_token(meta: Any) -> Version:
    """The Version of an object: its ETag, and its generation or version id where the
    store gives one (GCS compares generations, not ETags)."""
    e_tag, version = meta.get("e_tag"), meta.get("version")
    if not e_tag and not version:
        raise BackendError("the object store returned neither an ETag nor a version")
    return f"{e_tag or ''}#{version}" if version else str(e_tag)


def update_version(token: Version) -> dict[str, str | None]:
    e_tag, sep, version = token.rpartition("#") if "#" in token and not token.endswith('"') else (token, "", "")
    return {"e_tag": e_tag or None, "version": version or None} if sep else {"e_tag": token}


def open_object_store(
    url: str, *, endpoint: str | None = None, region: str | None = None, **options: Any
) -> ObjectStoreBackend:
    """The Backend for ``s3://bucket/prefix``, ``gs://bucket/prefix``,
    ``az://container/prefix`` (the account from AZURE_STORAGE_ACCOUNT_NAME) or
    ``memory://`` (an empty in-process store, for tests).

    Credentials come from each cloud's standard environment variables and files
    (AWS_ACCESS_KEY_ID / AWS_PROFILE and ~/.aws through boto3 when it is
    installed, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*), never from
    ckvc's configuration. ``endpoint`` (else AWS_ENDPOINT_URL_S3 or
    AWS_ENDPOINT_URL) points s3:// at MinIO, Ceph or a test server; plain http is
    allowed for a loopback endpoint, elsewhere only with ``allow_http=True``.
    ``options``: ``allow_http``, ``max_connections``, ``part_size``,
    ``coalesce_gap``, ``max_request``, ``lease_seconds``, ``timeout`` (seconds per
    request, default 60), ``upload_retries`` (obstore's retries of a sink's
    parts, default 5), and ``config``: extra obstore settings for the store.
    """
    parsed = urllib.parse.urlsplit(url)
    scheme = parsed.scheme.lower()
    if scheme not in SCHEMES:
        raise InvalidInputError(f"{url!r} is not an object store URL (s3://, gs://, az://)")
    bucket, prefix = parsed.netloc, parsed.path.strip("/")
    if scheme != "memory" and not bucket:
        raise InvalidInputError(f"{url!r} names no bucket")
    allow_http = bool(options.pop("allow_http", False))
    timeout = float(options.pop("timeout", 60.0))
    upload_retries = int(options.pop("upload_retries", 5))
    config: dict[str, Any] = dict(options.pop("config", None) or {})
    tuning = {k: options.pop(k) for k in list(options) if k in _TUNING}
    if options:
        raise InvalidInputError(f"unknown object store option(s): {', '.join(sorted(options))}")
    try:
        import obstore.store

        stores: Any = obstore.store
    except ImportError as exc:  # pragma: no cover - the remote extra
        raise InvalidInputError("object store remotes need obstore: pip install 'ckvc[remote]'") from exc

    client: dict[str, Any] = {"timeout": f"{timeout:g}s", "connect_timeout": "10s"}
    kwargs: dict[str, Any] = {}
    if scheme == "s3":
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            ep = urllib.parse.urlsplit(endpoint)
            if ep.scheme not in ("http", "https") or not ep.hostname:
                raise InvalidInputError(f"endpoint {endpoint!r} is not an http(s) URL")
            if ep.scheme == "http":
                if not (allow_http or _is_loopback(ep.hostname)):
                    raise InvalidInputError(
                        f"endpoint {endpoint} is plain http to another machine; pass allow_http=True to allow it"
                    )
                client["allow_http"] = True
            config["endpoint"] = endpoint
            config.setdefault("virtual_hosted_style_request", False)
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            config["region"] = region
        provider = aws_profile_credentials()
        if provider is not None:
            kwargs["credential_provider"] = provider

        def make(retries: dict[str, Any]) -> Any:
            return stores.S3Store(bucket, config=config, client_options=client, retry_config=retries, **kwargs)
    elif scheme == "memory":
        memory = stores.MemoryStore()

        def make(retries: dict[str, Any]) -> Any:
            return memory
    else:

        def make(retries: dict[str, Any]) -> Any:
            return stores.from_url(f"{scheme}://{bucket}", config=config, client_options=client, retry_config=retries)

    shown = f"{scheme}://{bucket}/{prefix}".rstrip("/")
    try:
        store = make({"max_retries": 0})
        upload_store = make({"max_retries": upload_retries}) if upload_retries else store
    except (obstore.exceptions.BaseError, ValueError) as exc:  # configuration: no account, a bad setting
        raise InvalidInputError(f"cannot open {shown}: {read_failure(exc).summary}") from exc
    return ObjectStoreBackend(store, url=shown, prefix=prefix, upload_store=upload_store, **tuning)


_TUNING = ("max_connections", "part_size", "coalesce_gap", "max_request", "lease_seconds")


def aws_profile_credentials() -> Any:
    """boto3's credential chain (profiles, ~/.aws/config and credentials, SSO) when
    the environment has no keys of its own and boto3 is installed; None lets
    obstore's own chain (environment, web identity, container and instance
    roles) decide."""
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return None
    config_files = [os.environ.get("AWS_SHARED_CREDENTIALS_FILE"), os.environ.get("AWS_CONFIG_FILE")]
    home = Path.home() / ".aws"
    if not (os.environ.get("AWS_PROFILE") or any(config_files) or home.exists()):
        return None
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None
    try:
        session = boto3.Session()
        found = session.get_credentials()
    except Exception as exc:  # botocore's ProfileNotFound, a malformed config file: one line, not a traceback
        raise InvalidInputError(f"AWS credentials: {exc}") from None
    return None if found is None else Boto3CredentialProvider(session)
