"""The Backend seam: bytes by key, nothing of chunks or commits.

Keys are relative, '/'-separated paths ("packs/ab12.pack", "refs/heads/main").
Every implementation (the local directory, the in-memory twin, later object stores)
passes the same contract suite (tests/storage/test_backend_contract.py); what one
cannot do natively it says in its capabilities, and the layers above pick the
variant that works without it (docs/DESIGN.md, "Backends"). Retry and caching are
wrappers around a Backend, never code inside one.

The hot read path stays zero-copy: ``read_into`` fills the caller's buffer (the
destination tensor), and ``read_ranges`` lets a high-latency store turn many small
reads of one pack into a few large requests.
"""

from __future__ import annotations

import builtins
import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from ckvc.errors import InvalidInputError, ObjectNotFoundError, StorageError
from ckvc.ids import Buffer

# An opaque token naming one content of a key, for compare-and-swap: a content
# digest locally and in memory, an ETag or generation on object stores.
Version = str

# What one piece of a read_stream holds (a bound on a stream's memory, large enough
# that a piece costs far less to hand over than to fetch).
STREAM_PIECE = 8 << 20


class BackendError(StorageError):
    """A backend operation failed on ``key``. ``transient``: worth retrying
    (timeouts, throttling, connection resets); permanent otherwise."""

    def __init__(
        self, message: str, *, key: str | None = None, transient: bool = False, failure: str | None = None
    ) -> None:
        # The message is the failure, so that the operation around it
        # (storage_errors) can add what it left done.
        super().__init__(message, path=key, failure=message if failure is None else failure)
        self.key = key
        self.transient = transient

    def with_outcome(self, outcome: str) -> BackendError:
        failure = self.failure or str(self)
        return BackendError(f"{failure}: {outcome}", key=self.key, transient=self.transient, failure=failure)


@dataclass(frozen=True)
class Capabilities:
    """What a backend does natively. The layers above read these instead of
    asking which backend they have."""

    atomic_rename: bool  # publish by rename (local); else a sink publishes on completion
    append: bool  # durable appends to an existing key (reflog lines); else one key per entry
    conditional_put: bool  # put_if_absent / compare_and_swap are atomic on the server side
    file_locks: bool  # lock() is an OS lock that dies with its process; else leases
    local_paths: bool  # keys are files under a directory (the LMDB index may live beside them)
    latency: Literal["memory", "local", "remote"]
    max_connections: int  # parallel requests worth issuing


@dataclass(frozen=True)
class KeyInfo:
    key: str
    size: int
    # Changes whenever the content does. Not always the token compare_and_swap
    # takes (locally it is the file's identity, since a digest of a pack would
    # read all of it): use get_versioned for that.
    version: Version
    mtime: float  # seconds since the epoch


TEMP_SUFFIX = ".tmp"  # reserved: a sink's temporary; no key may end with it


def check_key(key: str) -> str:
    """``key`` unchanged if it is a valid key: relative, '/'-separated, no empty,
    '.' or '..' component, no NUL, not a temporary's name. InvalidInputError
    otherwise (a key built from hostile data must not escape the backend).
    On every read: string tests only, no per-component loop."""
    wrapped = f"/{key}/"
    if not key or "//" in wrapped or "/./" in wrapped or "/../" in wrapped or "\0" in key or key.endswith(TEMP_SUFFIX):
        raise InvalidInputError(f"invalid storage key {key!r:.120}")
    return key


def describe_key(key: str) -> str:
    """How messages name a key: "pack NAME" for packs (as they always have), else the key."""
    folder, _, name = key.rpartition("/")
    return f"pack {name}" if folder == "packs" else key


