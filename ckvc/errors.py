"""The CkvcError hierarchy.

Every error ckvc raises on purpose derives from :class:`CkvcError`. Each class
carries ``exit_code``: the CLI maps an error to that code and a one-line
message, so scripts can tell failures apart without parsing text.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
from collections.abc import Callable, Iterator


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

    def __init__(self, *args: object, object_id: str | None = None) -> None:
        super().__init__(*args)
        self.object_id = object_id  # the missing object, where known (callers add commit/tensor context)

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
        return type(self)(
            self.reason,
            object_id=self.object_id,
            commit=commit or self.commit,
            tensor=tensor or self.tensor,
        )


class MalformedObjectError(CorruptObjectError):
    """An object whose bytes match its id but do not parse as its type says (a buggy or
    hostile writer made it): refetching the same id cannot repair it."""


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


class RunMismatchError(IncompatibleStateError):
    """A resume in a run that differs from the one that made the commit (another
    world size), refused before anything changes unless ``check_run=False``."""


class StorageError(CkvcError):
    """The operating system refused a read or write (disk full, I/O error, permissions).

    ``done`` says what had already happened when it failed, e.g. "nothing was
    committed" or "commit abc123 landed; its reflog entry was not written"."""

    exit_code = 18

    def __init__(
        self, message: str, *, path: str | None = None, errno: int | None = None, failure: str | None = None
    ) -> None:
        self.path = path
        self.errno = errno
        self.failure = failure  # "disk full while reading pack X": the message without its outcome
        super().__init__(message)

    def with_outcome(self, outcome: str) -> StorageError:
        """The same failure told with the outcome of the whole operation it ended
        (an outer :func:`storage_errors` knows it; the layer that failed does not)."""
        if self.failure is None:
            return self
        return type(self)(f"{self.failure}: {outcome}", path=self.path, errno=self.errno, failure=self.failure)


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


class InterruptedOperationError(CkvcError, KeyboardInterrupt):
    """Ctrl-C or a signal stopped an operation; the message says whether it took effect.

    ``landed`` is True when the operation had already taken effect (a commit whose
    branch had moved; ``result`` then holds its id): the CLI reports it and exits 0.
    Also a KeyboardInterrupt, so ``except KeyboardInterrupt`` still stops a training loop."""

    exit_code = 130

    def __init__(self, message: str, *, landed: bool = False, result: str | None = None) -> None:
        self.landed = landed
        self.result = result
        super().__init__(message)


class InvalidConfigError(UnsupportedFormatError):
    """The repository config file holds a value of the wrong type or out of range; names the key."""

    exit_code = 24


class NonFastForwardError(RefConflictError):
    """A push or pull that would drop commits from a branch (the other side has
    commits this one lacks), or move an existing tag; refused unless forced."""

    exit_code = 30


class UnknownRemoteError(InvalidInputError):
    """No remote of that name is configured, or its URL names no ckvc repository."""

    exit_code = 31


class RemoteSupportMissingError(CkvcError):
    """A remote URL whose backend is not installed (the ``remote`` extra for s3://, gs://, az://)."""

    exit_code = 32


class RemoteUnavailableError(CkvcError):
    """Data this repository does not hold locally (a lazy clone, or chunks the
    cache dropped) is needed and the remote that holds it cannot be reached.
    Names the remote and how many bytes are missing; nothing was changed.
    ``remote``: its name; ``missing_bytes``: stored bytes of the absent chunks."""

    exit_code = 34

    def __init__(self, message: str, *, remote: str | None = None, missing_bytes: int = 0) -> None:
        self.remote = remote
        self.missing_bytes = missing_bytes
        super().__init__(message)


class BackupIncompleteError(CkvcError):
    """auto_push had commits left to push when the process ended (the remote was
    down, or the wait at exit ran out): they stay queued in ``.ckvc/backup.json``.
    Only the exit status of a process that asked for it (``CKVC_REQUIRE_BACKUP=1``);
    otherwise a warning."""

    exit_code = 37


class SignatureError(CkvcError):
    """A commit or tag is not signed, carries a signature that does not verify, or
    is signed by a key that is not trusted (ckvc.signing): ``verify-commit`` says so,
    and with ``require_signatures`` every read path refuses it before any tensor
    byte is read."""

    exit_code = 38


class DistributedCommitError(CkvcError):
    """A multi-rank commit (ckvc.distributed) failed on some rank, or a rank was lost
    (killed, timed out): nothing was committed and the branch is unchanged. Raised
    on every surviving rank; ``failures`` maps a rank to what it reported."""

    exit_code = 40

    def __init__(self, message: str, *, failures: dict[int, str] | None = None) -> None:
        self.failures = dict(failures or {})
        super().__init__(message)


class EvaluationFailedError(CkvcError):
    """``ckvc validate``: the user's evaluation function could not be run, raised, or
    returned something that is not a metric (a mismatch is not this: exit 1)."""

    exit_code = 41


class UnexpectedError(CkvcError):
    """Exit code of the CLI's last-resort handler: an exception ckvc did not expect (a bug)."""

    exit_code = 70


