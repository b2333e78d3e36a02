"""Repo: the user-facing API. Commit, checkout, load, log, show, diff, branch, tag, resolve."""

from __future__ import annotations

import atexit
import collections
import dataclasses
import difflib
import fnmatch
import getpass
import heapq
import math
import os
import re
import shutil
import socket
import sys
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

import numpy as np

from ckvc.chunking import chunk_spans
from ckvc.codecs import DELTA, QUANT, DeltaBase, layout_for, make_codec
from ckvc.codecs.lossy import DTYPE_CODES as LOSSY_DTYPES
from ckvc.codecs.lossy import MODES as LOSSY_MODES
from ckvc.codecs.lossy import quantize
from ckvc.config import CODECS_VERSION, FILES_VERSION, RepoConfig
from ckvc.errors import (
    CkvcError,
    CorruptObjectError,
    DurabilityWarning,
    InterruptedOperationError,
    InvalidInputError,
    InvalidRevisionError,
    NotARepositoryError,
    ObjectNotFoundError,
    PrunedCommitError,
    RefConflictError,
    RefNotFoundError,
    StorageError,
    UnsafeContentError,
    UnsupportedFormatError,
    is_storage_exception,
    storage_error,
    storage_errors,
)
from ckvc.executor import Executor
from ckvc.ids import ObjectType, is_full_hex_id, object_id
from ckvc.objects import Blob, Commit, Snapshot, Tag, validate_metadata, validate_metrics
from ckvc.pruned import PruneLog, PruneRecord
from ckvc.refs import BRANCH_PREFIX, HEAD, TAG_PREFIX, ReflogEntry, RefStore, branch_ref, check_ref_name, tag_ref
from ckvc.stats import CodecUsage, codec_usage
from ckvc.storage.files import file_lock, require_writable
from ckvc.storage.object_store import ObjectStore, ObjectWriter

# torch is imported only where tensors are made or read (ckvc.state, ckvc.view, the
# bodies of commit/load/show/diff), so log, status, branch and tag start fast.
if TYPE_CHECKING:
    import torch

    from ckvc.gc import GcReport
    from ckvc.integrations.torch_nn import IncompatibleKeys
    from ckvc.retention import RetentionPlan, RetentionPolicy
    from ckvc.state import MapLocation, PendingBlob, TensorInfo
    from ckvc.view import CommitView

REPO_DIR = ".ckvc"
MIN_PREFIX = 4
_SUFFIX = re.compile(r"(~(\d*)|\^(\d*))")

# done bytes, total bytes
ProgressCallback = Callable[[int, int], None]


# What encoding one chunk produced: id, codec (-1: already stored), payload, the
# base it uses, whether a delta base was offered at all, and for a quantized
# chunk (max abs error, sum of squared errors, sum of squared values).
_Encoded = tuple[bytes, int, Any, bytes | None, bool, tuple[float, float, float] | None]
MIN_DELTA_CHUNK = 64 << 10  # chunks below this many bytes are always stored whole
# Tensors smaller than this stay exact under any lossy spec: step counters and
# scalars cost nothing and must not drift.
MIN_LOSSY_ELEMENTS = 4096
LOSSY_PRESETS: dict[str, dict[str, str]] = {
    "optimizer-q8": {"optimizer.*": "q8"},
    "optimizer-q4": {"optimizer.*": "q4"},
    "compact-q4": {"optimizer.*": "q4", "model.*": "residual-q4"},
}
LossySpec = str | Mapping[str, str] | None


@dataclass
class CommitStats:
    """What one commit wrote: how much was new, and what it cost on disk."""

    commit: str
    logical_bytes: int = 0  # tensor bytes in the state
    chunks: int = 0
    new_chunks: int = 0
    new_chunk_raw_bytes: int = 0
    new_chunk_stored_bytes: int = 0
    stored_bytes: int = 0  # everything appended to packs, metadata included
    seconds: float = 0.0


@dataclass(frozen=True)
class TensorSummary:
    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    kind: str  # "tensor", "parameter" or "numpy"


@dataclass
class CommitInfo:
    commit: Commit
    tensors: list[TensorSummary]
    values: dict[str, Any]  # non-tensor leaves by path
    logical_bytes: int
    stored_bytes: int  # stored size of the chunks this commit uses (shared ones included)
    by_codec: dict[str, CodecUsage] = field(default_factory=dict)  # over the same chunks
    blobs: int = 0  # stored byte buffers (tensors sharing storage share one)


class PendingCommit:
    """A commit being written in the background (``Repo.commit(..., blocking=False)``)."""

    def __init__(self, future: Future[str]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> str:
        """The commit id once it is durable and the branch has moved; raises its error."""
        self._future.ckvc_reported = True  # type: ignore[attr-defined]
        return self._future.result(timeout)


# Repos with background commits: finished (or their failure reported) at exit,
# never silently dropped.
_OPEN_REPOS: weakref.WeakSet[Repo] = weakref.WeakSet()


@atexit.register
def _finish_background_commits() -> None:
    """Wait for background commits; if one failed and nobody saw its error, say so
    and end the process with a non-zero status (the error's exit code), so a
    script whose last checkpoint was lost does not exit 0."""
    failed: BaseException | None = None
    for repo in list(_OPEN_REPOS):
        for future in repo._pending:
            try:
                future.result()
            except BaseException as exc:
                if getattr(future, "ckvc_reported", False):
                    continue  # its caller already got this error
                print(f"ckvc: a background commit in {repo.path} failed: {exc}", file=sys.stderr)
                failed = failed or exc
    if failed is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        # SystemExit raised in an atexit handler does not change the status; this does.
        os._exit(failed.exit_code if isinstance(failed, CkvcError) else 1)


@dataclass(frozen=True)
class Reached:
    """An object met by Repo.walk: a commit, a tag object (``commit`` None), or
    an object that could not be read (``error``)."""

    oid: str
    commit: Commit | None = None
    error: ObjectNotFoundError | CorruptObjectError | None = None


@dataclass(frozen=True)
class TensorChange:
    path: str
    old: TensorSummary
    new: TensorSummary
    rel_l2: float | None  # ||new - old|| / ||old||; None when shapes or dtypes differ
    max_abs: float | None


@dataclass
class StateDiff:
    """What changed from commit ``a`` to ``b``. ``changed`` comes largest relative
    change first (shape or dtype changes, which have none, before all others);
    tensors and values under an RNG state (``is_rng_path``) are not listed one by
    one but counted in ``rng_changed``, since they change on every step."""

    a: str
    b: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[TensorChange] = field(default_factory=list)
    values_changed: list[tuple[str, Any, Any]] = field(default_factory=list)
    metrics_changed: list[tuple[str, float | None, float | None]] = field(default_factory=list)
    added_bytes: int = 0
    removed_bytes: int = 0
    changed_bytes: int = 0  # bytes of the changed tensors (new side)
    unchanged: int = 0  # tensors identical in both
    rng_changed: list[str] = field(default_factory=list)  # RNG-state leaves that differ


_RNG_PART = re.compile(r"(?i)^(rng|rng_states?|random_states?|generator|rng_state(_\d+)?(\.pth)?)$")


def is_rng_path(path: str) -> bool:
    """Whether a state path lies under an RNG state (``ckvc.rng_state()`` saved as
    "rng", Hugging Face's "rng_state.pth", a "generator"): noise, not training."""
    return any(_RNG_PART.match(part) for part in re.split(r"[./]", path)) or "rng_state" in path


def _matches(path: str, patterns: Sequence[str]) -> bool:
    """``path`` is one of ``patterns``, lies under one ("model" covers "model.w"), or
    matches one as a glob ("*.weight")."""
    return any(path == p or path.startswith(p.rstrip(".") + ".") or fnmatch.fnmatchcase(path, p) for p in patterns)


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """ "; did you mean 'main'?" when a candidate is close to ``word``, else ""."""
    close = difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.6)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"


def _check_utf8(what: str, *values: Any) -> None:
    """Text must encode as UTF-8: a str holding lone surrogates (undecodable bytes
    from a command line or file name) cannot be stored."""
    for value in values:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidInputError(f"{what} is not valid UTF-8 text: {value!r}") from None


def _default_author() -> str:
    name = os.environ.get("CKVC_AUTHOR")
    if name:
        return name
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _thread_count(threads: int | None) -> int:
    """Worker threads for the chunk pipeline: ``threads``, else $CKVC_THREADS, else
    one per core. 1 runs every step inline, on the calling thread."""
    if threads is None:
        env = os.environ.get("CKVC_THREADS", "").strip()
        if not env:
            return os.cpu_count() or 2
        try:
            threads = int(env)
        except ValueError:
            raise InvalidInputError(f"CKVC_THREADS must be a positive integer, got {env!r}") from None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidInputError(f"threads must be a positive integer, got {threads!r}")
    return threads


class _OpenRepo(Protocol):
    def __call__(self, path: str | os.PathLike[str] = ".", *, threads: int | None = None) -> Repo: ...


