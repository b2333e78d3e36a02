"""Multi-rank commits over torch.distributed (docs/DESIGN.md, "Distributed").

Every rank calls :func:`commit` with its own state. The protocol, on a gloo group
with a timeout (the whole of it under each rank's writer pin, so gc removes
nothing a rank deduplicated against until the commit has landed):

1. the coordinator reads where the commit lands (branch, parent) and fixes its
   author and time; it broadcasts them, so every rank deltas against the same
   parent and can compute the commit's id itself;
2. each rank stages its state (host copy), writes its chunks into its own packs
   (``write.write_blobs``) and seals them, then all ranks exchange their entries
   (tree, blob table, counts: canonical msgpack bytes over the group, no pickle),
   or the error that stopped them;
3. if every rank succeeded, the coordinator writes one snapshot whose tree is
   ``{"rank0": state0, "rank1": state1, ...}`` and one commit (world size in its
   metadata under ``"distributed"``), moves the branch by compare-and-swap, and
   broadcasts the outcome. Every rank returns the same commit id.

A failure anywhere, or a lost rank (killed, timed out: gloo reports a closed
connection at once, a hang after the group's timeout), means no commit: each
surviving rank raises DistributedCommitError. The one exception is the
coordinator dying between its ref swap and its broadcast: survivors then find
the branch naming the id they computed and return it, so what a rank reports
always matches the branch. Packs of a failed commit are unreferenced; gc
reclaims them after its grace period.

:func:`load` and :func:`load_into` read one rank's part. Loading at another world
size is the DCP path's job (ckvc.integrations.dcp). A commit's tree is its
ranks' trees nested by ckvc.trees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

import msgpack
import torch
import torch.distributed as dist

from ckvc import read, trees, write
from ckvc import state as state_mod
from ckvc.chunking import size_batches
from ckvc.core import ProgressCallback, default_author
from ckvc.errors import (
    CkvcError,
    CorruptObjectError,
    DistributedCommitError,
    DurabilityWarning,
    InvalidInputError,
    UnsupportedTypeError,
)
from ckvc.objects import Blob, Commit
from ckvc.write import OnConflict

if TYPE_CHECKING:
    from ckvc.codecs.policy import LossySpec
    from ckvc.committer import PendingCommit
    from ckvc.repo import Repo
    from ckvc.restore import IncompatibleKeys
    from ckvc.state import MapLocation

# Commit metadata key holding {"world_size": n, "coordinator": r}.
METADATA_KEY = "distributed"
# How long a rank waits for the others in one step before giving up (seconds).
DEFAULT_TIMEOUT_S = 600.0

# gloo groups made for commits: (default group, timeout) -> group. One per world
# and timeout, created on first use (a collective every rank makes in order).
_GROUPS: dict[tuple[Any, float], dist.ProcessGroup] = {}


def rank_key(rank: int) -> str:
    """Where rank ``rank``'s state lives in a distributed commit's tree."""
    return f"rank{rank}"


def world_size(commit: Commit) -> int | None:
    """The world size a distributed commit was made at; None for any other commit."""
    info = commit.metadata.get(METADATA_KEY)
    if isinstance(info, dict) and type(info.get("world_size")) is int and info["world_size"] > 0:
        return int(info["world_size"])
    return None


# ---- moving bytes over the group ------------------------------------------------


class _PeerLost(Exception):
    """A collective failed: a rank died, hung past the timeout, or the group broke."""


def _collective(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except RuntimeError as exc:  # gloo: closed connection, timeout (DistBackendError is one)
        raise _PeerLost(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc


def _all_gather_bytes(group: dist.ProcessGroup, data: bytes) -> list[bytes]:
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    _collective(lambda: dist.all_gather(sizes, size, group=group))
    longest = max(int(s.item()) for s in sizes)
    buffer = torch.zeros(max(longest, 1), dtype=torch.uint8)
    if data:
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buffer) for _ in range(world)]
    _collective(lambda: dist.all_gather(out, buffer, group=group))
    return [o[: int(s.item())].numpy().tobytes() for o, s in zip(out, sizes, strict=True)]


def _broadcast_bytes(group: dist.ProcessGroup, source: int, data: bytes | None) -> bytes:
    """``data`` from group rank ``source`` on every rank."""
    mine = dist.get_rank(group) == source
    size = torch.tensor([len(data) if mine and data is not None else 0], dtype=torch.int64)
    _collective(lambda: dist.broadcast(size, group=group, group_src=source))
    buffer = torch.zeros(max(int(size.item()), 1), dtype=torch.uint8)
    if mine and data:
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    _collective(lambda: dist.broadcast(buffer, group=group, group_src=source))
    return buffer[: int(size.item())].numpy().tobytes()


def commit_group(group: dist.ProcessGroup | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> dist.ProcessGroup:
    """``group``, or a gloo group over the whole world with ``timeout`` (made on
    first use and kept: every rank must reach this call in the same order)."""
    if group is not None:
        return group
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidInputError(
            "no process group: call torch.distributed.init_process_group (torchrun sets it up) or pass group="
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidInputError(f"timeout must be a positive number of seconds, got {timeout!r}")
    key = (dist.group.WORLD, float(timeout))  # the object, not its id: a new world is a new key
    if key not in _GROUPS:
        try:
            _GROUPS[key] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:  # gloo: a rank died or left while the mesh was built
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DistributedCommitError(
                f"could not make the commit's gloo group (a rank was lost): {first}; nothing was committed"
            ) from exc
    return _GROUPS[key]


def _rank(group: dist.ProcessGroup | None, rank: int | None) -> int:
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise InvalidInputError(f"rank must be a non-negative int, got {rank!r}")
        return rank
    if group is None and not (dist.is_available() and dist.is_initialized()):
        raise InvalidInputError("no process group: pass rank= (or group=) to say whose part to read")
    return dist.get_rank(group)


# ---- commit ---------------------------------------------------------------------


@dataclass
class _Start:
    """What the coordinator fixes before anyone writes (broadcast as canonical data)."""

    target: str | None
    parent: str | None
    author: str
    time_ns: int
    error: str | None = None

    def encode(self) -> bytes:
        return trees.pack([self.target, self.parent, self.author, self.time_ns, self.error])

    @classmethod
    def decode(cls, data: bytes) -> _Start:
        target, parent, author, time_ns, error = msgpack.unpackb(data, raw=False)
        return cls(target, parent, author, time_ns, error)


@dataclass
class _Entry:
    """One rank's report: its tree and blobs, or the error that stopped it."""

    tree: bytes = b""
    blobs: list[Blob] = dataclasses.field(default_factory=list)
    pickled: bool = False
    lossy: dict[str, Any] = dataclasses.field(default_factory=dict)
    consistency: bytes | None = None
    error: str | None = None

    def encode(self) -> bytes:
        blobs = [b.to_wire() for b in self.blobs]
        return trees.pack([self.tree, blobs, self.pickled, self.lossy, self.consistency, self.error])

    @classmethod
    def decode(cls, data: bytes) -> _Entry:
        try:
            tree, blobs, pickled, lossy, consistency, error = msgpack.unpackb(data, raw=False)
            return cls(tree, [Blob.from_wire(b) for b in blobs], pickled, lossy, consistency, error)
        except Exception as exc:
            return cls(error=f"its report could not be read ({exc})")


