"""Durable file helpers: atomic replace, fsync of files and directories, locks."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ckvc.errors import ReadOnlyRepositoryError, RepositoryLockedError
from ckvc.storage.packs import is_pack_name

# errno values that mean "this file system or file may not be written here".
_NO_WRITE = (errno.EROFS, errno.EACCES, errno.EPERM)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_tmp_name(path: Path) -> str:
    """The hidden temporary a write of ``path`` goes through before its rename or
    link. Cut short so that it fits wherever ``path`` does (255 bytes)."""
    return f".{path.name[:64]}.{uuid.uuid4().hex}.tmp"


_TMP_TAIL = r"\.[0-9a-f]{32}\.tmp"  # atomic_tmp_name's uuid and suffix
_ATOMIC_TMP = re.compile(rf"^\..+{_TMP_TAIL}$")


def _stale_temporaries(path: Path) -> list[Path]:
    own = re.compile(rf"^\.{re.escape(path.name[:64])}{_TMP_TAIL}$")
    return [tmp for tmp in path.parent.glob(f".{glob.escape(path.name[:64])}.*.tmp") if own.match(tmp.name)]


def has_stale_temporaries(path: Path) -> bool:
    """Whether a :func:`write_atomic` of ``path`` left a temporary file (no lock needed to look)."""
    return bool(_stale_temporaries(path))


def remove_stale_temporaries(path: Path) -> None:
    """Remove what failed or killed :func:`write_atomic` calls for ``path`` left.
    Only for a caller holding the lock that every writer of ``path`` takes."""
    for tmp in _stale_temporaries(path):
        with contextlib.suppress(OSError):
            tmp.unlink()


def remove_stale_temporaries_in(directory: Path, *, recursive: bool = False) -> None:
    """:func:`remove_stale_temporaries` for every file of ``directory`` (and its
    subdirectories): what failed writes left where a later command never writes the
    same file (a tag whose creation failed). Only for a caller holding the lock
    that every writer there takes."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if recursive and entry.is_dir(follow_symlinks=False):
            remove_stale_temporaries_in(Path(entry.path), recursive=True)
        elif _ATOMIC_TMP.match(entry.name):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def write_atomic(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Replace ``path`` with ``data`` so a crash leaves the old or the new bytes, never a mix.
    ``sync_dir=False`` leaves the directory fsync to the caller, which can then
    tell a failure before the rename (nothing changed) from one after it."""
    tmp = path.with_name(atomic_tmp_name(path))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def append_durable(path: Path, data: bytes) -> None:
    """Append line records to a log file and fsync it. A torn last line (a crash
    mid-append) is closed first, so it cannot swallow the new record. If a write
    (or the fsync) fails, the file is cut back to its old size, so a failed
    append adds no record, whole or partial."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def require_writable(directory: Path, action: str) -> None:
    """ReadOnlyRepositoryError unless this process may write ``directory``."""
    if not os.access(directory, os.W_OK):
        raise ReadOnlyRepositoryError(
            f"cannot write (read-only or no permission) while {action} ({directory}): nothing was changed",
            path=str(directory),
        )


def _open_lock_file(path: Path, shared: bool) -> int | None:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno not in _NO_WRITE:
            raise
        error = exc
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        if shared:
            return None
    raise ReadOnlyRepositoryError(
        f"cannot create lock file {path}: the repository is read-only ({error.strerror}); nothing was changed",
        path=str(path),
        errno=error.errno,
    )


@contextlib.contextmanager
def file_lock(path: Path, *, timeout: float = 30.0, shared: bool = False) -> Iterator[None]:
    """An flock on ``path``. The kernel drops it when the holder dies, so a
    killed process never leaves a stale lock behind.

    In a repository that cannot be written (read-only mount, no write
    permission) the lock file is opened read-only, which flock accepts; if it
    does not exist there either, a shared lock is skipped (nobody can write
    there through this path) and an exclusive one is a ReadOnlyRepositoryError."""
    fd = _open_lock_file(path, shared)
    if fd is None:
        yield
        return
    try:
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    waited = f" (waited {timeout:.0f} s)" if timeout else ""
                    raise RepositoryLockedError(f"{path} is locked by another process{waited}") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        yield
    finally:
        os.close(fd)


def read_log_lines(path: Path) -> list[bytes]:
    """The lines of an append-only log file as bytes (none if it does not exist).
    Callers parse each line on its own, so one damaged line (a bad byte, a torn
    append) costs that line only."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return [line for line in data.split(b"\n") if line.strip()]


def looks_torn(line: bytes) -> bool:
    """A crash mid-append leaves a prefix of a JSON object with no closing brace;
    the next append starts a new line after it. Such lines are expected leftovers,
    not damage."""
    return line.lstrip().startswith(b"{") and not line.rstrip().endswith(b"}")


def list_packs(pack_dir: Path) -> list[str]:
    """The sealed packs' names in a local pack directory (tools and tests; the
    store itself enumerates packs through its Backend)."""
    return sorted(p.name for p in pack_dir.iterdir() if is_pack_name(p.name))
