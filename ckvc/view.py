"""Lazy, partial and in-place reads of a commit.

- :class:`CommitView` (``repo.view(rev)``, also ``repo.open(rev)``): a read-only
  mapping from tensor paths to tensors. Opening it reads only the snapshot;
  ``view[path]`` reads (and verifies) only the chunks that tensor covers.
- :meth:`CommitView.load` (``repo.load(rev, keys=..., prefix=...)``): a flat dict of
  some leaves, each blob read once, tensors that share storage sharing it again.
- :func:`load_into` (``repo.load_into(rev, model=..., optimizer=..., scheduler=...)``):
  chunks decoded straight into a model's existing parameters and buffers.

Paths are the dotted leaf paths ``Repo.show`` lists ("model.layer.0.weight",
"optimizer.state.0.exp_avg"). Every chunk is verified against its id, as in
``Repo.load``. See docs/DESIGN.md, "Lazy views and partial loads".
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from ckvc import state as state_mod
from ckvc.chunking import chunk_spans, size_batches
from ckvc.errors import (
    CorruptObjectError,
    IncompatibleStateError,
    InvalidInputError,
    ObjectNotFoundError,
    UnknownKeyError,
)
from ckvc.ids import ObjectType
from ckvc.objects import Blob, Commit, Snapshot
from ckvc.state import MapLocation, TensorInfo

if TYPE_CHECKING:
    from ckvc.core import ProgressCallback, Repository
    from ckvc.inspect import TensorSummary

# How many names an error message lists before it says "and N more".
_MAX_NAMED = 8


class IncompatibleKeys(NamedTuple):
    """What ``Repo.load_into(..., strict=False)`` could not match, like torch's
    ``load_state_dict``: model keys the commit lacks, and stored keys the model lacks."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(repr(i) for i in items[:_MAX_NAMED])
    return shown + (f" and {len(items) - _MAX_NAMED} more" if len(items) > _MAX_NAMED else "")


# ---- reading chunks -----------------------------------------------------------


class _Progress:
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
class _Read:
    """One chunk to read: straight into ``into``, or into a scratch buffer that
    ``then`` receives (on the calling thread, in order) and copies from."""

    blob: Blob
    oid: bytes
    size: int
    into: memoryview | None = None
    then: Callable[[np.ndarray], None] | None = None
    pinned: bool = False  # scratch in pinned host memory (the copy goes to a GPU)


def _scratch(read: _Read) -> np.ndarray:
    if read.pinned and torch.cuda.is_available():
        return torch.empty(read.size, dtype=torch.uint8, pin_memory=True).numpy()
    return np.empty(read.size, dtype=np.uint8)


PREFETCH_WINDOWS = 2  # how far ahead of the reads in flight chunks are announced to the kernel


def _read_batch(repo: Repository, commit: Commit, batch: Sequence[tuple[_Read, memoryview]]) -> None:
    """Decode and verify one batch of reads (on a pool thread); errors name the tensor."""
    for read, out in batch:
        try:
            repo.store.read_into(read.oid, out)
        except CorruptObjectError as exc:
            raise exc.with_context(commit=commit.id, tensor=read.blob.path) from None
        except ObjectNotFoundError as exc:
            raise ObjectNotFoundError(f"{exc} (tensor {read.blob.path!r}, commit {commit.id})") from None


def _run_reads(repo: Repository, commit: Commit, reads: Sequence[_Read], progress: _Progress) -> None:
    """Decode and verify ``reads`` on the repository's pool, a bounded window of
    tasks in flight (so scratch memory stays a few chunks)."""
    window = 4 * (os.cpu_count() or 2)
    in_flight: collections.deque[tuple[list[_Read], Future[None], list[np.ndarray | None]]] = collections.deque()

    def finish_oldest() -> None:
        batch, fut, scratches = in_flight.popleft()
        fut.result()
        for read, scratch in zip(batch, scratches, strict=True):
            if read.then is not None:
                assert scratch is not None
                read.then(scratch)
            progress.add(read.size)

    # Cold reads: the kernel fetches the chunks queued behind the running ones
    # while these decode, instead of each read waiting on the disk in turn.
    prefetch_ahead = PREFETCH_WINDOWS * window
    for read in reads[:prefetch_ahead]:
        repo.store.prefetch(read.oid)
    queued = 0
    try:
        for batch in size_batches(reads, lambda read: read.size):
            scratches: list[np.ndarray | None] = []
            targets: list[tuple[_Read, memoryview]] = []
            for read in batch:
                if queued + prefetch_ahead < len(reads):
                    repo.store.prefetch(reads[queued + prefetch_ahead].oid)
                queued += 1
                scratch = None
                out = read.into
                if out is None:
                    scratch = _scratch(read)
                    out = scratch.data.cast("B")
                scratches.append(scratch)
                targets.append((read, out))
            in_flight.append((batch, repo.executor.submit(_read_batch, repo, commit, targets), scratches))
            if len(in_flight) >= window:
                finish_oldest()
        while in_flight:
            finish_oldest()
    finally:
        for _, fut, _ in in_flight:  # after an error: let running reads finish before buffers go
            fut.cancel()
        for _, fut, _ in in_flight:
            if not fut.cancelled():
                fut.exception()