def _consistency_value(state: Any, key: str | None) -> bytes | None:
    """The canonical bytes of ``state[key]``, which every rank must agree on."""
    if key is None:
        return None
    if not isinstance(state, Mapping) or key not in state:
        raise InvalidInputError(f"consistency_key {key!r} is not a key of this rank's state")
    value = state[key]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if value is not None and type(value) not in (int, float, str, bool):
        raise InvalidInputError(f"state[{key!r}] must be an int, float, str, bool or one-element tensor")
    return trees.pack(value)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@overload
def commit(
    repo: Repo, state: Any, message: str = "", metrics: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None, *, group: dist.ProcessGroup | None = None, coordinator: int = 0,
    timeout: float = DEFAULT_TIMEOUT_S, blocking: Literal[True] = True, consistency_key: str | None = None,
    allow_pickle: bool = False, lossy: LossySpec = None, time_ns: int | None = None,
    progress: ProgressCallback | None = None, remote: str | None = None, on_conflict: OnConflict = "fail",
) -> str: ...  # fmt: skip


@overload
def commit(
    repo: Repo, state: Any, message: str = "", metrics: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None, *, group: dist.ProcessGroup | None = None, coordinator: int = 0,
    timeout: float = DEFAULT_TIMEOUT_S, blocking: Literal[False], consistency_key: str | None = None,
    allow_pickle: bool = False, lossy: LossySpec = None, time_ns: int | None = None,
    progress: ProgressCallback | None = None, remote: str | None = None, on_conflict: OnConflict = "fail",
) -> PendingCommit: ...  # fmt: skip


