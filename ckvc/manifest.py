"""Per-tensor manifests: for each tensor of a state, its dtype, shape, size and a
content hash that a commit gives from its chunk ids alone (no tensor byte read)
and that live tensors give by hashing their bytes (``manifest_of``), so a trainer
and an inference server can compare weights after a sync (docs/FORMAT.md, 13).

The hash of a tensor whose bytes, in C order, are B (``chunk_size`` C):

    H = BLAKE3("ckvc-manifest-v1\\0" || dtype || "\\0" || u64 ndim || u64 dims...
               || u64 C || id(B[0:C]) || id(B[C:2C]) || ...)

where id is the chunk id of docs/FORMAT.md (BLAKE3 over "ckvc-chunk\\0" and the
bytes) and the integers are little-endian. A commit's tensors are split at the
blob's chunk size, which is the repository's ``chunk_size`` (4 MiB by default)
rounded down to whole elements; ``manifest_of`` takes the same ``chunk_size``."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import blake3

from ckvc import graph
from ckvc.chunking import DEFAULT_CHUNK_SIZE
from ckvc.codecs.policy import chunk_size_for
from ckvc.core import Repository
from ckvc.errors import InvalidInputError
from ckvc.ids import ObjectType, object_id

if TYPE_CHECKING:
    from ckvc.objects import Snapshot
    from ckvc.state import TensorInfo

MANIFEST_TAG = b"ckvc-manifest-v1\x00"
# Live tensors are hashed this many bytes at a time (a CUDA tensor is copied to the host in such pieces).
COPY_PIECE = 64 << 20


@dataclass(frozen=True)
class ManifestEntry:
    path: str
    dtype: str  # as blobs name it: "float32", "bfloat16", "numpy:<f8"
    shape: tuple[int, ...]
    nbytes: int
    chunk_size: int
    hash: str  # hex

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape)}


def tensor_hash(dtype: str, shape: tuple[int, ...], chunk_size: int, chunk_ids: Iterator[bytes] | list[bytes]) -> str:
    h = blake3.blake3(MANIFEST_TAG)
    h.update(dtype.encode() + b"\x00")
    h.update(struct.pack(f"<{1 + len(shape)}Q", len(shape), *shape))
    h.update(struct.pack("<Q", chunk_size))
    for oid in chunk_ids:
        h.update(oid)
    return h.hexdigest()


def _whole_blob(info: TensorInfo, snapshot: Snapshot) -> bool:
    """The leaf is its blob's bytes, all of them, in order: its hash needs no read."""
    from ckvc import state as state_mod

    blob = snapshot.blobs[info.blob]
    return info.offset == 0 and info.stride is None and info.numel * state_mod.blob_itemsize(blob.dtype) == blob.nbytes


def manifest(core: Repository, commit_id: str) -> list[ManifestEntry]:
    """Every tensor of the commit, in state order, hashed from its chunk ids. A tensor
    that is a view into a larger buffer (shared storage) is read and hashed."""
    from ckvc import inspect
    from ckvc import state as state_mod
    from ckvc.state import TensorInfo

    commit = core.read_commit(commit_id)
    graph.check_not_pruned(core, commit.id)
    snapshot = core.read_snapshot(commit)
    leaves = state_mod.flatten(state_mod.parse_snapshot(snapshot, commit.id, allow_pickle=None).build())
    out = []
    for path, leaf in leaves.items():
        if not isinstance(leaf, TensorInfo):
            continue
        blob = snapshot.blobs[leaf.blob]
        if _whole_blob(leaf, snapshot):
            digest = tensor_hash(blob.dtype, leaf.shape, blob.chunk_size, list(blob.chunks))
            out.append(ManifestEntry(path, blob.dtype, leaf.shape, blob.nbytes, blob.chunk_size, digest))
        else:
            value = inspect.load_tensor(core, commit, snapshot, leaf)
            out.append(_entry(path, value, blob.chunk_size))
    return out


def _bytes_of(value: Any) -> tuple[str, tuple[int, ...], int, Iterator[memoryview]]:
    """(dtype name, shape, itemsize, the C-order bytes in pieces) of a tensor or array."""
    import numpy as np
    import torch

    from ckvc.state import NUMPY_DTYPE_PREFIX, dtype_name

    if isinstance(value, torch.Tensor):
        t = value.detach()
        flat = t.contiguous().reshape(-1) if t.device.type == "cpu" else t.reshape(-1)
        itemsize = t.element_size()
        step = max(1, COPY_PIECE // max(1, itemsize))

        def pieces() -> Iterator[memoryview]:
            for start in range(0, flat.numel(), step):
                part = flat[start : start + step]
                if part.device.type != "cpu":
                    part = part.cpu()
                yield part.contiguous().view(torch.uint8).numpy().data

        return dtype_name(t.dtype), tuple(t.shape), itemsize, pieces()
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        return (
            NUMPY_DTYPE_PREFIX + arr.dtype.str,
            tuple(arr.shape),
            arr.dtype.itemsize,
            iter([arr.reshape(-1).view(np.uint8).data]),
        )
    raise InvalidInputError(f"not a tensor or numpy array: {type(value).__name__}")


def _entry(path: str, value: Any, chunk_size: int) -> ManifestEntry:
    dtype, shape, itemsize, pieces = _bytes_of(value)
    size = chunk_size_for(chunk_size, itemsize)
    ids: list[bytes] = []
    pending = bytearray()
    total = 0
    for piece in pieces:
        total += len(piece)
        pending += piece
        while len(pending) >= size:
            ids.append(object_id(ObjectType.CHUNK, memoryview(pending)[:size]))
            del pending[:size]
    if pending:  # the last, short chunk; an empty tensor has none (as chunk_spans)
        ids.append(object_id(ObjectType.CHUNK, pending))
    return ManifestEntry(path, dtype, shape, total, size, tensor_hash(dtype, shape, size, ids))


def manifest_of(state: Any, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[ManifestEntry]:
    """The manifest of a live state (nested dicts and lists of tensors and numpy
    arrays, as ``repo.commit`` takes), for ``chunk_size`` (the repository's; 4 MiB by
    default): equal hashes mean equal dtype, shape and bytes."""
    from ckvc import state as state_mod

    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise InvalidInputError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    import numpy as np
    import torch

    leaves = state_mod.flatten(state)
    return [
        _entry(path, value, chunk_size)
        for path, value in leaves.items()
        if isinstance(value, torch.Tensor | np.ndarray)
    ]