def read_chunks(
    repo: Repository, commit: Commit, reads: Sequence[tuple[Blob, bytes, memoryview]], progress: ProgressCallback | None
) -> None:
    """Decode and verify whole chunks straight into their destinations (Repo.load)."""
    plan = [_Read(blob, oid, len(out), into=out) for blob, oid, out in reads]
    _run_reads(repo, commit, plan, _Progress(progress, sum(r.size for r in plan)))


def read_blobs(
    repo: Repository, commit: Commit, blobs: Sequence[Blob], progress: ProgressCallback | None = None
) -> list[torch.Tensor | np.ndarray]:
    """Allocate every blob and fill it with its chunks, decoded and verified on
    the pool. Chunks of all blobs are in flight together (a bounded window), so
    small tensors load in parallel too."""
    for blob in blobs:
        check_chunk_sizes(repo, commit, blob)  # before anything is allocated
    bases: list[torch.Tensor | np.ndarray] = []
    reads: list[tuple[Blob, bytes, memoryview]] = []
    for blob in blobs:
        spans = _spans(blob, commit)
        base, view = state_mod.allocate_blob(blob.dtype, blob.nbytes)
        bases.append(base)
        reads.extend((blob, oid, view[a:b]) for oid, (a, b) in zip(blob.chunks, spans, strict=True))
    read_chunks(repo, commit, reads, progress)
    return bases


def _spans(blob: Blob, commit: Commit) -> list[tuple[int, int]]:
    spans = list(chunk_spans(blob.nbytes, blob.chunk_size))
    if len(spans) != len(blob.chunks):
        raise CorruptObjectError("blob chunk list does not cover its size", commit=commit.id, tensor=blob.path)
    return spans


def check_chunk_sizes(repo: Repository, commit: Commit, blob: Blob, chunks: Iterable[int] | None = None) -> None:
    """Each chunk's size as the index records it against its span, before any
    buffer is allocated for the blob: a crafted blob table cannot make a read
    allocate what its chunks do not hold. One index lookup per chunk (fsck makes
    the same check). ``chunks``: the indices to check (default all)."""
    spans = _spans(blob, commit)
    wanted = range(len(spans)) if chunks is None else chunks
    found = repo.store.index.sizes(blob.chunks[i] for i in wanted)
    for i, size in zip(wanted, found, strict=True):
        oid, (start, end) = blob.chunks[i], spans[i]
        if size is None:
            try:
                entry = repo.store.locate(oid)  # indexes packs it does not know yet, else raises
            except ObjectNotFoundError as exc:
                raise ObjectNotFoundError(f"{exc} (tensor {blob.path!r}, commit {commit.id})") from None
            size = (entry.kind, entry.raw_size)
        if size != (ObjectType.CHUNK, end - start):
            raise CorruptObjectError(
                f"chunk {oid.hex()} at bytes {start}-{end} is stored as {size[1]} bytes of type {size[0]}",
                commit=commit.id,
                tensor=blob.path,
            )


def _itemsize(blob: Blob, commit: Commit) -> int:
    try:
        return state_mod.blob_itemsize(blob.dtype)
    except CorruptObjectError as exc:
        raise exc.with_context(commit=commit.id, tensor=blob.path) from None