class Sink(ABC):
    """Bytes written in parts, invisible under the key until ``publish`` (durable
    and atomic: a reader sees all of them or the key's absence). ``abort``
    discards them; a sink neither published nor aborted leaves at most a
    temporary that the backend's ``sweep`` removes once its writer is gone."""

    @abstractmethod
    def write(self, data: Buffer) -> None: ...

    def writev(self, parts: Sequence[Buffer]) -> None:
        """Write ``parts`` in order (locally one writev call)."""
        for part in parts:
            self.write(part)

    @property
    @abstractmethod
    def size(self) -> int:
        """Bytes written so far."""

    @abstractmethod
    def publish(self) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abort()


class Backend(ABC):
    capabilities: Capabilities
    readonly: bool = False  # this process may not write here (a read-only mount); the layers above refuse early

    # ---- reads ------------------------------------------------------------
    @abstractmethod
    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; ObjectNotFoundError for a
        missing key, CorruptObjectError when the key ends before ``out`` is full."""

    def readv_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in order from ``offset`` (locally one preadv): a record's
        header into a small buffer and its payload straight into its destination."""
        for buf in buffers:
            self.read_into(key, offset, buf)
            offset += len(buf)

    def size(self, key: str) -> int:
        """The key's size in bytes; ObjectNotFoundError when absent."""
        info = self.stat(key)
        if info is None:
            raise ObjectNotFoundError(f"{describe_key(key)} is missing")
        return info.size

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[int, memoryview]]:
        """(offset, bytes) for each (offset, size) in ``ranges``, in order. A backend
        with per-request latency coalesces neighbouring ranges into one request;
        the default reads each range."""
        for offset, size in ranges:
            buf = memoryview(bytearray(size))
            self.read_into(key, offset, buf)
            yield offset, buf

    def read_stream(self, key: str, offset: int, size: int, piece: int = STREAM_PIECE) -> Iterator[memoryview]:
        """[offset, offset + size) of the key as consecutive pieces (a remote
        backend: one streamed GET, where ``read_ranges`` would hold every range in
        memory at once); each piece is a buffer of its own, none empty, of about
        ``piece`` bytes (a store may hand over more at once). ObjectNotFoundError for a missing key,
        CorruptObjectError when the key ends first. The default reads each piece."""
        end = offset + size
        while offset < end:
            buf = memoryview(bytearray(min(piece, end - offset)))
            self.read_into(key, offset, buf)
            offset += len(buf)
            yield buf

    def read_tail(self, key: str, size: int) -> tuple[int, memoryview]:
        """(the key's size, its last ``size`` bytes or all of it if shorter): a
        pack's footer and table of contents in one request where the store can
        (a suffix range). ObjectNotFoundError for a missing key."""
        total = self.size(key)
        buf = memoryview(bytearray(min(size, total)))
        self.read_into(key, total - len(buf), buf)
        return total, buf

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The whole (small) object, or None when absent."""

    @abstractmethod
    def get_versioned(self, key: str) -> tuple[bytes, Version] | None:
        """The object and the version a later compare_and_swap expects, or None."""

    def prefetch(self, key: str, offset: int, size: int) -> None:  # noqa: B027 (a hint: doing nothing is right)
        """A hint that these bytes are read soon (local: fadvise WILLNEED)."""

    # ---- writes -----------------------------------------------------------
    @abstractmethod
    def open_sink(self, key: str) -> Sink: ...

    @abstractmethod
    def put(self, key: str, data: Buffer) -> None:
        """Replace the key's bytes atomically and durably (old or new, never a mix)."""

    def replace(self, key: str, data: Buffer) -> None:
        """``put``, except that where making the new name durable is a step of its
        own (local: the directory fsync) it is left to :meth:`sync` of the key, so
        a caller can tell a failure before the bytes became visible (nothing
        changed) from one after it (the update stands: refs). Default: ``put``."""
        self.put(key, data)

    def has_stale_puts(self, key: str) -> bool:
        """Whether a failed or killed put/replace of ``key`` left a temporary
        (local: write_atomic's ``.<name>.<hex>.tmp``). Cheap, takes no lock."""
        return False

    def remove_stale_puts(self, key: str) -> None:  # noqa: B027 (none by default)
        """Remove what failed or killed puts of ``key`` left; only for a caller
        holding the lock that every writer of ``key`` takes."""

    def remove_stale_puts_in(self, prefix: str, *, recursive: bool = False) -> None:  # noqa: B027 (none by default)
        """:meth:`remove_stale_puts` for every key in ``prefix``'s folder (and below
        it); only for a caller holding the lock every writer there takes."""

    @abstractmethod
    def put_if_absent(self, key: str, data: Buffer) -> bool:
        """Create the key; False (nothing written) if it exists."""

    @abstractmethod
    def compare_and_swap(self, key: str, expected: Version | None, data: Buffer) -> Version:
        """Write ``data`` if the key's version is ``expected`` (None: the key is
        absent); RefConflictError if another writer got there first."""

    def append(self, key: str, data: Buffer) -> None:
        """Durably append to the key (created if absent); only where
        ``capabilities.append``. Callers without it write one key per entry."""
        raise NotImplementedError(f"{type(self).__name__} cannot append")

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the key; nothing happens if it is absent. Locally not durable
        until :meth:`sync` of its folder (a delete lost in a crash leaves a file
        that was going away anyway, and batches of deletes pay one fsync)."""

    def rename(self, key: str, new_key: str) -> None:
        """Atomically give ``key``'s bytes the name ``new_key``; only where
        ``capabilities.atomic_rename`` (gc's rename to trash). Durable after :meth:`sync`."""
        raise NotImplementedError(f"{type(self).__name__} cannot rename")

    def prune_folders(self, key: str, stop: str) -> None:  # noqa: B027 (a key space has no folders)
        """Remove the folders left empty above ``key`` up to, not including, the
        folder ``stop`` ('' for the root), after a delete (local: the ref
        layout's rule that deleting a ref leaves no empty directory)."""

    def sync(self, prefix: str) -> None:  # noqa: B027 (durable on return by default)
        """Make earlier renames and deletes in the folder ``prefix`` durable (local: fsync the directory)."""

    # ---- listing ----------------------------------------------------------
    @abstractmethod
    def stat(self, key: str) -> KeyInfo | None: ...

    @abstractmethod
    def list(self, prefix: str = "", *, recursive: bool = True) -> Iterator[str]:
        """Keys starting with ``prefix``, in sorted order; never the backend's own
        temporaries. ``recursive=False``: only those directly in ``prefix``'s
        folder (locally also a directory there, which then fails to read: the
        caller reports it rather than missing it)."""

    def list_sizes(self, prefix: str = "", *, recursive: bool = True) -> dict[str, int]:
        """:meth:`list` with each key's size. An object store's listing carries the
        sizes, saving a HEAD per key; elsewhere one stat each."""
        sizes: dict[str, int] = {}
        for key in self.list(prefix, recursive=recursive):
            info = self.stat(key)
            if info is not None:
                sizes[key] = info.size
        return sizes

    def temporaries(self, prefix: str = "") -> builtins.list[KeyInfo]:
        """Unpublished sinks' temporaries directly in ``prefix``'s folder (live or
        left by dead writers), for fsck and gc to report and reclaim; their
        ``key`` is what :meth:`delete_temporary` takes."""
        return []

    def delete_temporary(self, key: str) -> None:  # noqa: B027 (no temporaries by default)
        """Remove a temporary listed by :meth:`temporaries` (gc, when no writer can be live)."""

    # ---- coordination -----------------------------------------------------
    @abstractmethod
    def lock(
        self, name: str, *, shared: bool = False, timeout: float = 30.0
    ) -> contextlib.AbstractContextManager[None]:
        """Hold the named lock (shared or exclusive) for the block;
        RepositoryLockedError after ``timeout`` seconds. Local: flock, released when
        the process dies; object stores: a lease object with an expiry."""

    def check_locks_held(self) -> None:  # noqa: B027 (an OS lock never lapses while its process lives)
        """RepositoryLockedError if a lock this process holds here may have lapsed
        (a lease whose renewals failed); called before steps that cannot be undone."""

    def sweep(self, prefix: str = "") -> builtins.list[str]:
        """Remove temporaries in ``prefix``'s folder whose writers are gone; their keys."""
        return []

    def forget(self, key: str) -> None:  # noqa: B027 (nothing cached by default)
        """Drop what is cached of ``key`` (an open descriptor): another process removed or replaced it."""

    def close(self) -> None:  # noqa: B027 (nothing to release by default)
        """Release cached handles; the backend may be used again afterwards."""


class ForwardingBackend(Backend):
    """Passes every call to ``inner``: the base of wrappers (retry, cache,
    counting in tests), which override what they change."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities
        self.readonly = inner.readonly

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(key, offset, out)

    def readv_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.inner.readv_into(key, offset, buffers)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[int, memoryview]]:
        return self.inner.read_ranges(key, ranges)

    def read_stream(self, key: str, offset: int, size: int, piece: int = STREAM_PIECE) -> Iterator[memoryview]:
        return self.inner.read_stream(key, offset, size, piece)

    def read_tail(self, key: str, size: int) -> tuple[int, memoryview]:
        return self.inner.read_tail(key, size)

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def get_versioned(self, key: str) -> tuple[bytes, Version] | None:
        return self.inner.get_versioned(key)

    def prefetch(self, key: str, offset: int, size: int) -> None:
        self.inner.prefetch(key, offset, size)

    def open_sink(self, key: str) -> Sink:
        return self.inner.open_sink(key)

    def put(self, key: str, data: Buffer) -> None:
        self.inner.put(key, data)

    def replace(self, key: str, data: Buffer) -> None:
        self.inner.replace(key, data)

    def has_stale_puts(self, key: str) -> bool:
        return self.inner.has_stale_puts(key)

    def remove_stale_puts(self, key: str) -> None:
        self.inner.remove_stale_puts(key)

    def remove_stale_puts_in(self, prefix: str, *, recursive: bool = False) -> None:
        self.inner.remove_stale_puts_in(prefix, recursive=recursive)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        return self.inner.put_if_absent(key, data)

    def compare_and_swap(self, key: str, expected: Version | None, data: Buffer) -> Version:
        return self.inner.compare_and_swap(key, expected, data)

    def append(self, key: str, data: Buffer) -> None:
        self.inner.append(key, data)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def rename(self, key: str, new_key: str) -> None:
        self.inner.rename(key, new_key)

    def prune_folders(self, key: str, stop: str) -> None:
        self.inner.prune_folders(key, stop)

    def sync(self, prefix: str) -> None:
        self.inner.sync(prefix)

    def stat(self, key: str) -> KeyInfo | None:
        return self.inner.stat(key)

    def list(self, prefix: str = "", *, recursive: bool = True) -> Iterator[str]:
        return self.inner.list(prefix, recursive=recursive)

    def list_sizes(self, prefix: str = "", *, recursive: bool = True) -> dict[str, int]:
        return self.inner.list_sizes(prefix, recursive=recursive)

    def temporaries(self, prefix: str = "") -> builtins.list[KeyInfo]:
        return self.inner.temporaries(prefix)

    def delete_temporary(self, key: str) -> None:
        self.inner.delete_temporary(key)

    def lock(
        self, name: str, *, shared: bool = False, timeout: float = 30.0
    ) -> contextlib.AbstractContextManager[None]:
        return self.inner.lock(name, shared=shared, timeout=timeout)

    def check_locks_held(self) -> None:
        self.inner.check_locks_held()

    def sweep(self, prefix: str = "") -> builtins.list[str]:
        return self.inner.sweep(prefix)

    def forget(self, key: str) -> None:
        self.inner.forget(key)

    def close(self) -> None:
        self.inner.close()
