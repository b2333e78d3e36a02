"""The CkvcError hierarchy.

Every error ckvc raises on purpose derives from :class:`CkvcError`. Each class
carries ``exit_code``: the CLI maps an error to that code and a one-line
message, so scripts can tell failures apart without parsing text.
"""

from __future__ import annotations


class CkvcError(Exception):
    """Root of every error ckvc raises on purpose."""

    exit_code: int = 1


class NotARepositoryError(CkvcError):
    exit_code = 3


class UnsupportedFormatError(CkvcError):
    exit_code = 4


class RepositoryLockedError(CkvcError):
    exit_code = 5


class ObjectNotFoundError(CkvcError, KeyError):
    exit_code = 6

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CorruptObjectError(CkvcError):
    """Stored bytes do not match their id. Names the object, and where known the
    commit and tensor that need it."""

    exit_code = 7

    def __init__(
        self,
        message: str,
        *,
        object_id: str | None = None,
        commit: str | None = None,
        tensor: str | None = None,
    ) -> None:
        self.reason = message
        self.object_id = object_id
        self.commit = commit
        self.tensor = tensor
        where = []
        if object_id:
            where.append(f"object {object_id}")
        if tensor:
            where.append(f"tensor {tensor!r}")
        if commit:
            where.append(f"commit {commit}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)

    def with_context(self, *, commit: str | None = None, tensor: str | None = None) -> CorruptObjectError:
        """A copy that also names the commit and tensor, as known higher up."""
        return CorruptObjectError(
            self.reason,
            object_id=self.object_id,
            commit=commit or self.commit,
            tensor=tensor or self.tensor,
        )


class InvalidRefNameError(CkvcError, ValueError):
    exit_code = 8


class RefNotFoundError(CkvcError):
    exit_code = 9


class RefConflictError(CkvcError):
    exit_code = 10


class InvalidRevisionError(CkvcError):
    exit_code = 11


class UnsafeContentError(CkvcError):
    """The content would execute code on load (pickle) and was not allowed."""

    exit_code = 12


class PrunedCommitError(CkvcError):
    """The commit's data was released by a retention policy; its history stays."""

    exit_code = 15

    def __init__(self, commit: str, policy: str, time_ns: int) -> None:
        import datetime as dt

        self.commit = commit
        self.policy = policy
        self.time_ns = time_ns
        when = dt.datetime.fromtimestamp(time_ns / 1e9, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        super().__init__(f"commit {commit[:12]} was pruned by retention policy [{policy}] at {when}; data released")


class UnsupportedTypeError(CkvcError, TypeError):
    """A value ckvc cannot store, named by its path in the state."""

    exit_code = 13

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(f"cannot store value at {path or '<root>'}: {detail}")


class InvalidInputError(CkvcError, ValueError):
    """A missing or unreadable input file, or an argument that makes no sense."""

    exit_code = 14


class UnknownKeyError(InvalidInputError, KeyError):
    """A path asked for (``load(keys=...)``, ``view[path]``) that the commit does not hold."""

    exit_code = 16

    def __init__(self, message: str, keys: tuple[str, ...] = ()) -> None:
        self.keys = keys
        super().__init__(message)

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class IncompatibleStateError(InvalidInputError):
    """A stored state does not fit the objects it is loaded into (``Repo.load_into``):
    missing or unexpected keys, or tensors whose shape or dtype differ. Raised
    before anything is modified."""

    exit_code = 17

    def __init__(
        self,
        message: str,
        *,
        missing: tuple[str, ...] = (),
        unexpected: tuple[str, ...] = (),
        mismatched: tuple[str, ...] = (),
    ) -> None:
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched
        super().__init__(message)


class StorageError(CkvcError):
    """The operating system refused a read or write (disk full, I/O error, permissions).

    ``done`` says what had already happened when it failed, e.g. "nothing was
    committed" or "commit abc123 landed; its reflog entry was not written"."""

    exit_code = 18

    def __init__(self, message: str, *, path: str | None = None, errno: int | None = None) -> None:
        self.path = path
        self.errno = errno
        super().__init__(message)


class StorageFullError(StorageError):
    """No space left on the device (ENOSPC, EDQUOT) or the index map is full."""

    exit_code = 19


class StorageIOError(StorageError):
    """An I/O error from the device (EIO) or another OS error with no better class."""

    exit_code = 20


class ReadOnlyRepositoryError(StorageError):
    """A write was asked of a repository that can only be read (read-only mount, no write permission)."""

    exit_code = 21


class DamagedIndexError(CkvcError):
    """The LMDB index cannot be opened or read; ``ckvc fsck --rebuild-index`` recreates it from the packs."""

    exit_code = 22


class InsufficientMemoryError(CkvcError):
    """A stored state (or a crafted one) needs more memory than this machine can allocate."""

    exit_code = 23


class InterruptedOperationError(CkvcError):
    """Ctrl-C or a signal stopped an operation; the message says whether it took effect."""

    exit_code = 130


__all__ = [
    "CkvcError",
    "CorruptObjectError",
    "DamagedIndexError",
    "IncompatibleStateError",
    "InsufficientMemoryError",
    "InterruptedOperationError",
    "InvalidInputError",
    "InvalidRefNameError",
    "InvalidRevisionError",
    "NotARepositoryError",
    "ObjectNotFoundError",
    "PrunedCommitError",
    "ReadOnlyRepositoryError",
    "RefConflictError",
    "RefNotFoundError",
    "RepositoryLockedError",
    "StorageError",
    "StorageFullError",
    "StorageIOError",
    "UnknownKeyError",
    "UnsafeContentError",
    "UnsupportedFormatError",
    "UnsupportedTypeError",
]