def _view_end(info: TensorInfo) -> int:
    """One past the last element a strided view reaches (numel > 0)."""
    assert info.stride is not None
    return info.offset + 1 + sum((n - 1) * s for n, s in zip(info.shape, info.stride, strict=True))


class _TensorLoader:
    """Reads what some tensor nodes need, each blob once and only the chunks that
    cover the elements asked for, and builds the tensors. Tensors of one blob
    share its buffer, so tied weights and views come back sharing storage."""

    def __init__(self, repo: Repository, commit: Commit, snapshot: Snapshot, map_location: MapLocation) -> None:
        self.repo = repo
        self.commit = commit
        self.snapshot = snapshot
        self.map_location = map_location
        self._bases: dict[int, tuple[torch.Tensor | np.ndarray, int]] = {}  # blob -> (buffer, its first element)
        self._placed: dict[tuple[int, str], Any] = {}
        self._made: dict[TensorInfo, Any] = {}

    def blob(self, info: TensorInfo) -> Blob:
        blobs = self.snapshot.blobs
        if info.blob >= len(blobs):
            raise CorruptObjectError(f"tensor refers to blob {info.blob} of {len(blobs)}", commit=self.commit.id)
        return blobs[info.blob]

    def plan(self, infos: Iterable[TensorInfo]) -> list[_Read]:
        """Allocate the buffers ``infos`` need; the reads that fill them. Once per loader."""
        assert not self._bases, "a _TensorLoader plans once"
        groups: dict[int, list[TensorInfo]] = {}
        for info in infos:
            self.blob(info)
            groups.setdefault(info.blob, []).append(info)
        reads: list[_Read] = []
        for index, group in groups.items():
            blob = self.snapshot.blobs[index]
            itemsize = _itemsize(blob, self.commit)
            spans = _spans(blob, self.commit)
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
                check_chunk_sizes(self.repo, self.commit, blob, chunks)
            try:
                base, view = state_mod.allocate_blob(blob.dtype, end - start)
            except CorruptObjectError as exc:
                raise exc.with_context(commit=self.commit.id, tensor=blob.path) from None
            for i in chunks:
                a, b = spans[i]
                reads.append(_Read(blob, blob.chunks[i], b - a, into=view[a - start : b - start]))
            self._bases[index] = (base, start // itemsize)
        return reads

    def tensor(self, info: TensorInfo) -> Any:
        """The tensor (or numpy array) for ``info``; its buffer must be planned and read."""
        made = self._made.get(info)
        if made is not None:
            return made
        base, first = self._bases[info.blob]
        local = info
        if info.stride is not None:
            local = dataclasses.replace(info, offset=info.offset - first if info.numel else 0)
        key = (info.blob, info.device)
        if key not in self._placed:
            self._placed[key] = state_mod.place(base, info.device, self.map_location)
        placed = self._placed[key]
        if info.numel == 0 and info.stride is None:
            placed = placed[:0]  # an empty tensor next to others in one blob (not written so, but harmless)
        try:
            made = state_mod.materialize(local, placed)
        except CorruptObjectError as exc:
            raise exc.with_context(commit=self.commit.id, tensor=self.snapshot.blobs[info.blob].path) from None
        self._made[info] = made
        return made


def _infos_in(node: Any) -> list[TensorInfo]:
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


def _fill_tree(node: Any, loader: _TensorLoader) -> Any:
    """``node`` with every TensorInfo replaced by its loaded tensor; containers
    keep their types (dict, OrderedDict, list, tuple)."""
    if isinstance(node, TensorInfo):
        return loader.tensor(node)
    if type(node) in (dict, collections.OrderedDict):
        return type(node)((k, _fill_tree(v, loader)) for k, v in node.items())
    if type(node) is list:
        return [_fill_tree(v, loader) for v in node]
    if type(node) is tuple:
        return tuple(_fill_tree(v, loader) for v in node)
    return node


# ---- opening a commit ---------------------------------------------------------


def _open(repo: Repository, rev: str, allow_pickle: bool) -> tuple[Commit, Snapshot, Any]:
    """The commit, its snapshot and its value tree (tensors as TensorInfo), with
    the same refusals as ``Repo.load``: pruned commits, and pickles unless allowed."""
    from ckvc.graph import readable_commit

    commit = readable_commit(repo, rev, allow_pickle=allow_pickle)
    snapshot = repo.read_snapshot(commit)
    root = state_mod.parse_snapshot(snapshot, commit.id, allow_pickle=allow_pickle).build()
    return commit, snapshot, root


def open_view(
    repo: Repository,
    rev: str,
    map_location: MapLocation = None,
    *,
    allow_pickle: bool = False,
    progress: ProgressCallback | None = None,
) -> CommitView:
    commit, snapshot, root = _open(repo, rev, allow_pickle)
    return CommitView(repo, commit, snapshot, root, map_location=map_location, progress=progress)


class CommitView(Mapping[str, "torch.Tensor | np.ndarray"]):
    """A read-only view of one commit's tensors, by dotted path.

    Keys, length, iteration and ``in`` use only the snapshot, read when the view
    was opened. ``view[path]`` reads and verifies only the chunks that tensor
    covers, each time it is asked for (keep the result rather than asking
    twice); each access returns new tensors, so tensors read separately never
    share storage (``view.load(keys=[...])`` reads several together, sharing as
    stored). Non-tensor leaves (epoch, lr, betas, ...) are in ``non_tensors``.

    A view does not hold gc off: if its commit becomes unreachable and gc runs,
    later reads raise ObjectNotFoundError.
    """

    def __init__(
        self,
        repo: Repository,
        commit: Commit,
        snapshot: Snapshot,
        root: Any,
        *,
        map_location: MapLocation = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        self._repo = repo
        self._commit = commit
        self._snapshot = snapshot
        self._map_location = map_location
        self._progress = progress
        self._leaves = state_mod.flatten(root)
        self._tensors = {p: v for p, v in self._leaves.items() if isinstance(v, TensorInfo)}

    @property
    def commit(self) -> Commit:
        return self._commit

    @property
    def non_tensors(self) -> dict[str, Any]:
        """The non-tensor leaves by path (a new dict each time)."""
        return {p: v for p, v in self._leaves.items() if not isinstance(v, TensorInfo)}

    def info(self, path: str) -> TensorSummary:
        """dtype, shape, nbytes and kind of the tensor at ``path``, without reading it."""
        from ckvc.inspect import tensor_summary

        return tensor_summary(path, self._tensor_info(path), self._snapshot)

    def _tensor_info(self, path: str) -> TensorInfo:
        info = self._tensors.get(path)
        if info is None:
            raise self._unknown([path])
        return info

    def _unknown(self, paths: Sequence[str]) -> UnknownKeyError:
        path = paths[0]
        where = f"commit {self._commit.id[:12]}"
        if len(paths) > 1:
            message = f"{where} holds no leaves {_names(list(paths))}"
        elif path in self._leaves:
            message = f"{path!r} in {where} is not a tensor (see .non_tensors)"
        elif any(p.startswith(path + ".") for p in self._leaves):
            message = f"{path!r} in {where} is not a leaf but a subtree: use prefix={path + '.'!r}"
        else:
            message = f"{where} holds no leaf {path!r}"
        return UnknownKeyError(message, tuple(paths))

    def __getitem__(self, path: str) -> torch.Tensor | np.ndarray:
        info = self._tensor_info(path)
        return self._load_tensors([info])[info]

    def __contains__(self, path: object) -> bool:
        return path in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"<CommitView {self._commit.id[:12]}: {len(self._tensors)} tensors, {len(self._leaves)} leaves>"

    def load(self, keys: Iterable[str] | None = None, *, prefix: str | None = None) -> dict[str, Any]:
        """The leaves named in ``keys`` and those whose path starts with ``prefix``
        (tensors and non-tensor values), as a flat dict in stored order. Only the
        chunks they cover are read. UnknownKeyError (a KeyError) if a key is not
        a leaf or the prefix matches nothing; nothing is read then."""
        if isinstance(keys, str):
            raise InvalidInputError("keys must be a list of paths; for one path write keys=[path]")
        if keys is None and prefix is None:
            selected = list(self._leaves)
        else:
            wanted = set()
            if keys is not None:
                keys = list(keys)
                if not all(isinstance(k, str) for k in keys):
                    raise InvalidInputError("keys must be str paths such as 'model.layer.0.weight'")
                unknown = [k for k in keys if k not in self._leaves]
                if unknown:
                    raise self._unknown(unknown)
                wanted = set(keys)
            if prefix is not None and not isinstance(prefix, str):
                raise InvalidInputError("prefix must be a str")
            selected = [p for p in self._leaves if p in wanted or (prefix is not None and p.startswith(prefix))]
            if prefix is not None and not any(p.startswith(prefix) for p in selected):
                raise UnknownKeyError(f"no leaf of commit {self._commit.id[:12]} starts with {prefix!r}", (prefix,))
        leaves = {p: self._leaves[p] for p in selected}
        loaded = self._load_tensors([leaf for leaf in leaves.values() if isinstance(leaf, TensorInfo)])
        return {p: loaded[leaf] if isinstance(leaf, TensorInfo) else leaf for p, leaf in leaves.items()}

    def _load_tensors(self, infos: Sequence[TensorInfo]) -> dict[TensorInfo, Any]:
        loader = _TensorLoader(self._repo, self._commit, self._snapshot, self._map_location)
        reads = loader.plan(infos)
        _run_reads(self._repo, self._commit, reads, _Progress(self._progress, sum(r.size for r in reads)))
        return {info: loader.tensor(info) for info in infos}


# ---- loading into live objects ------------------------------------------------


def _subtree(root: Any, path: str | None, commit: Commit) -> Any:
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


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride), strict=True):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _write_range(dst: torch.Tensor, start: int, stop: int, src: torch.Tensor) -> None:
    """Copy the 1-d ``src`` into elements [start, stop) of ``dst`` in row-major
    order, whatever ``dst``'s strides and device: a few rectangular copies."""
    if start >= stop:
        return
    if dst.dim() == 0:
        dst.copy_(src.reshape(()))
        return
    if dst.is_contiguous():
        dst.view(-1)[start:stop].copy_(src)
        return
    inner = dst.numel() // dst.shape[0]
    first, last = start // inner, (stop - 1) // inner
    if first == last:
        _write_range(dst[first], start - first * inner, stop - first * inner, src)
        return
    pos = 0
    if start % inner:  # the tail of the first row
        pos = inner - start % inner
        _write_range(dst[first], start % inner, inner, src[:pos])
        first += 1
    full_end = stop // inner
    if full_end > first:  # whole rows
        n = (full_end - first) * inner
        dst[first:full_end].copy_(src[pos : pos + n].view(full_end - first, *dst.shape[1:]))
        pos += n
    if stop % inner:  # the head of the last row
        _write_range(dst[full_end], 0, stop % inner, src[pos:])


