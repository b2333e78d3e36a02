"""An encoded value tree -> its state: parsed by the one validating parser
(ckvc.state.parse), then the tensors made from their blobs, each blob placed once
per device, so tensors that shared storage share it again. Reading chunks lives
in ckvc.read."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ckvc.errors import CorruptObjectError, InsufficientMemoryError
from ckvc.objects import Blob
from ckvc.state.arrays import BlobViews
from ckvc.state.parse import ParsedTree, TensorInfo, parse_tree
from ckvc.state.tables import (
    KIND_NUMPY,
    KIND_PARAMETER,
    NUMPY_DTYPE_PREFIX,
    MapLocation,
    blob_itemsize,
    torch_dtype,
)


def _device_available(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    if device.type == "mps":
        return bool(torch.backends.mps.is_available())
    return False


_warned_devices: set[str] = set()


def _target_device(recorded: str, map_location: MapLocation) -> torch.device:
    """Where a tensor saved on ``recorded`` goes, following torch.load's rules for
    str, torch.device and dict map_location (callables are handled by the caller).
    With no map_location a tensor returns to its recorded device, or to the CPU
    (with a warning) when that device is not present."""
    if isinstance(map_location, dict):
        recorded_mapped = map_location.get(recorded, recorded)
        return _target_device(recorded_mapped, None)
    if map_location is not None and not callable(map_location):
        return torch.device(map_location)
    device = torch.device(recorded)
    if _device_available(device):
        return device
    if recorded not in _warned_devices:
        _warned_devices.add(recorded)
        warnings.warn(
            f"ckvc: tensors saved on {recorded} are loaded on the CPU ({recorded} is not available)", stacklevel=3
        )
    return torch.device("cpu")


def materialize(info: TensorInfo, base: torch.Tensor | np.ndarray) -> Any:
    """The tensor (or numpy array) ``info`` describes, as a view of its blob."""
    if info.kind == KIND_NUMPY:
        if not isinstance(base, np.ndarray) or base.size != info.numel:
            raise CorruptObjectError("numpy node does not match its blob")
        return base.reshape(info.shape)
    if not isinstance(base, torch.Tensor):
        raise CorruptObjectError("tensor node refers to a numpy blob")
    if info.stride is None:
        if base.numel() != info.numel:
            raise CorruptObjectError(
                f"tensor of shape {list(info.shape)} does not match its blob of {base.numel()} elements"
            )
        out = base.view(info.shape)
    else:
        if info.numel:
            last = info.offset + sum((n - 1) * s for n, s in zip(info.shape, info.stride, strict=True))
            if last >= base.numel():
                raise CorruptObjectError("tensor view reaches past its blob")
        out = base.as_strided(info.shape, info.stride, info.offset)
    if info.kind == KIND_PARAMETER:
        return torch.nn.Parameter(out, requires_grad=info.requires_grad)
    if info.requires_grad:
        out.requires_grad_(True)
    return out


def decode_state(
    tree: bytes,
    load_blob: Callable[[int], torch.Tensor | np.ndarray],
    *,
    allow_pickle: bool = False,
    map_location: MapLocation = None,
    blobs: Sequence[Blob] | None = None,
    files: bool = False,
) -> Any:
    """Rebuild the state from its encoded tree. ``load_blob(index)`` returns the
    blob as a flat CPU tensor (or numpy array) of its dtype; each blob is loaded
    at most once. Tensors sharing a blob come back sharing storage. With
    ``blobs`` every tensor node is checked against its blob first. ``files``: file
    nodes come back as StoredFile (content and layout) instead of their content."""
    parsed = parse_tree(tree, blobs, allow_pickle=allow_pickle, files=files)
    return build_state(parsed, load_blob, map_location=map_location)


def build_state(
    parsed: ParsedTree, load_blob: Callable[[int], torch.Tensor | np.ndarray], *, map_location: MapLocation = None
) -> Any:
    """The state of a parsed tree, its tensors made from the blobs ``load_blob`` returns."""
    return parsed.build(TensorMaker(lambda index: (load_blob(index), None), map_location))


class TensorMaker(BlobViews):
    """Tensors (or numpy arrays) of tensor nodes, made from their blobs' buffers as
    loading makes them (BlobViews), each buffer placed once per recorded device
    following ``map_location``, so tensors that share a blob come back sharing
    storage. Used by build_state and ckvc.read."""

    def __init__(
        self, base_of: Callable[[int], tuple[torch.Tensor | np.ndarray, int | None]], map_location: MapLocation
    ) -> None:
        super().__init__(base_of)
        self._map_location = map_location

    def place(self, base: Any, recorded: str) -> Any:
        return place(base, recorded, self._map_location)

    def make(self, info: TensorInfo, base: Any) -> Any:
        return materialize(info, base)


def place(base: Any, recorded: str, map_location: MapLocation) -> Any:
    """Move a loaded CPU blob to where ``map_location`` sends a tensor saved on ``recorded``."""
    if not isinstance(base, torch.Tensor):
        return base
    if callable(map_location) and not isinstance(map_location, dict):
        moved = map_location(base.untyped_storage(), recorded)
        if isinstance(moved, torch.UntypedStorage):
            return torch.empty(0, dtype=base.dtype, device=moved.device).set_(moved, 0, (base.numel(),), (1,))
        return moved if isinstance(moved, torch.Tensor) else base
    target = _target_device(recorded, map_location)
    return base if target.type == "cpu" else base.to(target)


def allocate_blob(dtype: str, nbytes: int) -> tuple[torch.Tensor | np.ndarray, memoryview]:
    """A flat, uninitialised CPU buffer for a blob, and a writable byte view of it.
    InsufficientMemoryError when the machine cannot hold it (never a bare MemoryError)."""
    itemsize = blob_itemsize(dtype)
    if nbytes % itemsize:
        raise CorruptObjectError(f"blob of {nbytes} bytes cannot hold {dtype}")
    try:
        if dtype.startswith(NUMPY_DTYPE_PREFIX):
            raw = np.empty(nbytes, dtype=np.uint8)
            return raw.view(np.dtype(dtype[len(NUMPY_DTYPE_PREFIX) :])), raw.data.cast("B")
        raw_t = torch.empty(nbytes, dtype=torch.uint8)
    except (MemoryError, RuntimeError):  # torch's allocator raises RuntimeError
        raise InsufficientMemoryError(f"cannot allocate {nbytes} bytes for a {dtype} blob") from None
    return raw_t.view(torch_dtype(dtype)), raw_t.numpy().data.cast("B")