def commit(
    repo: Repo,
    state: Any,
    message: str = "",
    metrics: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    coordinator: int = 0,
    timeout: float = DEFAULT_TIMEOUT_S,
    blocking: bool = True,
    consistency_key: str | None = None,
    allow_pickle: bool = False,
    lossy: LossySpec = None,
    time_ns: int | None = None,
    progress: ProgressCallback | None = None,
    remote: str | None = None,
    on_conflict: OnConflict = "fail",
) -> str | PendingCommit:
    """Commit every rank's ``state`` as one commit; call it on every rank of
    ``group`` (default: a gloo group over the world with ``timeout`` seconds, made
    on first use). Returns the commit id, the same on every rank; its tree holds
    rank r's state under ``"rank{r}"`` and its metadata the world size.

    ``coordinator`` (a rank of the group) moves the branch; ``message``,
    ``metrics``, ``metadata``, ``lossy`` and ``time_ns`` are the coordinator's.
    ``consistency_key``: a top-level key of every state (``"step"``) whose values
    must agree across ranks. A failure on any rank, a rank lost, or a mismatch:
    no commit, DistributedCommitError on every surviving rank (``failures``: by
    rank). ``blocking=False`` returns a PendingCommit once this rank's state is
    copied; the protocol then runs on the repository's background commit thread
    (ranks must all commit the same way, in the same order).

    ``remote``: commit straight to that remote (a bucket every node reaches; each
    node's ``repo`` is its own clone of it, lazy or not, with no shared path). Each
    rank writes its chunks into its node's packs, uploads what the remote lacks of
    them, and only when every rank has, the coordinator uploads the commit and
    moves the remote's branch (HEAD's branch name) by compare-and-swap; then each
    node records the commit locally (remote-tracking ref and branch, no download).
    With ``blocking=False`` the PendingCommit's ``local()`` says when this rank's
    part is durable on its node, ``result()`` when the commit is on the remote.

    ``on_conflict="retry"``: when another writer moved the branch forward while
    the ranks wrote, the coordinator puts the commit on top of theirs (as
    ``Repo.commit`` does); the default is DistributedCommitError saying so."""
    repo.core.require_writable("committing")
    if metadata is not None and METADATA_KEY in metadata:
        raise InvalidInputError(f"metadata key {METADATA_KEY!r} is ckvc's, for the world size")
    group = commit_group(group, timeout)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if isinstance(coordinator, bool) or not isinstance(coordinator, int) or not 0 <= coordinator < world:
        raise InvalidInputError(f"coordinator must be a rank of the group (0..{world - 1}), got {coordinator!r}")
    meta = {**(metadata or {}), METADATA_KEY: {"coordinator": coordinator, "world_size": world}}
    request = write.CommitRequest.checked(message, metrics, meta, time_ns=time_ns)
    if blocking:
        repo.wait()
    key = rank_key(rank)
    staged = write.stage(
        repo.core, state, allow_pickle=allow_pickle, pin_memory=not blocking, lossy=lossy, metadata=meta
    )
    _check_depth(key, staged.tree)
    pending = [dataclasses.replace(b, path=f"{key}.{b.path}" if b.path else key) for b in staged.pending]
    consistency = _consistency_value(state, consistency_key)
    request = dataclasses.replace(request, pickled=staged.pickled)
    if remote is not None:
        hold_parts_on(repo, remote)
        local_stage: Future[None] = Future()
        bucket_args = (
            repo,
            group,
            coordinator,
            staged.tree,
            request,
            lossy,
            consistency,
            progress,
            on_conflict,
            remote,
        )
        if not blocking:
            handle = repo.run_in_background(_run_remote, pending, *bucket_args, local_stage)
            handle.local_stage = local_stage
            return handle
        return _run_remote(pending, *bucket_args, local_stage)
    args = (repo, group, coordinator, staged.tree, request, lossy, consistency, progress, on_conflict)
    if not blocking:
        return repo.run_in_background(_run, pending, *args)
    return _run(pending, *args)