class CkvcWarning(UserWarning):
    """Root of the warnings ckvc emits; the CLI prints each as one line on stderr."""


class DurabilityWarning(CkvcWarning):
    """An operation took effect, but a follow-up write failed (its reflog entry, a
    directory fsync); the repository repairs it on its next writable open."""


class DamageWarning(CkvcWarning):
    """Something damaged was skipped while reading (a stray ref file, a bad log line); fsck reports it."""


_FULL = (errno_mod.ENOSPC, errno_mod.EDQUOT, errno_mod.EFBIG)
_READ_ONLY = (errno_mod.EROFS, errno_mod.EACCES, errno_mod.EPERM)


def storage_error(exc: BaseException, action: str, outcome: str) -> StorageError:
    """The typed error for an OSError or lmdb error raised while ``action`` ran:
    one line saying what failed and ``outcome`` (what did and did not happen)."""
    err = exc.errno if isinstance(exc, OSError) else _lmdb_errno(exc)
    path = None
    if isinstance(exc, OSError) and exc.filename is not None:
        path = str(exc.filename)
    cls: type[StorageError]
    if err in _FULL or type(exc).__name__ == "MapFullError":
        cls, what = StorageFullError, "disk full"
    elif err in _READ_ONLY or type(exc).__name__ == "ReadonlyError":
        cls, what = ReadOnlyRepositoryError, "cannot write (read-only or no permission)"
    else:
        cls = StorageIOError
        if isinstance(exc, OSError) and exc.strerror:
            detail = exc.strerror
        else:
            detail = (str(exc).splitlines() or [type(exc).__name__])[0]
        what = f"I/O error ({detail})"
    where = f" ({path})" if path else ""
    failure = f"{what} while {action}{where}"
    return cls(f"{failure}: {outcome}", path=path, errno=err, failure=failure)


def _lmdb_errno(exc: BaseException) -> int | None:
    """lmdb reports OS errors as lmdb.Error with the strerror text only."""
    text = str(exc)
    for code in (*_FULL, *_READ_ONLY, errno_mod.EIO):
        if os.strerror(code) in text:
            return code
    return None


def is_storage_exception(exc: BaseException) -> bool:
    """An OSError or an lmdb error: what :func:`storage_errors` maps."""
    return isinstance(exc, OSError) or type(exc).__module__ == "lmdb"


@contextlib.contextmanager
def storage_errors(action: str, outcome: str) -> Iterator[None]:
    """Map OSError and lmdb errors raised inside the block to StorageFullError,
    ReadOnlyRepositoryError or StorageIOError, with a one-line message:
    ``with storage_errors("writing commit", "nothing was committed; the branch is unchanged"):``.
    A StorageError from a lower layer keeps its failure and takes this outcome;
    other CkvcErrors pass through unchanged."""
    try:
        yield
    except StorageError as exc:
        retold = exc.with_outcome(outcome)
        if retold is exc:
            raise
        raise retold from exc.__cause__
    except CkvcError:
        raise
    except Exception as exc:
        if not is_storage_exception(exc):
            raise
        raise storage_error(exc, action, outcome) from exc


__all__ = [
    "CkvcError",
    "CkvcWarning",
    "CorruptObjectError",
    "DamageWarning",
    "DamagedIndexError",
    "DistributedCommitError",
    "DurabilityWarning",
    "EvaluationFailedError",
    "IncompatibleStateError",
    "InsufficientMemoryError",
    "InterruptedOperationError",
    "InvalidConfigError",
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
    "SignatureError",
    "StorageError",
    "StorageFullError",
    "StorageIOError",
    "UnexpectedError",
    "UnknownKeyError",
    "UnsafeContentError",
    "UnsupportedFormatError",
    "UnsupportedTypeError",
    "after_landing",
    "is_storage_exception",
    "storage_error",
    "storage_errors",
]


@contextlib.contextmanager
def after_landing(
    done: str, *, result: str | None = None, on_failure: Callable[[], None] | None = None
) -> Iterator[None]:
    """The follow-up steps of an operation that has already taken effect (a ref
    has moved, gc's index swap is done). They cannot undo it, so reporting a
    failure would make a caller retry something that happened: an OS or lmdb
    error becomes a DurabilityWarning, and Ctrl-C an InterruptedOperationError
    with ``landed=True``. ``done`` says what took effect; ``on_failure`` records
    that a repair is due."""
    import warnings

    try:
        yield
    except KeyboardInterrupt:
        if on_failure is not None:
            on_failure()
        message = f"interrupted after it took effect: {done}"
        raise InterruptedOperationError(message, landed=True, result=result) from None
    except Exception as exc:
        # A StorageError: a backend's typed form of the same failure.
        if not (is_storage_exception(exc) or isinstance(exc, StorageError)):
            raise
        if on_failure is not None:
            on_failure()
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        warnings.warn(DurabilityWarning(f"{done}, but a follow-up write failed ({detail})"), stacklevel=3)
