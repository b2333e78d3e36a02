"""A state -> (an encoded value tree, the raw bytes of its tensors as
:class:`PendingBlob`), without pickle unless allowed. Tensors that share one
storage (tied weights, views of one buffer) share one blob."""

from __future__ import annotations

import collections
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from ckvc.errors import (
    UnsupportedTypeError,
)
from ckvc.state.parse import join_path
from ckvc.state.tables import (
    EXT_BIGINT,
    EXT_DEVICE,
    EXT_DTYPE,
    EXT_FILE,
    EXT_NPSCALAR,
    EXT_ODICT,
    EXT_PICKLE,
    EXT_SIZE,
    EXT_TENSOR,
    EXT_TUPLE,
    INT64_MIN,
    KIND_NUMPY,
    KIND_PARAMETER,
    KIND_TENSOR,
    MAX_DEPTH,
    MAX_SHARED_SPAN_OVERHEAD,
    NUMPY_DTYPE_PREFIX,
    NUMPY_KINDS,
    TORCH_DTYPE_NAMES,
    UINT64_MAX,
    PendingBlob,
    StoredFile,
    caller_stacklevel,
    dtype_name,
    is_utf8,
)


class _File(list[Any]):
    """Marker: [content, as_bytes, layout] becomes EXT_FILE."""


class _Tuple(list[Any]):
    """Marker during encoding: becomes EXT_TUPLE once tensor nodes are complete."""


class _ODict(dict[Any, Any]):
    """Marker during encoding: becomes EXT_ODICT."""


class _TensorNode(list[Any]):
    """Marker: [blob, shape, stride|None, offset, kind, device, requires_grad]."""


@dataclass
class _TensorUse:
    path: str
    tensor: torch.Tensor
    node: _TensorNode  # its blob, stride and offset are filled in by assign_blobs


# Dtypes NumPy holds as they are: their bytes come through .numpy() directly,
# a third of the cost of a uint8 view first (which the rest need).
_NUMPY_VIEWABLE = frozenset(
    (torch.float64, torch.float32, torch.float16, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
     torch.bool, torch.complex64, torch.complex128)
)  # fmt: skip


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    if t.dtype in _NUMPY_VIEWABLE and t.dim() and t.numel():
        return t.numpy().data.cast("B")
    flat = t.reshape(-1)
    if flat.dtype.itemsize:
        flat = flat.view(torch.uint8)
    return flat.numpy().data.cast("B")


def _to_host(t: torch.Tensor, pin: bool) -> tuple[torch.Tensor, bool]:
    """``t`` as a contiguous CPU tensor, and whether that is a private copy (memory
    no caller tensor shares). With ``pin`` a CUDA tensor is copied into pinned
    (page-locked) host memory without blocking; the caller synchronizes before
    reading it (``_Encoder.assign_blobs`` does)."""
    if pin and t.device.type == "cuda" and torch.cuda.is_available():
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host, True
    on_cpu = t.device.type == "cpu"
    host = t.contiguous() if on_cpu else t.to("cpu").contiguous()
    shared = on_cpu and host.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    return host, not shared