_EXTRA_STATE = "_extra_state"  # torch.nn.Module's state_dict key for get_extra_state()


@dataclass
class _Fill:
    key: str
    target: torch.Tensor  # detached; shares the parameter's memory
    info: TensorInfo
    blob: Blob


def _check_model(
    model: torch.nn.Module, stored: Any, snapshot: Snapshot, commit: Commit, strict: bool
) -> tuple[list[_Fill], list[tuple[str, Any]], IncompatibleKeys]:
    """Match the model's state_dict against the stored one; raise before anything changes."""
    if not isinstance(stored, dict):
        raise IncompatibleStateError(
            f"commit {commit.id[:12]} stores a {type(stored).__name__} where a model state_dict was expected"
        )
    targets = model.state_dict(keep_vars=True)
    missing = [k for k in targets if k not in stored]
    unexpected = [str(k) for k in stored if k not in targets]
    mismatched: list[str] = []
    fills: list[_Fill] = []
    extra: list[tuple[str, Any]] = []
    for key, target in targets.items():
        if key not in stored:
            continue
        source = stored[key]
        if key == _EXTRA_STATE or key.endswith("." + _EXTRA_STATE):
            extra.append((key, source))  # a module's get_extra_state(): given to its set_extra_state
            continue
        if not isinstance(target, torch.Tensor):
            mismatched.append(f"{key}: the model has a {type(target).__name__}, not a tensor")
            continue
        if not isinstance(source, TensorInfo) or source.kind == state_mod.KIND_NUMPY:
            mismatched.append(f"{key}: stored {type(source).__name__}, model has a tensor")
            continue
        if source.blob >= len(snapshot.blobs):
            raise CorruptObjectError(f"tensor refers to blob {source.blob} of {len(snapshot.blobs)}", commit=commit.id)
        blob = snapshot.blobs[source.blob]
        dtype = blob.dtype
        if tuple(source.shape) != tuple(target.shape):
            mismatched.append(f"{key}: stored shape {list(source.shape)}, model has {list(target.shape)}")
        elif dtype != state_mod.dtype_name(target.dtype) and (strict or dtype.startswith(state_mod.NUMPY_DTYPE_PREFIX)):
            mismatched.append(f"{key}: stored dtype {dtype}, model has {state_mod.dtype_name(target.dtype)}")
        else:
            fills.append(_Fill(key, target.detach(), source, blob))
    if mismatched or (strict and (missing or unexpected)):
        parts = []
        if missing:
            parts.append(f"missing keys {_names(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {_names(unexpected)}")
        if mismatched:
            parts.append(f"mismatched tensors {_names(mismatched)}")
        raise IncompatibleStateError(
            f"commit {commit.id[:12]} does not fit the model: {'; '.join(parts)}; nothing was loaded",
            missing=tuple(missing),
            unexpected=tuple(unexpected),
            mismatched=tuple(mismatched),
        )
    return fills, extra, IncompatibleKeys(missing, unexpected)


