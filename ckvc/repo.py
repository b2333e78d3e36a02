"""Repo: the user-facing API (commit, checkout, load, log, show, diff, branch, tag,
resolve, maintenance), a thin facade over a :class:`ckvc.core.Repository` and the
functions of ckvc.graph, ckvc.write, ckvc.inspect and the maintenance modules."""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

from ckvc import graph, inspect, write
from ckvc.codecs.policy import DeltaBackoff, LossySpec, chunk_size_for, lossy_patterns
from ckvc.config import CODECS_VERSION, RepoConfig
from ckvc.core import REPO_DIR, ProgressCallback, Repository, find_repo_root
from ckvc.errors import (
    CkvcError,
    DurabilityWarning,
    InterruptedOperationError,
    InvalidInputError,
    InvalidRevisionError,
    RefConflictError,
    RefNotFoundError,
    UnsupportedFormatError,
    storage_errors,
)
from ckvc.graph import Reached, did_you_mean
from ckvc.ids import ObjectType
from ckvc.inspect import CommitInfo, StateDiff, TensorChange, TensorSummary, is_rng_path
from ckvc.objects import Commit, Snapshot, Tag
from ckvc.pruned import PruneLog, PruneRecord
from ckvc.refs import HEAD, TAG_PREFIX, ReflogEntry, RefStore, branch_ref, tag_ref
from ckvc.storage.files import file_lock
from ckvc.storage.object_store import ObjectStore
from ckvc.write import CommitStats, PendingCommit

# torch is imported only where tensors are made or read (ckvc.state, ckvc.view, the
# bodies of commit/load/show/diff), so log, status, branch and tag start fast.
if TYPE_CHECKING:
    import torch

    from ckvc.executor import Executor
    from ckvc.fsck import FsckReport
    from ckvc.gc import GcReport
    from ckvc.inspect import DiskUsage
    from ckvc.integrations.torch_nn import IncompatibleKeys
    from ckvc.retention import RetentionPlan, RetentionPolicy
    from ckvc.state import MapLocation, PendingBlob
    from ckvc.view import CommitView

__all__ = [
    "REPO_DIR", "CommitInfo", "CommitStats", "PendingCommit", "ProgressCallback", "Reached", "Repo", "StateDiff",
    "TensorChange", "TensorSummary", "did_you_mean", "find_repo_root", "is_rng_path",
]  # fmt: skip


class _OpenRepo(Protocol):
    def __call__(self, path: str | os.PathLike[str] = ".", *, threads: int | None = None) -> Repo: ...


class _OpenView(Protocol):
    def __call__(
        self, rev: str = "HEAD", map_location: MapLocation = None, *, allow_pickle: bool = False,
        progress: ProgressCallback | None = None,
    ) -> CommitView: ...  # fmt: skip


class _Open:
    """``Repo.open(path)`` on the class opens a repository. On an instance,
    ``repo.open(rev)`` is the old spelling of ``repo.view(rev)``: it still works,
    with a DeprecationWarning, for one release."""

    @overload
    def __get__(self, instance: None, owner: type[Repo]) -> _OpenRepo: ...

    @overload
    def __get__(self, instance: Repo, owner: type[Repo] | None = None) -> _OpenView: ...

    def __get__(self, instance: Repo | None, owner: type[Repo] | None = None) -> _OpenRepo | _OpenView:
        if instance is None:
            assert owner is not None
            return owner._open_repository
        view = instance.view

        def deprecated(*args: Any, **kwargs: Any) -> CommitView:
            warnings.warn("repo.open(rev) is deprecated; use repo.view(rev)", DeprecationWarning, stacklevel=2)
            return view(*args, **kwargs)

        return deprecated