def _check_depth(key: str, tree: bytes) -> None:
    """A rank's state sits one level down in the commit's tree: refuse one that
    would then nest too deep, before anything is written."""
    try:
        state_mod.parse_tree(trees.nest_trees([(key, tree, 0)]), None, allow_pickle=None)
    except CorruptObjectError as exc:
        raise UnsupportedTypeError(key, f"too deep for a distributed commit ({exc.reason})") from None


def _run(
    pending: list[state_mod.PendingBlob],
    repo: Repo,
    group: dist.ProcessGroup,
    coordinator: int,
    tree: bytes,
    request: write.CommitRequest,
    lossy: LossySpec,
    consistency: bytes | None,
    progress: ProgressCallback | None,
    on_conflict: OnConflict,
) -> str:
    core = repo.core
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    expected: str | None = None  # the commit's id, once every rank knows it
    head: write.Head | None = None
    try:
        with write.batch(core) as writer:  # the pin lasts until the branch has moved
            # 1. Where the commit lands, its author and time: the coordinator's.
            start: _Start | None = None
            if rank == coordinator:
                try:
                    read_head = write.read_head(core)
                    start = _Start(
                        read_head.target,
                        read_head.parent,
                        default_author() if request.author is None else request.author,
                        request.time_ns if request.time_ns is not None else time.time_ns(),
                    )
                except CkvcError as exc:
                    start = _Start(None, None, "", 0, error=_describe(exc))
            start = _Start.decode(_broadcast_bytes(group, coordinator, start.encode() if start else None))
            if start.error is not None:
                raise DistributedCommitError(
                    f"rank {coordinator} (coordinator) could not start the commit: {start.error}; "
                    "nothing was committed",
                    failures={coordinator: start.error},
                )
            head = write.Head(start.target, start.parent)
            request = dataclasses.replace(request, author=start.author, time_ns=start.time_ns)
            # 2. This rank's chunks, durable in its own packs; then everyone's entries.
            part = _Entry(tree, pickled=request.pickled, consistency=consistency)
            entry, local_error = _write_part(core, pending, part, head, lossy, writer, progress)
            entries = [_Entry.decode(e) for e in _all_gather_bytes(group, entry.encode())]
            failures = {r: e.error for r, e in enumerate(entries) if e.error is not None}
            if not failures:
                failures = _inconsistent(entries)
            if failures:
                message = _failed_message(failures, start.target)
                raise DistributedCommitError(message, failures=failures) from local_error
            # 3. The one commit: every rank computes its id, the coordinator writes it.
            blobs, request = _combined(entries, request)
            expected = write.commit_id_of(blobs, request, head.parent)
            outcome: bytes | None = None
            if rank == coordinator:
                try:
                    landed = write.finish(core, blobs, request, head=head, writer=writer, on_conflict=on_conflict)
                    assert landed == expected or on_conflict == "retry", (landed, expected)
                    outcome = trees.pack([landed, None])
                except Exception as exc:
                    outcome = trees.pack([None, _describe(exc)])
                    if write.landed(core, head, expected):
                        outcome = trees.pack([expected, None])
            commit_id, error = msgpack.unpackb(_broadcast_bytes(group, coordinator, outcome), raw=False)
            if error is not None:
                failures = {coordinator: error}
                raise DistributedCommitError(_failed_message(failures, start.target), failures=failures)
    except _PeerLost as exc:
        # The coordinator moved the branch, then was lost before saying so (on top of
        # another writer's commit, with retry: the same snapshot under another id).
        found = None if expected is None else write.landed_with(core, head, blobs, request)
        if found is not None:
            warnings.warn(
                DurabilityWarning(f"commit {found[:12]} landed, but a rank was lost after it did: {exc}"),
                stacklevel=2,
            )
            return found
        where = head.where if head is not None else "the branch"
        raise DistributedCommitError(
            f"rank {rank} of {world} lost contact with the other ranks ({exc}): nothing was committed; "
            f"{where} is unchanged"
        ) from exc
    assert isinstance(commit_id, str)
    return commit_id


# ---- commit straight to a remote ----------------------------------------------------


def _node_key(repo: Repo) -> str:
    """Which node's repository a rank writes to: ranks with the same key share it."""
    return f"{socket.gethostname()}:{os.path.realpath(repo.core.local_dir)}"