def _check_optimizer(optimizer: torch.optim.Optimizer, stored: Any, commit: Commit) -> None:
    """The checks Optimizer.load_state_dict makes, made before anything changes."""
    where = f"commit {commit.id[:12]}"
    if not (isinstance(stored, dict) and isinstance(stored.get("param_groups"), list) and "state" in stored):
        raise IncompatibleStateError(f"{where} does not store an optimizer state_dict there")
    saved = stored["param_groups"]
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved):
        raise IncompatibleStateError(f"{where}: malformed optimizer param_groups")
    if len(saved) != len(optimizer.param_groups):
        raise IncompatibleStateError(
            f"{where} has {len(saved)} optimizer parameter groups, the optimizer {len(optimizer.param_groups)}"
        )
    for i, (s, g) in enumerate(zip(saved, optimizer.param_groups, strict=True)):
        if len(s["params"]) != len(g["params"]):
            raise IncompatibleStateError(
                f"{where}: optimizer parameter group {i} has {len(s['params'])} parameters stored, "
                f"{len(g['params'])} in the optimizer"
            )


def _plan_fills(fills: Sequence[_Fill], commit: Commit) -> list[list[tuple[_Read | None, _Fill]]]:
    """Reads that decode each fill's chunks straight into the target's memory where
    they can (CPU, contiguous, same dtype, whole chunks) and through a one-chunk
    scratch buffer otherwise. A fill whose source is a strided view (rare: views
    of a shared storage) gets one entry with no read; it is loaded on its own.

    Grouped in passes: a target met again with another source (the model ties
    what the commit stores apart) is written in a later pass, so the last key
    wins as with load_state_dict and no two reads write one memory at once."""
    passes: list[list[tuple[_Read | None, _Fill]]] = []
    seen: dict[tuple[Any, ...], list[TensorInfo]] = {}
    for fill in fills:
        t = fill.target
        if t.numel() == 0:
            continue
        where = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        sources = seen.setdefault(where, [])
        if fill.info in sources:
            continue  # tied in the model and in the commit: written once
        sources.append(fill.info)
        while len(passes) < len(sources):
            passes.append([])
        passes[len(sources) - 1].extend(_fill_reads(fill, commit))
    return passes


