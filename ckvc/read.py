"""The one read engine: a commit's chunks decoded and verified into their destinations.

``Repo.load``, views (ckvc.view), ``load_into`` (ckvc.restore) and
file export (ckvc.formats) all read through here, in three steps:

1. **plan**: which chunks, and where each goes: straight into the allocated
   tensor's memory (contiguous CPU), or into a one-chunk scratch buffer that a
   callback copies from (GPU, strided, cast). Chunk sizes are checked against
   the index before a buffer is allocated, so a crafted blob table cannot make
   a read allocate what its chunks do not hold.
2. **order**: the reads grouped per pack and sorted by offset (:func:`plan`), so
   the store can coalesce neighbouring records into one backend read
   (``ObjectStore.read_many_into``), which a high-latency backend needs.
3. **run**: batches decoded in parallel on the repository's executor, in a
   bounded window (scratch memory stays a few chunks), the chunks queued behind
   announced to the store (``prefetch``) for cold reads, progress reported in
   order on the calling thread.

Errors name the commit and the tensor. Entry points take ``core`` (anything with
``store``, ``executor`` and ``read_snapshot(commit)``) and a commit already
resolved and checked readable (not pruned, pickles allowed if it holds any).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ckvc import state as state_mod
from ckvc.bulk import pauses_gc
from ckvc.chunking import BATCH_BYTES, chunk_spans, size_batches
from ckvc.core import ProgressCallback
from ckvc.errors import CorruptObjectError, InvalidInputError, ObjectNotFoundError, UnknownKeyError
from ckvc.executor import runs_inline
from ckvc.ids import ObjectType
from ckvc.objects import Blob, Commit, Snapshot
from ckvc.state import MapLocation, TensorInfo

if TYPE_CHECKING:
    import torch

    from ckvc.executor import Executor
    from ckvc.storage.index import IndexEntry
    from ckvc.storage.object_store import ObjectStore


# The most one ranged read of a high-latency backend asks for (object stores
# serve 8-16 MiB ranges at full speed; larger ones only delay the first byte).
REMOTE_REQUEST_BYTES = 8 << 20
# How far ahead of the reads in flight chunks are announced to the store, in windows.
PREFETCH_WINDOWS = 2
# Records further apart than this get separate read-ahead hints.
PREFETCH_GAP = 64 << 10
# How many names an error message lists before it says "and N more".
MAX_NAMED = 8


class ReadCore(Protocol):
    """What the engine needs of a repository (ckvc.core.Repository, ckvc.Repo)."""

    @property
    def store(self) -> ObjectStore: ...

    @property
    def executor(self) -> Executor: ...

    def read_snapshot(self, commit: Commit) -> Snapshot: ...


def format_names(items: Sequence[str]) -> str:
    """The first MAX_NAMED items quoted, and how many more there are."""
    shown = ", ".join(repr(i) for i in items[:MAX_NAMED])
    return shown + (f" and {len(items) - MAX_NAMED} more" if len(items) > MAX_NAMED else "")


class Progress:
    """Bytes done over bytes planned, reported to a ProgressCallback."""

    def __init__(self, callback: ProgressCallback | None, total: int = 0) -> None:
        self.callback = callback
        self.total = total
        self.done = 0

    def add(self, n: int) -> None:
        self.done += n
        if self.callback is not None:
            self.callback(self.done, self.total)


@dataclass
class ChunkRead:
    """One chunk to read: straight into ``into``, or into a scratch buffer that
    ``then`` receives (on the calling thread) and copies from."""

    blob: Blob
    oid: bytes
    size: int
    into: memoryview | None = None
    then: Callable[[np.ndarray], None] | None = None
    pinned: bool = False  # scratch in pinned host memory (the copy goes to a GPU)
    entry: IndexEntry | None = None  # where the index keeps it, once looked up (one lookup per chunk)


@dataclass
class PackReads:
    """The reads of one pack, by offset; ``pack`` None: chunks the index does not
    know (the read looks for them in packs not indexed yet, else raises)."""

    pack: str | None
    reads: list[ChunkRead]


# ---- planning -----------------------------------------------------------------


def blob_spans(blob: Blob, commit: Commit) -> list[tuple[int, int]]:
    """The byte span of each of ``blob``'s chunks; CorruptObjectError when its
    chunk list does not cover its size."""
    spans = list(chunk_spans(blob.nbytes, blob.chunk_size))
    if len(spans) != len(blob.chunks):
        raise CorruptObjectError("blob chunk list does not cover its size", commit=commit.id, tensor=blob.path)
    return spans


def blob_itemsize(blob: Blob, commit: Commit) -> int:
    try:
        return state_mod.blob_itemsize(blob.dtype)
    except CorruptObjectError as exc:
        raise exc.with_context(commit=commit.id, tensor=blob.path) from None


def not_found(exc: ObjectNotFoundError, commit: Commit, tensor: str) -> ObjectNotFoundError:
    """``exc`` naming the tensor and commit that need the object."""
    return ObjectNotFoundError(f"{exc} (tensor {tensor!r}, commit {commit.id})")


def check_chunk_sizes(
    store: ObjectStore, commit: Commit, blob: Blob, chunks: Iterable[int] | None = None,
    looked_up: Sequence[IndexEntry | None] | None = None,
) -> list[IndexEntry | None]:  # fmt: skip
    """Each chunk's size as the index records it against its span, before any
    buffer is allocated for the blob (fsck makes the same check). ``chunks``: the
    indices to check (default all); ``looked_up``: their index entries when the
    caller has them. Returns their index entries (None: a chunk a promisor remote
    holds), for the reads to use rather than look them up again."""
    spans = blob_spans(blob, commit)
    wanted = range(len(spans)) if chunks is None else list(chunks)
    entries = list(looked_up) if looked_up is not None else store.index.get_many([blob.chunks[i] for i in wanted])
    for n, (i, entry) in enumerate(zip(wanted, entries, strict=True)):
        oid, (start, end) = blob.chunks[i], spans[i]
        size = None if entry is None else (entry.kind, entry.raw_size)
        if size is None:
            size = store.promised_size(oid)  # a lazy clone's chunk, from the remote catalog
        if size is None:
            try:
                entry = entries[n] = store.locate(oid)  # indexes packs it does not know yet, else raises
            except ObjectNotFoundError as exc:
                raise not_found(exc, commit, blob.path) from None
            size = (entry.kind, entry.raw_size)
        if size != (ObjectType.CHUNK, end - start):
            raise CorruptObjectError(
                f"chunk {oid.hex()} at bytes {start}-{end} is stored as {size[1]} bytes of type {size[0]}",
                commit=commit.id,
                tensor=blob.path,
            )
    return entries


def plan(store: ObjectStore, reads: Iterable[ChunkRead]) -> list[PackReads]:
    """``reads`` grouped per pack (packs in the order their first read comes),
    each group sorted by offset, chunks the index does not know last: neighbouring
    records of a pack come one after the other, for the store to coalesce."""
    reads = list(reads)
    unlocated = [read for read in reads if read.entry is None]
    for read, entry in zip(unlocated, store.index.get_many(r.oid for r in unlocated), strict=True):
        read.entry = entry  # fetched since it was planned, or planned without its entry
    groups: dict[str | None, list[tuple[int, ChunkRead]]] = {}
    unknown: list[tuple[int, ChunkRead]] = []
    for read in reads:
        if read.entry is None:
            unknown.append((0, read))
        else:
            groups.setdefault(read.entry.pack, []).append((read.entry.offset, read))
    if unknown:
        groups[None] = unknown
    return [PackReads(pack, [r for _, r in sorted(rs, key=lambda x: x[0])]) for pack, rs in groups.items()]


# ---- running ------------------------------------------------------------------


def _scratch(read: ChunkRead) -> np.ndarray:
    if read.pinned:  # only GPU destinations ask for pinned scratch, so torch is here already
        import torch

        if torch.cuda.is_available():
            return torch.empty(read.size, dtype=torch.uint8, pin_memory=True).numpy()
    return np.empty(read.size, dtype=np.uint8)


def _read_one(store: ObjectStore, commit: Commit, read: ChunkRead, out: memoryview) -> None:
    try:
        store.read_into(read.oid, out)
    except CorruptObjectError as exc:
        raise exc.with_context(commit=commit.id, tensor=read.blob.path) from None
    except ObjectNotFoundError as exc:
        raise not_found(exc, commit, read.blob.path) from None


def _read_batch(store: ObjectStore, commit: Commit, batch: Sequence[tuple[ChunkRead, memoryview]]) -> None:
    """Decode and verify one batch (on a pool thread) in one store call; errors name the tensor."""
    if len(batch) == 1:
        _read_one(store, commit, *batch[0])
        return
    try:
        located = [(read.oid, read.entry, out) for read, out in batch if read.entry is not None]
        if len(located) == len(batch):  # one pack's reads by offset (plan): no lookup, no regrouping
            store.read_located_into(located)
        else:
            store.read_many_into([(read.oid, out) for read, out in batch])
    except (CorruptObjectError, ObjectNotFoundError) as exc:
        # Which chunk failed: read them one by one, so the error names its tensor.
        for read, out in batch:
            _read_one(store, commit, read, out)
        if isinstance(exc, CorruptObjectError):
            raise exc.with_context(commit=commit.id) from None
        raise


def _finish_batch(
    batch: Sequence[ChunkRead], scratches: Sequence[np.ndarray | None], progress: Progress, _: object
) -> None:
    for read, scratch in zip(batch, scratches, strict=True):
        if read.then is not None:
            assert scratch is not None
            read.then(scratch)
        progress.add(read.size)


def _land_fetched(store: ObjectStore, reads: Sequence[ChunkRead], progress: Progress) -> Sequence[ChunkRead]:
    """What a lazy clone or the cache lacks, fetched in one batch (``store.ensure``)
    and decoded and verified by the fetch straight into the reads' buffers: the
    reads still to do. Another read of a chunk that landed copies it."""
    if store.promisor is None or not reads:
        return reads
    landing: dict[bytes, memoryview] = {}
    for read in reads:
        if read.into is not None:
            landing.setdefault(read.oid, read.into)
        # a chunk read only into scratch (GPU, strided) is fetched, then read locally
    landed = store.ensure([read.oid for read in reads], landing)
    if not landed:
        return reads
    todo: list[ChunkRead] = []
    for read in reads:
        if read.oid not in landed:
            todo.append(read)
            continue
        source = landing[read.oid]
        if read.into is not None:
            if read.into is not source:
                read.into[:] = source
        else:
            assert read.then is not None
            scratch = _scratch(read)
            scratch[:] = np.frombuffer(source, dtype=np.uint8)
            read.then(scratch)
        progress.add(read.size)
    return todo


@pauses_gc
def run_reads(core: ReadCore, commit: Commit, reads: Sequence[ChunkRead], progress: Progress) -> None:
    """Decode and verify ``reads`` (in :func:`plan`'s order) on the executor, a
    bounded window of batches in flight. Each scratch read's ``then`` runs on the
    calling thread once its batch is done; no read outlives this call. The cache
    evicts only once it has returned (``ObjectStore.reading``)."""
    with core.store.reading():
        _run_reads(core, commit, reads, progress)


def _run_reads(core: ReadCore, commit: Commit, reads: Sequence[ChunkRead], progress: Progress) -> None:
    store = core.store
    reads = _land_fetched(store, reads, progress)
    groups = plan(store, reads)
    # Locally a batch is a pool task's worth (BATCH_BYTES); where each request
    # costs a round trip, a batch is one pack's reads up to one large ranged
    # read, so the store makes one request per run of records.
    remote = store.backend.capabilities.latency == "remote"
    limit = REMOTE_REQUEST_BYTES if remote else BATCH_BYTES
    batches = [b for group in groups for b in size_batches(group.reads, lambda read: read.size, limit)]
    with core.executor.window() as window:
        # Cold reads: the store fetches the batches queued behind the running ones
        # while these decode, instead of each read waiting on the disk in turn.
        ahead = PREFETCH_WINDOWS * window.depth
        for batch in batches[:ahead]:
            _prefetch(store, batch)
        for number, batch in enumerate(batches):
            if number + ahead < len(batches):
                _prefetch(store, batches[number + ahead])
            scratches: list[np.ndarray | None] = []
            targets: list[tuple[ChunkRead, memoryview]] = []
            for read in batch:
                scratch = None
                out = read.into
                if out is None:
                    scratch = _scratch(read)
                    out = scratch.data.cast("B")
                scratches.append(scratch)
                targets.append((read, out))
            window.submit(
                _read_batch, store, commit, targets, then=functools.partial(_finish_batch, batch, scratches, progress),
                inline=not remote and runs_inline(sum(read.size for read in batch), len(batch)),
            )  # fmt: skip


def _prefetch(store: ObjectStore, batch: Sequence[ChunkRead]) -> None:
    """Read-ahead hints for a batch (one pack's reads by offset, when planned with
    their entries): one per run of neighbouring records where there was one per
    record. A gap over PREFETCH_GAP starts a new run, so that a hint never asks
    for much more than the reads need (records of a partial load can lie far apart)."""
    packs = {read.entry.pack if read.entry is not None else None for read in batch}
    if len(packs) != 1 or None in packs:
        for read in batch:
            store.prefetch(read.oid, read.entry)
        return
    start = end = -1
    pack = ""
    for read in batch:
        entry = read.entry
        assert entry is not None
        if start >= 0 and (entry.offset < end or entry.offset - end > PREFETCH_GAP):
            store.prefetch_span(pack, start, end - start)
            start = -1
        if start < 0:
            pack, start = entry.pack, entry.offset
        end = entry.offset + entry.record_size
    if start >= 0:
        store.prefetch_span(pack, start, end - start)


# ---- blobs and tensors --------------------------------------------------------


def _allocator(arrays: bool) -> Callable[[str, int], tuple[Any, memoryview]]:
    """How a blob's buffer is made: a torch tensor, or with ``arrays`` a NumPy array (no torch)."""
    return state_mod.allocate_array if arrays else state_mod.allocate_blob


def read_blobs(
    core: ReadCore, commit: Commit, blobs: Sequence[Blob], progress: ProgressCallback | None = None,
    *, arrays: bool = False,
) -> list[torch.Tensor | np.ndarray]:  # fmt: skip
    """Every blob allocated whole and filled with its chunks: flat CPU buffers of
    their dtypes (NumPy arrays with ``arrays``). Chunks of all blobs are in flight
    together, so small tensors load in parallel too."""
    # every chunk looked up in one index transaction, then checked, before anything is allocated
    found = iter(core.store.index.get_many([oid for blob in blobs for oid in blob.chunks]))
    entries = [
        check_chunk_sizes(core.store, commit, blob, looked_up=[next(found) for _ in blob.chunks]) for blob in blobs
    ]
    bases: list[torch.Tensor | np.ndarray] = []
    reads: list[ChunkRead] = []
    allocate = _allocator(arrays)
    for blob, located in zip(blobs, entries, strict=True):
        spans = blob_spans(blob, commit)
        base, view = allocate(blob.dtype, blob.nbytes)
        bases.append(base)
        reads.extend(
            ChunkRead(blob, oid, b - a, into=view[a:b], entry=entry)
            for oid, (a, b), entry in zip(blob.chunks, spans, located, strict=True)
        )
    run_reads(core, commit, reads, Progress(progress, sum(r.size for r in reads)))
    return bases


def _view_end(info: TensorInfo) -> int:
    """One past the last element a strided view reaches (numel > 0)."""
    assert info.stride is not None
    return info.offset + 1 + sum((n - 1) * s for n, s in zip(info.shape, info.stride, strict=True))


class BlobLoader:
    """Reads what some tensor nodes need, each blob once and only the chunks that
    cover the elements asked for, and builds the tensors. Tensors of one blob
    share its buffer, so tied weights and views come back sharing storage.
    ``arrays``: NumPy arrays instead of tensors, without torch (ckvc.numpy)."""

    def __init__(
        self, core: ReadCore, commit: Commit, snapshot: Snapshot, map_location: MapLocation, *, arrays: bool = False
    ) -> None:
        self.core = core
        self.commit = commit
        self.snapshot = snapshot
        self._bases: dict[int, tuple[torch.Tensor | np.ndarray, int]] = {}  # blob -> (buffer, its first element)
        self._allocate = _allocator(arrays)
        self._maker: state_mod.BlobViews = (
            state_mod.ArrayMaker(self._bases.__getitem__)
            if arrays
            else state_mod.TensorMaker(self._bases.__getitem__, map_location)
        )

    def blob(self, info: TensorInfo) -> Blob:
        blobs = self.snapshot.blobs
        if info.blob >= len(blobs):
            raise CorruptObjectError(f"tensor refers to blob {info.blob} of {len(blobs)}", commit=self.commit.id)
        return blobs[info.blob]

    def plan(self, infos: Iterable[TensorInfo]) -> list[ChunkRead]:
        """Allocate the buffers ``infos`` need; the reads that fill them. Once per loader."""
        assert not self._bases, "a BlobLoader plans once"
        groups: dict[int, list[TensorInfo]] = {}
        for info in infos:
            self.blob(info)
            groups.setdefault(info.blob, []).append(info)
        reads: list[ChunkRead] = []
        for index, group in groups.items():
            blob = self.snapshot.blobs[index]
            itemsize = blob_itemsize(blob, self.commit)
            spans = blob_spans(blob, self.commit)
            ranges = []
            for info in group:
                if info.numel == 0:
                    continue
                if info.stride is None or info.kind == state_mod.KIND_NUMPY:
                    ranges.append((0, blob.nbytes // itemsize))
                else:
                    ranges.append((info.offset, _view_end(info)))
            start = end = 0
            chunks: list[int] = []
            entries: list[IndexEntry | None] = []
            if ranges:
                lo, hi = min(r[0] for r in ranges) * itemsize, max(r[1] for r in ranges) * itemsize
                if hi > blob.nbytes:
                    where = {"commit": self.commit.id, "tensor": blob.path}
                    raise CorruptObjectError("tensor view reaches past its blob", **where)
                size = blob.chunk_size
                if size % itemsize:  # chunks not aligned to elements: read it all
                    lo, hi = 0, blob.nbytes
                chunks = list(range(lo // size, -(-hi // size)))
                start, end = spans[chunks[0]][0], spans[chunks[-1]][1]
                entries = check_chunk_sizes(self.core.store, self.commit, blob, chunks)
            try:
                base, view = self._allocate(blob.dtype, end - start)
            except CorruptObjectError as exc:
                raise exc.with_context(commit=self.commit.id, tensor=blob.path) from None
            for i, entry in zip(chunks, entries, strict=True):
                a, b = spans[i]
                reads.append(ChunkRead(blob, blob.chunks[i], b - a, into=view[a - start : b - start], entry=entry))
            self._bases[index] = (base, start // itemsize)
        return reads

    def tensor(self, info: TensorInfo) -> Any:
        """The tensor (or numpy array) for ``info``; its buffer must be planned and read."""
        try:
            return self._maker(info)
        except CorruptObjectError as exc:
            raise exc.with_context(commit=self.commit.id, tensor=self.snapshot.blobs[info.blob].path) from None


def load_tensors(
    core: ReadCore,
    commit: Commit,
    snapshot: Snapshot,
    infos: Sequence[TensorInfo],
    *,
    map_location: MapLocation = None,
    progress: ProgressCallback | None = None,
) -> dict[TensorInfo, Any]:
    """The tensors of ``infos``, read together (only the chunks they cover)."""
    loader = BlobLoader(core, commit, snapshot, map_location)
    reads = loader.plan(infos)
    run_reads(core, commit, reads, Progress(progress, sum(r.size for r in reads)))
    return {info: loader.tensor(info) for info in infos}


def infos_in(node: Any) -> list[TensorInfo]:
    """Every TensorInfo in a value tree."""
    found: list[TensorInfo] = []

    def walk(v: Any) -> None:
        if isinstance(v, TensorInfo):
            found.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(node)
    return found


def fill_tree(node: Any, loader: BlobLoader) -> Any:
    """``node`` with every TensorInfo replaced by its loaded tensor; containers
    keep their types (dict, OrderedDict, list, tuple)."""
    if isinstance(node, TensorInfo):
        return loader.tensor(node)
    if type(node) in (dict, collections.OrderedDict):
        return type(node)((k, fill_tree(v, loader)) for k, v in node.items())
    if type(node) is list:
        return [fill_tree(v, loader) for v in node]
    if type(node) is tuple:
        return tuple(fill_tree(v, loader) for v in node)
    return node


# ---- leaves by path -----------------------------------------------------------


def node_at(root: Any, path: str | None, commit: Commit) -> Any:
    """The node at dotted ``path`` (None: the root). Dict keys may hold dots
    themselves ("layer.0.weight"), so every split is tried."""
    if path is None:
        return root

    def find(node: Any, rest: str) -> Any:
        if isinstance(node, dict):
            for key, value in node.items():
                name = str(key)
                if rest == name:
                    return value
                if rest.startswith(name + "."):
                    found = find(value, rest[len(name) + 1 :])
                    if found is not _MISSING:
                        return found
        elif isinstance(node, (list, tuple)):
            head, _, tail = rest.partition(".")
            if head.isdigit() and int(head) < len(node):
                return node[int(head)] if not tail else find(node[int(head)], tail)
        return _MISSING

    found = find(root, path)
    if found is _MISSING:
        raise UnknownKeyError(f"commit {commit.id[:12]} holds nothing at {path!r}", (path,))
    return found


_MISSING = object()


def unknown_leaves(leaves: Mapping[str, Any], paths: Sequence[str], commit: Commit) -> UnknownKeyError:
    """The error for ``paths`` that are not tensor leaves, saying what they are instead."""
    path = paths[0]
    where = f"commit {commit.id[:12]}"
    if len(paths) > 1:
        message = f"{where} holds no leaves {format_names(list(paths))}"
    elif path in leaves:
        message = f"{path!r} in {where} is not a tensor (see .non_tensors)"
    elif any(p.startswith(path + ".") for p in leaves):
        message = f"{path!r} in {where} is not a leaf but a subtree: use prefix={path + '.'!r}"
    else:
        message = f"{where} holds no leaf {path!r}"
    return UnknownKeyError(message, tuple(paths))


def select_leaves(
    leaves: Mapping[str, Any], commit: Commit, keys: Iterable[str] | None, prefix: str | None
) -> list[str]:
    """The paths of ``leaves`` named in ``keys`` or starting with ``prefix``, in
    stored order (all when both are None). UnknownKeyError for a key that is not a
    leaf or a prefix that matches nothing."""
    if isinstance(keys, str):
        raise InvalidInputError("keys must be a list of paths; for one path write keys=[path]")
    if keys is None and prefix is None:
        return list(leaves)
    wanted = set()
    if keys is not None:
        keys = list(keys)
        if not all(isinstance(k, str) for k in keys):
            raise InvalidInputError("keys must be str paths such as 'model.layer.0.weight'")
        unknown = [k for k in keys if k not in leaves]
        if unknown:
            raise unknown_leaves(leaves, unknown, commit)
        wanted = set(keys)
    if prefix is not None and not isinstance(prefix, str):
        raise InvalidInputError("prefix must be a str")
    selected = [p for p in leaves if p in wanted or (prefix is not None and p.startswith(prefix))]
    if prefix is not None and not any(p.startswith(prefix) for p in selected):
        raise UnknownKeyError(f"no leaf of commit {commit.id[:12]} starts with {prefix!r}", (prefix,))
    return selected


def _holds(leaves: Mapping[str, Any], path: str) -> bool:
    return any(p.startswith(path + ".") for p in leaves)


@pauses_gc
def load_leaves(
    core: ReadCore,
    commit: Commit,
    snapshot: Snapshot,
    leaves: Mapping[str, Any],
    keys: Iterable[str] | None,
    prefix: str | None,
    *,
    map_location: MapLocation = None,
    progress: ProgressCallback | None = None,
    subtrees: Mapping[str, Any] | None = None,
    arrays: bool = False,
) -> dict[str, Any]:
    """The selected leaves (:func:`select_leaves`) as a flat dict by path, tensors
    read together, each blob once; nothing is read when the selection is refused.
    ``subtrees`` (path -> node of the built state): loaded whole, nested, beside them."""
    selected: dict[str, Any] = {p: leaves[p] for p in select_leaves(leaves, commit, keys, prefix)}
    selected.update(subtrees or {})
    loader = BlobLoader(core, commit, snapshot, map_location, arrays=arrays)
    reads = loader.plan(info for node in selected.values() for info in infos_in(node))
    run_reads(core, commit, reads, Progress(progress, sum(r.size for r in reads)))
    return {p: fill_tree(node, loader) for p, node in selected.items()}


# ---- whole states -------------------------------------------------------------


@pauses_gc
def load_state(
    core: ReadCore,
    commit: Commit,
    *,
    map_location: MapLocation = None,
    allow_pickle: bool = False,
    progress: ProgressCallback | None = None,
    keys: Iterable[str] | None = None,
    prefix: str | None = None,
    files: bool = False,
    subtree: str | None = None,
    arrays: bool = False,
) -> Any:
    """The state ``commit`` stores (``Repo.load``); with ``keys``/``prefix`` a flat
    dict of those leaves (:func:`load_leaves`), a key naming a subtree ("rng")
    giving its nested value; with ``subtree`` only the value at that path.
    ``files``: file nodes come back as StoredFile (content and layout), for
    ckvc.formats to write them back. ``arrays``: tensors as NumPy arrays, torch
    dtypes and devices as their names, and torch never imported (ckvc.numpy)."""
    snapshot = core.read_snapshot(commit)
    # fsck's structure checks, before anything is allocated or read.
    parsed = state_mod.parse_snapshot(snapshot, commit.id, allow_pickle=allow_pickle, files=files, torch_free=arrays)
    if subtree is not None:
        if keys is not None or prefix is not None:
            raise InvalidInputError("subtree= loads one nested value; it takes no keys or prefix")
        if not isinstance(subtree, str):
            raise InvalidInputError("subtree must be a str path such as 'rng' or 'model.encoder'")
        only = {subtree: node_at(parsed.build(), subtree, commit)}
        loaded = load_leaves(
            core, commit, snapshot, {}, [], None, map_location=map_location, progress=progress, subtrees=only,
            arrays=arrays,
        )  # fmt: skip
        return loaded[subtree]
    if keys is not None or prefix is not None:
        root = parsed.build()
        leaves = state_mod.flatten(root)
        if keys is not None and not isinstance(keys, str):
            keys = list(keys)
            # a key that is no leaf but holds some (a dict or list): its nested value
            nested = {
                k: node_at(root, k, commit)
                for k in keys
                if isinstance(k, str) and k not in leaves and _holds(leaves, k)
            }
            keys = [k for k in keys if k not in nested]
        else:
            nested = {}
        return load_leaves(
            core, commit, snapshot, leaves, keys, prefix, map_location=map_location, progress=progress,
            subtrees=nested, arrays=arrays,
        )  # fmt: skip
    bases = read_blobs(core, commit, snapshot.blobs, progress, arrays=arrays)
    if arrays:
        return parsed.build(state_mod.ArrayMaker(lambda index: (bases[index], None)))
    return state_mod.build_state(parsed, bases.__getitem__, map_location=map_location)
