"""Tensor nodes made from their blobs' buffers: :class:`BlobViews`, the one place
that makes each node once from a buffer placed once (tensors sharing a blob come
back sharing memory), with two makers on top: torch tensors (ckvc.state.decode's
TensorMaker) and NumPy arrays (:class:`ArrayMaker`, no torch imported; bfloat16
and float8 through ``ml_dtypes``), for ckvc.numpy and ckvc.jax."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ckvc.errors import CorruptObjectError, InsufficientMemoryError, InvalidInputError
from ckvc.state.parse import TensorInfo
from ckvc.state.tables import KIND_NUMPY, NUMPY_DTYPE_PREFIX, blob_itemsize

# Torch dtype names with the same name and bytes in NumPy.
_NUMPY_NATIVE = {
    "float64", "float32", "float16", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128",
}  # fmt: skip
# Torch dtype names whose NumPy dtype ml_dtypes provides under the same name.
_ML_DTYPES = {"bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"}


@functools.lru_cache(maxsize=64)
def numpy_dtype(name: str) -> np.dtype[Any]:
    """The NumPy dtype of a blob dtype name (a torch name or "numpy:" + dtype.str).
    InvalidInputError for a torch dtype NumPy has no match for (complex32,
    float4_e2m1fn_x2), or one that needs ``ml_dtypes`` when it is not installed."""
    if name.startswith(NUMPY_DTYPE_PREFIX):
        return np.dtype(name[len(NUMPY_DTYPE_PREFIX) :])
    if name in _NUMPY_NATIVE:
        return np.dtype(name)
    if name in _ML_DTYPES:
        try:
            import ml_dtypes
        except ImportError:
            raise InvalidInputError(
                f"{name} arrays need the ml_dtypes package: pip install 'ckvc[jax]' (or ml_dtypes)"
            ) from None
        if not hasattr(ml_dtypes, name):
            raise InvalidInputError(f"{name} arrays need a newer ml_dtypes (this one is {ml_dtypes.__version__})")
        return np.dtype(getattr(ml_dtypes, name))
    raise InvalidInputError(f"torch dtype {name} has no NumPy equivalent; load it with ckvc's torch API")


class BlobViews:
    """Tensor nodes made from their blobs' flat CPU buffers as loading makes them:
    each buffer asked for once (``base_of(blob)`` returns it and the element of the
    blob it starts at, None when it holds the whole blob), placed once per
    recorded device, each node made once. Subclasses say how to place and make."""

    def __init__(self, base_of: Callable[[int], tuple[Any, int | None]]) -> None:
        self._base_of = base_of
        self._bases: dict[int, tuple[Any, int | None]] = {}
        self._placed: dict[tuple[int, str], Any] = {}
        self._made: dict[TensorInfo, Any] = {}

    def place(self, base: Any, recorded: str) -> Any:
        return base

    def make(self, info: TensorInfo, base: Any) -> Any:
        raise NotImplementedError

    def __call__(self, info: TensorInfo) -> Any:
        made = self._made.get(info)
        if made is not None:
            return made
        if info.blob not in self._bases:
            self._bases[info.blob] = self._base_of(info.blob)
        base, first = self._bases[info.blob]
        key = (info.blob, info.device)
        if key not in self._placed:
            self._placed[key] = self.place(base, info.device)
        placed = self._placed[key]
        local = info
        if first is not None:  # a part of the blob: offsets relative to it
            if info.stride is not None:
                local = dataclasses.replace(info, offset=info.offset - first if info.numel else 0)
            elif info.numel == 0:
                placed = placed[:0]  # an empty tensor next to others in one blob (not written so, but harmless)
        made = self.make(local, placed)
        self._made[info] = made
        return made


def allocate_array(dtype: str, nbytes: int) -> tuple[np.ndarray, memoryview]:
    """A flat, uninitialised buffer for a blob as a NumPy array of its dtype, and a
    writable byte view of it (ckvc.state.decode.allocate_blob without torch)."""
    itemsize = blob_itemsize(dtype)
    if nbytes % itemsize:
        raise CorruptObjectError(f"blob of {nbytes} bytes cannot hold {dtype}")
    as_dtype = numpy_dtype(dtype)
    try:
        raw = np.empty(nbytes, dtype=np.uint8)
    except MemoryError:
        raise InsufficientMemoryError(f"cannot allocate {nbytes} bytes for a {dtype} blob") from None
    return raw.view(as_dtype), raw.data.cast("B")


class ArrayMaker(BlobViews):
    """NumPy arrays of tensor nodes: torch tensors come back as arrays of the same
    dtype, shape and strides (views of one buffer where they shared storage),
    NumPy nodes as they were committed. Devices are ignored: arrays live on the host."""

    def make(self, info: TensorInfo, base: Any) -> Any:
        if not isinstance(base, np.ndarray):
            raise CorruptObjectError("tensor node does not match its blob")
        if info.kind == KIND_NUMPY or info.stride is None:
            if base.size != info.numel:
                raise CorruptObjectError(
                    f"tensor of shape {list(info.shape)} does not match its blob of {base.size} elements"
                )
            return base.reshape(info.shape)
        if info.numel:
            last = info.offset + sum((n - 1) * s for n, s in zip(info.shape, info.stride, strict=True))
            if last >= base.size:
                raise CorruptObjectError("tensor view reaches past its blob")
        item = base.itemsize
        return np.lib.stride_tricks.as_strided(
            base[info.offset :] if info.numel else base[:0],
            shape=info.shape,
            strides=tuple(s * item for s in info.stride),
            writeable=True,
        )