def _run_remote(
    pending: list[state_mod.PendingBlob],
    repo: Repo,
    group: dist.ProcessGroup,
    coordinator: int,
    tree: bytes,
    request: write.CommitRequest,
    lossy: LossySpec,
    consistency: bytes | None,
    progress: ProgressCallback | None,
    on_conflict: OnConflict,
    remote: str,
    local_stage: Future[None],
) -> str:
    """The protocol of :func:`_run` with a remote as the commit's home
    (ckvc.remote.publish): the coordinator reads the remote's branch and, once every
    rank reports its part uploaded, publishes the commit there; each node's first
    rank then records it locally, and all ranks leave together."""
    from ckvc.remote import publish

    core = repo.core
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    expected: str | None = None
    start: _Start | None = None
    handle: Any = None
    leader = False
    entries: list[_Entry] = []
    try:
        with contextlib.ExitStack() as stack, write.batch(core) as writer:
            # 1. The coordinator opens the remote (making it on the first commit) and
            #    reads its branch: the parent every rank deltas against.
            prepared: str | None = None  # this rank's error before writing, if any
            if rank == coordinator:
                try:
                    target, _ = core.refs.head()
                    if target is None:
                        raise InvalidInputError("HEAD is detached: a commit to a remote lands on HEAD's branch")
                    handle = stack.enter_context(publish.kept_open_for_commit(core, remote, create=True))
                    start = _Start(
                        target,
                        handle.core.refs.read(target),
                        default_author() if request.author is None else request.author,
                        request.time_ns if request.time_ns is not None else time.time_ns(),
                    )
                except (CkvcError, OSError) as exc:
                    start = _Start(None, None, "", 0, error=_describe(exc))
            start = _Start.decode(_broadcast_bytes(group, coordinator, start.encode() if start else None))
            if start.error is not None:
                raise DistributedCommitError(
                    f"rank {coordinator} (coordinator) could not start the commit on {remote}: {start.error}; "
                    "nothing was committed",
                    failures={coordinator: start.error},
                )
            assert start.target is not None
            head = write.Head(start.target, start.parent)
            request = dataclasses.replace(request, author=start.author, time_ns=start.time_ns)
            try:
                if handle is None:
                    handle = stack.enter_context(publish.kept_open_for_commit(core, remote, create=False))
                stack.enter_context(handle.core.store.pin())
            except (CkvcError, OSError) as exc:
                prepared = _describe(exc)
            # 1b. Ranks sharing a repository name its first rank, which records the
            #     commit there; a node that lacks the parent's history fetches it first.
            has_parent = start.parent is None or core.object_exists(start.parent)
            node = _node_key(repo)
            nodes = [trees.unpack(b) for b in _all_gather_bytes(group, trees.pack([node, has_parent]))]
            leader = next(r for r, (key, _) in enumerate(nodes) if key == node) == rank
            if not all(ok for _, ok in nodes):
                if leader and not has_parent and prepared is None:
                    prepared = _fetch_history(core, remote)
                _all_gather_bytes(group, b"")  # the others wait for their node's history
            # 2. This rank's chunks, durable in its node's packs, then on the remote.
            part = _Entry(tree, pickled=request.pickled, consistency=consistency)
            if prepared is None:
                assert handle is not None
                entry, local_error = _write_and_upload(
                    core, pending, part, head, lossy, writer, progress, handle, remote, local_stage
                )
            else:
                entry, local_error = _Entry(error=prepared), None
            _settle_stage(local_stage, entry.error)
            entries = [_Entry.decode(e) for e in _all_gather_bytes(group, entry.encode())]
            failures = {r: e.error for r, e in enumerate(entries) if e.error is not None}
            if not failures:
                failures = _inconsistent(entries)
            if failures:
                raise DistributedCommitError(
                    _failed_message(failures, f"{remote}/{start.target.removeprefix('refs/heads/')}"),
                    failures=failures,
                ) from local_error
            # 3. The one commit: every rank computes its id, the coordinator publishes it.
            blobs, request = _combined(entries, request)
            expected = write.commit_id_of(blobs, request, head.parent)
            outcome: bytes | None = None
            if rank == coordinator:
                assert handle is not None
                try:
                    step = publish.StepCommit(blobs, request, head.parent, start.target)
                    step, landed = publish.publish(core, handle, writer, step, on_conflict)
                    outcome = trees.pack([landed, None, step.parent])
                except Exception as exc:
                    outcome = trees.pack([None, _describe(exc), None])
                    if publish.landed_on_remote(handle, start.target, expected):
                        outcome = trees.pack([expected, None, head.parent])
            commit_id, error, parent = msgpack.unpackb(_broadcast_bytes(group, coordinator, outcome), raw=False)
            head = write.Head(head.target, parent)  # what it went on top of, with retry
            if error is not None:
                failures = {coordinator: error}
                raise DistributedCommitError(
                    _failed_message(failures, f"{remote}/{start.target.removeprefix('refs/heads/')}"),
                    failures=failures,
                )
            # 4. Each node learns the commit; no rank returns before its node knows it
            #    (and the other writer's history first, when it went on top of theirs).
            if leader:
                fetch_error = None
                if head.parent is not None and head.parent != start.parent:
                    fetch_error = _fetch_history(core, remote, [head.parent])
                if fetch_error is not None:
                    warnings.warn(DurabilityWarning(f"commit {commit_id[:12]} landed; {fetch_error}"), stacklevel=2)
                _record(core, remote, writer, blobs, request, head, commit_id)
            _all_gather_bytes(group, b"")
    except _PeerLost as exc:
        if expected is not None and start is not None and start.target and _landed_on(core, remote, start, expected):
            # The remote's branch names the commit, but a rank was lost after the swap,
            # perhaps this node's first: every survivor records it here.
            if entries:
                blobs, request = _combined(entries, request)
                with write.batch(core) as writer:
                    _record(core, remote, writer, blobs, request, write.Head(start.target, start.parent), expected)
            warnings.warn(
                DurabilityWarning(
                    f"commit {expected[:12]} landed on {remote}, but a rank was lost after it did: {exc}"
                ),
                stacklevel=2,
            )
            return expected
        where = f"{remote}/{start.target.removeprefix('refs/heads/')}" if start and start.target else remote
        raise DistributedCommitError(
            f"rank {rank} of {world} lost contact with the other ranks ({exc}): nothing was committed; "
            f"{where} is unchanged"
        ) from exc
    finally:
        _settle_stage(local_stage, "the commit failed before this rank's part was written")
    assert isinstance(commit_id, str)
    return commit_id