class _Encoder:
    def __init__(self, allow_pickle: bool, pin_memory: bool = False) -> None:
        self.allow_pickle = allow_pickle
        self.pin_memory = pin_memory
        self.pickled = False
        self.blobs: list[PendingBlob] = []
        self.tensor_uses: list[_TensorUse] = []
        self.has_files = False  # a file node (ext 10) was written: format version 3

    def encode(self, value: Any, path: str, depth: int = 0) -> Any:
        """``depth``: how many containers enclose ``value``."""
        t = type(value)
        if value is None or t in (bool, bytes, float):
            return value
        if depth >= MAX_DEPTH and t in (list, tuple, dict, collections.OrderedDict):
            raise UnsupportedTypeError(path, f"the state nests containers deeper than {MAX_DEPTH} levels")
        if t is str:
            return value if is_utf8(value) else self._fallback(value, path, "string is not valid UTF-8")
        if t is int:
            if INT64_MIN <= value <= UINT64_MAX:
                return value
            return msgpack.ExtType(EXT_BIGINT, value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True))
        if t is list:
            return [self.encode(v, join_path(path, i), depth + 1) for i, v in enumerate(value)]
        if t is tuple:
            return _Tuple(self.encode(v, join_path(path, i), depth + 1) for i, v in enumerate(value))
        if t is dict or t is collections.OrderedDict:
            encoded = {}
            for k, v in value.items():
                if not ((type(k) is str and is_utf8(k)) or (type(k) is int and INT64_MIN <= k <= UINT64_MAX)):
                    return self._fallback(value, path, f"dict key {k!r:.50} is not a UTF-8 str or a 64-bit int")
                encoded[k] = self.encode(v, join_path(path, k), depth + 1)
            return encoded if t is dict else _ODict(encoded)
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if t is StoredFile:
            self.has_files = True
            # Content first: its tensors give shared blobs their path (delta bases).
            content = self.encode(value.content, path, depth + 1)
            return _File([content, value.as_bytes, self.encode(value.layout, path + "/layout", depth + 1)])
        if t is np.ndarray:
            return self._ndarray(value, path)
        if isinstance(value, np.generic) and value.dtype.kind in NUMPY_KINDS:
            return msgpack.ExtType(EXT_NPSCALAR, _pack([value.dtype.str, value.tobytes()]))
        if t is torch.dtype:
            if value not in TORCH_DTYPE_NAMES:
                return self._fallback(value, path, f"unsupported dtype {value}")
            return msgpack.ExtType(EXT_DTYPE, TORCH_DTYPE_NAMES[value].encode())
        if t is torch.device:
            return msgpack.ExtType(EXT_DEVICE, str(value).encode())
        if t is torch.Size:
            return msgpack.ExtType(EXT_SIZE, _pack(list(value)))
        return self._fallback(value, path, f"type {t.__module__}.{t.__qualname__} is not supported")

    def _fallback(self, value: Any, path: str, why: str) -> Any:
        if not self.allow_pickle:
            raise UnsupportedTypeError(path, why + " (commit with allow_pickle=True to pickle it)")
        try:
            data = pickle.dumps(value, protocol=5)
        except Exception as exc:
            raise UnsupportedTypeError(path, f"{why}, and pickling failed: {exc}") from None
        warnings.warn(f"ckvc: pickling the value at {path or '<root>'} ({why})", stacklevel=caller_stacklevel())
        self.pickled = True
        return msgpack.ExtType(EXT_PICKLE, data)

    def _tensor(self, value: torch.Tensor, path: str) -> Any:
        kind = KIND_PARAMETER if type(value) is torch.nn.Parameter else KIND_TENSOR
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            return self._fallback(value, path, f"tensor subclass {type(value).__qualname__} is not supported")
        if value.layout != torch.strided or value.is_quantized or value.is_nested or value.is_meta:
            return self._fallback(value, path, f"{value.layout} / quantized / nested / meta tensors are not supported")
        if value.dtype not in TORCH_DTYPE_NAMES:
            return self._fallback(value, path, f"unsupported dtype {value.dtype}")
        t = value.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        node = _TensorNode([None, list(t.shape), None, 0, kind, str(value.device), bool(value.requires_grad)])
        self.tensor_uses.append(_TensorUse(path, t, node))
        return node

    def _ndarray(self, value: np.ndarray, path: str) -> Any:
        if value.dtype.kind not in NUMPY_KINDS or value.dtype.fields is not None:
            return self._fallback(value, path, f"numpy dtype {value.dtype} is not supported")
        arr = np.ascontiguousarray(value)
        index = len(self.blobs)
        data = arr.reshape(-1).view(np.uint8).data.cast("B") if arr.size else memoryview(b"")
        self.blobs.append(PendingBlob(NUMPY_DTYPE_PREFIX + arr.dtype.str, arr.dtype.itemsize, data, path, arr))
        # value.shape, not arr.shape: ascontiguousarray turns 0-d arrays into 1-d.
        return _TensorNode([index, list(value.shape), None, 0, KIND_NUMPY, "cpu", False])

    def assign_blobs(self) -> None:
        """Give every tensor use a blob: one per storage, shared where views overlap."""
        groups: dict[tuple[int, str], list[_TensorUse]] = {}
        for use in self.tensor_uses:
            t = use.tensor
            storage = t.untyped_storage()
            if t.numel() == 0 or storage.nbytes() == 0:
                groups[(id(use), "solo")] = [use]
            else:
                groups.setdefault((storage.data_ptr(), str(t.device)), []).append(use)
        for uses in groups.values():
            if len(uses) > 1 and self._share(uses):
                continue
            for use in uses:
                self._store_alone(use)
        on_gpu = any(u.tensor.device.type == "cuda" for u in self.tensor_uses)
        if self.pin_memory and on_gpu and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies into pinned memory have landed

    def _store_alone(self, use: _TensorUse) -> None:
        t, private = _to_host(use.tensor, self.pin_memory)
        index = len(self.blobs)
        self.blobs.append(PendingBlob(dtype_name(t.dtype), t.dtype.itemsize, _bytes_of(t), use.path, t, private))
        use.node[0] = index

    def _share(self, uses: list[_TensorUse]) -> bool:
        """Store one span for views of one storage. False when not worth it."""
        dtype = uses[0].tensor.dtype
        if any(u.tensor.dtype != dtype for u in uses) or dtype.itemsize == 0:
            return False
        views = {(u.tensor.storage_offset(), tuple(u.tensor.shape), u.tensor.stride()) for u in uses}
        if len(views) == 1 and uses[0].tensor.is_contiguous():
            # Identical contiguous views (tied weights): one blob, plain shapes.
            self._store_alone(uses[0])
            for u in uses[1:]:
                u.node[0] = uses[0].node[0]
            return True
        starts, ends, covered = [], [], 0
        for offset, shape, stride in views:
            starts.append(offset)
            ends.append(offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)))
            covered += int(np.prod(shape))
        lo, hi = min(starts), max(ends)
        if hi - lo > MAX_SHARED_SPAN_OVERHEAD * covered:
            return False
        base = uses[0].tensor
        span = torch.empty(0, dtype=dtype, device=base.device).set_(base.untyped_storage(), lo, (hi - lo,), (1,))
        span, private = _to_host(span, self.pin_memory)
        index = len(self.blobs)
        self.blobs.append(PendingBlob(dtype_name(dtype), dtype.itemsize, _bytes_of(span), uses[0].path, span, private))
        for u in uses:
            u.node[0] = index
            u.node[2] = list(u.tensor.stride())
            u.node[3] = u.tensor.storage_offset() - lo
        return True


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True, use_single_float=False)


