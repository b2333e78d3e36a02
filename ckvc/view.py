"""Lazy, partial reads of a commit: :class:`CommitView` (``repo.view(rev)``, also
``repo.open(rev)``), a read-only mapping from tensor paths to tensors. Opening it
reads only the snapshot; ``view[path]`` reads (and verifies) only the chunks that
tensor covers; ``view.load(keys, prefix=...)`` (also ``repo.load(rev, keys=...)``)
a flat dict of some leaves, each blob read once, tensors that share storage
sharing it again. The reading is ckvc.read's.

Paths are the dotted leaf paths ``Repo.show`` lists ("model.layer.0.weight",
"optimizer.state.0.exp_avg"). Every chunk is verified against its id, as in
``Repo.load``. See docs/DESIGN.md, "Lazy views and partial loads".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckvc import read
from ckvc import state as state_mod
from ckvc.objects import Commit
from ckvc.read import ProgressCallback, ReadCore
from ckvc.state import MapLocation, TensorInfo

if TYPE_CHECKING:
    from ckvc.inspect import TensorSummary


def open_view(
    core: ReadCore,
    commit: Commit,
    map_location: MapLocation = None,
    *,
    allow_pickle: bool = False,
    progress: ProgressCallback | None = None,
) -> CommitView:
    return CommitView(core, commit, map_location=map_location, allow_pickle=allow_pickle, progress=progress)


class CommitView(Mapping[str, "torch.Tensor | np.ndarray"]):
    """A read-only view of one commit's tensors, by dotted path.

    Keys, length, iteration and ``in`` use only the snapshot, read when the view
    was opened. ``view[path]`` reads and verifies only the chunks that tensor
    covers, each time it is asked for (keep the result rather than asking
    twice); each access returns new tensors, so tensors read separately never
    share storage (``view.load(keys=[...])`` reads several together, sharing as
    stored). Non-tensor leaves (epoch, lr, betas, ...) are in ``non_tensors``.

    ``commit``: resolved and readable (not pruned; pickles only with
    ``allow_pickle``), as ``Repo.view`` checks. A view does not hold gc off: if
    its commit becomes unreachable and gc runs, later reads raise
    ObjectNotFoundError.
    """

    def __init__(
        self,
        core: ReadCore,
        commit: Commit,
        *,
        map_location: MapLocation = None,
        allow_pickle: bool = False,
        progress: ProgressCallback | None = None,
    ) -> None:
        self._core = core
        self._commit = commit
        self._snapshot = core.read_snapshot(commit)
        root = state_mod.parse_snapshot(self._snapshot, commit.id, allow_pickle=allow_pickle).build()
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
            raise read.unknown_leaves(self._leaves, [path], self._commit)
        return info

    def __getitem__(self, path: str) -> torch.Tensor | np.ndarray:
        info = self._tensor_info(path)
        loaded = read.load_tensors(
            self._core, self._commit, self._snapshot, [info], map_location=self._map_location, progress=self._progress
        )
        return loaded[info]

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
        return read.load_leaves(
            self._core,
            self._commit,
            self._snapshot,
            self._leaves,
            keys,
            prefix,
            map_location=self._map_location,
            progress=self._progress,
        )