class _OpenView(Protocol):
    def __call__(
        self,
        rev: str = "HEAD",
        map_location: MapLocation = None,
        *,
        allow_pickle: bool = False,
        progress: ProgressCallback | None = None,
    ) -> CommitView: ...


class _RepoOrCommit:
    """``Repo.open(path)`` on the class opens a repository; ``repo.open(rev)`` on an
    instance opens a commit, as ``repo.view(rev)`` does (docs/DESIGN.md, "Lazy
    views and partial loads")."""

    @overload
    def __get__(self, instance: None, owner: type[Repo]) -> _OpenRepo: ...

    @overload
    def __get__(self, instance: Repo, owner: type[Repo] | None = None) -> _OpenView: ...

    def __get__(self, instance: Repo | None, owner: type[Repo] | None = None) -> _OpenRepo | _OpenView:
        if instance is not None:
            return instance.view
        assert owner is not None
        return owner._open_repository


def find_repo_root(start: str | os.PathLike[str]) -> Path:
    """The directory holding ``.ckvc``, searching ``start`` and its parents like git."""
    path = Path(start).resolve()
    if path.name == REPO_DIR and (path / "config.json").is_file():
        return path.parent
    for candidate in (path, *path.parents):
        if (candidate / REPO_DIR / "config.json").is_file():
            return candidate
    raise NotARepositoryError(f"not a ckvc repository (or any parent up to /): {path}")