def _landed_on(core: Any, remote: str, start: _Start, expected: str) -> bool:
    """Whether the remote's branch names ``expected`` (read afresh: the commit's
    own connection closed with the error that brought us here)."""
    from ckvc.remote import publish

    assert start.target is not None
    try:
        with contextlib.closing(publish.open_for_commit(core, remote, create=False)) as handle:
            return publish.landed_on_remote(handle, start.target, expected)
    except (CkvcError, OSError):
        return False


def hold_parts_on(repo: Repo, remote: str) -> None:
    """A node's repository holds only its own ranks' parts: ``remote`` becomes a
    promisor of it (absent chunks are fetched from there, fsck counts them as held
    there), as a lazy clone's origin is. UnknownRemoteError before anything is written."""
    from ckvc.hybrid.promisor import promisor_names
    from ckvc.hybrid.settings import HybridSettings

    repo.remotes.get(remote)
    settings = HybridSettings.load(repo.core)
    if not settings.active or remote not in promisor_names(repo.core, settings):
        repo.set_config(promisors=[*settings.promisors, remote])


def _settle_stage(stage: Future[None], error: str | None) -> None:
    """Mark this rank's local stage done (or failed), once."""
    if stage.done():
        return
    if error is None:
        stage.set_result(None)
    else:
        stage.set_exception(DistributedCommitError(error))


def _fetch_history(core: Any, remote: str, tips: Sequence[str] | None = None) -> str | None:
    """Fetch the remote's commits and snapshots (no chunks), or those ``tips`` reach
    (no ref moved); the error, if any."""
    from ckvc.remote.fetch import fetch, fetch_history

    try:
        if tips is None:
            fetch(core, remote, chunks=False)
        else:
            fetch_history(core, remote, tips)
    except (CkvcError, OSError) as exc:
        return f"fetching the history of {remote}: {_describe(exc)}"
    return None


def _record(
    core: Any,
    remote: str,
    writer: Any,
    blobs: list[Blob],
    request: write.CommitRequest,
    head: write.Head,
    commit_id: str,
) -> None:
    """This node's record of a commit that landed on the remote; a failure here
    leaves the commit standing (a warning: the next fetch brings it)."""
    from ckvc.remote import publish

    assert head.target is not None
    try:
        publish.record(core, remote, writer, publish.StepCommit(blobs, request, head.parent, head.target))
    except (CkvcError, OSError) as exc:
        warnings.warn(
            DurabilityWarning(f"commit {commit_id[:12]} landed on {remote}, but recording it here failed: {exc}"),
            stacklevel=3,
        )


