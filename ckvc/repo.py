"""Repo: the user-facing API (commit, checkout, load, log, show, diff, branch, tag,
resolve, maintenance), a thin facade over a :class:`ckvc.core.Repository` and the
functions of ckvc.graph, ckvc.write, ckvc.inspect and the maintenance modules."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

from ckvc import graph, inspect, retention, signing
from ckvc.committer import Committer
from ckvc.core import REPO_DIR, OnCore, Part, ProgressCallback, Repository, find_repo_root
from ckvc.errors import InvalidRevisionError, RefNotFoundError, SignatureError
from ckvc.fsck import run_fsck
from ckvc.gc import collect_garbage
from ckvc.graph import Reached, did_you_mean
from ckvc.hybrid import api as hybrid_api
from ckvc.inspect import CommitInfo, StateDiff, TensorChange, TensorSummary, is_rng_path
from ckvc.refs import tag_ref
from ckvc.remote import api as remote_api
from ckvc.signing import Signature, Verification

# torch, numpy and the codecs are imported only where tensors are made or read
# (ckvc.write, ckvc.state, ckvc.view, the bodies of commit/load/show/diff), so log,
# status, branch and tag start fast (tests/cli/test_cli_startup.py).
if TYPE_CHECKING:
    import torch

    from ckvc import write
    from ckvc.codecs.policy import LossySpec
    from ckvc.committer import PendingCommit
    from ckvc.config import RepoConfig
    from ckvc.executor import Executor
    from ckvc.hybrid.cache import Hybrid
    from ckvc.manifest import ManifestEntry
    from ckvc.notes import Note
    from ckvc.pruned import PruneLog
    from ckvc.refs import RefStore
    from ckvc.remote.location import RemoteList
    from ckvc.restore import IncompatibleKeys
    from ckvc.scrub import ScrubReport
    from ckvc.state import MapLocation, PendingBlob
    from ckvc.storage.object_store import ObjectStore
    from ckvc.validate import Validation
    from ckvc.view import CommitView
    from ckvc.write import CommitStats, OnConflict

__all__ = [
    "REPO_DIR", "CommitInfo", "ProgressCallback", "Reached", "Repo", "StateDiff",
    "TensorChange", "TensorSummary", "did_you_mean", "find_repo_root", "is_rng_path",
]  # fmt: skip


class _OpenRepo(Protocol):
    def __call__(self, path: str | os.PathLike[str] = ".", *, threads: int | None = None) -> Repo: ...


class _Open:
    """``Repo.open(path)`` on the class opens a repository. On an instance,
    ``repo.open(rev)`` is the old spelling of ``repo.view(rev)``: it still works,
    with a DeprecationWarning, for one release."""

    @overload
    def __get__(self, instance: None, owner: type[Repo]) -> _OpenRepo: ...

    @overload
    def __get__(self, instance: Repo, owner: type[Repo] | None = None) -> Callable[..., CommitView]: ...

    def __get__(self, instance: Repo | None, owner: type[Repo] | None = None) -> _OpenRepo | Callable[..., CommitView]:
        if instance is None:
            assert owner is not None
            return owner._open_repository
        view = instance.view

        def deprecated(*args: Any, **kwargs: Any) -> CommitView:
            warnings.warn("repo.open(rev) is deprecated; use repo.view(rev)", DeprecationWarning, stacklevel=2)
            return view(*args, **kwargs)

        return deprecated


class Repo:
    """A ckvc repository: ``path/.ckvc`` holding packs, an index, refs and config.
    Functions of its Repository (``core``) are bound with ``OnCore``, its parts with
    ``Part``; methods here are what the facade itself adds (background commits,
    the hybrid cache)."""

    def __init__(self, core: Repository) -> None:
        self.core = core
        self._commits = Committer(core)  # the commit path; its background thread is made by the first commit
        self.last_commit_stats: CommitStats | None = None
        core.commit_observers.extend((self._record_stats, self._apply_retention))  # the cache adds its own
        hybrid_api.attach(core)  # a lazy clone's promisor, the cache budget, auto_push
        if core.dir is not None and (core.dir / "hooks.json").exists():  # most repositories set none
            from ckvc.hooks import attach

            attach(core)

    path: Part[Path] = Part("local_path")  # the directory holding .ckvc
    dir: Part[Path] = Part("local_dir")  # path/.ckvc
    config: Part[RepoConfig] = Part("config")
    store: Part[ObjectStore] = Part("store")
    refs: Part[RefStore] = Part("refs")
    prune_log: Part[PruneLog] = Part("prune_log")
    executor: Part[Executor] = Part("executor")
    threads: Part[int] = Part("threads")

    # ---- lifecycle ----------------------------------------------------------
    @classmethod
    def init(
        cls, path: str | os.PathLike[str] = ".", *, chunk_size: int | None = None,
        codec: Mapping[str, Any] | None = None, default_branch: str = "main", keyframe_interval: int | None = None,
        threads: int | None = None,
    ) -> Repo:  # fmt: skip
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
            self._commits.close()
        finally:
            self.core.close()  # the cache first

    def wait(self) -> None:
        """Wait for every pending background commit; raise the first error not yet seen."""
        self._commits.wait()

    def __enter__(self) -> Repo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Repo({str(self.core.path)!r})" if self.core.path is not None else "Repo(in memory)"

    # ---- commit -------------------------------------------------------------
    @overload
    def commit(
        self, state: Any, message: str = "", metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None, *, merge: Sequence[str] = (), allow_pickle: bool = False,
        retain: bool | None = None, blocking: Literal[True] = True, progress: ProgressCallback | None = None,
        lossy: LossySpec = None, time_ns: int | None = None, on_conflict: OnConflict = "fail",
        sign: bool | None = None,
    ) -> str: ...  # fmt: skip

    @overload
    def commit(
        self, state: Any, message: str = "", metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None, *, merge: Sequence[str] = (), allow_pickle: bool = False,
        retain: bool | None = None, blocking: Literal[False], progress: ProgressCallback | None = None,
        lossy: LossySpec = None, time_ns: int | None = None, on_conflict: OnConflict = "fail",
        sign: bool | None = None,
    ) -> PendingCommit: ...  # fmt: skip

    def commit(
        self, state: Any, message: str = "", metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None, *, merge: Sequence[str] = (), allow_pickle: bool = False,
        retain: bool | None = None, blocking: bool = True, progress: ProgressCallback | None = None,
        lossy: LossySpec = None, time_ns: int | None = None, on_conflict: OnConflict = "fail",
        sign: bool | None = None,
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

        ``on_conflict="retry"``: when another writer moved the branch forward
        meanwhile, go on top of it (the CLI's default) instead of RefConflictError.

        ``sign=True`` signs the commit with the configured key (``sign_key``;
        ckvc.signing), False never; the default follows ``sign_commits``. The
        signature is stored before the branch moves and does not change the id.

        ``blocking=False`` returns a PendingCommit as soon as the state's bytes
        are copied, so training may change its tensors at once; the commit is
        written in the background, in order with other commits. Its errors
        surface on ``.result()`` and at the next commit, ``wait()`` or close."""
        return self._commits.commit(
            state, message, metrics, metadata, merge=merge, allow_pickle=allow_pickle, retain=retain,
            blocking=blocking, progress=progress, lossy=lossy, time_ns=time_ns, on_conflict=on_conflict, sign=sign,
        )  # fmt: skip

    # ---- commit observers: every commit path fires them (ckvc.write.finish) ----
    def _record_stats(self, event: write.Committed) -> None:
        if event.stats is not None:
            self.last_commit_stats = event.stats

    def _apply_retention(self, event: write.Committed) -> None:
        policy = self.retention_policy()
        if policy is not None and (event.retain or (event.retain is None and policy.auto)):
            retention.retain_after_commit(self.core, policy, event.commit)

    # ---- reading ------------------------------------------------------------
    read_commit = OnCore(Repository.read_commit)
    read_tag = OnCore(Repository.read_tag)
    read_snapshot = OnCore(Repository.read_snapshot)
    readable_commit = OnCore(graph.readable_commit)

    def load(
        self, rev: str = "HEAD", map_location: MapLocation = None, *, allow_pickle: bool = False,
        progress: ProgressCallback | None = None, keys: Iterable[str] | None = None, prefix: str | None = None,
        subtree: str | None = None, verify_signatures: bool | None = None,
    ) -> Any:  # fmt: skip
        """The state stored in ``rev``; HEAD does not move. Every byte is verified.

        With ``keys`` (leaf paths as ``show`` lists them, "model.layer.0.weight",
        or a subtree's, "rng": its nested value) and/or ``prefix`` ("model."): only
        those, as a flat dict by path, reading only the chunks they cover;
        ``subtree="rng"``: only the nested value there. UnknownKeyError (a KeyError)
        for a path the commit does not hold. Under ``require_signatures`` a commit
        no trusted key signed raises SignatureError before anything is read;
        ``verify_signatures=False`` skips that check (with a warning), True forces it."""
        from ckvc import read

        commit = self.readable_commit(rev, allow_pickle=allow_pickle, verify_signatures=verify_signatures)
        return read.load_state(
            self.core, commit, map_location=map_location, allow_pickle=allow_pickle, progress=progress, keys=keys,
            prefix=prefix, subtree=subtree,
        )  # fmt: skip

    def view(
        self, rev: str = "HEAD", map_location: MapLocation = None, *, allow_pickle: bool = False,
        progress: ProgressCallback | None = None, verify_signatures: bool | None = None,
    ) -> CommitView:  # fmt: skip
        """A lazy, read-only mapping of ``rev``'s tensors by path. Opening it reads
        the snapshot only; ``view[path]`` reads and verifies only that tensor's
        chunks. ``view.info(path)``, ``view.non_tensors``, ``view.commit``,
        ``view.load(keys, prefix=...)``. Pruned commits, pickles and signatures as in ``load``."""
        from ckvc.view import CommitView

        commit = self.readable_commit(rev, allow_pickle=allow_pickle, verify_signatures=verify_signatures)
        return CommitView(self.core, commit, map_location=map_location, allow_pickle=allow_pickle, progress=progress)

    def load_into(
        self, rev: str = "HEAD", *, model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None, strict: bool = True,
        model_key: str | None = "model", optimizer_key: str | None = "optimizer",
        scheduler_key: str | None = "scheduler", map_location: MapLocation = None, allow_pickle: bool = False,
        progress: ProgressCallback | None = None, rng: bool | str = False, check_run: bool = True,
        verify_signatures: bool | None = None,
    ) -> IncompatibleKeys:  # fmt: skip
        """Restore ``rev`` into live objects, for a state committed as ``{"model":
        model.state_dict(), "optimizer": ..., "scheduler": ...}`` (``*_key``: where each
        lives, a dotted path; None: the whole state). Parameters and buffers are
        overwritten in place (``data_ptr()``s stay): chunks decode straight into their
        memory (CPU, contiguous, same dtype), else through a one-chunk staging buffer,
        never through a second copy of the state. ``strict``: missing or unexpected keys
        and any shape or dtype difference raise IncompatibleStateError before anything
        changes; ``strict=False`` returns the missing and unexpected keys (like
        ``load_state_dict``) and casts dtypes; shapes must match. The optimizer and
        scheduler get their ``load_state_dict`` (``map_location``: where their tensors
        load first). ``rng``: also restore the RNG state ``ckvc.rng_state()`` saved under
        "rng" (or the path given; UnknownKeyError if absent). Verified as ``load`` is; a
        chunk found damaged while the model is being written leaves it partly written.
        A commit made at another world size than this process's (both known: the
        commit's "ckvc.run" metadata, the process group or WORLD_SIZE) raises
        RunMismatchError first, unless ``check_run=False``. Signatures as in ``load``."""
        from ckvc.restore import load_into

        commit = self.readable_commit(rev, allow_pickle=allow_pickle, verify_signatures=verify_signatures)
        return load_into(
            self.core, commit, model=model, optimizer=optimizer,
            scheduler=scheduler, strict=strict, model_key=model_key,
            optimizer_key=optimizer_key, scheduler_key=scheduler_key, map_location=map_location,
            allow_pickle=allow_pickle, progress=progress, rng_key=("rng" if rng is True else rng or None),
            check_run=check_run,
        )  # fmt: skip

    def checkout(
        self, rev: str, map_location: MapLocation = None, *, allow_pickle: bool = False,
        progress: ProgressCallback | None = None, verify_signatures: bool | None = None,
    ) -> Any:  # fmt: skip
        """Load ``rev`` and move HEAD to it, like git checkout: onto the branch when
        ``rev`` names one, detached otherwise, only after the state loaded cleanly. The
        next ``commit`` continues from ``rev``, detached unless ``rev`` is a branch
        (``switch(rev, new_branch="retry")`` first resumes an old epoch on a new branch).
        ``load`` moves no HEAD: a commit after it lands on the current branch tip."""
        self.wait()  # a background commit must land on the branch it was made on
        commit_id = self.resolve(rev)
        state = self.load(
            commit_id, map_location, allow_pickle=allow_pickle, progress=progress, verify_signatures=verify_signatures
        )
        with self.store.pin():
            if not self.store.has(bytes.fromhex(commit_id)):  # gc took it while we loaded
                raise InvalidRevisionError(f"revision {rev!r}: commit {commit_id[:12]} was garbage-collected")
            graph.move_head(self.core, rev, commit_id)
        return state

    def switch(self, rev: str, *, new_branch: str | None = None) -> str:
        """Move HEAD to ``rev`` without loading it. Returns the commit id.
        A pruned commit is refused: there is no state to resume from.
        ``new_branch``: first create that branch at ``rev`` and move HEAD onto it
        (git switch -c); RefConflictError if it exists."""
        self.wait()  # a background commit must land on the branch it was made on
        return graph.switch(self.core, rev, new_branch=new_branch)

    def reset(self, rev: str) -> str:
        """Move the branch HEAD is on to ``rev``, HEAD staying on it (git reset), once
        background commits have landed; returns the commit id (``graph.reset``)."""
        self.wait()  # a background commit must land on the branch it was made on
        return graph.reset(self.core, rev)

    # ---- history ------------------------------------------------------------
    log = OnCore(graph.log)
    best = OnCore(graph.best)
    rank = OnCore(graph.rank)
    head = OnCore(graph.head)

    def show(self, rev: str = "HEAD", *, tensors: bool = True) -> CommitInfo:
        """The commit ``rev`` names with its tensors (dtype, shape, size), non-tensor
        values and stored sizes; reads no tensor data. ``tensors=False`` skips
        parsing the state (empty ``tensors`` and ``values``; torch is not imported)."""
        return inspect.show(self.core, self.resolve(rev), tensors=tensors)

    def manifest(self, rev: str = "HEAD") -> list[ManifestEntry]:
        """Per tensor: dtype, shape, size and a content hash from the chunk ids (no tensor
        data read), equal to ``ckvc.manifest_of(state)`` for the state committed."""
        from ckvc.manifest import manifest

        return manifest(self.core, self.resolve(rev))

    def diff(self, a: str, b: str = "HEAD", paths: Sequence[str] = (), *, data: bool = True) -> StateDiff:
        """Tensors added, removed and changed from ``a`` to ``b`` (with relative L2
        change and max abs difference), changed non-tensor values and metrics.
        ``paths``: only leaves equal to, under, or matching (glob) one of them.
        ``data=False`` reads no tensor bytes (no rel_l2 / max_abs: ``--stat``)."""
        return inspect.diff(self.core, self.resolve(a), self.resolve(b), paths, data=data)

    # ---- refs ---------------------------------------------------------------
    branch = OnCore(graph.create_branch)
    delete_branch = OnCore(graph.delete_branch)
    branches = OnCore(graph.branches)
    tag = OnCore(graph.create_tag)
    delete_tag = OnCore(graph.delete_tag)
    tags = OnCore(graph.tags)
    tag_object = OnCore(graph.tag_object)
    reflog = OnCore(graph.reflog)
    expire_reflogs = OnCore(graph.expire_reflogs)
    resolve = OnCore(graph.resolve)
    ref_tips = OnCore(graph.ref_tips)
    walk = OnCore(graph.walk)
    iter_reachable_commits = OnCore(graph.iter_reachable_commits)

    # ---- lifecycle ----------------------------------------------------------
    pruned = OnCore(Repository.pruned)
    retention_policy = OnCore(retention.stored_policy)
    set_retention = OnCore(retention.store_policy)
    set_config = OnCore(hybrid_api.set_config)

    # ---- remotes ------------------------------------------------------------
    @property
    def remotes(self) -> RemoteList:
        """The configured remotes: ``add(name, url, endpoint=, region=)``, ``remove``, ``list``, ``get``."""
        return remote_api.remotes(self.core)

    fetch = OnCore(remote_api.fetch)
    pull = OnCore(remote_api.pull)
    ls_remote = OnCore(remote_api.ls_remote)
    remote_branches = OnCore(remote_api.remote_branches)
    fsck_remote = OnCore(remote_api.fsck_remote)
    repair = OnCore(remote_api.repair)
    gc_remote = OnCore(remote_api.gc_remote)
    retain_remote = OnCore(remote_api.retain_remote)
    push = OnCore(hybrid_api.push)

    @classmethod
    def clone(
        cls, url: str, path: str | os.PathLike[str], *, endpoint: str | None = None, region: str | None = None,
        threads: int | None = None, progress: ProgressCallback | None = None, lazy: bool = False,
        trusted_keys: str | os.PathLike[str] | None = None, require_signatures: bool = False,
    ) -> Repo:  # fmt: skip
        """A new repository at ``path`` from the remote at ``url`` (as ``origin``), with
        the remote HEAD's branch checked out, like git clone. ``lazy``: refs and
        metadata only, tensor data fetched (verified) on first read.
        ``trusted_keys``/``require_signatures``: the clone's trust settings, already
        in force for its first fetch (ckvc.signing)."""
        from ckvc.remote.clone import clone

        return cls(
            clone(
                url, path, endpoint=endpoint, region=region, threads=threads, progress=progress, lazy=lazy,
                trusted_keys=trusted_keys, require_signatures=require_signatures,
            )
        )  # fmt: skip

    def export(
        self, rev: str, out: str | os.PathLike[str], *, format: Literal["pt", "safetensors", "dir"] | None = None,
        prefix: str | None = None, progress: ProgressCallback | None = None, allow_pickle: bool = False,
        verify_signatures: bool | None = None, sign_key: str | os.PathLike[str] | None = None,
    ) -> list[Path]:  # fmt: skip
        """Write ``rev`` to ``out`` without moving HEAD (``ckvc export``; see
        ckvc.formats.export_commit); returns the files written. ``sign_key`` (a PEM
        ECDSA P-256 private key): also an OpenSSF model-signing bundle, ``out/model.sig``
        (``out.sig`` for a file), built from the bytes as they are written."""
        from ckvc.formats.export import export_commit

        key = None if sign_key is None else signing.load_signing_key(sign_key)
        return export_commit(
            self, rev, Path(out), format=format, prefix=prefix, progress=progress, allow_pickle=allow_pickle,
            verify_signatures=verify_signatures, sign_key=key,
        )  # fmt: skip

    def validate(
        self, rev: str, evaluate: Callable[[Any], Any] | str, *, metric: str | None = None, rtol: float = 1e-6,
        atol: float = 0.0, record: bool = True, fresh_process: bool = False,
    ) -> Validation:  # fmt: skip
        """Does ``rev`` still perform as recorded? Load it, run ``evaluate(state)`` (a
        callable, or "module:function"; ``fresh_process``: imported and run in a new
        interpreter), compare what it returns (a number named ``metric``, or a dict)
        with the commit's recorded metrics within ``rtol``/``atol``, and (``record``)
        add a note "validated: ok" or "validated: MISMATCH ..." (ckvc.validate)."""
        from ckvc.validate import validate

        return validate(
            self.core, rev, evaluate, metric=metric, rtol=rtol, atol=atol, record=record, fresh_process=fresh_process
        )

    # ---- scrub (ckvc.scrub) --------------------------------------------------------
    def scrub(
        self, remote: str | None = None, *, max_bytes: int | None = None, max_seconds: float | None = None,
        progress: ProgressCallback | None = None, clock: Callable[[], float] | None = None,
    ) -> ScrubReport:  # fmt: skip
        """Verify the packs this scrub cycle has not, longest unverified first, within a
        budget of bytes or seconds (neither: the rest of the cycle); of ``remote`` (its
        packs, read through its backend) when given. Resumable; repairs nothing."""
        import time

        from ckvc.scrub import SCRUB_FILE, scrub

        clock = clock or time.monotonic
        if remote is None:
            return scrub(
                self.core.store, self.core.local_dir / SCRUB_FILE, max_bytes=max_bytes, max_seconds=max_seconds,
                clock=clock, progress=progress,
            )  # fmt: skip
        from ckvc.remote.common import remotes_of
        from ckvc.remote.location import REMOTES_DIR
        from ckvc.remote.repository import open_remote

        spec = remotes_of(self.core).get(remote)
        handle = open_remote(self.core, spec)
        try:
            state = self.core.local_dir / REMOTES_DIR / spec.name / SCRUB_FILE
            state.parent.mkdir(parents=True, exist_ok=True)
            handle.core.store.refresh()
            return scrub(
                handle.core.store, state, max_bytes=max_bytes, max_seconds=max_seconds, clock=clock,
                progress=progress,
            )  # fmt: skip
        finally:
            handle.close()

    # ---- notes (ckvc.notes) --------------------------------------------------------
    def note(
        self, rev: str = "HEAD", *, metrics: Mapping[str, Any] | None = None, metadata: Mapping[str, Any] | None = None,
        message: str = "", sign: bool | None = None,
    ) -> Note:  # fmt: skip
        """Add a note to ``rev``: metrics, metadata or text learned after the commit (an
        evaluation's result). Appended, never changing the commit's id; push and fetch
        carry it; ``best``, ``rank`` and keep-best retention see the newest value of a
        metric. Signed when ``sign`` (default: the ``sign_commits`` setting)."""
        from ckvc.notes import add_note

        return add_note(self.core, self.resolve(rev), metrics=metrics, metadata=metadata, message=message, sign=sign)

    def notes(self, rev: str = "HEAD") -> list[Note]:
        """``rev``'s notes, oldest first (damaged records skipped with a warning)."""
        from ckvc.notes import notes_of

        return notes_of(self.core, self.resolve(rev))

    # ---- signatures (ckvc.signing) -----------------------------------------------
    def sign(self, rev: str = "HEAD") -> Signature:
        """Sign the commit ``rev`` after the fact with the configured key (``sign_key``):
        history made before signing was turned on, vouched for now. Returns the record."""
        key = signing.signer_for(self.core, True)
        assert key is not None
        self.core.require_writable("signing")
        return signing.sign(self.core, self.resolve(rev), "commit", key)

    def verify_commit(self, rev: str = "HEAD") -> Verification:
        """Who signed ``rev``, checked against the trusted keys: SignatureError when
        it is not signed, a signature does not verify, or no trusted key signed it."""
        verdict = signing.verify(self.core, self.resolve(rev), "commit")
        if not verdict.good:
            raise SignatureError(verdict.describe())
        return verdict

    def verify_tag(self, name: str) -> Verification:
        """``verify_commit`` for the annotated tag ``name`` (its tag object's signature)."""
        oid = self.core.refs.read(tag_ref(name))
        if oid is None:
            raise RefNotFoundError(f"tag {name!r} not found{graph.ref_hint(self.core, name, branches=False)}")
        verdict = signing.verify(self.core, oid, "tag")
        if not verdict.good:
            raise SignatureError(verdict.describe())
        return verdict

    push_mirror = OnCore(remote_api.push_mirror)
    mirror = staticmethod(remote_api.mirror)

    status = OnCore(hybrid_api.status)
    backup_status = OnCore(hybrid_api.backup_status)
    wait_for_backup = OnCore(hybrid_api.wait_for_backup)

    @property
    def cache(self) -> Hybrid:
        """The local chunk cache: ``report()``, ``pin(rev)``, ``unpin(rev)``, ``prune()``
        (``ckvc.hybrid.api.cache``)."""
        return hybrid_api.cache(self.core)

    retain = OnCore(retention.retain)
    gc = OnCore(collect_garbage)
    fsck = OnCore(run_fsck)
    du = OnCore(inspect.disk_usage)

    def run_in_background(self, fn: Callable[..., str], pending: Sequence[PendingBlob], *args: Any) -> PendingCommit:
        """Run ``fn(private copies of pending, *args)`` (a commit written elsewhere,
        e.g. ckvc.distributed) on this repository's background commit thread: in
        order with the other background commits, its error raised like theirs,
        waited for at close. The copies are made before this returns."""
        return self._commits.run_in_background(fn, pending, *args)
