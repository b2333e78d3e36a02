"""The local directory behind the Backend interface: a repository's ``.ckvc`` folder.

Keys are paths relative to ``root``. Reads of immutable keys (packs) go through a
cache of open descriptors and ``preadv`` straight into the caller's buffer; writes
publish by fsync + rename + directory fsync; locks are flocks, which the kernel
drops when their holder dies.

Errors are today's: a pack that cannot be opened or read is a typed StorageError
(storage_error), a missing one ObjectNotFoundError, a short one CorruptObjectError.
Writes raise the OSError itself, which the operation around them maps with
``storage_errors`` into an error that says what it left done (or, past its point
of no return, ``after_landing`` into a warning).
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import fcntl
import hashlib
import os
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ckvc.errors import CkvcError, CorruptObjectError, ObjectNotFoundError, RefConflictError, storage_error
from ckvc.ids import Buffer
from ckvc.storage.backend import (
    TEMP_SUFFIX,
    Backend,
    Capabilities,
    KeyInfo,
    Sink,
    Version,
    check_key,
    describe_key,
)
from ckvc.storage.durable import (
    append_durable,
    atomic_tmp_name,
    file_lock,
    fsync_dir,
    has_stale_temporaries,
    remove_stale_temporaries,
    remove_stale_temporaries_in,
    write_atomic,
)

MAX_OPEN_PACKS = 64
# compare_and_swap's lock: its own file, so that a caller holding a lock of its
# own (refs.lock) around a swap does not wait on itself.
CAS_LOCK = "cas.lock"

LOCAL_CAPABILITIES = Capabilities(
    atomic_rename=True,
    append=True,
    conditional_put=True,
    file_locks=True,
    local_paths=True,
    latency="local",
    max_connections=16,
)


def content_version(data: Buffer) -> Version:
    """The compare-and-swap version of some bytes: a digest of the content."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class OpenFiles:
    """Read-only descriptors of keys, least recently used first out, at most
    ``max_open`` of them idle: a repository has a pack per commit, far more than
    a process may keep open. A descriptor in use by a read is never closed under it."""

    def __init__(self, root: Path, max_open: int) -> None:
        self.root = root
        self.max_open = max_open
        self._fds: collections.OrderedDict[str, list[int]] = collections.OrderedDict()  # key -> [fd, users, size]
        self._retired: dict[int, int] = {}  # fd -> users, for files dropped from the cache while in use
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def opened(self, key: str) -> Iterator[tuple[int, int]]:
        """(descriptor, size) of ``key`` for the duration of the block; a read's
        OSError inside it is the typed storage error naming the key."""
        with self._lock:
            entry = self._fds.get(key)
            if entry is not None:
                self._fds.move_to_end(key)
                entry[1] += 1
            else:
                fd, size = self._open(key)
                entry = [fd, 1, size]
                self._fds[key] = entry
                self._evict_idle()
            fd, size = entry[0], entry[2]
        try:
            yield fd, size
        except OSError as exc:  # EIO and the like from a read of this key
            raise storage_error(exc, f"reading {describe_key(key)}", "nothing was read from it") from None
        finally:
            with self._lock:
                if self._fds.get(key) is entry:
                    entry[1] -= 1
                    self._evict_idle()
                else:  # dropped from the cache while we used it
                    self._retired[fd] -= 1
                    if not self._retired[fd]:
                        del self._retired[fd]
                        os.close(fd)

    def _open(self, key: str) -> tuple[int, int]:
        try:
            fd = os.open(self.root / key, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFoundError(f"{describe_key(key)} is missing") from None
        except OSError as exc:
            raise storage_error(exc, f"opening {describe_key(key)}", "nothing was read from it") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise CorruptObjectError(f"{describe_key(key)} is not a regular file")
        return fd, st.st_size

    def _evict_idle(self) -> None:
        """Close least recently used idle files beyond the cap (lock held)."""
        excess = len(self._fds) - self.max_open
        for key in list(self._fds):
            if excess <= 0:
                break
            fd, users, _size = self._fds[key]
            if users == 0:
                del self._fds[key]
                os.close(fd)
                excess -= 1

    def forget(self, key: str) -> None:
        with self._lock:
            entry = self._fds.pop(key, None)
            if entry is not None:
                if entry[1]:
                    self._retired[entry[0]] = entry[1]
                else:
                    os.close(entry[0])

    def close(self) -> None:
        with self._lock:
            entries, self._fds = list(self._fds.values()), collections.OrderedDict()
        for fd, users, _size in entries:
            if users:
                self._retired[fd] = users
            else:
                os.close(fd)


class LocalSink(Sink):
    """A ``<key>.tmp`` file, flock'ed by its writer until published or aborted:
    a temporary nobody holds is a dead writer's, which :meth:`LocalBackend.sweep`
    removes. Between creating the file and locking it a writer checks that its name
    still leads to it (a sweep may have taken it in that instant), so a sweep needs
    no other sign of life, and a writer killed or failing before its first byte
    (an empty temporary) leaves nothing that lasts."""

    def __init__(self, backend: LocalBackend, key: str) -> None:
        self._backend = backend
        self.key = key
        self.path = backend.root / key
        self.tmp_path = self.path.with_name(self.path.name + TEMP_SUFFIX)
        self._size = 0
        self._fd = -1
        while self._fd < 0:
            try:
                fd = os.open(self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                # A sweep that locked the file between its creation and this lock
                # removed it as a dead writer's: then the name is gone, start again.
                ours = os.stat(self.tmp_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                ours = False
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(self.tmp_path)
                raise
            if ours:
                self._fd = fd
            else:
                os.close(fd)

    @property
    def size(self) -> int:
        return self._size

    def write(self, data: Buffer) -> None:
        self.writev((data,))

    def writev(self, parts: Sequence[Buffer]) -> None:
        total = sum(len(p) for p in parts)
        written = os.writev(self._fd, parts)
        if written != total:  # short write: finish it the slow way
            rest = b"".join(bytes(p) for p in parts)[written:]
            while rest:
                rest = rest[os.write(self._fd, rest) :]
        self._size += total

    def publish(self) -> None:
        """fsync, rename into place (still locked: no sweep can take it first), directory fsync."""
        os.fsync(self._fd)
        os.rename(self.tmp_path, self.path)
        os.close(self._fd)
        self._fd = -1
        self._backend.files.forget(self.key)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(OSError):
            os.unlink(self.tmp_path)

    def release(self) -> None:
        """Close the descriptor and so drop the lock, leaving the temporary as a
        killed writer would (for tests of sweep)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LocalBackend(Backend):
    """Keys relative to ``root`` (the ``.ckvc`` directory). ``readonly``: whether
    this process may write there (None: ask the OS); the layers above use it to
    open the index read-only and refuse writes early."""

    capabilities = LOCAL_CAPABILITIES

    def __init__(self, root: Path, *, readonly: bool | None = None, max_open: int = MAX_OPEN_PACKS) -> None:
        self.root = Path(root)
        self.readonly = not os.access(self.root, os.W_OK) if readonly is None else readonly
        self.files = OpenFiles(self.root, max_open)

    def path(self, key: str) -> Path:
        """The file of ``key`` (local_paths: the index and tools outside the Backend use it)."""
        return self.root / check_key(key)

    # ---- reads ----------------------------------------------------------------
    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self.readv_into(key, offset, (out,))

    def readv_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        with self.files.opened(check_key(key)) as (fd, _size):
            got = os.preadv(fd, buffers, offset)
        if got != sum(len(b) for b in buffers):
            raise CorruptObjectError(f"{describe_key(key)} is truncated at offset {offset}")

    def size(self, key: str) -> int:
        with self.files.opened(check_key(key)) as (_fd, size):
            return size

    def prefetch(self, key: str, offset: int, size: int) -> None:
        """POSIX_FADV_WILLNEED: the read that follows finds the range in the page
        cache. A hint only: a missing key is reported by the read itself."""
        if not hasattr(os, "posix_fadvise"):
            return
        try:
            with self.files.opened(check_key(key)) as (fd, _size):
                os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)
        except (CkvcError, OSError):  # a hint never fails its caller
            pass

    def get(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def get_versioned(self, key: str) -> tuple[bytes, Version] | None:
        data = self.get(key)
        return None if data is None else (data, content_version(data))

    # ---- writes ---------------------------------------------------------------
    def open_sink(self, key: str) -> LocalSink:
        return LocalSink(self, check_key(key))

    def _with_parent(self, key: str, write: Callable[[Path], None]) -> None:
        """Run ``write`` on the key's path, creating the key's folder once if it is missing."""
        path = self.path(key)
        try:
            write(path)
        except FileNotFoundError:  # the folder is missing (or another writer just made it): once more
            path.parent.mkdir(parents=True, exist_ok=True)
            write(path)
        self.files.forget(key)

    def put(self, key: str, data: Buffer) -> None:
        self._with_parent(key, lambda path: write_atomic(path, bytes(data)))

    def replace(self, key: str, data: Buffer) -> None:
        self._with_parent(key, lambda path: write_atomic(path, bytes(data), sync_dir=False))

    def has_stale_puts(self, key: str) -> bool:
        return has_stale_temporaries(self.path(key))

    def remove_stale_puts(self, key: str) -> None:
        remove_stale_temporaries(self.path(key))

    def remove_stale_puts_in(self, prefix: str, *, recursive: bool = False) -> None:
        _, folder = self._folder(prefix)
        remove_stale_temporaries_in(folder, recursive=recursive)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        """A durable temporary linked to the key's name: link() fails if the name
        exists, and a reader never sees a partly written key."""
        created: list[bool] = []

        def create(path: Path) -> None:
            tmp = path.with_name(atomic_tmp_name(path))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                try:
                    os.link(tmp, path)
                    created.append(True)
                except FileExistsError:
                    created.append(False)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            if created[-1]:
                fsync_dir(path.parent)

        self._with_parent(key, create)
        return created[-1]

    def compare_and_swap(self, key: str, expected: Version | None, data: Buffer) -> Version:
        check_key(key)
        with file_lock(self.root / CAS_LOCK):
            current = self.get_versioned(key)
            version = None if current is None else current[1]
            if version != expected:
                state = "was created" if expected is None else "was changed" if version else "was deleted"
                raise RefConflictError(f"{key} {state} by another writer; nothing was written")
            self.put(key, data)
        return content_version(data)

    def append(self, key: str, data: Buffer) -> None:
        self._with_parent(key, lambda path: append_durable(path, bytes(data)))

    def delete(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except (FileNotFoundError, NotADirectoryError):
            pass
        self.files.forget(key)

    def rename(self, key: str, new_key: str) -> None:
        os.rename(self.path(key), self.path(new_key))
        self.files.forget(key)
        self.files.forget(new_key)

    def prune_folders(self, key: str, stop: str) -> None:
        top = self.root / check_key(stop) if stop else self.root
        folder = self.path(key).parent
        while folder != top and top in folder.parents:
            try:
                folder.rmdir()
            except OSError:
                break
            folder = folder.parent

    def sync(self, prefix: str) -> None:
        folder = prefix.rpartition("/")[0]
        fsync_dir(self.root / folder if folder else self.root)

    # ---- listing --------------------------------------------------------------
    def stat(self, key: str) -> KeyInfo | None:
        try:
            st = os.stat(self.path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return KeyInfo(key, st.st_size, f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}", st.st_mtime)

    def _folder(self, prefix: str) -> tuple[str, Path]:
        folder = prefix.rpartition("/")[0]
        if folder:
            check_key(folder)
        return folder, self.root / folder if folder else self.root

    def list(self, prefix: str = "", *, recursive: bool = True) -> Iterator[str]:
        folder, path = self._folder(prefix)
        keys: builtins.list[str] = []

        def walk(rel: str, directory: Path) -> None:
            try:
                entries = list(os.scandir(directory))
            except (FileNotFoundError, NotADirectoryError):
                return
            for entry in entries:
                key = f"{rel}/{entry.name}" if rel else entry.name
                if entry.name.endswith(TEMP_SUFFIX) or not (key.startswith(prefix) or prefix.startswith(key + "/")):
                    continue
                if recursive and entry.is_dir(follow_symlinks=False):
                    walk(key, Path(entry.path))
                elif key.startswith(prefix):
                    keys.append(key)

        walk(folder, path)
        return iter(sorted(keys))

    def temporaries(self, prefix: str = "") -> builtins.list[KeyInfo]:
        folder, path = self._folder(prefix)
        found = []
        try:
            names = sorted(n for n in os.listdir(path) if n.endswith(TEMP_SUFFIX) and not n.startswith("."))
        except OSError:
            return []
        for name in names:
            key = f"{folder}/{name}" if folder else name
            try:
                st = os.stat(path / name)
            except FileNotFoundError:
                continue  # its writer published (renamed) it meanwhile
            if key.startswith(prefix):
                found.append(KeyInfo(key, st.st_size, f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}", st.st_mtime))
        return found

    def delete_temporary(self, key: str) -> None:
        if not key.endswith(TEMP_SUFFIX):
            raise ValueError(f"{key!r} is not a temporary")
        check_key(key[: -len(TEMP_SUFFIX)])
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / key)

    def sweep(self, prefix: str = "") -> builtins.list[str]:
        """Remove temporaries whose writer is gone (killed, or its cleanup failed
        too): their lock is free (see :class:`LocalSink`). Returns their keys."""
        removed: builtins.list[str] = []
        for info in self.temporaries(prefix):
            path = self.root / info.key
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(path)
                removed.append(info.key)
            except OSError:
                pass  # held by a live writer, or not ours to remove
            finally:
                os.close(fd)
        return removed

    # ---- coordination ---------------------------------------------------------
    def lock(
        self, name: str, *, shared: bool = False, timeout: float = 30.0
    ) -> contextlib.AbstractContextManager[None]:
        """An flock on the file ``name`` (gc.lock, refs.lock...: the names older
        ckvc versions lock too, so old and new code running together still exclude)."""
        return file_lock(self.path(name), shared=shared, timeout=timeout)

    def forget(self, key: str) -> None:
        self.files.forget(key)

    def close(self) -> None:
        self.files.close()


def backend_at(where: Backend | str | os.PathLike[str]) -> Backend:
    """``where`` itself, or the LocalBackend of the directory it names: the call
    forms that took a ``.ckvc`` path (RefStore, PruneLog, RepoConfig) keep working."""
    return where if isinstance(where, Backend) else LocalBackend(Path(where))