def _combined(entries: Sequence[_Entry], request: write.CommitRequest) -> tuple[list[Blob], write.CommitRequest]:
    """The blobs and request of the commit made of every rank's entry."""
    blobs = [b for e in entries for b in e.blobs]
    combined = trees.nest_trees([(rank_key(r), e.tree, len(e.blobs)) for r, e in enumerate(entries)])
    request = dataclasses.replace(
        request,
        tree=combined,
        pickled=any(e.pickled for e in entries),
        lossy={k: v for e in entries for k, v in e.lossy.items()},
    )
    return blobs, request


def _write_part(
    core: Any,
    pending: list[state_mod.PendingBlob],
    part: _Entry,
    head: write.Head,
    lossy: LossySpec,
    writer: Any,
    progress: ProgressCallback | None,
    sealed: Callable[[list[Blob]], None] | None = None,
) -> tuple[_Entry, BaseException | None]:
    """Write and seal this rank's chunks: ``part`` with its blobs, or an entry naming
    the error. With ``sealed`` the blobs are written in slices (:func:`_slices`),
    each sealed and then passed to ``sealed`` while the next is written."""
    report = write.WriteReport()
    total = sum(len(b.data) for b in pending)
    blobs: list[Blob] = []
    try:
        policy = write.chunk_policy(core, lossy)
        written = 0
        for piece in _slices(pending) if sealed is not None else [pending]:
            shown = None if progress is None else _offset_progress(progress, written, total)
            piece_blobs = write.write_blobs(
                core, piece, parent=head.parent, policy=policy, writer=writer, report=report, progress=shown
            )
            writer.commit()  # durable and indexed before the coordinator may name it (or it is uploaded)
            blobs.extend(piece_blobs)
            written += sum(len(b.data) for b in piece)
            if sealed is not None:
                sealed(piece_blobs)
    except Exception as exc:
        return _Entry(error=_describe(exc)), exc
    return dataclasses.replace(part, blobs=blobs, lossy=report.lossy), None


# A rank's part goes to the bucket in slices of about a quarter of it (never under
# 8 MiB: each slice is a pack here and one there), so the upload of one slice
# overlaps the encoding of the next (DESIGN, "Training across machines").
UPLOAD_SLICES = 4
MIN_UPLOAD_SLICE = 8 << 20


def _slices(pending: Sequence[state_mod.PendingBlob]) -> list[list[state_mod.PendingBlob]]:
    """``pending`` cut in order into runs of whole blobs of at most
    max(total / UPLOAD_SLICES, MIN_UPLOAD_SLICE) bytes each (a bigger blob alone);
    at least one run, empty when ``pending`` is."""
    target = max(MIN_UPLOAD_SLICE, -(-sum(len(b.data) for b in pending) // UPLOAD_SLICES))
    return list(size_batches(pending, lambda blob: len(blob.data), target)) or [[]]


def _offset_progress(progress: ProgressCallback, before: int, total: int) -> ProgressCallback:
    return lambda done, _: progress(before + done, total)


def _write_and_upload(
    core: Any,
    pending: list[state_mod.PendingBlob],
    part: _Entry,
    head: write.Head,
    lossy: LossySpec,
    writer: Any,
    progress: ProgressCallback | None,
    handle: Any,
    remote: str,
    local_stage: Future[None],
) -> tuple[_Entry, BaseException | None]:
    """This rank's part written into its node's packs and uploaded to the remote,
    each sealed slice sent (by one uploader thread, in order) while the next is
    encoded. ``local_stage`` is settled once everything is written here. The
    uploader is always joined before this returns: the handle is closed after."""
    from ckvc.remote import publish

    uploader = ThreadPoolExecutor(1, thread_name_prefix="ckvc-upload")
    uploads: list[Future[Any]] = []

    def sealed(blobs: list[Blob]) -> None:
        if not any(f.done() and f.exception() is not None for f in uploads):  # after a failure, nothing more
            uploads.append(uploader.submit(publish.upload_part, core, handle, blobs))

    try:
        entry, local_error = _write_part(core, pending, part, head, lossy, writer, progress, sealed)
        _settle_stage(local_stage, entry.error)
    finally:
        uploader.shutdown(wait=True)
    for upload in uploads:
        exc = upload.exception()
        if exc is None:
            continue
        if not isinstance(exc, CkvcError | OSError):
            raise exc
        if entry.error is None:
            entry, local_error = _Entry(error=f"uploading to {remote}: {_describe(exc)}"), exc
        break
    return entry, local_error


def _inconsistent(entries: Sequence[_Entry]) -> dict[int, str]:
    values = [e.consistency for e in entries]
    if all(v == values[0] for v in values):
        return {}
    shown = [msgpack.unpackb(v, raw=False) if v is not None else None for v in values]
    return {
        r: f"consistency value {shown[r]!r} differs from rank 0's {shown[0]!r}"
        for r in range(len(values))
        if values[r] != values[0]
    }


def _failed_message(failures: Mapping[int, str], target: str | None) -> str:
    where = target or "HEAD"
    shown = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items())[:4])
    more = f" (and {len(failures) - 4} more ranks)" if len(failures) > 4 else ""
    unchanged = f"nothing was committed; {where} is unchanged"
    return f"distributed commit failed on {len(failures)} rank(s): {shown}{more}: {unchanged}"