class Repo:
    """A ckvc repository: ``path/.ckvc`` holding packs, an index, refs and config."""

    def __init__(self, core: Repository) -> None:
        self.core = core
        self._background = write.BackgroundCommits(str(core.path))
        self._backoff = DeltaBackoff()  # per tensor path, across this Repo's commits
        self.last_commit_stats: CommitStats | None = None

    # ---- parts --------------------------------------------------------------
    @property
    def path(self) -> Path:
        """The directory holding ``.ckvc``."""
        return _local(self.core.path)

    @property
    def dir(self) -> Path:
        """``path/.ckvc``."""
        return _local(self.core.dir)

    @property
    def config(self) -> RepoConfig:
        return self.core.config

    @property
    def store(self) -> ObjectStore:
        return self.core.store

    @property
    def refs(self) -> RefStore:
        return self.core.refs

    @property
    def prune_log(self) -> PruneLog:
        return self.core.prune_log

    @property
    def executor(self) -> Executor:
        return self.core.executor

    @property
    def threads(self) -> int:
        return self.core.executor.threads

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
        return cls(
            Repository.init_local(
                path, chunk_size=chunk_size, codec=codec, default_branch=default_branch,
                keyframe_interval=keyframe_interval, threads=threads,
            )
        )  # fmt: skip

    @classmethod
    def _open_repository(cls, path: str | os.PathLike[str] = ".", *, threads: int | None = None) -> Repo:
        """Open the repository at ``path`` or in one of its parents. ``threads``:
        worker threads for hashing, encoding and decoding chunks (default
        $CKVC_THREADS, else one per core; 1 runs serially, with the same results)."""
        return cls(Repository.open_local(path, threads=threads))

    open = _Open()

    def close(self) -> None:
        """Finish pending background commits (raising the first error), then close."""
        try:
            self._background.close()
        finally:
            self.core.close()

    def wait(self) -> None:
        """Wait for every pending background commit; raise the first error not yet seen."""
        self._background.wait()

    def __enter__(self) -> Repo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Repo({str(self.core.path)!r})"

    def _chunk_size_for(self, itemsize: int) -> int:  # the writer's rule, as tests/test_format_vectors.py calls it
        return chunk_size_for(self.config.chunk_size, itemsize)

    # ---- commit -------------------------------------------------------------
    @overload
    def commit(
        self, state: Any, message: str = "", metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None, *, merge: Sequence[str] = (), allow_pickle: bool = False,
        retain: bool | None = None, blocking: Literal[True] = True, progress: ProgressCallback | None = None,
        lossy: LossySpec = None, time_ns: int | None = None,
    ) -> str: ...  # fmt: skip

    @overload
    def commit(
        self, state: Any, message: str = "", metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None, *, merge: Sequence[str] = (), allow_pickle: bool = False,
        retain: bool | None = None, blocking: Literal[False], progress: ProgressCallback | None = None,
        lossy: LossySpec = None, time_ns: int | None = None,
    ) -> PendingCommit: ...  # fmt: skip

    def commit(
        self, state: Any, message: str = "", metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None, *, merge: Sequence[str] = (), allow_pickle: bool = False,
        retain: bool | None = None, blocking: bool = True, progress: ProgressCallback | None = None,
        lossy: LossySpec = None, time_ns: int | None = None,
    ) -> str | PendingCommit:  # fmt: skip
        """Store ``state`` as a new commit on the current branch (or detached HEAD)
        and return its id. Everything is durable before the branch moves.

        ``merge`` names further revisions to record as parents (e.g. the runs a
        weight average was made from); HEAD's commit stays the first parent.
        ``retain`` applies the stored retention policy afterwards (default: when
        the policy says ``auto``).

        ``lossy`` (opt-in, never the default) stores matching float tensors
        quantized: ``{"optimizer.*": "q4", "model.*": "residual-q4"}`` (glob
        patterns over tensor paths; modes q8, q4, residual-q8, residual-q4) or a
        preset name (ckvc.codecs.policy.LOSSY_PRESETS). The commit records which
        tensors are lossy and their measured errors (``Commit.lossy``).

        ``time_ns`` sets the commit time (default: now), e.g. a file's mtime
        when importing an existing checkpoint folder (ckvc.importer).

        ``blocking=False`` returns a PendingCommit as soon as the state's bytes
        are copied, so training may change its tensors at once; the commit is
        written in the background, in order with other commits. Its errors
        surface on ``.result()`` and at the next commit, ``wait()`` or close."""
        self.core.require_writable("committing")
        if blocking:
            self.wait()  # commits land in the order they were made; raises unseen background errors
        else:
            self._background.raise_unseen()
        started = time.perf_counter()
        request = write.CommitRequest.checked(message, metrics, metadata, time_ns=time_ns)
        policy = self.retention_policy()
        if retain and policy is None:
            raise InvalidInputError("retain=True but no retention policy is set (Repo.set_retention)")
        lossy_patterns(lossy)  # a bad spec fails here, before any work
        # Async: GPU tensors go to pinned host memory (when CUDA is present).
        staged = write.stage(
            self.core, state, allow_pickle=allow_pickle, pin_memory=not blocking, lossy=lossy, metadata=metadata
        )
        request = dataclasses.replace(request, tree=staged.tree, pickled=staged.pickled)
        args = (request, tuple(merge), lossy, policy, retain, progress, started)
        if not blocking:
            return self._background.submit(self._write_commit, write.owned(staged.pending), *args)
        return self._write_commit(staged.pending, *args)

    def _write_commit(
        self, pending: list[PendingBlob], request: write.CommitRequest, merge: tuple[str, ...], lossy: LossySpec,
        policy: RetentionPolicy | None, retain: bool | None, progress: ProgressCallback | None, started: float,
    ) -> str:  # fmt: skip
        """write_blobs then finish, in one batch. The outcome is exact (docs/GUIDE.md,
        "Errors and exit codes"): an error means the branch did not move; once it
        has moved the commit is reported, a failing follow-up step being a warning."""
        outcome, report = write.Outcome(), write.WriteReport()
        try:
            with write.batch(self.core) as writer:
                head = write.read_head(self.core, outcome)
                request = dataclasses.replace(request, merge=tuple(dict.fromkeys(self.resolve(r) for r in merge)))
                chunks = write.chunk_policy(self.core, lossy, self._backoff)
                blobs = write.write_blobs(
                    self.core, pending, parent=head.parent, policy=chunks, writer=writer, report=report,
                    progress=progress,
                )  # fmt: skip
                request = dataclasses.replace(request, lossy=report.lossy)
                commit_id = write.finish(self.core, blobs, request, head=head, writer=writer, outcome=outcome)
        except BaseException as exc:
            return write.settle(self.core, outcome, exc)
        self.last_commit_stats = report.stats(commit_id, writer.bytes_written, time.perf_counter() - started)
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

    # ---- reading ------------------------------------------------------------
    def read_commit(self, commit_id: str) -> Commit:
        return self.core.read_commit(commit_id)

    def read_tag(self, tag_id: str) -> Tag:
        return self.core.read_tag(tag_id)

    def read_snapshot(self, commit: Commit) -> Snapshot:
        return self.core.read_snapshot(commit)

    def readable_commit(self, rev: str, *, allow_pickle: bool = False) -> Commit:
        """The commit ``rev`` names, refused as every read refuses it: pruned
        (PrunedCommitError), or holding pickles unless allowed (UnsafeContentError)."""
        return graph.readable_commit(self.core, rev, allow_pickle=allow_pickle)

    def load(
        self, rev: str = "HEAD", map_location: MapLocation = None, *, allow_pickle: bool = False,
        progress: ProgressCallback | None = None, keys: Iterable[str] | None = None, prefix: str | None = None,
    ) -> Any:  # fmt: skip
        """The state stored in ``rev``; HEAD does not move. Every byte is verified.

        With ``keys`` (leaf paths as ``show`` lists them, "model.layer.0.weight")
        and/or ``prefix`` ("model."): only those leaves, as a flat dict by path,
        reading only the chunks they cover. UnknownKeyError (a KeyError) for a
        key the commit does not hold."""
        from ckvc import read

        commit = self.readable_commit(rev, allow_pickle=allow_pickle)
        return read.load_state(
            self.core, commit, map_location=map_location, allow_pickle=allow_pickle, progress=progress, keys=keys,
            prefix=prefix,
        )  # fmt: skip

    def view(
        self, rev: str = "HEAD", map_location: MapLocation = None, *, allow_pickle: bool = False,
        progress: ProgressCallback | None = None,
    ) -> CommitView:  # fmt: skip
        """A lazy, read-only mapping of ``rev``'s tensors by path. Opening it reads
        the snapshot only; ``view[path]`` reads and verifies only that tensor's
        chunks. ``view.info(path)``, ``view.non_tensors``, ``view.commit``,
        ``view.load(keys, prefix=...)``. Pruned commits and pickles as in ``load``."""
        from ckvc.view import CommitView

        commit = self.readable_commit(rev, allow_pickle=allow_pickle)
        return CommitView(self.core, commit, map_location=map_location, allow_pickle=allow_pickle, progress=progress)

    def load_into(
        self, rev: str = "HEAD", *, model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None, strict: bool = True,
        model_key: str | None = "model", optimizer_key: str | None = "optimizer",
        scheduler_key: str | None = "scheduler", map_location: MapLocation = None, allow_pickle: bool = False,
        progress: ProgressCallback | None = None,
    ) -> IncompatibleKeys:  # fmt: skip
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
            self.core, self.readable_commit(rev, allow_pickle=allow_pickle), model=model, optimizer=optimizer,
            scheduler=scheduler, strict=strict, model_key=model_key,
            optimizer_key=optimizer_key, scheduler_key=scheduler_key, map_location=map_location,
            allow_pickle=allow_pickle, progress=progress,
        )  # fmt: skip

    def checkout(
        self, rev: str, map_location: MapLocation = None, *, allow_pickle: bool = False,
        progress: ProgressCallback | None = None,
    ) -> Any:  # fmt: skip
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
            graph.check_not_pruned(self.core, commit_id)
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
        full_branch = graph.branch_named(self.core, rev)
        message = f"checkout: moving to {rev}"
        if full_branch is not None:
            self.refs.set_head(branch=full_branch, message=message)
        else:
            self.refs.set_head(detached=commit_id, message=message)

    # ---- history ------------------------------------------------------------
    def log(
        self, rev: str | Sequence[str] = "HEAD", *, limit: int | None = None, first_parent: bool = False,
        all: bool = False,
    ) -> list[Commit]:  # fmt: skip
        """Commits reachable from ``rev`` (a revision or a list of them), newest
        first (by commit time); with ``first_parent``, the first-parent chain from
        ``rev`` down to the root. ``all``: from every branch, tag and HEAD; the order
        is then topological too (no commit before one of its children), as
        ``log --graph`` needs."""
        return graph.log(self.core, rev, limit=limit, first_parent=first_parent, all=all)

    def best(self, metric: str, mode: Literal["min", "max"] = "min", rev: str = "HEAD", *, all: bool = False) -> Commit:
        """The commit reachable from ``rev`` (``all``: from any branch or tag) with the
        lowest (``mode="min"``) or highest (``"max"``) value of ``metric``; the newest
        among equals. Commits without the metric (or with NaN) are skipped;
        InvalidInputError when none has it, naming the metrics there are."""
        return graph.best(self.core, metric, mode, rev, all=all)

    def rank(
        self, metric: str, mode: Literal["min", "max"] = "min", rev: str = "HEAD", *, all: bool = False
    ) -> list[Commit]:
        """The commits reachable from ``rev`` that have ``metric``, best first
        (``mode`` as for ``best``), newest first among equals."""
        return graph.rank(self.core, metric, mode, rev, all=all)

    def head(self) -> tuple[str | None, str | None]:
        """(current branch name or None when detached, commit id or None when unborn)."""
        return graph.head(self.core)

    def show(self, rev: str = "HEAD", *, tensors: bool = True) -> CommitInfo:
        """The commit ``rev`` names with its tensors (dtype, shape, size), non-tensor
        values and stored sizes; reads no tensor data. ``tensors=False`` skips
        parsing the state (empty ``tensors`` and ``values``; torch is not imported)."""
        return inspect.show(self.core, self.resolve(rev), tensors=tensors)

    def diff(self, a: str, b: str = "HEAD", paths: Sequence[str] = (), *, data: bool = True) -> StateDiff:
        """Tensors added, removed and changed from ``a`` to ``b`` (with relative L2
        change and max abs difference), changed non-tensor values and metrics.
        ``paths``: only leaves equal to, under, or matching (glob) one of them.
        ``data=False`` reads no tensor bytes (no rel_l2 / max_abs: ``--stat``)."""
        return inspect.diff(self.core, self.resolve(a), self.resolve(b), paths, data=data)

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
            raise RefNotFoundError(f"branch {name!r} not found{graph.ref_hint(self.core, name, tags=False)}")
        target, _ = self.refs.head()
        if target == full:
            raise InvalidInputError(f"cannot delete branch {name!r}: HEAD is on it")
        self.refs.delete_if_equals(full, current, "branch: deleted")
        return current

    def branches(self) -> dict[str, str]:
        return graph.branches(self.core)

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
                tag = Tag(commit_id, name, write.default_author(), time.time_ns(), message)
                write.check_utf8("tag message", message)
                with storage_errors(f"writing tag {name}", "no tag was created"), write.batch(self.core) as w:
                    target = w.put(ObjectType.TAG, tag.encode()).hex()
                    w.commit()
            try:
                self.refs.set_if_equals(full, None, target, f"tag: {name}")
            except RefConflictError:
                raise RefConflictError(f"tag {name!r} already exists") from None
        return target

    def delete_tag(self, name: str) -> str:
        full = tag_ref(name)
        current = self.refs.read(full)
        if current is None:
            raise RefNotFoundError(f"tag {name!r} not found{graph.ref_hint(self.core, name, branches=False)}")
        self.refs.delete_if_equals(full, current, "tag: deleted")
        return current

    def tags(self) -> dict[str, str]:
        """Tag name -> commit id (annotated tags peeled)."""
        return graph.tags(self.core)

    def tag_object(self, name: str) -> Tag | None:
        """The annotated tag ``name`` (its message, tagger, time); None for a
        lightweight tag. RefNotFoundError when there is no such tag."""
        oid = self.refs.read(tag_ref(name))
        if oid is None:
            raise RefNotFoundError(f"tag {name!r} not found{graph.ref_hint(self.core, name, branches=False)}")
        if self.store.stat(bytes.fromhex(oid)).kind != ObjectType.TAG:
            return None
        return self.read_tag(oid)

    def reflog(self, ref: str = "HEAD") -> list[ReflogEntry]:
        full = ref if ref == HEAD or ref.startswith("refs/") else graph.branch_named(self.core, ref) or TAG_PREFIX + ref
        entries = self.refs.reflog(full)
        if not entries and full != HEAD and self.refs.read(full) is None:
            raise RefNotFoundError(f"no branch or tag {ref!r}{graph.ref_hint(self.core, ref)}")
        return entries

    def resolve(self, rev: str) -> str:
        """The full commit id ``rev`` names: an id or unique id prefix, a branch,
        a tag, HEAD, or any of those followed by ``~n``, ``^`` and ``^n``."""
        return graph.resolve(self.core, rev)

    def ref_tips(self, *, include_reflogs: bool = True, damaged: list[str] | None = None) -> dict[str, str]:
        """Every commit a ref, HEAD or (optionally) a reflog names: label -> commit id."""
        return graph.ref_tips(self.core, include_reflogs=include_reflogs, damaged=damaged)

    def walk(self, tips: Iterable[str], visited: set[str] | None = None) -> Iterator[Reached]:
        """Every commit and tag object reachable from ``tips`` (ckvc.graph.walk)."""
        return graph.walk(self.core, tips, visited)

    def iter_reachable_commits(self, tips: Mapping[str, str]) -> Iterator[Commit]:
        """Each readable commit reachable from ``tips`` once (tags peeled)."""
        return graph.iter_reachable_commits(self.core, tips)

    # ---- lifecycle ----------------------------------------------------------
    def pruned(self) -> dict[str, PruneRecord]:
        """Commits whose data a retention policy released: id -> when and by which policy."""
        return self.core.pruned()

    def retention_policy(self) -> RetentionPolicy | None:
        from ckvc.retention import stored_policy

        return stored_policy(self.core)

    def set_retention(self, policy: RetentionPolicy | None) -> None:
        """Store ``policy`` in the repository config (None removes it)."""
        self.core.require_writable("storing the retention policy")
        config = self.core.stored_config()
        config.retention = policy.to_config() if policy is not None else None
        self.core.save_config(config)

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
        self.core.require_writable("changing the config")
        config = self.core.stored_config()
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
        self.core.save_config(config)
        return config

    def retain(self, policy: RetentionPolicy | None = None, *, dry_run: bool = False) -> RetentionPlan:
        """Apply ``policy`` (default: the stored one): record every commit no rule
        keeps as pruned. History stays; ``gc`` frees the data. Returns the plan,
        with the rules that keep each kept commit."""
        from ckvc.retention import retain

        return retain(self.core, policy, dry_run=dry_run)

    def gc(self, *, dry_run: bool = False, now: bool = False, grace_s: float | None = None) -> GcReport:
        """Delete what nothing reachable needs and repack mostly-dead packs.
        ``now`` skips the grace period (only when nothing else is writing)."""
        from ckvc.gc import GcReport, execute_gc, plan_gc

        if not dry_run:
            self.core.require_writable("running gc")
        grace = 0.0 if now else (self.config.gc_grace_s if grace_s is None else grace_s)
        expiry = self.config.reflog_expiry_s
        # One gc at a time: a second one could delete the first one's temporary packs.
        # OS errors up to gc's index swap delete nothing (execute_gc says what happened after it).
        with (
            storage_errors("running gc", "gc deleted nothing; the repository is unchanged"),
            file_lock(self.dir / "gc-run.lock", timeout=0),
        ):
            threshold = self.config.repack_threshold
            plan = plan_gc(self.core, grace_s=grace, repack_threshold=threshold, reflog_expiry_s=expiry)
            if dry_run:
                return GcReport(plan)
            return execute_gc(self.core, plan, reflog_expiry_s=expiry)

    def fsck(
        self, *, rebuild_index: bool = False, level: str = "full", sample: float | None = None,
        progress: ProgressCallback | None = None,
    ) -> FsckReport:  # fmt: skip
        """Check the refs, the commit graph and (level "full", the default) every
        stored object against its id; "metadata" and "refs" check less, faster;
        ``sample`` re-hashes a random fraction of the objects."""
        from ckvc.fsck import run_fsck

        return run_fsck(self.core, rebuild_index=rebuild_index, level=level, sample=sample, progress=progress)

    def du(self) -> DiskUsage:
        """Logical vs stored bytes, dedup and compression ratios, unique bytes per commit."""
        return inspect.disk_usage(self.core)


def _local(path: Path | None) -> Path:
    if path is None:
        raise InvalidInputError("this repository has no local directory")
    return path
