"""The in-memory twin of the local directory, for fast tests and for the
object-store variants of the layers above.

``object_store_semantics=True`` makes it say what S3 says: no rename, no append,
no file locks (its ``lock`` still works, as the lease objects of an object store
will, so a layer that asks the capabilities picks the object-store variant and
still runs). Thread-safe; everything is lost with the object.
"""

from __future__ import annotations

import builtins
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from ckvc.errors import CorruptObjectError, ObjectNotFoundError, RefConflictError, RepositoryLockedError
from ckvc.ids import Buffer
from ckvc.storage.backend import Backend, Capabilities, KeyInfo, Sink, Version, check_key, describe_key
from ckvc.storage.local import content_version

MEMORY_CAPABILITIES = Capabilities(
    atomic_rename=True,
    append=True,
    conditional_put=True,
    file_locks=True,
    local_paths=False,
    latency="memory",
    max_connections=16,
)
# What an object store lacks (ARCHITECTURE §4): no rename, no append, no OS locks.
OBJECT_STORE_CAPABILITIES = replace(MEMORY_CAPABILITIES, atomic_rename=False, append=False, file_locks=False)


@dataclass(frozen=True, slots=True)
class _Object:
    data: bytes
    version: Version
    mtime: float


class _SharedLock:
    """A readers-writer lock with a timeout; not re-entrant, like an flock taken twice."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def hold(self, name: str, shared: bool, timeout: float) -> Iterator[None]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._writer or (not shared and self._readers):
                left = deadline - time.monotonic()
                timed_out = left <= 0 or not self._cond.wait(left)
                if timed_out and (self._writer or (not shared and self._readers)):
                    waited = f" (waited {timeout:.0f} s)" if timeout else ""
                    raise RepositoryLockedError(f"{name} is locked by another process{waited}")
            if shared:
                self._readers += 1
            else:
                self._writer = True
        try:
            yield
        finally:
            with self._cond:
                if shared:
                    self._readers -= 1
                else:
                    self._writer = False
                self._cond.notify_all()


class MemorySink(Sink):
    def __init__(self, backend: MemoryBackend, key: str) -> None:
        self._backend = backend
        self.key = key
        self._parts: list[bytes] | None = []
        self._size = 0

    @property
    def size(self) -> int:
        return self._size

    def write(self, data: Buffer) -> None:
        if self._parts is None:
            raise ValueError("write to a sink that was published or aborted")
        self._parts.append(bytes(data))
        self._size += len(data)

    def publish(self) -> None:
        if self._parts is None:
            raise ValueError("publish of a sink that was published or aborted")
        data, self._parts = b"".join(self._parts), None
        self._backend.store(self.key, data)

    def abort(self) -> None:
        self._parts = None


class MemoryBackend(Backend):
    def __init__(self, *, object_store_semantics: bool = False) -> None:
        self.capabilities = OBJECT_STORE_CAPABILITIES if object_store_semantics else MEMORY_CAPABILITIES
        self.readonly = False
        self._objects: dict[str, _Object] = {}
        self._lock = threading.Lock()
        self._locks: dict[str, _SharedLock] = {}

    def store(self, key: str, data: bytes) -> Version:
        """Replace the key's bytes (what every write comes down to)."""
        version = content_version(data)
        with self._lock:
            self._objects[key] = _Object(data, version, time.time())
        return version

    def _get(self, key: str) -> _Object:
        obj = self._objects.get(check_key(key))
        if obj is None:
            raise ObjectNotFoundError(f"{describe_key(key)} is missing")
        return obj

    # ---- reads ----------------------------------------------------------------
    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        data = self._get(key).data
        end = offset + len(out)
        if offset < 0 or end > len(data):
            raise CorruptObjectError(f"{describe_key(key)} is truncated at offset {offset}")
        out[:] = memoryview(data)[offset:end]

    def size(self, key: str) -> int:
        return len(self._get(key).data)

    def get(self, key: str) -> bytes | None:
        obj = self._objects.get(check_key(key))
        return None if obj is None else obj.data

    def get_versioned(self, key: str) -> tuple[bytes, Version] | None:
        obj = self._objects.get(check_key(key))
        return None if obj is None else (obj.data, obj.version)

    # ---- writes ---------------------------------------------------------------
    def open_sink(self, key: str) -> MemorySink:
        return MemorySink(self, check_key(key))

    def put(self, key: str, data: Buffer) -> None:
        self.store(check_key(key), bytes(data))

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        check_key(key)
        with self._lock:
            if key in self._objects:
                return False
            blob = bytes(data)
            self._objects[key] = _Object(blob, content_version(blob), time.time())
            return True

    def compare_and_swap(self, key: str, expected: Version | None, data: Buffer) -> Version:
        check_key(key)
        blob = bytes(data)
        with self._lock:
            current = self._objects.get(key)
            version = None if current is None else current.version
            if version != expected:
                state = "was created" if expected is None else "was changed" if version else "was deleted"
                raise RefConflictError(f"{key} {state} by another writer; nothing was written")
            new = content_version(blob)
            self._objects[key] = _Object(blob, new, time.time())
            return new

    def append(self, key: str, data: Buffer) -> None:
        if not self.capabilities.append:
            raise NotImplementedError("this backend has object-store semantics: no appends")
        check_key(key)
        with self._lock:
            current = self._objects.get(key)
            blob = (current.data if current else b"") + bytes(data)
            self._objects[key] = _Object(blob, content_version(blob), time.time())

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(check_key(key), None)

    def rename(self, key: str, new_key: str) -> None:
        if not self.capabilities.atomic_rename:
            raise NotImplementedError("this backend has object-store semantics: no rename")
        check_key(new_key)
        with self._lock:
            obj = self._objects.pop(check_key(key), None)
            if obj is None:
                raise ObjectNotFoundError(f"{describe_key(key)} is missing")
            self._objects[new_key] = obj

    # ---- listing --------------------------------------------------------------
    def stat(self, key: str) -> KeyInfo | None:
        obj = self._objects.get(check_key(key))
        return None if obj is None else KeyInfo(key, len(obj.data), obj.version, obj.mtime)

    def list(self, prefix: str = "", *, recursive: bool = True) -> Iterator[str]:
        folder = prefix.rpartition("/")[0]
        with self._lock:
            keys = sorted(k for k in self._objects if k.startswith(prefix))
        if recursive:
            return iter(keys)
        depth = folder.count("/") + 1 if folder else 0
        return iter([k for k in keys if k.count("/") == depth])

    # ---- coordination ---------------------------------------------------------
    def lock(
        self, name: str, *, shared: bool = False, timeout: float = 30.0
    ) -> contextlib.AbstractContextManager[None]:
        check_key(name)
        with self._lock:
            lock = self._locks.setdefault(name, _SharedLock())
        return lock.hold(name, shared, timeout)

    def sweep(self, prefix: str = "") -> builtins.list[str]:
        return []  # an unpublished sink holds its bytes itself: nothing is left behind
