"""Lazy and partial reads of a commit.

- :class:`CommitView` (``repo.view(rev)``, also ``repo.open(rev)``): a read-only
  mapping from tensor paths to tensors. Opening it reads only the snapshot;
  ``view[path]`` reads (and verifies) only the chunks that tensor covers.
- :meth:`CommitView.load` (``repo.load(rev, keys=..., prefix=...)``): a flat dict of
  some leaves, each blob read once, tensors that share storage sharing it again.

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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckvc import state as state_mod
from ckvc.chunking import chunk_spans
from ckvc.errors import (
    CorruptObjectError,
    InvalidInputError,
    ObjectNotFoundError,
    UnknownKeyError,
    UnsafeContentError,
)
from ckvc.objects import Blob, Commit, Snapshot
from ckvc.state import MapLocation, TensorInfo

if TYPE_CHECKING:
    from ckvc.repo import ProgressCallback, Repo, TensorSummary

# How many names an error message lists before it says "and N more".
_MAX_NAMED = 8


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


def _run_reads(repo: Repo, commit: Commit, reads: Sequence[_Read], progress: _Progress) -> None:
    """Decode and verify ``reads`` on the repository's pool, a bounded window of
    chunks in flight (so scratch memory stays a few chunks)."""
    window = 4 * (os.cpu_count() or 2)
    in_flight: collections.deque[tuple[_Read, Future[None], np.ndarray | None]] = collections.deque()

    def finish_oldest() -> None:
        read, fut, scratch = in_flight.popleft()
        try:
            fut.result()
        except CorruptObjectError as exc:
            raise exc.with_context(commit=commit.id, tensor=read.blob.path) from None
        except ObjectNotFoundError as exc:
            raise ObjectNotFoundError(f"{exc} (tensor {read.blob.path!r}, commit {commit.id})") from None
        if read.then is not None:
            assert scratch is not None
            read.then(scratch)
        progress.add(read.size)

    try:
        for read in reads:
            scratch = None
            out = read.into
            if out is None:
                scratch = _scratch(read)
                out = scratch.data.cast("B")
            in_flight.append((read, repo._submit(repo.store.read_into, read.oid, out), scratch))
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


def _spans(blob: Blob, commit: Commit) -> list[tuple[int, int]]:
    spans = list(chunk_spans(blob.nbytes, blob.chunk_size))
    if len(spans) != len(blob.chunks):
        raise CorruptObjectError("blob chunk list does not cover its size", commit=commit.id, tensor=blob.path)
    return spans


def _itemsize(blob: Blob, commit: Commit) -> int:
    try:
        itemsize = state_mod.blob_itemsize(blob.dtype)
    except (KeyError, TypeError, ValueError):
        raise CorruptObjectError(f"unknown dtype {blob.dtype!r}", commit=commit.id, tensor=blob.path) from None
    if itemsize <= 0:
        raise CorruptObjectError(f"dtype {blob.dtype!r} has no width", commit=commit.id, tensor=blob.path)
    return itemsize


def _view_end(info: TensorInfo) -> int:
    """One past the last element a strided view reaches (numel > 0)."""
    assert info.stride is not None
    return info.offset + 1 + sum((n - 1) * s for n, s in zip(info.shape, info.stride, strict=True))


class _TensorLoader:
    """Reads what some tensor nodes need, each blob once and only the chunks that
    cover the elements asked for, and builds the tensors. Tensors of one blob
    share its buffer, so tied weights and views come back sharing storage."""

    def __init__(self, repo: Repo, commit: Commit, snapshot: Snapshot, map_location: MapLocation) -> None:
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


# ---- opening a commit ---------------------------------------------------------


def _open(repo: Repo, rev: str, allow_pickle: bool) -> tuple[Commit, Snapshot, Any]:
    """The commit, its snapshot and its value tree (tensors as TensorInfo), with
    the same refusals as ``Repo.load``: pruned commits, and pickles unless allowed."""
    commit = repo.read_commit(repo.resolve(rev))
    repo._check_not_pruned(commit.id)
    if commit.pickled and not allow_pickle:
        raise UnsafeContentError(
            f"commit {commit.id[:12]} holds pickled values, which can run code; "
            "load with allow_pickle=True only if you trust it"
        )
    snapshot = repo.read_snapshot(commit)
    try:
        root = state_mod.skeleton(snapshot.tree, allow_pickle=allow_pickle)
    except CorruptObjectError as exc:
        raise exc.with_context(commit=commit.id) from None
    return commit, snapshot, root


def open_view(
    repo: Repo,
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
        repo: Repo,
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
        from ckvc.repo import Repo

        return Repo._summary(path, self._tensor_info(path), self._snapshot)

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