# ---- reading one rank's part ----------------------------------------------------


def _part_commit(
    repo: Repo, rev: str, rank: int, group: dist.ProcessGroup | None, allow_pickle: bool, verify_signatures: bool | None
) -> Commit:
    commit = repo.readable_commit(rev, allow_pickle=allow_pickle, verify_signatures=verify_signatures)
    size = world_size(commit)
    if size is None:
        raise InvalidInputError(f"commit {commit.id[:12]} is not a distributed commit (no {METADATA_KEY!r} metadata)")
    in_group = group is not None or (dist.is_available() and dist.is_initialized())
    current = dist.get_world_size(group) if in_group else None
    if rank >= size or (current is not None and current != size):
        now = f" at world size {current}" if current is not None else ""
        raise InvalidInputError(
            f"commit {commit.id[:12]} was made at world size {size}; rank {rank}{now} has no part in it "
            "(load at another world size through DCP: ckvc.dcp)"
        )
    return commit


def load(
    repo: Repo,
    rev: str = "HEAD",
    map_location: MapLocation = None,
    *,
    group: dist.ProcessGroup | None = None,
    rank: int | None = None,
    allow_pickle: bool = False,
    progress: ProgressCallback | None = None,
    verify_signatures: bool | None = None,
) -> Any:
    """This rank's state in the distributed commit ``rev`` (``rank``: whose part,
    default this process's rank in ``group``); reads only that part's chunks.
    InvalidInputError for a commit made at another world size; signatures as ``Repo.load``."""
    rank = _rank(group, rank)
    commit = _part_commit(repo, rev, rank, group, allow_pickle, verify_signatures)
    snapshot = repo.read_snapshot(commit)
    root = state_mod.parse_snapshot(snapshot, commit.id, allow_pickle=allow_pickle).build()
    key = rank_key(rank)
    if not isinstance(root, dict) or key not in root:
        raise CorruptObjectError(f"distributed commit holds no part {key!r}", commit=commit.id)
    part = root[key]
    loader = read.BlobLoader(repo.core, commit, snapshot, map_location)
    reads = loader.plan(read.infos_in(part))
    read.run_reads(repo.core, commit, reads, read.Progress(progress, sum(r.size for r in reads)))
    return read.fill_tree(part, loader)


def load_into(
    repo: Repo,
    rev: str = "HEAD",
    *,
    group: dist.ProcessGroup | None = None,
    rank: int | None = None,
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
    verify_signatures: bool | None = None,
) -> IncompatibleKeys:
    """``Repo.load_into`` for this rank's part of the distributed commit ``rev``:
    the ``*_key`` paths are within the rank's state."""
    from ckvc.restore import load_into as load_into_core

    rank = _rank(group, rank)
    commit = _part_commit(repo, rev, rank, group, allow_pickle, verify_signatures)
    key = rank_key(rank)

    def within(path: str | None) -> str | None:
        return key if path is None else f"{key}.{path}"

    return load_into_core(
        repo.core, commit, model=model, optimizer=optimizer, scheduler=scheduler, strict=strict,
        model_key=within(model_key), optimizer_key=within(optimizer_key), scheduler_key=within(scheduler_key),
        map_location=map_location, allow_pickle=allow_pickle, progress=progress,
    )  # fmt: skip
