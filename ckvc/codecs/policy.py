"""The per-chunk choice a commit makes, as one object: each tensor's chunk size
(whole elements), whether its chunks are offered the parent's chunks as delta
bases (and the back-off for tensors whose deltas keep losing), which tensors
are stored lossy and in which mode. Pure: what is stored where is write.py's."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ckvc.codecs.lossy import COMPACT_MODES
from ckvc.codecs.lossy import DTYPE_CODES as LOSSY_DTYPES
from ckvc.codecs.lossy import MODES as LOSSY_MODES
from ckvc.errors import InvalidInputError
from ckvc.objects import Blob

MIN_DELTA_CHUNK = 64 << 10  # chunks below this many bytes are always stored whole
# Tensors smaller than this stay exact under a lossy spec: step counters and scalars
# cost nothing and must not drift.
MIN_LOSSY_ELEMENTS = 4096
# The compact modes code a tensor against its parent with one scale per 4096 elements,
# so biases and norm weights pay off from here (they are a tenth of a MiniLM run's
# compact bytes when kept exact).
MIN_COMPACT_ELEMENTS = 256
LOSSY_PRESETS: dict[str, dict[str, str]] = {
    "optimizer-q8": {"optimizer.*": "q8"},
    "optimizer-q4": {"optimizer.*": "q4"},
    "compact-q4": {"optimizer.*": "q4", "model.*": "residual-q4"},
    # Each save coded against the one before (docs/DESIGN.md, "The compact lossy tier").
    "compact": {"optimizer.*.exp_avg_sq": "log2", "optimizer.*": "coarse", "model.*": "track"},
}
KNOWN_MODES = (*LOSSY_MODES, *COMPACT_MODES)
# Glob patterns over tensor paths -> lossy mode, or a preset name; None: exact.
LossySpec = str | Mapping[str, str] | None


def chunk_size_for(chunk_size: int, itemsize: int) -> int:
    """The repository chunk size rounded down to whole elements (odd numpy
    itemsizes), and never less than one element (docs/FORMAT.md, chunking)."""
    return max(itemsize, chunk_size - chunk_size % itemsize) if itemsize > 1 else chunk_size


def lossy_patterns(spec: LossySpec) -> dict[str, str] | None:
    """The spec's patterns (a preset resolved), every mode checked; None: exact."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec not in LOSSY_PRESETS:
            raise InvalidInputError(f"unknown lossy preset {spec!r}; known: {sorted(LOSSY_PRESETS)}")
        spec = LOSSY_PRESETS[spec]
    for pattern, mode in spec.items():
        if mode not in KNOWN_MODES:
            raise InvalidInputError(f"unknown lossy mode {mode!r} for {pattern!r}; known: {sorted(KNOWN_MODES)}")
    return dict(spec)


class DeltaBackoff:
    """Per tensor path: commits left before a delta is tried again, after a delta
    lost to standalone encoding (optimizer moments often do). Lives as long as
    the Repo that commits, across its commits."""

    def __init__(self) -> None:
        self._wait: dict[str, tuple[int, int]] = {}  # path -> (commits to skip, losses in a row)

    def tries(self, path: str) -> bool:
        """Whether this commit offers ``path`` a delta (counts one skipped commit down)."""
        wait, losses = self._wait.get(path, (0, 0))
        if wait > 0:
            self._wait[path] = (wait - 1, losses)
        return wait == 0

    def record(self, path: str, won: bool) -> None:
        """Exponential backoff for tensors whose delta keeps losing: 1, 2, 4, 8 commits."""
        if won:
            self._wait.pop(path, None)
        else:
            _, losses = self._wait.get(path, (0, 0))
            self._wait[path] = (1 << min(losses, 3), losses + 1)


@dataclass
class ChunkPolicy:
    """The choices for one commit. ``uses_bases``: the codec can store deltas."""

    chunk_size: int
    keyframe_interval: int
    uses_bases: bool
    lossy: LossySpec = None
    backoff: DeltaBackoff = field(default_factory=DeltaBackoff)

    def __post_init__(self) -> None:
        self._patterns = lossy_patterns(self.lossy)  # a bad spec fails here, before any work

    @property
    def uses_parent(self) -> bool:
        """Whether the parent's chunks can be bases at all (deltas or residuals)."""
        return self.uses_bases and self.keyframe_interval >= 2

    def chunk_size_for(self, itemsize: int) -> int:
        return chunk_size_for(self.chunk_size, itemsize)

    def lossy_mode(self, path: str, dtype: str, nbytes: int, itemsize: int) -> str | None:
        """The lossy mode of a tensor (None: exact); the first matching pattern wins."""
        if self._patterns is None:
            return None
        matched = next((m for p, m in self._patterns.items() if fnmatch.fnmatchcase(path, p)), None)
        smallest = MIN_COMPACT_ELEMENTS if matched in COMPACT_MODES else MIN_LOSSY_ELEMENTS
        eligible = dtype in LOSSY_DTYPES and nbytes // itemsize >= smallest
        return matched if eligible else None

    def bases(
        self, path: str, dtype: str, nbytes: int, chunk_size: int, mode: str | None, before: Blob | None
    ) -> Sequence[bytes | None]:
        """The parent's chunks a tensor's chunks may build on, by position: only when
        the parent held it with the same dtype, size and chunking, and (for exact
        chunks) its deltas are not backing off."""
        if before is None or (before.dtype, before.nbytes, before.chunk_size) != (dtype, nbytes, chunk_size):
            return ()
        if mode is None and not self.backoff.tries(path):
            return ()
        return before.chunks

    def chunk_base(self, bases: Sequence[bytes | None], index: int, size: int, mode: str | None) -> bytes | None:
        """The base offered to chunk ``index``. A tiny chunk's delta saves a few
        hundred bytes and costs a second record read and decode on every checkout
        (lossy residuals excepted)."""
        small = size < MIN_DELTA_CHUNK and mode is None
        return bases[index] if index < len(bases) and not small else None

    def keyframe_due(self, age: int) -> bool:
        """Whether a chunk whose keyframe is ``age`` commits old is stored whole instead."""
        return age + 1 >= self.keyframe_interval
