"""Writing a commit in two steps that may run in different processes:

- :func:`write_blobs`: chunk, hash, skip what is stored, encode (deltas, lossy
  modes: a :class:`~ckvc.codecs.policy.ChunkPolicy`), append to packs, seal. It
  moves no ref; the blobs it returns are plain data (ids and sizes) another
  process can pass on.
- :func:`finish`: the snapshot and commit objects over every blob, then the
  branch's compare-and-swap and its reflog entry, last (docs/FORMAT.md, write order).

``Repo.commit`` is :func:`stage` (state -> tree and pending blobs), then these two
over one pack writer; an error is mapped to its exact outcome by :func:`settle`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ckvc import graph, signing
from ckvc.bulk import pauses_gc
from ckvc.chunking import BATCH_BYTES, chunk_spans, size_batches
from ckvc.codecs import DELTA, QUANT, DeltaBase, layout_for
from ckvc.codecs.lossy import COMPACT_MODES, quant_header, quantize, quantize_compact
from ckvc.codecs.lossy import MODES as LOSSY_MODES
from ckvc.codecs.policy import ChunkPolicy, DeltaBackoff, LossySpec, lossy_patterns
from ckvc.config import CODECS_VERSION, COMPACT_VERSION, FILES_VERSION
from ckvc.core import ProgressCallback, Repository, check_utf8, default_author
from ckvc.errors import (
    CkvcError,
    CorruptObjectError,
    DurabilityWarning,
    InterruptedOperationError,
    InvalidInputError,
    ObjectNotFoundError,
    RefConflictError,
    StorageError,
    is_storage_exception,
    storage_error,
)
from ckvc.executor import default_window_depth, runs_inline
from ckvc.ids import Buffer, ObjectType, object_id
from ckvc.objects import Blob, Commit, Snapshot, validate_metadata, validate_metrics
from ckvc.refs import BRANCH_PREFIX
from ckvc.storage.object_store import ObjectWriter

if TYPE_CHECKING:
    from ckvc.state import PendingBlob


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


@dataclass
class WriteReport:
    """What :func:`write_blobs` measured: plain data, added up over calls
    (:meth:`merge`). ``lossy``: per lossy tensor path, its mode and measured
    errors, as the commit records them (``Commit.lossy``)."""

    logical_bytes: int = 0
    chunks: int = 0
    new_chunks: int = 0
    new_chunk_raw_bytes: int = 0
    new_chunk_stored_bytes: int = 0
    lossy: dict[str, dict[str, Any]] = field(default_factory=dict)

    def merge(self, other: WriteReport) -> None:
        for f in dataclasses.fields(self):
            if f.name != "lossy":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.lossy.update(other.lossy)

    def stats(self, commit: str, stored_bytes: int, seconds: float) -> CommitStats:
        """The CommitStats of a commit made of these blobs; ``stored_bytes``: all it
        appended, metadata included."""
        return CommitStats(
            commit, self.logical_bytes, self.chunks, self.new_chunks, self.new_chunk_raw_bytes,
            self.new_chunk_stored_bytes, stored_bytes, seconds,
        )  # fmt: skip


@dataclass(frozen=True)
class CommitRequest:
    """Everything a commit records besides its blobs. ``tree``: the encoded value
    tree (``stage``); ``merge``: further parents (full commit ids) after the
    branch's commit; ``lossy``: ``WriteReport.lossy``; ``author`` (default
    $CKVC_AUTHOR, else user@host) and ``time_ns`` (default now) make ids repeatable."""

    tree: bytes = b""
    message: str = ""
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    pickled: bool = False
    merge: tuple[str, ...] = ()
    lossy: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    author: str | None = None
    time_ns: int | None = None
    sign: bool | None = None  # True/False: sign or not; None: the sign_commits setting

    @classmethod
    def checked(
        cls,
        message: str = "",
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        *,
        author: str | None = None,
        time_ns: int | None = None,
        sign: bool | None = None,
    ) -> CommitRequest:
        """A request from user input, each field checked (InvalidInputError)."""
        if not isinstance(message, str):
            raise InvalidInputError("message must be a str")
        check_utf8("message", message)
        for key, value in (metadata or {}).items():
            check_utf8("metadata", key, value)
        try:
            clean_metrics = validate_metrics(metrics)
            clean_metadata = validate_metadata(metadata)
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from None
        if time_ns is not None and (isinstance(time_ns, bool) or not isinstance(time_ns, int) or time_ns < 0):
            raise InvalidInputError(f"time_ns must be a non-negative int, got {time_ns!r}")
        if author is not None:
            check_utf8("author", author)
        if sign is not None and not isinstance(sign, bool):
            raise InvalidInputError(f"sign must be True, False or None, got {sign!r}")
        return cls(
            message=message, metrics=clean_metrics, metadata=clean_metadata, author=author, time_ns=time_ns, sign=sign
        )


@dataclass
class Staged:
    """A state made ready to write: its tree and the bytes of its tensors."""

    tree: bytes
    pending: list[PendingBlob]
    pickled: bool


@pauses_gc
def stage(
    core: Repository,
    state: Any,
    *,
    allow_pickle: bool = False,
    pin_memory: bool = False,
    lossy: LossySpec = None,
    metadata: Mapping[str, Any] | None = None,
) -> Staged:
    """Encode ``state`` (GPU tensors to pinned host memory with ``pin_memory``) and
    raise the format version first if the commit needs a newer one. A bad
    ``lossy`` spec fails first, before any work."""
    from ckvc import state as state_mod

    lossy_patterns(lossy)
    tree, pending, pickled, has_files = state_mod.encode_state(state, allow_pickle=allow_pickle, pin_memory=pin_memory)
    if has_files or any(not isinstance(v, str) for v in (metadata or {}).values()):
        core.upgrade_format(FILES_VERSION)
    elif lossy is not None:
        core.upgrade_format(CODECS_VERSION)  # quantized records are a version-2 codec
    if any(mode in COMPACT_MODES for mode in (lossy_patterns(lossy) or {}).values()):
        core.upgrade_format(COMPACT_VERSION)  # lossy chains, powers of two, Huffman codes
    return Staged(tree, pending, pickled)


class StagingBuffers:
    """Host memory for the private copies of background commits, reused from one
    commit to the next: the first touch of fresh pages costs about twice the copy
    itself (DESIGN, "The stall of a background commit"), so a commit's stall is one
    copy into warm memory. A buffer comes back once the commit that used it has
    landed (a failed commit's is dropped: its traceback may still view it); at most
    ``keep`` are kept, double buffering for a commit made while one is written."""

    ALIGN = 64  # each blob starts on a cache line (codecs view blobs as arrays)

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: list[Any] = []  # uint8 tensors, smallest first
        self._lock = threading.Lock()

    def owned(self, pending: Sequence[PendingBlob]) -> tuple[list[PendingBlob], Any]:
        """The blobs with private copies of their bytes, so the caller may change
        its tensors at once, and the buffer holding them (None when none was
        needed) to give back; blobs already private (from a GPU) stay."""
        import torch

        spans: list[tuple[int, int]] = []
        size = 0
        for blob in pending:
            n = 0 if blob.private else len(blob.data)
            spans.append((size, n))
            size += -(-n // self.ALIGN) * self.ALIGN
        if size == 0:
            return list(pending), None
        buffer = self._take(size)
        flat = buffer.numpy().data.cast("B")
        out = []
        for blob, (start, n) in zip(pending, spans, strict=True):
            if blob.private:
                out.append(blob)
                continue
            if n:
                buffer[start : start + n].copy_(torch.frombuffer(blob.data, dtype=torch.uint8))
            out.append(dataclasses.replace(blob, data=flat[start : start + n], owner=buffer, private=True))
        return out, buffer

    def _take(self, size: int) -> Any:
        import torch

        with self._lock:
            for i, buffer in enumerate(self._free):
                if size <= buffer.numel() <= 2 * size:  # never pin a far larger buffer to a small commit
                    return self._free.pop(i)
        return torch.empty(size, dtype=torch.uint8)

    def give(self, buffer: Any) -> None:
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=lambda b: b.numel())
            del self._free[: max(0, len(self._free) - self.keep)]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def chunk_policy(core: Repository, lossy: LossySpec = None, backoff: DeltaBackoff | None = None) -> ChunkPolicy:
    """The repository's chunk policy as configured now."""
    return ChunkPolicy(
        chunk_size=core.config.chunk_size,
        keyframe_interval=core.config.keyframe_interval,
        uses_bases=core.codec.uses_bases,
        lossy=lossy,
        backoff=backoff if backoff is not None else DeltaBackoff(),
    )


@contextmanager
def batch(core: Repository) -> Iterator[ObjectWriter]:
    """A pack writer, under a pin that keeps gc from removing anything the batch
    deduplicates against until the writer is done (and, in ``Repo.commit``, the
    branch has moved: gc then sees the commit from the refs). The observers of a
    commit that :func:`finish` landed in the batch run once the pin is released:
    retention may then collect."""
    landed: list[tuple[Repository, Committed]] = []
    token = _LANDED.set(landed)
    try:
        with core.store.pin(), core.store.writer(core.codec, core.config.max_pack_size) as writer:
            yield writer
    finally:
        _LANDED.reset(token)
        for where, event in landed:
            notify(where, event)


# ---- write_blobs ----------------------------------------------------------------

# What encoding one chunk produced: id, codec (-1: already stored), payload, the
# base it uses, whether a delta against a keyframe one commit old was tried (what
# the backoff counts), and for a quantized chunk (max abs error, sum of squared
# errors, sum of squared values).
_Encoded = tuple[bytes, int, Any, bytes | None, bool, tuple[float, float, float] | None]


def delta_candidates(core: Repository, parent: str | None, policy: ChunkPolicy) -> dict[str, Blob]:
    """The parent's blobs by tensor path: the default delta bases."""
    if parent is None or not policy.uses_parent:
        return {}
    try:
        snapshot = core.read_snapshot(core.read_commit(parent))
    except (CorruptObjectError, ObjectNotFoundError):
        return {}  # a damaged parent only costs the deltas; fsck reports it
    by_path: dict[str, Blob] = {}
    for blob in snapshot.blobs:
        by_path.setdefault(blob.path, blob)
    return by_path


def delta_base(core: Repository, parent_chunk: bytes | None, policy: ChunkPolicy) -> DeltaBase | None:
    """The keyframe a new chunk is stored against: the parent's chunk at the
    same offset if that is stored whole, else the parent chunk's own base.
    Every delta is then one link from a whole chunk, so a checkout decodes at
    most two records per chunk (docs/DESIGN.md, "Delta bases"). None once the
    keyframe is ``keyframe_interval`` commits old: the chunk becomes a keyframe."""
    if parent_chunk is None:
        return None
    store = core.store
    try:
        keyframe, age = parent_chunk, 0
        info = store.base_info(parent_chunk)
        if not info.whole:
            if info.base is None:
                return None  # a lossy chunk without a keyframe: nothing exact to build on
            keyframe, age = info.base, info.age
        if policy.keyframe_due(age) or not store.base_info(keyframe).whole:
            return None
        return DeltaBase(keyframe, store.read(keyframe, ObjectType.CHUNK), 0, age)
    except (CorruptObjectError, ObjectNotFoundError):
        return None  # never build on a damaged base: store this chunk whole


def compact_link(core: Repository, parent_chunk: bytes | None, policy: ChunkPolicy) -> tuple[bytes, Buffer, int] | None:
    """What a compact-tier chunk builds on: (the parent's chunk, its plain bytes,
    the new link's age) when that chunk is stored whole or is itself a lossy link
    and the chain is younger than the keyframe interval; None: start a chain."""
    if parent_chunk is None:
        return None
    store = core.store
    try:
        info = store.base_info(parent_chunk)
        if info.whole:
            age = 0
        elif store.locate(parent_chunk).codec == QUANT:
            age = info.age
        else:
            return None  # an exact delta: a chain starts here rather than grow two kinds of link
        if policy.keyframe_due(age):
            return None
        return parent_chunk, store.read(parent_chunk, ObjectType.CHUNK), age + 1
    except (CorruptObjectError, ObjectNotFoundError):
        return None  # never build on a damaged base


def _quantized(
    core: Repository, view: memoryview, dtype: str, mode: str, parent_chunk: bytes | None, policy: ChunkPolicy
) -> _Encoded | None:
    """A quantized chunk, or None to store it exactly: a residual mode without
    an exact keyframe to build on stores the chunk whole (it becomes one)."""
    if mode in COMPACT_MODES:
        link = compact_link(core, parent_chunk, policy) if mode != "coarse" else None
        compact = quantize_compact(view, dtype, mode, link[1] if link else None, link[2] if link else 1)
        if compact is None:
            return None
        base_oid = link[0] if link is not None and quant_header(compact.payload).residual else None
        oid = object_id(ObjectType.CHUNK, compact.plain.data)
        measured = (compact.max_abs_error, compact.sum_sq_error, compact.sum_sq_value)
        return oid, QUANT, compact.payload, base_oid, False, measured
    bits, residual = LOSSY_MODES[mode]
    keyframe = delta_base(core, parent_chunk, policy) if residual else None
    if residual and keyframe is None:
        return None
    result = quantize(view, dtype, bits, keyframe.plain if keyframe else None, keyframe.age + 1 if keyframe else 1)
    if result is None:
        return None  # non-finite values: kept exact
    oid = object_id(ObjectType.CHUNK, result.plain.data)
    error = (result.max_abs_error, result.sum_sq_error, result.sum_sq_value)
    return oid, QUANT, result.payload, keyframe.oid if keyframe else None, False, error


# Encoded chunks a commit may hold in flight (issue 33: a commit's extra memory
# under 64 MiB whatever the state's size; DESIGN, "Host memory").
WRITE_WINDOW_BYTES = 24 << 20


def write_window_depth(threads: int, chunk_size: int) -> int:
    """Tasks in flight while writing: as many as WRITE_WINDOW_BYTES of chunks hold
    (a task is one chunk, or small chunks up to BATCH_BYTES), never fewer than one
    a thread plus two (every thread busy while the oldest lands) nor more than the
    executor's default."""
    per_task = max(chunk_size, BATCH_BYTES)
    return max(threads + 2, min(default_window_depth(threads), WRITE_WINDOW_BYTES // per_task))


@pauses_gc
def write_blobs(
    core: Repository,
    pending: Sequence[PendingBlob],
    *,
    parent: str | None = None,
    policy: ChunkPolicy | None = None,
    writer: ObjectWriter | None = None,
    report: WriteReport | None = None,
    progress: ProgressCallback | None = None,
) -> list[Blob]:
    """Store ``pending``'s chunks; returns one Blob per pending blob, in order.
    Chunks are hashed and encoded on the executor and appended in order on this
    thread; a bounded window keeps memory at a few chunks. A chunk whose tensor
    ``parent`` (a commit id) held with the same dtype and size may be stored as a
    delta against the parent's chunk at the same offset. With ``writer`` the
    records go into that batch and stay unsealed; without, this call seals and
    indexes its own. ``report`` receives the counts and lossy errors."""
    if writer is None:
        with batch(core) as own:
            blobs = write_blobs(
                core, pending, parent=parent, policy=policy, writer=own, report=report, progress=progress
            )
            own.commit()
        return blobs
    policy = policy if policy is not None else chunk_policy(core)
    report = report if report is not None else WriteReport()
    parent_blobs = delta_candidates(core, parent, policy)

    def work(view: memoryview, layout: Any, parent_chunk: bytes | None, dtype: str, mode: str | None) -> _Encoded:
        if mode is not None:
            quantized = _quantized(core, view, dtype, mode, parent_chunk, policy)
            if quantized is not None:
                return quantized if writer.wants(quantized[0]) else (quantized[0], -1, None, None, False, quantized[5])
        oid = object_id(ObjectType.CHUNK, view)
        if not writer.wants(oid):
            return oid, -1, None, None, False, None
        base = delta_base(core, parent_chunk, policy)
        codec_id, payload = writer.encode(view, layout, base)
        if base is None:
            return oid, codec_id, payload, None, False, None
        # Only a delta that lost against the parent's own chunk says deltas do not
        # pay for this tensor: one that lost against an older keyframe leaves this
        # chunk as a fresh keyframe for the next commit's one-commit delta.
        fresh = base.age == 0
        return oid, codec_id, payload, base.oid if codec_id == DELTA else None, fresh, None

    total = sum(len(b.data) for b in pending)
    done = 0
    chunk_ids: list[list[bytes]] = [[] for _ in pending]
    fresh_tried = [False] * len(pending)
    delta_won = [False] * len(pending)
    modes = [policy.lossy_mode(b.path, b.dtype, len(b.data), b.itemsize) for b in pending]
    errors: dict[int, tuple[float, float, float, int]] = {}

    def append(blob_index: int, raw_size: int, encoded: _Encoded) -> None:
        nonlocal done
        oid, codec_id, payload, base_oid, fresh, error = encoded
        fresh_tried[blob_index] |= fresh
        if error is not None:
            max_abs, sq_err, sq_val, count = errors.get(blob_index, (0.0, 0.0, 0.0, 0))
            errors[blob_index] = (max(max_abs, error[0]), sq_err + error[1], sq_val + error[2], count + raw_size)
        chunk_ids[blob_index].append(oid)
        delta_won[blob_index] |= codec_id == DELTA
        report.chunks += 1
        if payload is not None:
            before = writer.bytes_written
            if writer.add_encoded(ObjectType.CHUNK, oid, raw_size, codec_id, payload, base_oid):
                report.new_chunks += 1
                report.new_chunk_raw_bytes += raw_size
                report.new_chunk_stored_bytes += writer.bytes_written - before
        done += raw_size
        if progress is not None:
            progress(done, total)

    def jobs() -> Iterator[tuple[int, memoryview, Any, bytes | None, str, Any]]:
        """(blob index, chunk view, layout, delta base, dtype, lossy mode) per chunk, in order."""
        for index, blob in enumerate(pending):
            report.logical_bytes += len(blob.data)
            chunk_size = policy.chunk_size_for(blob.itemsize)
            layout = layout_for(blob.dtype)
            mode = modes[index]
            bases = policy.bases(blob.path, blob.dtype, len(blob.data), chunk_size, mode, parent_blobs.get(blob.path))
            for i, (start, end) in enumerate(chunk_spans(len(blob.data), chunk_size)):
                base_oid = policy.chunk_base(bases, i, end - start, mode)
                yield index, blob.data[start:end], layout, base_oid, blob.dtype, mode

    def work_batch(group: list[tuple[int, memoryview, Any, bytes | None, str, Any]]) -> list[_Encoded]:
        return [work(view, layout, base, dtype, mode) for _, view, layout, base, dtype, mode in group]

    def land(group: list[tuple[int, memoryview, Any, bytes | None, str, Any]], results: list[_Encoded]) -> None:
        for job, encoded in zip(group, results, strict=True):
            append(job[0], len(job[1]), encoded)

    # The window keeps every core busy while a pack is sealed (fsync), and holds
    # the encoded chunks waiting to land in order: about WRITE_WINDOW_BYTES of
    # them (DESIGN, "Host memory"). Small chunks share a task (size_batches): a
    # task's fixed cost is that of encoding a few KiB.
    with core.executor.window(write_window_depth(core.executor.threads, policy.chunk_size)) as window:
        for group in size_batches(jobs(), lambda job: len(job[1])):
            inline = runs_inline(sum(len(job[1]) for job in group), len(group))
            window.submit(work_batch, group, then=functools.partial(land, group), inline=inline)
    for index, blob in enumerate(pending):
        if delta_won[index] or fresh_tried[index]:
            policy.backoff.record(blob.path, delta_won[index])
    for index, (max_abs, sq_err, sq_val, nbytes) in sorted(errors.items()):
        elements = nbytes // pending[index].itemsize
        report.lossy[pending[index].path] = {
            "codec": str(modes[index]),
            "max_abs_error": max_abs,
            "rms_error": math.sqrt(sq_err / elements) if elements else 0.0,
            "rel_rms_error": math.sqrt(sq_err / sq_val) if sq_val else 0.0,
        }
    return [
        Blob(b.path, b.dtype, len(b.data), policy.chunk_size_for(b.itemsize), tuple(ids))
        for b, ids in zip(pending, chunk_ids, strict=True)
    ]


# ---- finish ---------------------------------------------------------------------

OnConflict = Literal["fail", "retry"]
# A commit goes on top of other writers' commits at most this often in a row (a livelock guard).
MAX_RETRIES_ON_CONFLICT = 100


@dataclass(frozen=True)
class Head:
    """Where a commit lands: the branch ref it moves (None: a detached HEAD) and
    the commit that names now (its first parent, and what the swap expects)."""

    target: str | None
    parent: str | None

    @property
    def where(self) -> str:
        return self.target or "HEAD"


@dataclass
class Outcome:
    """What is known of a commit in progress, for :func:`settle`."""

    head: Head | None = None
    commit: str | None = None  # its id, once computed (it may or may not have landed)


def read_head(core: Repository, outcome: Outcome | None = None) -> Head:
    """Where a commit made now lands. Refuses to build on a branch that names a
    missing object or a non-commit: the new commit's history would be broken."""
    target, parent = core.refs.head()
    head = Head(target, parent)
    if outcome is not None:
        outcome.head = head
    if parent is not None:
        try:
            kind = core.store.stat(bytes.fromhex(parent)).kind
        except ObjectNotFoundError:
            raise ObjectNotFoundError(
                f"{head.where} names commit {parent[:12]}, which is not in the repository: "
                "nothing was committed; run `ckvc fsck`"
            ) from None
        if kind != ObjectType.COMMIT:
            raise CorruptObjectError(
                f"{head.where} names a {kind.name.lower()} object, not a commit: "
                "nothing was committed; run `ckvc fsck`",
                object_id=parent,
            )
    return head


def commit_object(snapshot_id: bytes, request: CommitRequest, parent: str | None) -> Commit:
    """The commit :func:`finish` writes for a snapshot: with ``request.author`` and
    ``request.time_ns`` set, any process computes the same object (and id), so the
    ranks of a distributed commit know its id without being told."""
    return Commit(
        tree=snapshot_id.hex(),
        parents=tuple(dict.fromkeys(((parent,) if parent else ()) + tuple(request.merge))),
        author=default_author() if request.author is None else request.author,
        time_ns=time.time_ns() if request.time_ns is None else request.time_ns,
        message=request.message,
        metrics=dict(request.metrics),
        metadata=dict(request.metadata),
        pickled=request.pickled,
        lossy={k: dict(v) for k, v in request.lossy.items()},
    )


def finish(
    core: Repository,
    blobs: Sequence[Blob],
    request: CommitRequest,
    *,
    head: Head | None = None,
    writer: ObjectWriter | None = None,
    outcome: Outcome | None = None,
    report: WriteReport | None = None,
    started: float | None = None,
    retain: bool | None = None,
    on_conflict: OnConflict = "fail",
) -> str:
    """Write the snapshot of ``blobs`` (in the tree's order) and the commit, make
    them durable, then move the branch by compare-and-swap from ``head`` (default:
    where HEAD is now) with its reflog entry. Returns the commit id. Without
    ``writer`` this call uses (and seals) its own batch.

    Another writer may move the branch meanwhile: RefConflictError saying so, the
    branch unchanged; with ``on_conflict="retry"``, when it moved forward (its
    new tip descends from ours), the commit goes on top of it instead (a new
    commit object over the same snapshot; the reflog entry says so).

    Once the branch has moved, the repository's commit observers get a
    :class:`Committed` (after the batch's pin is released): ``report`` and
    ``started`` (a ``time.perf_counter()``) make its stats, ``retain`` is passed on."""
    if writer is None:
        with batch(core) as own:
            head = head or read_head(core, outcome)
            return finish(
                core, blobs, request, head=head, writer=own, outcome=outcome, report=report, started=started,
                retain=retain, on_conflict=on_conflict,
            )  # fmt: skip
    head = head or read_head(core, outcome)
    signer = signing.signer_for(core, request.sign)
    snapshot_id, commit_id = put_commit(writer, blobs, request, head.parent)
    reflog_message = commit_reflog_message(request)
    for attempt in range(MAX_RETRIES_ON_CONFLICT + 1):
        if outcome is not None:
            outcome.commit, outcome.head = commit_id, head
        writer.commit()
        if signer is not None:  # durable before the branch names the commit
            signing.sign(core, commit_id, "commit", signer)
        try:
            if head.target is not None:
                core.refs.set_if_equals(head.target, head.parent, commit_id, reflog_message)
            else:
                assert head.parent is not None
                core.refs.set_head_if_equals(head.parent, commit_id, reflog_message)
            break
        except RefConflictError:
            theirs = core.refs.read(head.target) if head.target is not None else core.refs.head()[1]
            forward = theirs is not None and (head.parent is None or graph.is_ancestor(core, head.parent, theirs))
            if on_conflict != "retry" or not forward or attempt == MAX_RETRIES_ON_CONFLICT:
                raise moved_meanwhile(head, theirs, forward, on_conflict) from None
            assert theirs is not None
            head = Head(head.target, theirs)
            commit_id = writer.put(ObjectType.COMMIT, commit_object(snapshot_id, request, theirs).encode()).hex()
            reflog_message = f"{commit_reflog_message(request)} (on top of {theirs[:12]}, committed meanwhile)"
    stats = None
    if report is not None:
        seconds = time.perf_counter() - started if started is not None else 0.0
        stats = report.stats(commit_id, writer.bytes_written, seconds)
    announce(core, Committed(commit_id, head, stats, retain))
    return commit_id


def moved_meanwhile(head: Head, theirs: str | None, forward: bool, on_conflict: OnConflict) -> RefConflictError:
    """The error of a commit whose branch another writer moved: what happened, and what to do."""
    where = head.where.removeprefix(BRANCH_PREFIX)
    what = f"another writer moved {where} to {theirs[:12]}" if theirs else f"{where} was deleted"
    if on_conflict == "retry" and not forward:
        advice = "not forward, so the commit was not put on top; look at `ckvc reflog` and commit again"
    elif on_conflict == "retry":
        advice = f"{MAX_RETRIES_ON_CONFLICT} times in a row; commit again"
    else:
        advice = "commit again, or with on_conflict='retry' to go on top of it (the CLI does)"
    return RefConflictError(
        f"{what} while this commit was being written: nothing was committed ({where} unchanged by it); {advice}"
    )


def commit_reflog_message(request: CommitRequest) -> str:
    """The reflog line of a commit: its message's first line."""
    return f"commit: {request.message.splitlines()[0] if request.message else ''}".rstrip()


def put_commit(
    writer: ObjectWriter, blobs: Sequence[Blob], request: CommitRequest, parent: str | None
) -> tuple[bytes, str]:
    """Add the snapshot of ``blobs`` and the commit on ``parent`` to ``writer``
    (unsealed); returns the snapshot's id and the commit's (hex)."""
    snapshot_id = writer.put(ObjectType.SNAPSHOT, Snapshot(tuple(blobs), request.tree).encode())
    return snapshot_id, writer.put(ObjectType.COMMIT, commit_object(snapshot_id, request, parent).encode()).hex()


def snapshot_id_of(blobs: Sequence[Blob], request: CommitRequest) -> bytes:
    """The id :func:`put_commit` gives the snapshot of ``blobs``, without writing it."""
    return object_id(ObjectType.SNAPSHOT, Snapshot(tuple(blobs), request.tree).encode())


def commit_id_of(blobs: Sequence[Blob], request: CommitRequest, parent: str | None) -> str:
    """The id :func:`put_commit` gives the commit, without writing it."""
    return object_id(ObjectType.COMMIT, commit_object(snapshot_id_of(blobs, request), request, parent).encode()).hex()


def landed_with(core: Repository, head: Head | None, blobs: Sequence[Blob], request: CommitRequest) -> str | None:
    """The commit the branch (or detached HEAD) names now, if it is this one: the
    commit of ``blobs`` and ``request`` on whatever parent it has (a commit that
    went on top of another writer's with ``on_conflict="retry"`` has another id
    than the one first computed)."""
    try:
        target = head.target if head is not None else None
        current = core.refs.read(target) if target is not None else core.refs.head()[1]
        if current is None:
            return None
        parents = core.read_commit(current).parents
        if commit_id_of(blobs, request, parents[0] if parents else None) == current:
            return current
    except (OSError, CkvcError):
        pass
    return None


# ---- commit observers -----------------------------------------------------------


@dataclass(frozen=True)
class Committed:
    """A commit that has landed, as its observers see it (``Repository.commit_observers``).
    ``stats``: what the commit wrote, when its path measured it; ``retain``: the
    caller's word on applying the retention policy (None: the policy's own)."""

    commit: str
    head: Head
    stats: CommitStats | None = None
    retain: bool | None = None


# The commits landed inside the open batch of this thread, fired when it closes.
_LANDED: ContextVar[list[tuple[Repository, Committed]] | None] = ContextVar("ckvc_landed", default=None)


def announce(core: Repository, event: Committed) -> None:
    """A commit landed on ``core``: its observers run when the open batch closes
    (now, outside one)."""
    deferred = _LANDED.get()
    if deferred is not None:
        deferred.append((core, event))
    else:
        notify(core, event)


def notify(core: Repository, event: Committed) -> None:
    """Run ``core``'s commit observers. The commit stands whatever they do: a
    failing observer is a DurabilityWarning naming it, never an error."""
    for observer in list(core.commit_observers):
        try:
            observer(event)
        except InterruptedOperationError:
            raise  # an interrupt says the commit landed (its own message)
        except Exception as exc:
            what = getattr(observer, "__name__", type(observer).__name__).strip("_").replace("_", " ")
            warnings.warn(
                DurabilityWarning(f"commit {event.commit[:12]} landed on {event.head.where}, but {what} failed: {exc}"),
                stacklevel=2,
            )


def landed(core: Repository, head: Head | None, commit_id: str) -> bool:
    """Whether the branch (or detached HEAD) names ``commit_id`` now."""
    try:
        target = head.target if head is not None else None
        current = core.refs.read(target) if target is not None else core.refs.head()[1]
    except (OSError, CkvcError):
        return False
    return current == commit_id


def settle(core: Repository, outcome: Outcome, exc: BaseException) -> str:
    """The exact outcome of a commit that ``exc`` interrupted (docs/GUIDE.md,
    "Errors and exit codes"): raises a typed error saying the branch did not move,
    or, once the commit has landed, warns that a later step failed and returns
    its id (an interrupt then raises, saying the commit landed)."""
    where = outcome.head.where if outcome.head is not None else "HEAD"
    written = outcome.commit
    if written is None or not landed(core, outcome.head, written):
        unchanged = f"nothing was committed; {where} is unchanged"
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, CkvcError):
            raise InterruptedOperationError(f"interrupted: {unchanged}") from None
        if not isinstance(exc, CkvcError) and is_storage_exception(exc):
            raise storage_error(exc, "writing the commit", unchanged) from exc
        if isinstance(exc, StorageError):
            raise exc.with_outcome(unchanged) from exc.__cause__
        raise exc
    if isinstance(exc, InterruptedOperationError):
        raise exc
    if isinstance(exc, KeyboardInterrupt):
        raise InterruptedOperationError(
            f"interrupted after commit {written[:12]} landed on {where}", landed=True, result=written
        ) from None
    if not isinstance(exc, Exception):
        raise exc
    warnings.warn(
        DurabilityWarning(f"commit {written[:12]} landed on {where}, but a later step failed: {exc}"), stacklevel=4
    )
    return written