class Repo:
    """A ckvc repository: ``path/.ckvc`` holding packs, an index, refs and config."""

    def __init__(self, root: Path, *, threads: int | None = None) -> None:
        self.path = root
        self.threads = _thread_count(threads)
        self.dir = root / REPO_DIR
        self.config = RepoConfig.load(self.dir)
        self.store = ObjectStore(self.dir)
        self.refs = RefStore(self.dir)
        self.prune_log = PruneLog(self.dir)
        if self.refs.repair_pending(self._object_exists):
            self._repair_on_open()
        self._codec = make_codec(str(self.config.codec["name"]), self.config.codec.get("level"))
        self._pool: ThreadPoolExecutor | None = None
        self.executor = Executor(self.threads)  # reads (ckvc.read)
        self._commit_thread: ThreadPoolExecutor | None = None
        self._pending: list[Future[str]] = []
        self.last_commit_stats: CommitStats | None = None
        # Per tensor path: commits left before a delta is tried again, after a
        # delta lost to standalone encoding (optimizer moments often do).
        self._delta_backoff: dict[str, tuple[int, int]] = {}

    # ---- lifecycle ----------------------------------------------------------
    @classmethod
    def init(
        cls,
        path: str | os.PathLike[str] = ".",
        *,
        chunk_size: int | None = None,
        codec: Mapping[str, Any] | None = None,
        default_branch: str = "main",
        keyframe_interval: int | None = None,
        threads: int | None = None,
    ) -> Repo:
        """Create ``path/.ckvc`` (and ``path`` if needed). Built in a temporary
        directory and renamed into place, so a crash leaves no half repository.
        ``codec``: ``{"name": "auto"|"zstd"|"raw", "level": n}``; ``keyframe_interval``:
        how often a tensor's chunks are stored whole, deltas in between (1: no deltas).
        ``threads``: as for ``Repo.open``."""
        root = Path(path).resolve()
        target = root / REPO_DIR
        if target.exists():
            raise InvalidInputError(f"{target} already exists")
        if root.exists() and not root.is_dir():
            raise InvalidInputError(f"{root} is not a directory")
        config = RepoConfig(default_branch=default_branch)
        if chunk_size is not None:
            config.chunk_size = chunk_size
        if codec is not None:
            config.codec = dict(codec)
        if keyframe_interval is not None:
            config.keyframe_interval = keyframe_interval
        try:
            config.validate()
            branch_ref(default_branch)
        except ValueError as exc:
            if isinstance(exc, CkvcError):
                raise
            raise InvalidInputError(str(exc)) from None
        root.mkdir(parents=True, exist_ok=True)
        staging = root / f".ckvc-init-{uuid.uuid4().hex}"
        try:
            staging.mkdir()
            for sub in ("packs", "refs/heads", "refs/tags", "logs"):
                (staging / sub).mkdir(parents=True)
            config.save(staging)
            for lock in ("gc.lock", "gc-intent.lock", "gc-run.lock", "refs.lock", "pruned.lock"):  # flock targets
                (staging / lock).touch()
            RefStore(staging).init_head(branch_ref(default_branch))
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return cls(root, threads=threads)

    @classmethod
    def _open_repository(cls, path: str | os.PathLike[str] = ".", *, threads: int | None = None) -> Repo:
        """Open the repository at ``path`` or in one of its parents. ``threads``:
        worker threads for hashing, encoding and decoding chunks (default
        $CKVC_THREADS, else one per core; 1 runs serially, with the same results)."""
        return cls(find_repo_root(path), threads=threads)

    # Repo.open(path) opens a repository; repo.open(rev) opens a commit (= repo.view(rev)).
    open = _RepoOrCommit()

    def _require_writable(self, action: str) -> None:
        """Refuse a write up front in a repository this process cannot write (a
        read-only mount, no write permission), even one that would change nothing."""
        require_writable(self.dir, action)

    def _object_exists(self, oid: str) -> bool:
        try:
            return self.store.has(bytes.fromhex(oid))
        except (ValueError, CkvcError):
            return False

    def _repair_on_open(self) -> None:
        """Finish what an update left undone after it took effect (a reflog entry
        or directory fsync that failed; docs/DESIGN.md, "Exact outcomes"). A
        repository that still cannot be written keeps the marker for later."""
        try:
            restored = self.refs.repair()
        except (OSError, CkvcError):
            return
        if restored:
            warnings.warn(DurabilityWarning(f"restored {restored} reflog entries lost to failed writes"), stacklevel=3)

    def close(self) -> None:
        """Finish pending background commits (raising the first error), then close."""
        try:
            self.wait()
        finally:
            if self._commit_thread is not None:
                self._commit_thread.shutdown(wait=True)
                self._commit_thread = None
            _OPEN_REPOS.discard(self)
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            self.executor.close()
            self.store.close()

    def wait(self) -> None:
        """Wait for every pending background commit; raise the first error not yet seen."""
        futures_wait(self._pending)
        self._raise_background_error()

    def _committer(self) -> ThreadPoolExecutor:
        if self._commit_thread is None:
            # One thread: background commits land in order, each moving the branch from the last.
            self._commit_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckvc-commit")
            _OPEN_REPOS.add(self)
        return self._commit_thread

    def _raise_background_error(self) -> None:
        """Drop finished background commits; raise the first failure nobody has seen."""
        still, error = [], None
        for future in self._pending:
            if not future.done():
                still.append(future)
            elif future.exception() is not None and not getattr(future, "ckvc_reported", False):
                future.ckvc_reported = True  # type: ignore[attr-defined]
                error = error or future.exception()
        self._pending = still
        if error is not None:
            raise error

    def __enter__(self) -> Repo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Repo({str(self.path)!r})"

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn`` on the pool; inline once the interpreter is shutting down
        (a background commit finishing at exit can no longer use the pool), and
        always when the repository runs serially (``threads=1``)."""
        if self.threads > 1:
            try:
                return self.pool.submit(fn, *args)
            except RuntimeError:
                pass
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="ckvc")
        return self._pool

    # ---- commit -------------------------------------------------------------
    @overload
    def commit(
        self,
        state: Any,
        message: str = "",
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        *,
        merge: Sequence[str] = (),
        allow_pickle: bool = False,
        retain: bool | None = None,
        blocking: Literal[True] = True,
        progress: ProgressCallback | None = None,
        lossy: LossySpec = None,
        time_ns: int | None = None,
    ) -> str: ...

    @overload
    def commit(
        self,
        state: Any,
        message: str = "",
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        *,
        merge: Sequence[str] = (),
        allow_pickle: bool = False,
        retain: bool | None = None,
        blocking: Literal[False],
        progress: ProgressCallback | None = None,
        lossy: LossySpec = None,
        time_ns: int | None = None,
    ) -> PendingCommit: ...

    def commit(
        self,
        state: Any,
        message: str = "",
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        *,
        merge: Sequence[str] = (),
        allow_pickle: bool = False,
        retain: bool | None = None,
        blocking: bool = True,
        progress: ProgressCallback | None = None,
        lossy: LossySpec = None,
        time_ns: int | None = None,
    ) -> str | PendingCommit:
        """Store ``state`` as a new commit on the current branch (or detached HEAD)
        and return its id. Everything is durable before the branch moves.

        ``merge`` names further revisions to record as parents (e.g. the runs a
        weight average was made from); HEAD's commit stays the first parent.
        ``retain`` applies the stored retention policy afterwards (default: when
        the policy says ``auto``).

        ``lossy`` (opt-in, never the default) stores matching float tensors
        quantized: ``{"optimizer.*": "q4", "model.*": "residual-q4"}`` (glob
        patterns over tensor paths; modes q8, q4, residual-q8, residual-q4) or a
        preset name (LOSSY_PRESETS). The commit records which tensors are lossy
        and their measured errors (``Commit.lossy``).

        ``time_ns`` sets the commit time (default: now), e.g. a file's mtime
        when importing an existing checkpoint folder (ckvc.importer).

        ``blocking=False`` returns a PendingCommit as soon as the state's bytes
        are copied, so training may change its tensors at once; the commit is
        written in the background, in order with other commits. Its errors
        surface on ``.result()`` and at the next commit, ``wait()`` or close."""
        self._require_writable("committing")
        if blocking:
            self.wait()  # commits land in the order they were made; raises unseen background errors
        else:
            self._raise_background_error()
        started = time.perf_counter()
        if not isinstance(message, str):
            raise InvalidInputError("message must be a str")
        _check_utf8("message", message)
        for key, value in (metadata or {}).items():
            _check_utf8("metadata", key, value)
        policy = self.retention_policy()
        if retain and policy is None:
            raise InvalidInputError("retain=True but no retention policy is set (Repo.set_retention)")
        try:
            clean_metrics = validate_metrics(metrics)
            clean_metadata = validate_metadata(metadata)
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from None
        if time_ns is not None and (isinstance(time_ns, bool) or not isinstance(time_ns, int) or time_ns < 0):
            raise InvalidInputError(f"time_ns must be a non-negative int, got {time_ns!r}")
        self._lossy_modes([], lossy)  # a bad spec fails here, before any work
        from ckvc import state as state_mod

        # Async: GPU tensors go to pinned host memory (when CUDA is present).
        tree, pending, pickled, has_files = state_mod.encode_state(
            state, allow_pickle=allow_pickle, pin_memory=not blocking
        )
        if has_files or any(not isinstance(v, str) for v in clean_metadata.values()):
            self._upgrade_format(FILES_VERSION)
        elif lossy is not None:
            self._upgrade_format(CODECS_VERSION)  # quantized records are a version-2 codec
        if not blocking:
            # Own the bytes now: the caller may mutate its tensors as soon as we return.
            # Blobs that already are private copies (from a GPU, made contiguous) are kept as they are.
            owned = [
                b if b.private else dataclasses.replace(b, **state_mod.private_copy(b.data), private=True)
                for b in pending
            ]
            future = self._committer().submit(
                self._write_commit,
                tree, owned, pickled, message, clean_metrics, clean_metadata, merge, policy, retain, progress, started,
                lossy, time_ns,
            )  # fmt: skip
            self._pending.append(future)
            return PendingCommit(future)
        return self._write_commit(
            tree,
            pending,
            pickled,
            message,
            clean_metrics,
            clean_metadata,
            merge,
            policy,
            retain,
            progress,
            started,
            lossy,
            time_ns,
        )

    def _write_commit(
        self,
        tree: bytes,
        pending: list[PendingBlob],
        pickled: bool,
        message: str,
        clean_metrics: dict[str, float],
        clean_metadata: dict[str, Any],
        merge: Sequence[str],
        policy: RetentionPolicy | None,
        retain: bool | None,
        progress: ProgressCallback | None,
        started: float,
        lossy: LossySpec = None,
        time_ns: int | None = None,
    ) -> str:
        """Write the objects and move the branch. The outcome is exact (docs/GUIDE.md,
        "Errors and exit codes"): an error means the branch did not move; once it
        has moved the commit is reported, a failing follow-up step being a warning."""
        # What is known so far: the branch (None: detached HEAD) and the commit id once written.
        outcome: dict[str, str | None] = {"where": "HEAD", "target": None, "commit": None}
        try:
            commit_id = self._write_commit_objects(
                tree, pending, pickled, message, clean_metrics, clean_metadata, merge, progress, started, lossy,
                time_ns, outcome,
            )  # fmt: skip
        except BaseException as exc:
            where = outcome["where"]
            written = outcome["commit"]
            if written is None or not self._landed(outcome["target"], written):
                unchanged = f"nothing was committed; {where} is unchanged"
                if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, CkvcError):
                    raise InterruptedOperationError(f"interrupted: {unchanged}") from None
                if not isinstance(exc, CkvcError) and is_storage_exception(exc):
                    raise storage_error(exc, "writing the commit", unchanged) from exc
                if isinstance(exc, StorageError):
                    raise exc.with_outcome(unchanged) from exc.__cause__
                raise
            if isinstance(exc, InterruptedOperationError):
                raise
            if isinstance(exc, KeyboardInterrupt):
                raise InterruptedOperationError(
                    f"interrupted after commit {written[:12]} landed on {where}", landed=True, result=written
                ) from None
            if not isinstance(exc, Exception):
                raise
            warnings.warn(
                DurabilityWarning(f"commit {written[:12]} landed on {where}, but a later step failed: {exc}"),
                stacklevel=2,
            )
            return written
        if policy is not None and (retain or (retain is None and policy.auto)):
            try:
                self.retain(policy)
            except KeyboardInterrupt:
                raise InterruptedOperationError(
                    f"interrupted during retention after commit {commit_id[:12]} landed", landed=True, result=commit_id
                ) from None
            except CkvcError as exc:
                warnings.warn(
                    DurabilityWarning(f"commit {commit_id[:12]} landed, but the retention policy failed: {exc}"),
                    stacklevel=2,
                )
        return commit_id

    def _landed(self, target: str | None, commit_id: str) -> bool:
        """Whether the branch (or detached HEAD) names ``commit_id`` now."""
        try:
            current = self.refs.read(target) if target is not None else self.refs.head()[1]
        except (OSError, CkvcError):
            return False
        return current == commit_id

    def _write_commit_objects(
        self,
        tree: bytes,
        pending: list[PendingBlob],
        pickled: bool,
        message: str,
        clean_metrics: dict[str, float],
        clean_metadata: dict[str, str],
        merge: Sequence[str],
        progress: ProgressCallback | None,
        started: float,
        lossy: LossySpec,
        time_ns: int | None,
        outcome: dict[str, str | None],
    ) -> str:
        stats = CommitStats(commit="")
        lossy_report: dict[str, dict[str, Any]] = {}
        # The pin keeps gc from removing anything this commit deduplicates against
        # until its branch has moved (gc then sees the commit from the refs).
        with self.store.pin(), self.store.writer(self._codec, self.config.max_pack_size) as writer:
            target, parent = self.refs.head()
            outcome["target"] = target
            outcome["where"] = target or "HEAD"
            if parent is not None:
                self._check_parent(target or "HEAD", parent)
            extra_parents = tuple(dict.fromkeys(self.resolve(r) for r in merge))
            parent_blobs = self._delta_candidates(parent)
            blobs = self._store_blobs(writer, pending, stats, progress, parent_blobs, lossy, lossy_report)
            snapshot_id = writer.put(ObjectType.SNAPSHOT, Snapshot(tuple(blobs), tree).encode())
            commit = Commit(
                tree=snapshot_id.hex(),
                parents=tuple(dict.fromkeys(((parent,) if parent else ()) + extra_parents)),
                author=_default_author(),
                time_ns=time.time_ns() if time_ns is None else time_ns,
                message=message,
                metrics=clean_metrics,
                metadata=clean_metadata,
                pickled=pickled,
                lossy=lossy_report,
            )
            commit_id = writer.put(ObjectType.COMMIT, commit.encode()).hex()
            outcome["commit"] = commit_id
            writer.commit()
            reflog_message = f"commit: {message.splitlines()[0] if message else ''}".rstrip()
            if target is not None:
                self.refs.set_if_equals(target, parent, commit_id, reflog_message)
            else:
                assert parent is not None
                self.refs.set_head_if_equals(parent, commit_id, reflog_message)
        stats.stored_bytes = writer.bytes_written
        stats.commit = commit_id
        stats.seconds = time.perf_counter() - started
        self.last_commit_stats = stats
        return commit_id

    def _check_parent(self, where: str, parent: str) -> None:
        """Refuse to build on a branch that names a missing object or a non-commit:
        the new commit's history would be broken. Nothing is written yet."""
        try:
            kind = self.store.stat(bytes.fromhex(parent)).kind
        except ObjectNotFoundError:
            raise ObjectNotFoundError(
                f"{where} names commit {parent[:12]}, which is not in the repository: "
                "nothing was committed; run `ckvc fsck`"
            ) from None
        if kind != ObjectType.COMMIT:
            raise CorruptObjectError(
                f"{where} names a {kind.name.lower()} object, not a commit: nothing was committed; run `ckvc fsck`",
                object_id=parent,
            )

    def _chunk_size_for(self, itemsize: int) -> int:
        """The repo chunk size rounded down to whole elements (odd numpy itemsizes),
        and never less than one element."""
        size = self.config.chunk_size
        return max(itemsize, size - size % itemsize) if itemsize > 1 else size

    def _delta_candidates(self, parent: str | None) -> dict[str, Blob]:
        """The first parent's blobs by tensor path: the default delta bases."""
        if parent is None or not self._codec.uses_bases or self.config.keyframe_interval < 2:
            return {}
        try:
            snapshot = self.read_snapshot(self.read_commit(parent))
        except (CorruptObjectError, ObjectNotFoundError):
            return {}  # a damaged parent only costs the deltas; fsck reports it
        by_path: dict[str, Blob] = {}
        for blob in snapshot.blobs:
            by_path.setdefault(blob.path, blob)
        return by_path

    def _delta_base(self, parent_chunk: bytes | None) -> DeltaBase | None:
        """The keyframe a new chunk is stored against: the parent's chunk at the
        same offset if that is stored whole, else the parent chunk's own base.
        Every delta is then one link from a whole chunk, so a checkout decodes at
        most two records per chunk (docs/DESIGN.md, "Delta bases"). None once the
        keyframe is ``keyframe_interval`` commits old: the chunk becomes a keyframe."""
        if parent_chunk is None:
            return None
        try:
            keyframe, age = parent_chunk, 0
            info = self.store.base_info(parent_chunk)
            if not info.whole:
                if info.base is None:
                    return None  # a lossy chunk without a keyframe: nothing exact to build on
                keyframe, age = info.base, info.age
            if age + 1 >= self.config.keyframe_interval or not self.store.base_info(keyframe).whole:
                return None
            return DeltaBase(keyframe, self.store.read(keyframe, ObjectType.CHUNK), 0, age)
        except (CorruptObjectError, ObjectNotFoundError):
            return None  # never build on a damaged base: store this chunk whole

    def _tries_delta(self, path: str) -> bool:
        wait, _ = self._delta_backoff.get(path, (0, 0))
        if wait > 0:
            self._delta_backoff[path] = (wait - 1, self._delta_backoff[path][1])
        return wait == 0

    def _record_delta_outcome(self, path: str, won: bool) -> None:
        """Exponential backoff for tensors whose delta keeps losing: 1, 2, 4, 8 commits."""
        if won:
            self._delta_backoff.pop(path, None)
        else:
            _, losses = self._delta_backoff.get(path, (0, 0))
            self._delta_backoff[path] = (1 << min(losses, 3), losses + 1)

    @staticmethod
    def _lossy_modes(pending: Sequence[PendingBlob], lossy: LossySpec) -> list[str | None]:
        """The lossy mode of each blob (None: exact) from a spec of glob patterns
        over tensor paths, or a preset name. The first matching pattern wins."""
        if lossy is None:
            return [None] * len(pending)
        if isinstance(lossy, str):
            if lossy not in LOSSY_PRESETS:
                raise InvalidInputError(f"unknown lossy preset {lossy!r}; known: {sorted(LOSSY_PRESETS)}")
            lossy = LOSSY_PRESETS[lossy]
        for pattern, mode in lossy.items():
            if mode not in LOSSY_MODES:
                raise InvalidInputError(f"unknown lossy mode {mode!r} for {pattern!r}; known: {sorted(LOSSY_MODES)}")
        modes: list[str | None] = []
        for blob in pending:
            matched = next((m for p, m in lossy.items() if fnmatch.fnmatchcase(blob.path, p)), None)
            eligible = blob.dtype in LOSSY_DTYPES and len(blob.data) // blob.itemsize >= MIN_LOSSY_ELEMENTS
            modes.append(matched if eligible else None)
        return modes

    def _quantize(self, view: memoryview, dtype: str, mode: str, parent_chunk: bytes | None) -> _Encoded | None:
        """A quantized chunk, or None to store it exactly: a residual mode without
        an exact keyframe to build on stores the chunk whole (it becomes one)."""
        bits, residual = LOSSY_MODES[mode]
        keyframe = self._delta_base(parent_chunk) if residual else None
        if residual and keyframe is None:
            return None
        result = quantize(view, dtype, bits, keyframe.plain if keyframe else None, keyframe.age + 1 if keyframe else 1)
        if result is None:
            return None  # non-finite values: kept exact
        oid = object_id(ObjectType.CHUNK, result.plain.data)
        error = (result.max_abs_error, result.sum_sq_error, result.sum_sq_value)
        return oid, QUANT, result.payload, keyframe.oid if keyframe else None, False, error

    def _store_blobs(
        self,
        writer: ObjectWriter,
        pending: list[PendingBlob],
        stats: CommitStats,
        progress: ProgressCallback | None,
        parent_blobs: Mapping[str, Blob] | None = None,
        lossy: LossySpec = None,
        lossy_report: dict[str, dict[str, Any]] | None = None,
    ) -> list[Blob]:
        """Hash and encode chunks on the pool; append them in order on this thread.
        At most a few chunks are in flight, so memory stays bounded. A chunk whose
        tensor existed in the parent with the same dtype and size may be stored
        as a delta against the parent's chunk at the same offset."""
        parent_blobs = parent_blobs or {}
        lossy_report = {} if lossy_report is None else lossy_report

        def work(view: memoryview, layout: Any, parent_chunk: bytes | None, dtype: str, mode: str | None) -> _Encoded:
            if mode is not None:
                quantized = self._quantize(view, dtype, mode, parent_chunk)
                if quantized is not None:
                    return (
                        quantized if writer.wants(quantized[0]) else (quantized[0], -1, None, None, False, quantized[5])
                    )
            oid = object_id(ObjectType.CHUNK, view)
            if not writer.wants(oid):
                return oid, -1, None, None, False, None
            base = self._delta_base(parent_chunk)
            codec_id, payload = writer.encode(view, layout, base)
            if base is None:
                return oid, codec_id, payload, None, False, None
            return oid, codec_id, payload, base.oid if codec_id == DELTA else None, True, None

        total = sum(len(b.data) for b in pending)
        done = 0
        # Enough chunks in flight to keep every core busy while a pack is sealed
        # (fsync); at 4 MiB chunks this bounds extra memory to a few tens of MiB.
        max_in_flight = 4 * (os.cpu_count() or 2) + 2
        in_flight: collections.deque[tuple[int, Future[_Encoded], int]]
        in_flight = collections.deque()
        chunk_ids: list[list[bytes]] = [[] for _ in pending]

        delta_tried = [False] * len(pending)
        delta_won = [False] * len(pending)
        modes = self._lossy_modes(pending, lossy)
        errors: dict[int, tuple[float, float, float, int]] = {}

        def drain_one() -> None:
            nonlocal done
            blob_index, fut, raw_size = in_flight.popleft()
            oid, codec_id, payload, base_oid, offered, error = fut.result()
            delta_tried[blob_index] |= offered
            if error is not None:
                max_abs, sq_err, sq_val, count = errors.get(blob_index, (0.0, 0.0, 0.0, 0))
                errors[blob_index] = (max(max_abs, error[0]), sq_err + error[1], sq_val + error[2], count + raw_size)
            chunk_ids[blob_index].append(oid)
            delta_won[blob_index] |= codec_id == DELTA
            stats.chunks += 1
            if payload is not None:
                before = writer.bytes_written
                if writer.add_encoded(ObjectType.CHUNK, oid, raw_size, codec_id, payload, base_oid):
                    stats.new_chunks += 1
                    stats.new_chunk_raw_bytes += raw_size
                    stats.new_chunk_stored_bytes += writer.bytes_written - before
            done += raw_size
            if progress is not None:
                progress(done, total)

        try:
            for index, blob in enumerate(pending):
                stats.logical_bytes += len(blob.data)
                chunk_size = self._chunk_size_for(blob.itemsize)
                layout = layout_for(blob.dtype)
                before = parent_blobs.get(blob.path)
                bases: Sequence[bytes | None] = ()
                if (
                    before is not None
                    and (before.dtype, before.nbytes, before.chunk_size) == (blob.dtype, len(blob.data), chunk_size)
                    and (modes[index] is not None or self._tries_delta(blob.path))
                ):
                    bases = before.chunks
                for i, (start, end) in enumerate(chunk_spans(len(blob.data), chunk_size)):
                    # A tiny chunk's delta saves a few hundred bytes and costs a second
                    # record read and decode on every checkout (lossy residuals excepted).
                    small = end - start < MIN_DELTA_CHUNK and modes[index] is None
                    base_oid = bases[i] if i < len(bases) and not small else None
                    task = self._submit(work, blob.data[start:end], layout, base_oid, blob.dtype, modes[index])
                    in_flight.append((index, task, end - start))
                    if len(in_flight) >= max_in_flight:
                        drain_one()
            while in_flight:
                drain_one()
        finally:
            for _, fut, _ in in_flight:
                fut.cancel()
        for index, blob in enumerate(pending):
            if delta_tried[index]:
                self._record_delta_outcome(blob.path, delta_won[index])
        for index, (max_abs, sq_err, sq_val, nbytes) in sorted(errors.items()):
            elements = nbytes // pending[index].itemsize
            lossy_report[pending[index].path] = {
                "codec": str(modes[index]),
                "max_abs_error": max_abs,
                "rms_error": math.sqrt(sq_err / elements) if elements else 0.0,
                "rel_rms_error": math.sqrt(sq_err / sq_val) if sq_val else 0.0,
            }
        return [
            Blob(b.path, b.dtype, len(b.data), self._chunk_size_for(b.itemsize), tuple(ids))
            for b, ids in zip(pending, chunk_ids, strict=True)
        ]

    # ---- reading ------------------------------------------------------------
    def read_commit(self, commit_id: str) -> Commit:
        try:
            raw = self.store.read(bytes.fromhex(commit_id), ObjectType.COMMIT)
        except CorruptObjectError as exc:
            raise exc.with_context(commit=commit_id) from None
        return Commit.decode(raw, commit_id)

    def read_tag(self, tag_id: str) -> Tag:
        return Tag.decode(self.store.read(bytes.fromhex(tag_id), ObjectType.TAG), tag_id)

    def read_snapshot(self, commit: Commit) -> Snapshot:
        try:
            return Snapshot.decode(self.store.read(bytes.fromhex(commit.tree), ObjectType.SNAPSHOT))
        except CorruptObjectError as exc:
            raise exc.with_context(commit=commit.id) from None

    def readable_commit(self, rev: str, *, allow_pickle: bool = False) -> Commit:
        """The commit ``rev`` names, refused as every read refuses it: pruned
        (PrunedCommitError), or holding pickles unless allowed (UnsafeContentError)."""
        commit = self.read_commit(self.resolve(rev))
        self._check_not_pruned(commit.id)
        if commit.pickled and not allow_pickle:
            raise UnsafeContentError(
                f"commit {commit.id[:12]} holds pickled values, which can run code; "
                "load with allow_pickle=True only if you trust it"
            )
        return commit

    def load(
        self,
        rev: str = "HEAD",
        map_location: MapLocation = None,
        *,
        allow_pickle: bool = False,
        progress: ProgressCallback | None = None,
        keys: Iterable[str] | None = None,
        prefix: str | None = None,
    ) -> Any:
        """The state stored in ``rev``; HEAD does not move. Every byte is verified.

        With ``keys`` (leaf paths as ``show`` lists them, "model.layer.0.weight")
        and/or ``prefix`` ("model."): only those leaves, as a flat dict by path,
        reading only the chunks they cover. UnknownKeyError (a KeyError) for a
        key the commit does not hold."""
        from ckvc import read

        commit = self.readable_commit(rev, allow_pickle=allow_pickle)
        return read.load_state(
            self,
            commit,
            map_location=map_location,
            allow_pickle=allow_pickle,
            progress=progress,
            keys=keys,
            prefix=prefix,
        )

    def view(
        self,
        rev: str = "HEAD",
        map_location: MapLocation = None,
        *,
        allow_pickle: bool = False,
        progress: ProgressCallback | None = None,
    ) -> CommitView:
        """A lazy, read-only mapping of ``rev``'s tensors by path (also ``repo.open(rev)``).
        Opening it reads the snapshot only; ``view[path]`` reads and verifies only
        that tensor's chunks. ``view.info(path)``, ``view.non_tensors``, ``view.commit``,
        ``view.load(keys, prefix=...)``. Pruned commits and pickles as in ``load``."""
        from ckvc.view import CommitView

        commit = self.readable_commit(rev, allow_pickle=allow_pickle)
        return CommitView(self, commit, map_location=map_location, allow_pickle=allow_pickle, progress=progress)

    def load_into(
        self,
        rev: str = "HEAD",
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        strict: bool = True,
        model_key: str | None = "model",
        optimizer_key: str | None = "optimizer",
        scheduler_key: str | None = "scheduler",
        map_location: MapLocation = None,
        allow_pickle: bool = False,
        progress: ProgressCallback | None = None,
    ) -> IncompatibleKeys:
        """Restore ``rev`` into live objects, for a state committed as
        ``{"model": model.state_dict(), "optimizer": ..., "scheduler": ...}``
        (``*_key``: where each lives, a dotted path; None: the whole state).

        The model's parameters and buffers are overwritten in place: chunks are
        decoded straight into their memory (CPU, contiguous, same dtype), through a
        one-chunk staging buffer otherwise (GPU, non-contiguous), never through a
        second copy of the state. ``data_ptr()``s do not change. ``strict``: missing
        or unexpected keys and any shape or dtype difference raise
        IncompatibleStateError before anything is modified; ``strict=False``
        returns the missing and unexpected keys (like ``load_state_dict``) and
        casts dtypes, but shapes must still match. The optimizer and scheduler are
        restored with their ``load_state_dict`` (``map_location``: where their
        tensors are loaded first; the optimizer then follows its parameters).
        Verified as ``load`` is; a chunk found damaged while the model is being
        written leaves it partly written (CorruptObjectError)."""
        from ckvc.integrations.torch_nn import load_into

        return load_into(
            self,
            self.readable_commit(rev, allow_pickle=allow_pickle),
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            strict=strict,
            model_key=model_key,
            optimizer_key=optimizer_key,
            scheduler_key=scheduler_key,
            map_location=map_location,
            allow_pickle=allow_pickle,
            progress=progress,
        )

    def _read_blobs(
        self, commit: Commit, blobs: Sequence[Blob], progress: ProgressCallback | None = None
    ) -> list[torch.Tensor | np.ndarray]:
        from ckvc import read

        return read.read_blobs(self, commit, blobs, progress)

    def checkout(
        self,
        rev: str,
        map_location: MapLocation = None,
        *,
        allow_pickle: bool = False,
        progress: ProgressCallback | None = None,
    ) -> Any:
        """Load ``rev`` and move HEAD to it, like git checkout: onto the branch
        when ``rev`` names one, detached otherwise. HEAD moves only after the
        state loaded cleanly. The next ``commit`` continues from ``rev`` (its
        parent is ``rev``), on a detached HEAD unless ``rev`` is a branch name:
        to resume from an old epoch on a new branch, ``switch(rev,
        new_branch="retry")`` first. ``load`` reads a commit without moving HEAD,
        so a commit after it still lands on the current branch tip."""
        self.wait()  # a background commit must land on the branch it was made on
        commit_id = self.resolve(rev)
        state = self.load(commit_id, map_location, allow_pickle=allow_pickle, progress=progress)
        with self.store.pin():
            if not self.store.has(bytes.fromhex(commit_id)):  # gc took it while we loaded
                raise InvalidRevisionError(f"revision {rev!r}: commit {commit_id[:12]} was garbage-collected")
            self._move_head(rev, commit_id)
        return state

    def switch(self, rev: str, *, new_branch: str | None = None) -> str:
        """Move HEAD to ``rev`` without loading it. Returns the commit id.
        A pruned commit is refused: there is no state to resume from.
        ``new_branch``: first create that branch at ``rev`` and move HEAD onto it
        (git switch -c); RefConflictError if it exists."""
        self.wait()  # a background commit must land on the branch it was made on
        with self.store.pin():  # HEAD may name a commit only a reflog keeps: gc must see the move
            commit_id = self.resolve(rev)
            self._check_not_pruned(commit_id)
            if new_branch is not None:
                self.branch(new_branch, commit_id)
                self.refs.set_head(branch=branch_ref(new_branch), message=f"checkout: moving to {new_branch}")
            else:
                self._move_head(rev, commit_id)
        return commit_id

    def _move_head(self, rev: str, commit_id: str) -> None:
        """HEAD onto the branch ``rev`` names, or detached at ``commit_id``.
        ``HEAD`` itself leaves HEAD where it is (git checkout HEAD moves nothing)."""
        if rev == "HEAD":
            return
        full_branch = self._branch_named(rev)
        message = f"checkout: moving to {rev}"
        if full_branch is not None:
            self.refs.set_head(branch=full_branch, message=message)
        else:
            self.refs.set_head(detached=commit_id, message=message)

    def _branch_named(self, rev: str) -> str | None:
        """The full branch ref ``rev`` names exactly, if it is a branch name."""
        candidates = [rev] if rev.startswith(BRANCH_PREFIX) else [BRANCH_PREFIX + rev]
        for full in candidates:
            try:
                check_ref_name(full)
            except CkvcError:
                return None
            if self.refs.read(full) is not None:
                return full
        return None

    # ---- history ------------------------------------------------------------
    def log(
        self,
        rev: str | Sequence[str] = "HEAD",
        *,
        limit: int | None = None,
        first_parent: bool = False,
        all: bool = False,
    ) -> list[Commit]:
        """Commits reachable from ``rev`` (a revision or a list of them), newest
        first (by commit time); with ``first_parent``, the first-parent chain from
        ``rev`` down to the root. ``all``: from every branch, tag and HEAD; the order
        is then topological too (no commit before one of its children), as
        ``log --graph`` needs."""
        revs = [rev] if isinstance(rev, str) else list(rev)
        if all:
            revs = list(dict.fromkeys([*self.branches().values(), *self.tags().values(), *revs]))
            _, head_id = self.head()
            revs = [r for r in revs if r != "HEAD" or head_id is not None]
        starts = list(dict.fromkeys(self.resolve(r) for r in revs))
        if first_parent:  # the chain itself, whatever the commit times say
            chain = [self.read_commit(starts[0])]
            while chain[-1].parents and (limit is None or len(chain) < limit):
                chain.append(self.read_commit(chain[-1].parents[0]))
            return chain
        if all or len(starts) > 1:
            return self._topo_log(starts, limit)
        seen = set(starts)
        heap: list[tuple[int, int, Commit]] = []
        counter = 0
        for start in starts:
            first = self.read_commit(start)
            heapq.heappush(heap, (-first.time_ns, counter, first))
            counter += 1
        out: list[Commit] = []
        while heap and (limit is None or len(out) < limit):
            _, _, commit = heapq.heappop(heap)
            out.append(commit)
            for parent in commit.parents:
                if parent not in seen:
                    seen.add(parent)
                    pc = self.read_commit(parent)
                    heapq.heappush(heap, (-pc.time_ns, counter, pc))
                    counter += 1
        return out

    def _topo_log(self, starts: Sequence[str], limit: int | None) -> list[Commit]:
        """Every commit reachable from ``starts``, newest first, but never a parent
        before all of its children (equal commit times, clock skew)."""
        commits: dict[str, Commit] = {}
        stack = list(starts)
        while stack:
            oid = stack.pop()
            if oid not in commits:
                commits[oid] = self.read_commit(oid)
                stack.extend(commits[oid].parents)
        waiting = collections.Counter(p for c in commits.values() for p in set(c.parents))
        heap = [(-c.time_ns, i, c) for i, c in enumerate(commits.values()) if not waiting[c.id]]
        heapq.heapify(heap)
        order = {oid: i for i, oid in enumerate(commits)}
        out: list[Commit] = []
        while heap and (limit is None or len(out) < limit):
            _, _, commit = heapq.heappop(heap)
            out.append(commit)
            for parent in set(commit.parents):
                waiting[parent] -= 1
                if not waiting[parent]:
                    pc = commits[parent]
                    heapq.heappush(heap, (-pc.time_ns, order[parent], pc))
        return out

    def best(self, metric: str, mode: Literal["min", "max"] = "min", rev: str = "HEAD", *, all: bool = False) -> Commit:
        """The commit reachable from ``rev`` (``all``: from any branch or tag) with the
        lowest (``mode="min"``) or highest (``"max"``) value of ``metric``; the newest
        among equals. Commits without the metric (or with NaN) are skipped;
        InvalidInputError when none has it, naming the metrics there are."""
        if mode not in ("min", "max"):
            raise InvalidInputError(f"mode must be 'min' or 'max', got {mode!r}")
        ranked = self.rank(metric, mode, rev, all=all)
        if not ranked:
            known = sorted({k for c in self.log(rev, all=all) for k in c.metrics})
            hint = did_you_mean(metric, known) or (f"; metrics recorded: {', '.join(known)}" if known else "")
            where = "any branch or tag" if all else repr(rev)
            raise InvalidInputError(f"no commit reachable from {where} has metric {metric!r}{hint}")
        return ranked[0]

    def rank(
        self, metric: str, mode: Literal["min", "max"] = "min", rev: str = "HEAD", *, all: bool = False
    ) -> list[Commit]:
        """The commits reachable from ``rev`` that have ``metric``, best first
        (``mode`` as for ``best``), newest first among equals."""
        commits = [c for c in self.log(rev, all=all) if _finite(c.metrics.get(metric))]
        sign = 1 if mode == "min" else -1
        # log is newest first and sorted() is stable: the newest wins ties
        return sorted(commits, key=lambda c: sign * float(c.metrics[metric]))

    def head(self) -> tuple[str | None, str | None]:
        """(current branch name or None when detached, commit id or None when unborn)."""
        target, commit_id = self.refs.head()
        short = target[len(BRANCH_PREFIX) :] if target and target.startswith(BRANCH_PREFIX) else target
        return short, commit_id

    def show(self, rev: str = "HEAD", *, tensors: bool = True) -> CommitInfo:
        """The commit ``rev`` names with its tensors (dtype, shape, size), non-tensor
        values and stored sizes; reads no tensor data. ``tensors=False`` skips
        parsing the state (empty ``tensors`` and ``values``; torch is not imported)."""
        commit = self.read_commit(self.resolve(rev))
        self._check_not_pruned(commit.id)
        snapshot = self.read_snapshot(commit)
        summaries: list[TensorSummary] = []
        values: dict[str, Any] = {}
        if tensors:
            from ckvc import state as state_mod
            from ckvc.state import TensorInfo

            leaves = state_mod.flatten(state_mod.parse_snapshot(snapshot, commit.id, allow_pickle=None).build())
            for path, leaf in leaves.items():
                if isinstance(leaf, TensorInfo):
                    summaries.append(self._summary(path, leaf, snapshot))
                else:
                    values[path] = leaf
        used = {oid for b in snapshot.blobs for oid in b.chunks}
        by_codec = codec_usage(self, used)
        stored = sum(c.stored_bytes for c in by_codec.values())
        logical = sum(b.nbytes for b in snapshot.blobs)
        return CommitInfo(commit, summaries, values, logical, stored, by_codec, len(snapshot.blobs))

    @staticmethod
    def _summary(path: str, info: TensorInfo, snapshot: Snapshot) -> TensorSummary:
        from ckvc import state as state_mod

        blob = snapshot.blobs[info.blob]
        itemsize = state_mod.blob_itemsize(blob.dtype)
        kind = {state_mod.KIND_TENSOR: "tensor", state_mod.KIND_PARAMETER: "parameter"}.get(info.kind, "numpy")
        dtype = blob.dtype.removeprefix(state_mod.NUMPY_DTYPE_PREFIX)
        return TensorSummary(path, dtype, info.shape, info.numel * itemsize, kind)

    def diff(self, a: str, b: str = "HEAD", paths: Sequence[str] = (), *, data: bool = True) -> StateDiff:
        """Tensors added, removed and changed from ``a`` to ``b`` (with relative L2
        change and max abs difference), changed non-tensor values and metrics.
        ``paths``: only leaves equal to, under, or matching (glob) one of them.
        ``data=False`` reads no tensor bytes (no rel_l2 / max_abs: ``--stat``)."""
        from ckvc import state as state_mod
        from ckvc.state import TensorInfo

        ca, cb = self.read_commit(self.resolve(a)), self.read_commit(self.resolve(b))
        self._check_not_pruned(ca.id)
        self._check_not_pruned(cb.id)
        sa, sb = self.read_snapshot(ca), self.read_snapshot(cb)
        la = state_mod.flatten(state_mod.parse_snapshot(sa, ca.id, allow_pickle=None).build())
        lb = state_mod.flatten(state_mod.parse_snapshot(sb, cb.id, allow_pickle=None).build())
        result = StateDiff(ca.id, cb.id)
        if paths:
            la = {p: v for p, v in la.items() if _matches(p, paths)}
            lb = {p: v for p, v in lb.items() if _matches(p, paths)}
        for name in sorted(set(ca.metrics) | set(cb.metrics)):
            old, new = ca.metrics.get(name), cb.metrics.get(name)
            if not _same_value(old, new):
                result.metrics_changed.append((name, old, new))

        def size(leaves: Mapping[str, Any], snapshot: Snapshot, path: str) -> int:
            leaf = leaves[path]
            return self._summary(path, leaf, snapshot).nbytes if isinstance(leaf, TensorInfo) else 0

        # RNG states are counted apart, in rng_changed only
        for path in lb:
            if path not in la:
                if is_rng_path(path):
                    result.rng_changed.append(path)
                else:
                    result.added.append(path)
                    result.added_bytes += size(lb, sb, path)
        for path in la:
            if path not in lb:
                if is_rng_path(path):
                    result.rng_changed.append(path)
                else:
                    result.removed.append(path)
                    result.removed_bytes += size(la, sa, path)
        for path in (p for p in la if p in lb):
            va, vb = la[path], lb[path]
            if isinstance(va, TensorInfo) and isinstance(vb, TensorInfo):
                blob_a, blob_b = sa.blobs[va.blob], sb.blobs[vb.blob]
                same_view = (va.shape, va.stride, va.offset, va.kind) == (vb.shape, vb.stride, vb.offset, vb.kind)
                if same_view and (blob_a.dtype, blob_a.chunks) == (blob_b.dtype, blob_b.chunks):
                    result.unchanged += 1
                    continue
                if is_rng_path(path):
                    result.rng_changed.append(path)
                    continue
                result.changed_bytes += size(lb, sb, path)
                if data:
                    result.changed.append(self._tensor_change(path, ca, sa, va, cb, sb, vb))
                else:
                    result.changed.append(
                        TensorChange(path, self._summary(path, va, sa), self._summary(path, vb, sb), None, None)
                    )
            elif isinstance(va, TensorInfo) or isinstance(vb, TensorInfo) or not _same_value(va, vb):
                if is_rng_path(path):
                    result.rng_changed.append(path)
                else:
                    result.values_changed.append((path, _display_value(va), _display_value(vb)))
        # largest relative change first; shape/dtype changes (no rel_l2) lead, as the biggest change of all
        result.changed.sort(key=lambda c: -math.inf if c.rel_l2 is None else -c.rel_l2)
        return result

    def _tensor_change(
        self, path: str, ca: Commit, sa: Snapshot, va: TensorInfo, cb: Commit, sb: Snapshot, vb: TensorInfo
    ) -> TensorChange:
        import torch

        old, new = self._summary(path, va, sa), self._summary(path, vb, sb)
        if old.shape != new.shape or old.dtype != new.dtype:
            return TensorChange(path, old, new, None, None)
        ta = self._load_tensor(ca, sa, va)
        tb = self._load_tensor(cb, sb, vb)
        if isinstance(ta, np.ndarray):
            ta, tb = torch.from_numpy(np.asarray(ta)), torch.from_numpy(np.asarray(tb))
        if not (
            ta.dtype.is_floating_point
            or ta.dtype.is_complex
            or ta.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
        ):
            return TensorChange(path, old, new, None, None)
        xa, xb = (
            ta.detach().to(torch.float64 if not ta.is_complex() else torch.complex128),
            tb.detach().to(torch.float64 if not tb.is_complex() else torch.complex128),
        )
        delta = (xb - xa).abs()
        norm_a = float(torch.linalg.vector_norm(xa)) if xa.numel() else 0.0
        norm_d = float(torch.linalg.vector_norm(delta)) if delta.numel() else 0.0
        rel = norm_d / norm_a if norm_a else (0.0 if norm_d == 0 else math.inf)
        return TensorChange(path, old, new, rel, float(delta.max()) if delta.numel() else 0.0)

    def _check_not_pruned(self, commit_id: str) -> None:
        record = self.pruned().get(commit_id)
        if record is not None:
            raise PrunedCommitError(commit_id, record.policy, record.time_ns)

    def _load_tensor(self, commit: Commit, snapshot: Snapshot, info: TensorInfo) -> Any:
        from ckvc import state as state_mod

        (base,) = self._read_blobs(commit, [snapshot.blobs[info.blob]])
        return state_mod.materialize(info, base)

    # ---- refs ---------------------------------------------------------------
    def branch(self, name: str, rev: str = "HEAD") -> str:
        """Create branch ``name`` at ``rev``; RefConflictError if it exists."""
        full = branch_ref(name)
        with self.store.pin():  # the commit may be one gc is about to collect
            commit_id = self.resolve(rev)
            if self.refs.read(full) is not None:
                raise RefConflictError(f"branch {name!r} already exists")
            try:
                self.refs.set_if_equals(full, None, commit_id, f"branch: created from {rev}")
            except RefConflictError:
                raise RefConflictError(f"branch {name!r} already exists") from None  # created meanwhile
        return commit_id

    def delete_branch(self, name: str) -> str:
        full = branch_ref(name)
        current = self.refs.read(full)
        if current is None:
            raise RefNotFoundError(f"branch {name!r} not found{self._ref_hint(name, tags=False)}")
        target, _ = self.refs.head()
        if target == full:
            raise InvalidInputError(f"cannot delete branch {name!r}: HEAD is on it")
        self.refs.delete_if_equals(full, current, "branch: deleted")
        return current

    def branches(self) -> dict[str, str]:
        return {k[len(BRANCH_PREFIX) :]: v for k, v in self.refs.list_refs(BRANCH_PREFIX).items()}

    def tag(self, name: str, rev: str = "HEAD", message: str | None = None) -> str:
        """Create a tag: annotated (a tag object) when ``message`` is given,
        lightweight otherwise. Returns what the tag ref points at."""
        full = tag_ref(name)
        with self.store.pin():
            commit_id = self.resolve(rev)
            target = commit_id
            if self.refs.read(full) is not None:
                raise RefConflictError(f"tag {name!r} already exists")
            if message is not None:
                tag = Tag(commit_id, name, _default_author(), time.time_ns(), message)
                _check_utf8("tag message", message)
                with (
                    storage_errors(f"writing tag {name}", "no tag was created"),
                    self.store.writer(self._codec) as writer,
                ):
                    target = writer.put(ObjectType.TAG, tag.encode()).hex()
                    writer.commit()
            try:
                self.refs.set_if_equals(full, None, target, f"tag: {name}")
            except RefConflictError:
                raise RefConflictError(f"tag {name!r} already exists") from None
        return target

    def delete_tag(self, name: str) -> str:
        full = tag_ref(name)
        current = self.refs.read(full)
        if current is None:
            raise RefNotFoundError(f"tag {name!r} not found{self._ref_hint(name, branches=False)}")
        self.refs.delete_if_equals(full, current, "tag: deleted")
        return current

    def tags(self) -> dict[str, str]:
        """Tag name -> commit id (annotated tags peeled)."""
        return {k[len(TAG_PREFIX) :]: self._peel(v) for k, v in self.refs.list_refs(TAG_PREFIX).items()}

    def tag_object(self, name: str) -> Tag | None:
        """The annotated tag ``name`` (its message, tagger, time); None for a
        lightweight tag. RefNotFoundError when there is no such tag."""
        oid = self.refs.read(tag_ref(name))
        if oid is None:
            raise RefNotFoundError(f"tag {name!r} not found{self._ref_hint(name, branches=False)}")
        if self.store.stat(bytes.fromhex(oid)).kind != ObjectType.TAG:
            return None
        return self.read_tag(oid)

    def reflog(self, ref: str = "HEAD") -> list[ReflogEntry]:
        if ref != HEAD and not ref.startswith("refs/"):
            full = self._branch_named(ref) or (TAG_PREFIX + ref)
        else:
            full = ref
        entries = self.refs.reflog(full)
        if not entries and full != HEAD and self.refs.read(full) is None:
            raise RefNotFoundError(f"no branch or tag {ref!r}{self._ref_hint(ref)}")
        return entries

    # ---- revisions ----------------------------------------------------------
    def resolve(self, rev: str) -> str:
        """The full commit id ``rev`` names: an id or unique id prefix, a branch,
        a tag, HEAD, or any of those followed by ``~n``, ``^`` and ``^n``."""
        if not isinstance(rev, str) or not rev:
            raise InvalidRevisionError(f"invalid revision {rev!r}")
        match = re.search(r"[~^]", rev)
        base, suffix = (rev[: match.start()], rev[match.start() :]) if match else (rev, "")
        commit_id = self._resolve_base(rev, base)
        pos = 0
        while pos < len(suffix):
            m = _SUFFIX.match(suffix, pos)
            if m is None:
                raise InvalidRevisionError(f"invalid revision {rev!r}: cannot parse {suffix[pos:]!r}")
            pos = m.end()
            if m.group(0).startswith("~"):
                for _ in range(int(m.group(2) or 1)):
                    parents = self.read_commit(commit_id).parents
                    if not parents:
                        raise InvalidRevisionError(f"revision {rev!r} goes past the root commit")
                    commit_id = parents[0]
            else:
                n = int(m.group(3) or 1)
                if n == 0:
                    continue
                parents = self.read_commit(commit_id).parents
                if n > len(parents):
                    raise InvalidRevisionError(f"revision {rev!r}: commit {commit_id[:12]} has no parent {n}")
                commit_id = parents[n - 1]
        return commit_id

    def _resolve_base(self, rev: str, base: str) -> str:
        if base == HEAD:
            _, commit_id = self.refs.head()
            if commit_id is None:
                raise InvalidRevisionError(f"revision {rev!r}: HEAD has no commits yet")
            return commit_id
        if is_full_hex_id(base):
            return self._peel_checked(rev, base)
        candidates = [base] if base.startswith("refs/") else [BRANCH_PREFIX + base, TAG_PREFIX + base, "refs/" + base]
        for full in candidates:
            try:
                check_ref_name(full)
            except CkvcError:
                continue
            value = self.refs.read(full)
            if value is not None:
                return self._peel_checked(rev, value)
        if len(base) >= MIN_PREFIX and re.fullmatch(r"[0-9a-f]+", base):
            return self._resolve_prefix(rev, base)
        raise InvalidRevisionError(f"unknown revision {rev!r}{self._ref_hint(base)}")

    def _ref_hint(self, name: str, *, branches: bool = True, tags: bool = True) -> str:
        """A did-you-mean suffix for an unknown revision or ref, from branch and tag names."""
        try:
            names = [*(self.branches() if branches else ()), *(self.tags() if tags else ())]
        except CkvcError:
            return ""  # a damaged ref must not hide the original error
        return did_you_mean(name, names)

    def _resolve_prefix(self, rev: str, prefix: str) -> str:
        key = bytes.fromhex(prefix[: len(prefix) // 2 * 2])
        matches: list[str] = []
        for attempt in range(2):
            matches = [
                s.oid.hex()
                for s in self.store.iter_stored(key)
                if s.oid.hex().startswith(prefix) and s.kind in (ObjectType.COMMIT, ObjectType.TAG)
            ]
            if matches or attempt or not self.store.refresh():
                break
        if not matches:
            raise InvalidRevisionError(f"unknown revision {rev!r}")
        commits = {self._peel(m) for m in matches}
        if len(commits) > 1:
            raise InvalidRevisionError(f"ambiguous revision {rev!r}: matches {len(commits)} commits")
        return commits.pop()

    def _peel(self, oid: str) -> str:
        """A tag object id -> its commit id; a commit id stays itself."""
        kind = self.store.stat(bytes.fromhex(oid)).kind
        if kind == ObjectType.TAG:
            return self.read_tag(oid).target
        return oid

    def _peel_checked(self, rev: str, oid: str) -> str:
        try:
            kind = self.store.stat(bytes.fromhex(oid)).kind
        except ObjectNotFoundError:
            raise InvalidRevisionError(f"unknown revision {rev!r}") from None
        if kind == ObjectType.TAG:
            return self.read_tag(oid).target
        if kind != ObjectType.COMMIT:
            raise InvalidRevisionError(f"revision {rev!r} names a {kind.name.lower()}, not a commit")
        return oid

    # ---- reachability -------------------------------------------------------
    def ref_tips(self, *, include_reflogs: bool = True, damaged: list[str] | None = None) -> dict[str, str]:
        """Every commit a ref, HEAD or (optionally) a reflog names: label -> commit id.
        Damaged refs raise RefNotFoundError, or are listed in ``damaged`` when given."""
        tips: dict[str, str] = dict(self.refs.list_refs(damaged=damaged))
        try:
            _, head_id = self.refs.head()
            if head_id:
                tips[HEAD] = head_id
        except RefNotFoundError as exc:
            if damaged is None:
                raise
            damaged.append(str(exc))
        if include_reflogs:
            for i, oid in enumerate(dict.fromkeys(self.refs.iter_reflog_ids())):
                tips.setdefault(f"reflog:{i}", oid)
        return tips

    def walk(self, tips: Iterable[str], visited: set[str] | None = None) -> Iterator[Reached]:
        """Every commit and tag object reachable from ``tips``, once each (tags
        peeled, all parents followed). An object that cannot be read is yielded
        with its error and not followed: the caller decides whether that is fatal
        (gc), a finding (fsck) or to be skipped. Ids in ``visited`` are not
        walked; every id met is added to it."""
        visited = set() if visited is None else visited
        stack = list(tips)
        while stack:
            oid = stack.pop()
            if oid in visited:
                continue
            visited.add(oid)
            try:
                if self.store.stat(bytes.fromhex(oid)).kind == ObjectType.TAG:
                    stack.append(self.read_tag(oid).target)
                    yield Reached(oid)
                    continue
                commit = self.read_commit(oid)
            except (ObjectNotFoundError, CorruptObjectError) as exc:
                yield Reached(oid, error=exc)
                continue
            stack.extend(commit.parents)
            yield Reached(oid, commit)

    def iter_reachable_commits(self, tips: Mapping[str, str]) -> Iterator[Commit]:
        """Each readable commit reachable from ``tips`` once (tags peeled)."""
        for reached in self.walk(tips.values()):
            if reached.commit is not None:
                yield reached.commit

    # ---- lifecycle ----------------------------------------------------------
    def pruned(self) -> dict[str, PruneRecord]:
        """Commits whose data a retention policy released: id -> when and by which policy."""
        return self.prune_log.records()

    def retention_policy(self) -> RetentionPolicy | None:
        from ckvc.retention import RetentionPolicy

        raw = self.config.retention
        return RetentionPolicy.from_config(raw) if raw else None

    def set_retention(self, policy: RetentionPolicy | None) -> None:
        """Store ``policy`` in the repository config (None removes it)."""
        self._require_writable("storing the retention policy")
        config = RepoConfig.load(self.dir)
        config.retention = policy.to_config() if policy is not None else None
        config.save(self.dir)
        self.config = config

    def _upgrade_format(self, version: int) -> None:
        """Raise the repository's format version to ``version`` before writing what
        older versions lack, so an older ckvc refuses the repository up front instead
        of failing on (or calling corrupt) that object. Nothing to do if it is there."""
        if self.config.format_version >= version:
            return
        config = RepoConfig.load(self.dir)
        config.format_version = max(config.format_version, version)
        config.save(self.dir)
        self.config = config

    def set_config(self, **values: Any) -> RepoConfig:
        """Change settings: reflog_expiry_s, gc_grace_s, repack_threshold (lifecycle),
        keyframe_interval (int) and codec ({"name": "auto"|"zstd"|"raw", "level": n}).
        Choosing a version-2 codec upgrades a version 1 repository's format (older
        ckvc then refuses it, rather than misreading it)."""
        numbers = {"reflog_expiry_s", "gc_grace_s", "repack_threshold"}
        unknown = set(values) - numbers - {"keyframe_interval", "codec"}
        if unknown:
            settable = sorted(numbers | {"keyframe_interval", "codec"})
            raise InvalidInputError(f"unknown or read-only setting(s): {sorted(unknown)}; settable: {settable}")
        self._require_writable("changing the config")
        config = RepoConfig.load(self.dir)
        for key, value in values.items():
            if key == "codec":
                if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
                    raise InvalidInputError(f"codec must be a mapping with a name, got {value!r}")
                config.codec = dict(value)
                if config.codec["name"] not in ("raw", "zstd"):
                    config.format_version = max(config.format_version, CODECS_VERSION)
            elif key == "keyframe_interval":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise InvalidInputError(f"keyframe_interval must be an integer, got {value!r}")
                config.keyframe_interval = value
            else:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise InvalidInputError(f"{key} must be a number, got {value!r}")
                setattr(config, key, float(value))
        try:
            config.validate()
        except (ValueError, UnsupportedFormatError) as exc:
            raise InvalidInputError(str(exc)) from None
        config.save(self.dir)
        self.config = config
        self._codec = make_codec(str(config.codec["name"]), config.codec.get("level"))
        return config

    def retain(self, policy: RetentionPolicy | None = None, *, dry_run: bool = False) -> RetentionPlan:
        """Apply ``policy`` (default: the stored one): record every commit no rule
        keeps as pruned. History stays; ``gc`` frees the data. Returns the plan,
        with the rules that keep each kept commit."""
        from ckvc.retention import apply_retention, plan_retention

        policy = policy or self.retention_policy()
        if policy is None:
            raise InvalidInputError("no retention policy given or stored (ckvc retain --keep-last N ...)")
        if not dry_run:
            self._require_writable("applying retention")
        plan = plan_retention(self, policy)
        if not dry_run:
            apply_retention(self, plan)
        return plan

    def gc(self, *, dry_run: bool = False, now: bool = False, grace_s: float | None = None) -> GcReport:
        """Delete what nothing reachable needs and repack mostly-dead packs.
        ``now`` skips the grace period (only when nothing else is writing)."""
        from ckvc.gc import GcReport, execute_gc, plan_gc

        if not dry_run:
            self._require_writable("running gc")
        grace = 0.0 if now else (self.config.gc_grace_s if grace_s is None else grace_s)
        expiry = self.config.reflog_expiry_s
        # One gc at a time: a second one could delete the first one's temporary packs.
        # OS errors up to gc's index swap delete nothing (execute_gc says what happened after it).
        with (
            storage_errors("running gc", "gc deleted nothing; the repository is unchanged"),
            file_lock(self.dir / "gc-run.lock", timeout=0),
        ):
            plan = plan_gc(self, grace_s=grace, repack_threshold=self.config.repack_threshold, reflog_expiry_s=expiry)
            if dry_run:
                return GcReport(plan)
            return execute_gc(self, plan, reflog_expiry_s=expiry)

    def fsck(
        self,
        *,
        rebuild_index: bool = False,
        level: str = "full",
        sample: float | None = None,
        progress: ProgressCallback | None = None,
    ) -> Any:
        """Check the refs, the commit graph and (level "full", the default) every
        stored object against its id; "metadata" and "refs" check less, faster;
        ``sample`` re-hashes a random fraction of the objects."""
        from ckvc.fsck import run_fsck

        return run_fsck(self, rebuild_index=rebuild_index, level=level, sample=sample, progress=progress)

    def du(self) -> Any:
        """Logical vs stored bytes, dedup and compression ratios, unique bytes per commit."""
        from ckvc.stats import disk_usage

        return disk_usage(self)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _display_value(v: Any) -> Any:
    from ckvc.state import TensorInfo

    if isinstance(v, TensorInfo):
        return f"<tensor {list(v.shape)}>"
    return v