def _wire(value: Any) -> Any:
    """Turn encoding markers into msgpack extension types, innermost first."""
    t = type(value)
    if t is list:
        return [_wire(v) for v in value]
    if t is dict:
        return {k: _wire(v) for k, v in value.items()}
    if t is _Tuple:
        return msgpack.ExtType(EXT_TUPLE, _pack([_wire(v) for v in value]))
    if t is _ODict:
        return msgpack.ExtType(EXT_ODICT, _pack({k: _wire(v) for k, v in value.items()}))
    if t is _TensorNode:
        return msgpack.ExtType(EXT_TENSOR, _pack(list(value)))
    if t is _File:
        # The layout is packed on its own so that a plain load skips it unparsed.
        return msgpack.ExtType(EXT_FILE, _pack([_wire(value[0]), value[1], _pack(_wire(value[2]))]))
    return value


class EncodedState(NamedTuple):
    tree: bytes
    blobs: list[PendingBlob]
    pickled: bool
    has_files: bool  # holds file nodes (ext 10), which need format version 3


def encode_state(state: Any, *, allow_pickle: bool = False, pin_memory: bool = False) -> EncodedState:
    """The encoded tree, its blobs, whether anything was pickled and whether it
    holds file nodes. Raises UnsupportedTypeError
    naming the path of the first value it cannot store. ``pin_memory``: copy CUDA
    tensors into pinned host memory (when CUDA is available), for async commits."""
    encoder = _Encoder(allow_pickle, pin_memory)
    markers = encoder.encode(state, "")
    encoder.assign_blobs()
    return EncodedState(_pack(_wire(markers)), encoder.blobs, encoder.pickled, encoder.has_files)