def _fill_reads(fill: _Fill, commit: Commit) -> list[tuple[_Read | None, _Fill]]:
    info, blob, target = fill.info, fill.blob, fill.target
    if info.stride is not None and not _contiguous(info.shape, info.stride):
        return [(None, fill)]
    itemsize = _itemsize(blob, commit)
    src_dtype = state_mod.torch_dtype(blob.dtype)
    lo = (0 if info.stride is None else info.offset) * itemsize
    hi = lo + info.numel * itemsize
    if hi > blob.nbytes or (info.stride is None and hi != blob.nbytes):
        raise CorruptObjectError("tensor does not match its blob", commit=commit.id, tensor=blob.path)
    if blob.chunk_size % itemsize:
        raise CorruptObjectError("chunks are not aligned to elements", commit=commit.id, tensor=blob.path)
    direct = target.device.type == "cpu" and target.is_contiguous() and src_dtype == target.dtype
    target_bytes = target.reshape(-1).view(torch.uint8).numpy().data.cast("B") if direct else None
    spans = _spans(blob, commit)
    first, last = lo // blob.chunk_size, -(-hi // blob.chunk_size)
    out: list[tuple[_Read | None, _Fill]] = []
    for i in range(first, last):
        a, b = spans[i]
        if target_bytes is not None and lo <= a and b <= hi:
            out.append((_Read(blob, blob.chunks[i], b - a, into=target_bytes[a - lo : b - lo]), fill))
            continue

        def then(scratch: np.ndarray, a: int = a, b: int = b) -> None:
            x, y = max(a, lo), min(b, hi)
            piece = torch.from_numpy(scratch[x - a : y - a]).view(src_dtype)
            _write_range(target, (x - lo) // itemsize, (y - lo) // itemsize, piece)

        out.append((_Read(blob, blob.chunks[i], b - a, then=then, pinned=target.device.type == "cuda"), fill))
    return out


def load_into(
    repo: Repository,
    rev: str,
    *,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    strict: bool,
    model_key: str | None,
    optimizer_key: str | None,
    scheduler_key: str | None,
    map_location: MapLocation,
    allow_pickle: bool,
    progress: ProgressCallback | None,
) -> IncompatibleKeys:
    """See ``Repo.load_into``."""
    commit, snapshot, root = _open(repo, rev, allow_pickle)
    model_node = _subtree(root, model_key, commit) if model is not None else None
    optim_node = _subtree(root, optimizer_key, commit) if optimizer is not None else None
    sched_node = _subtree(root, scheduler_key, commit) if scheduler is not None else None

    # 1. Check everything before anything changes.
    fills: list[_Fill] = []
    extra: list[tuple[str, Any]] = []
    result = IncompatibleKeys([], [])
    if model is not None:
        fills, extra, result = _check_model(model, model_node, snapshot, commit, strict)
    if optimizer is not None:
        _check_optimizer(optimizer, optim_node, commit)
    passes = _plan_fills(fills, commit)
    for entries in passes:
        for read, fill in entries:
            if read is not None and not repo.store.has(read.oid):
                try:
                    repo.store.locate(read.oid)  # indexes packs it does not know yet, else raises
                except ObjectNotFoundError as exc:
                    raise ObjectNotFoundError(f"{exc} (tensor {fill.key!r}, commit {commit.id})") from None

    # 2. Read what is loaded whole (optimizer, scheduler, extra states) before the
    # model changes, so a damaged chunk there leaves the model as it was.
    loader = _TensorLoader(repo, commit, snapshot, map_location)
    others = [node for node in (optim_node, sched_node, *(v for _, v in extra)) if node is not None]
    other_reads = loader.plan(info for node in others for info in _infos_in(node))
    total = sum(r.size for r in other_reads)
    total += sum(r.size for entries in passes for r, _ in entries if r is not None)
    total += sum(f.info.numel * _itemsize(f.blob, commit) for entries in passes for r, f in entries if r is None)
    tracker = _Progress(progress, total)
    _run_reads(repo, commit, other_reads, tracker)

    # 3. The model: chunks straight into its parameters and buffers.
    for entries in passes:
        _run_reads(repo, commit, [r for r, _ in entries if r is not None], tracker)
        for read, fill in entries:
            if read is None:  # a strided view of a shared storage: its span on its own
                alone = _TensorLoader(repo, commit, snapshot, None)
                _run_reads(repo, commit, alone.plan([fill.info]), _Progress(None))
                with torch.no_grad():
                    fill.target.copy_(alone.tensor(fill.info))
                tracker.add(fill.info.numel * _itemsize(fill.blob, commit))
    if fills:
        increment = getattr(torch.autograd.graph, "increment_version", None)
        if increment is not None:  # written behind autograd's back: tell it
            increment([f.target for f in fills if f.target.numel()])
    if model is not None:
        for key, node in extra:
            owner = key[: -len(_EXTRA_STATE)].rstrip(".")
            model.get_submodule(owner).set_extra_state(_fill_tree(node, loader))
    if optimizer is not None:
        optimizer.load_state_dict(_fill_tree(optim_node, loader))
    if scheduler is not None:
        scheduler.load_state_dict(_fill_tree(sched_node, loader))
    return result
