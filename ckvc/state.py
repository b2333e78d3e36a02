"""Training state <-> (value tree, tensor byte buffers), without pickle.

A state is a nested structure of dicts, lists, tuples, tensors, numpy arrays and
plain Python values. :func:`encode_state` turns it into an encoded *tree* (msgpack
with the extension types below) plus a list of :class:`PendingBlob`: the raw
bytes of every tensor, to be chunked and stored. :func:`decode_state` reverses it.

Tensors that share one storage (tied weights, views of one buffer) share one blob,
and are restored sharing one storage again.

Over 600 lines on purpose: the encoder, the one validating tree parser and the
tensor making share the format's extension codes, dtype tables and node checks
(docs/FORMAT.md §10); reading chunks lives in ckvc.read.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib
import math
import pickle
import random
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from ckvc.chunking import MAX_CHUNK_SIZE
from ckvc.errors import (
    CkvcError,
    CorruptObjectError,
    InsufficientMemoryError,
    UnsafeContentError,
    UnsupportedTypeError,
)
from ckvc.objects import Blob, Snapshot

# msgpack extension type codes used in the tree (docs/FORMAT.md, "Value tree").
EXT_TUPLE = 1
EXT_BIGINT = 2
EXT_DTYPE = 3
EXT_TENSOR = 4
EXT_NPSCALAR = 5
EXT_PICKLE = 6
EXT_DEVICE = 7
EXT_SIZE = 8
EXT_ODICT = 9
EXT_FILE = 10  # a file's content plus how to rebuild its exact bytes (ckvc.formats)

# Tensor node kinds.
KIND_TENSOR = 0
KIND_PARAMETER = 1
KIND_NUMPY = 2

NUMPY_DTYPE_PREFIX = "numpy:"

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16",
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2",
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "bool", "complex32", "complex64", "complex128",
    )
    if hasattr(torch, name)
}  # fmt: skip
_TORCH_DTYPE_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}
# Numpy kinds with a fixed-size, pointer-free representation.
_NUMPY_KINDS = set("biufcSUmM")
_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1
_INT64_MAX = (1 << 63) - 1
# The deepest nesting of containers (dict, list, tuple, OrderedDict) a state may
# have (docs/FORMAT.md §10.8): refused at commit, and a stored tree that nests
# deeper is corrupt. Keeps every walk over a tree (ours and the caller's) far from
# Python's recursion limit.
MAX_DEPTH = 128
# A span shared by several views is stored once only while it is no larger than
# this many times the bytes the views cover; beyond that each view is stored alone.
_MAX_SHARED_SPAN_OVERHEAD = 2

# The stdlib's gc, imported by name: mypy takes benchmarks/gc.py for it.
_gc: Any = importlib.import_module("gc")

MapLocation = None | str | torch.device | dict[str, str] | Callable[[Any, str], Any]


@dataclass
class PendingBlob:
    """Bytes of one tensor or shared storage span, ready to be chunked."""

    dtype: str  # a torch dtype name ("float32") or "numpy:" + numpy dtype.str
    itemsize: int
    data: memoryview  # contiguous bytes (format "B")
    path: str  # the first state path that uses it, for messages and delta bases
    owner: Any  # keeps the memory behind ``data`` alive
    private: bool = False  # ``data`` is a copy made here, shared with no caller tensor


@dataclass
class StoredFile:
    """A file of a committed file or directory (ckvc.formats): ``content`` is what
    ``load`` returns (tensors, bytes, a link's target); ``layout`` says how to rebuild
    the file's exact bytes and mode, read only by :func:`decode_state` with
    ``files=True``. Encoded as ext 10 (docs/FORMAT.md, 10.7)."""

    content: Any
    layout: dict[str, Any]
    as_bytes: bool = False  # content is a uint8 array that ``load`` returns as bytes


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


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _TORCH_DTYPE_NAMES[dtype]
    except KeyError:
        raise KeyError(f"unsupported torch dtype {dtype}") from None


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
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
    host = t.to("cpu").contiguous()
    shared = host.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and t.device.type == "cpu"
    return host, not shared


def _caller_stacklevel() -> int:
    """The warnings stacklevel of the first frame outside ckvc, as seen from the
    function that calls warnings.warn (which calls this)."""
    frame = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("ckvc"):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def is_utf8(text: str) -> bool:
    """False for strings holding lone surrogates, which UTF-8 cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


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
            if _INT64_MIN <= value <= _UINT64_MAX:
                return value
            return msgpack.ExtType(EXT_BIGINT, value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True))
        if t is list:
            return [self.encode(v, _join(path, i), depth + 1) for i, v in enumerate(value)]
        if t is tuple:
            return _Tuple(self.encode(v, _join(path, i), depth + 1) for i, v in enumerate(value))
        if t is dict or t is collections.OrderedDict:
            encoded = {}
            for k, v in value.items():
                if not ((type(k) is str and is_utf8(k)) or (type(k) is int and _INT64_MIN <= k <= _UINT64_MAX)):
                    return self._fallback(value, path, f"dict key {k!r:.50} is not a UTF-8 str or a 64-bit int")
                encoded[k] = self.encode(v, _join(path, k), depth + 1)
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
        if isinstance(value, np.generic) and value.dtype.kind in _NUMPY_KINDS:
            return msgpack.ExtType(EXT_NPSCALAR, _pack([value.dtype.str, value.tobytes()]))
        if t is torch.dtype:
            if value not in _TORCH_DTYPE_NAMES:
                return self._fallback(value, path, f"unsupported dtype {value}")
            return msgpack.ExtType(EXT_DTYPE, _TORCH_DTYPE_NAMES[value].encode())
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
        warnings.warn(f"ckvc: pickling the value at {path or '<root>'} ({why})", stacklevel=_caller_stacklevel())
        self.pickled = True
        return msgpack.ExtType(EXT_PICKLE, data)

    def _tensor(self, value: torch.Tensor, path: str) -> Any:
        kind = KIND_PARAMETER if type(value) is torch.nn.Parameter else KIND_TENSOR
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            return self._fallback(value, path, f"tensor subclass {type(value).__qualname__} is not supported")
        if value.layout != torch.strided or value.is_quantized or value.is_nested or value.is_meta:
            return self._fallback(value, path, f"{value.layout} / quantized / nested / meta tensors are not supported")
        if value.dtype not in _TORCH_DTYPE_NAMES:
            return self._fallback(value, path, f"unsupported dtype {value.dtype}")
        t = value.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        node = _TensorNode([None, list(t.shape), None, 0, kind, str(value.device), bool(value.requires_grad)])
        self.tensor_uses.append(_TensorUse(path, t, node))
        return node

    def _ndarray(self, value: np.ndarray, path: str) -> Any:
        if value.dtype.kind not in _NUMPY_KINDS or value.dtype.fields is not None:
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
            if t.numel() == 0 or t.untyped_storage().nbytes() == 0:
                groups[(id(use), "solo")] = [use]
            else:
                groups.setdefault((t.untyped_storage().data_ptr(), str(t.device)), []).append(use)
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
        if hi - lo > _MAX_SHARED_SPAN_OVERHEAD * covered:
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


def _unpack_shallow(data: bytes) -> Any:
    """One msgpack value with its extension values left undecoded (as _Ext): the C
    decoder is never re-entered from its own hook, so a deep tree costs no C stack
    (re-entering it once per level overflowed the stack at ~195 levels)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True, ext_hook=_Ext)


def _unpack_plain(data: bytes) -> Any:
    """An extension payload that holds no extension values (tensor node, size, numpy scalar)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)


class _Ext:
    """An extension value whose payload is not decoded yet."""

    __slots__ = ("code", "data")

    def __init__(self, code: int, data: bytes) -> None:
        self.code = code
        self.data = data


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


def _counts(values: list[Any]) -> bool:
    """Ints (not bools) in [0, 2^63): what torch accepts as sizes, strides and offsets."""
    return all(type(n) is int and 0 <= n <= _INT64_MAX for n in values)


@dataclass(frozen=True)
class TensorInfo:
    """A tensor node of the tree, before its bytes are loaded."""

    blob: int
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None  # None: contiguous over the whole blob
    offset: int
    kind: int
    device: str
    requires_grad: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # Python ints: numpy's int64 product wraps

    @classmethod
    def from_node(cls, node: Any) -> TensorInfo:
        ok = type(node) is list and len(node) == 7
        if ok:
            blob, shape, stride, offset, kind, device, requires_grad = node
            ok = (
                type(blob) is int
                and 0 <= blob <= _INT64_MAX
                and type(shape) is list
                and _counts(shape)
                and (stride is None or (type(stride) is list and len(stride) == len(shape) and _counts(stride)))
                and type(offset) is int
                and 0 <= offset <= _INT64_MAX
                and type(kind) is int
                and kind in (KIND_TENSOR, KIND_PARAMETER, KIND_NUMPY)
                and type(device) is str
                and type(requires_grad) is bool
            )
        if not ok:
            raise CorruptObjectError(f"malformed tensor node {node!r:.200}")
        info = cls(blob, tuple(shape), None if stride is None else tuple(stride), offset, kind, device, requires_grad)
        if len(shape) > 1 and info.numel > _INT64_MAX:
            raise CorruptObjectError(f"tensor of shape {shape} has more than 2^63 elements")
        return info


@dataclass(frozen=True)
class PickledValue:
    """Stands for a pickled value when a tree is described without unpickling."""

    nbytes: int


@functools.lru_cache(maxsize=256)
def blob_itemsize(dtype: str) -> int:
    """Bytes per element of a blob dtype string (docs/FORMAT.md §10.5);
    CorruptObjectError for one this reader does not know or allow."""
    if dtype.startswith(NUMPY_DTYPE_PREFIX):
        try:
            np_dtype = np.dtype(dtype[len(NUMPY_DTYPE_PREFIX) :])
        except Exception:
            raise CorruptObjectError(f"unknown dtype {dtype!r:.100}") from None
        if np_dtype.kind not in _NUMPY_KINDS or np_dtype.fields is not None or not np_dtype.itemsize:
            raise CorruptObjectError(f"numpy dtype {dtype!r:.100} is not allowed in a blob")
        return int(np_dtype.itemsize)
    try:
        return _TORCH_DTYPES[dtype].itemsize
    except KeyError:
        raise CorruptObjectError(f"unknown dtype {dtype!r:.100}") from None


def check_blob(blob: Blob) -> int:
    """A blob's own consistency (dtype, size, chunk size), before anything is
    allocated for it; returns its itemsize. CorruptObjectError naming the blob's path."""
    try:
        itemsize = blob_itemsize(blob.dtype)
    except CorruptObjectError as exc:
        raise exc.with_context(tensor=blob.path) from None
    if blob.nbytes % itemsize or blob.nbytes > _INT64_MAX:
        raise CorruptObjectError(f"blob of {blob.nbytes} bytes cannot hold {blob.dtype}", tensor=blob.path)
    if blob.chunk_size > max(MAX_CHUNK_SIZE, itemsize):
        raise CorruptObjectError(f"blob chunk size {blob.chunk_size} is over the maximum", tensor=blob.path)
    return itemsize


@functools.lru_cache(maxsize=64)
def _device_ok(name: str) -> bool:
    try:
        torch.device(name)
    except Exception:
        return False
    return True


class _TensorChecker:
    """The checks a tensor node must pass against the snapshot's blobs before
    anything is allocated or read for it (docs/FORMAT.md §10.3, 10.8)."""

    def __init__(self, blobs: Sequence[Blob]) -> None:
        self.blobs = blobs
        # Per blob: (elements, is numpy, may require grad).
        self.facts: list[tuple[int, bool, bool]] = []
        for blob in blobs:
            itemsize = check_blob(blob)
            is_numpy = blob.dtype.startswith(NUMPY_DTYPE_PREFIX)
            grad = is_numpy or _TORCH_DTYPES[blob.dtype].is_floating_point or _TORCH_DTYPES[blob.dtype].is_complex
            self.facts.append((blob.nbytes // itemsize, is_numpy, grad))

    def check(self, info: TensorInfo) -> None:
        if info.blob >= len(self.facts):
            raise CorruptObjectError(f"tensor refers to blob {info.blob} of {len(self.facts)}")
        elements, is_numpy, grad = self.facts[info.blob]
        if is_numpy != (info.kind == KIND_NUMPY):
            kind = "numpy" if info.kind == KIND_NUMPY else "torch"
            raise CorruptObjectError(f"a {kind} node on a {self.blobs[info.blob].dtype} blob")
        if info.stride is None:
            if info.offset or info.numel != elements:
                raise CorruptObjectError(
                    f"tensor of shape {list(info.shape)} does not match its blob of {elements} elements"
                )
        elif is_numpy:
            raise CorruptObjectError("a numpy node with strides")
        elif info.numel and info.offset + sum((n - 1) * s for n, s in zip(info.shape, info.stride, strict=True)) >= (
            elements
        ):
            raise CorruptObjectError("tensor view reaches past its blob")
        if info.requires_grad and not grad:
            raise CorruptObjectError(f"a {self.blobs[info.blob].dtype} tensor cannot require grad")
        if not _device_ok(info.device):
            raise CorruptObjectError(f"unknown device {info.device!r:.50}")


def _render(path: tuple[Any, Any] | None) -> str:
    """A dotted state path ("optimizer.state.0") from its linked (parent, key) form."""
    parts = []
    while path is not None:
        path, key = path
        parts.append(str(key))
    return ".".join(reversed(parts)) or "<root>"


class ParsedTree:
    """A state tree read and checked by :func:`parse_tree`, tensors not loaded yet."""

    def __init__(self, holder: list[Any], slots: list[Any], finishers: list[Any]) -> None:
        self._holder = holder
        self._slots = slots  # (container, key, TensorInfo, path) per tensor node
        self._finishers = finishers  # (container, key, payload, type), innermost first

    def build(self, make_tensor: Callable[[TensorInfo], Any] | None = None) -> Any:
        """The state, each tensor node replaced by ``make_tensor(info)`` (by its
        TensorInfo when None). Call once: it fills the tree in place."""
        with _gc_paused():
            return self._build(make_tensor)

    def _build(self, make_tensor: Callable[[TensorInfo], Any] | None) -> Any:
        for container, key, info, path in self._slots:
            if make_tensor is None:
                container[key] = info
                continue
            try:
                container[key] = make_tensor(info)
            except CorruptObjectError as exc:
                raise exc.with_context(tensor=_render(path)) from None
            except CkvcError:
                raise
            except Exception as exc:  # torch refusing a view the checks let through
                raise CorruptObjectError(f"tensor cannot be built: {exc}", tensor=_render(path)) from None
        for container, key, payload, make in self._finishers:
            container[key] = make(payload)
        return self._holder[0]


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic collector off while a tree is read: a tree is tens of thousands of
    fresh objects, and the collections they trigger (each walking every live
    object) cost more than the reading itself. Restored only by whoever paused it."""
    was_enabled = _gc.isenabled()
    _gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            _gc.enable()


def parse_tree(
    tree: bytes, blobs: Sequence[Blob] | None, *, allow_pickle: bool | None, files: bool = False
) -> ParsedTree:
    """Read and check a state tree without recursion: at most MAX_DEPTH nested
    containers, str or int dict keys, known extension codes, well-formed tensor
    nodes and (with ``blobs``) every tensor node consistent with its blob. Pickled
    values are unpickled when allow_pickle is True, refused when False
    (UnsafeContentError), and PickledValue placeholders when None. Errors are
    CorruptObjectError naming the path. File nodes (ext 10) become their content,
    or with ``files`` a StoredFile with its layout read too. The one validator:
    load, views, show and fsck all read trees through it."""
    with _gc_paused():
        return _parse_tree(tree, blobs, allow_pickle, files)


def _file_value(node: list[Any], as_bytes: bool, files: bool) -> Any:
    """A file node's value once its content (and layout) are built: ``node`` is
    [content] or [content, layout]."""
    content = node[0]
    if as_bytes and isinstance(content, np.ndarray):
        content = content.tobytes()
    if not files:
        return content
    if not isinstance(node[1], dict):
        raise CorruptObjectError("file node's layout is not a map")
    return StoredFile(content, node[1], as_bytes)


def _parse_tree(tree: bytes, blobs: Sequence[Blob] | None, allow_pickle: bool | None, files: bool) -> ParsedTree:
    try:
        root = _unpack_shallow(tree)
    except Exception as exc:
        raise CorruptObjectError(f"malformed state tree: {exc}") from None
    checker = _TensorChecker(blobs) if blobs is not None else None
    holder = [root]
    slots: list[Any] = []
    finishers: list[Any] = []
    # Containers whose children are still to be read: (container, path, depth);
    # 4-tuples are finishers, queued once everything below them is done.
    stack: list[Any] = []

    def too_deep(path: Any) -> CorruptObjectError:
        return CorruptObjectError(f"state tree nests deeper than {MAX_DEPTH} levels at {_render(path)!r}")

    def take(container: Any, key: Any, value: _Ext, path: Any, depth: int) -> None:
        """An extension value: decoded, checked, and put in place (or queued)."""
        code = value.code
        if depth > MAX_DEPTH and code in (EXT_TUPLE, EXT_ODICT, EXT_FILE):
            raise too_deep(path)
        try:
            if code == EXT_TENSOR:
                info = TensorInfo.from_node(_unpack_plain(value.data))
                if checker is not None:
                    checker.check(info)
                slots.append((container, key, info, path))
            elif code in (EXT_TUPLE, EXT_ODICT):
                payload = _unpack_shallow(value.data)
                if type(payload) is not (list if code == EXT_TUPLE else dict):
                    raise CorruptObjectError(f"extension {code} holds a {type(payload).__name__}")
                stack.append((container, key, payload, tuple if code == EXT_TUPLE else collections.OrderedDict))
                stack.append((payload, path, depth))
            elif code == EXT_FILE:
                triple = _unpack_shallow(value.data)
                if type(triple) is not list or len(triple) != 3:
                    raise CorruptObjectError("malformed file node")
                content, as_bytes, layout = triple
                if type(as_bytes) is not bool or type(layout) is not bytes:
                    raise CorruptObjectError("malformed file node")
                if as_bytes and not (type(content) is _Ext and content.code == EXT_TENSOR):
                    raise CorruptObjectError("file node's bytes are not an array")
                # The node's parts are read like a list's items; the layout only when
                # asked for (a plain load skips it unparsed).
                node = [content, _unpack_shallow(layout)] if files else [content]
                stack.append((container, key, node, lambda n, b=as_bytes: _file_value(n, b, files)))
                stack.append((node, path, depth))
            else:
                container[key] = _leaf(code, value.data, allow_pickle)
        except CorruptObjectError as exc:
            if code == EXT_TENSOR:
                raise exc.with_context(tensor=_render(path)) from None
            raise CorruptObjectError(f"{exc.reason} at {_render(path)!r}") from None
        except CkvcError:
            raise
        except Exception as exc:
            raise CorruptObjectError(f"malformed value of extension type {code}: {exc} at {_render(path)!r}") from None

    t = type(root)
    if t is _Ext:
        take(holder, 0, root, None, 1)
    elif t is list or t is dict:
        stack.append((root, None, 1))
    while stack:
        item = stack.pop()
        if len(item) == 4:
            finishers.append(item)
            continue
        container, path, depth = item
        depth += 1  # of the children
        if type(container) is dict:
            for key, value in container.items():
                if type(key) is not str and type(key) is not int:
                    raise CorruptObjectError(f"dict key {key!r:.50} is not a str or an int at {_render(path)!r}")
                t = type(value)
                if t is _Ext:
                    take(container, key, value, (path, key), depth)
                elif t is list or t is dict:
                    if depth > MAX_DEPTH:
                        raise too_deep((path, key))
                    stack.append((value, (path, key), depth))
        else:
            for key, value in enumerate(container):
                t = type(value)
                if t is _Ext:
                    take(container, key, value, (path, key), depth)
                elif t is list or t is dict:
                    if depth > MAX_DEPTH:
                        raise too_deep((path, key))
                    stack.append((value, (path, key), depth))
    return ParsedTree(holder, slots, finishers)


def _leaf(code: int, data: bytes, allow_pickle: bool | None) -> Any:
    """The value of an extension type that holds no further tree."""
    if code == EXT_BIGINT:
        return int.from_bytes(data, "big", signed=True)
    if code == EXT_DTYPE:
        return _TORCH_DTYPES[data.decode()]
    if code == EXT_DEVICE:
        return torch.device(data.decode())
    if code == EXT_SIZE:
        dims = _unpack_plain(data)
        if type(dims) is not list or not _counts(dims):
            raise CorruptObjectError("malformed torch.Size")
        return torch.Size(dims)
    if code == EXT_NPSCALAR:
        pair = _unpack_plain(data)
        if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not str or type(pair[1]) is not bytes:
            raise CorruptObjectError("malformed numpy scalar")
        dtype = np.dtype(pair[0])
        if dtype.kind not in _NUMPY_KINDS or dtype.fields is not None or len(pair[1]) != dtype.itemsize:
            raise CorruptObjectError("malformed numpy scalar")
        return np.frombuffer(pair[1], dtype=dtype)[0]
    if code == EXT_PICKLE:
        if allow_pickle is None:
            return PickledValue(len(data))
        if not allow_pickle:
            raise UnsafeContentError("this commit holds pickled values; load with allow_pickle=True to run them")
        return pickle.loads(data)  # noqa: S301 - explicit opt-in above
    raise CorruptObjectError(f"unknown extension type {code} in state tree")


def parse_snapshot(
    snapshot: Snapshot, commit_id: str | None = None, *, allow_pickle: bool | None, files: bool = False
) -> ParsedTree:
    """``snapshot``'s tree read and checked against its blobs (:func:`parse_tree`),
    every blob checked too (:func:`check_blob`): what load, views and show
    require before anything is allocated, and what fsck checks on every
    reachable commit. Errors name ``commit_id``."""
    try:
        return parse_tree(snapshot.tree, snapshot.blobs, allow_pickle=allow_pickle, files=files)
    except CorruptObjectError as exc:
        raise exc.with_context(commit=commit_id) from None


def flatten(value: Any, path: str = "") -> dict[str, Any]:
    """Leaves of a nested state by dotted path ("optimizer.state.3.exp_avg").
    Empty containers are leaves too, so nothing disappears."""
    out: dict[str, Any] = {}

    def walk(v: Any, p: str) -> None:
        if isinstance(v, dict) and v:
            for k, x in v.items():
                walk(x, _join(p, k))
        elif isinstance(v, (list, tuple)) and not isinstance(v, torch.Size) and v:
            for i, x in enumerate(v):
                walk(x, _join(p, i))
        else:
            out[p] = v

    walk(value, path)
    return out


def skeleton(tree: bytes, *, allow_pickle: bool | None = False, blobs: Sequence[Blob] | None = None) -> Any:
    """The state's structure with a TensorInfo in place of every tensor: reads no
    tensor bytes. Pickled values follow ``allow_pickle`` as in :func:`parse_tree`;
    with ``blobs`` every tensor node is checked against its blob."""
    return parse_tree(tree, blobs, allow_pickle=allow_pickle).build()


def describe_state(tree: bytes, blobs: Sequence[Blob] | None = None) -> dict[str, Any]:
    """Leaves by path, with TensorInfo for tensors and PickledValue for pickles;
    reads no tensor bytes and runs no pickle."""
    return flatten(skeleton(tree, allow_pickle=None, blobs=blobs))


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


class TensorMaker:
    """Tensors (or numpy arrays) of tensor nodes, made from their blobs' buffers as
    loading makes them: each buffer asked for once, placed once per recorded
    device (``map_location``), each node made once, so tensors that share a blob
    come back sharing storage. ``base_of(blob)`` returns a flat CPU buffer and the
    element of the blob it starts at, None when it holds the whole blob (offsets
    stay as stored). Called with a TensorInfo; used by build_state and ckvc.read."""

    def __init__(
        self, base_of: Callable[[int], tuple[torch.Tensor | np.ndarray, int | None]], map_location: MapLocation
    ) -> None:
        self._base_of = base_of
        self._map_location = map_location
        self._bases: dict[int, tuple[Any, int | None]] = {}
        self._placed: dict[tuple[int, str], Any] = {}
        self._made: dict[TensorInfo, Any] = {}

    def __call__(self, info: TensorInfo) -> Any:
        made = self._made.get(info)
        if made is not None:
            return made
        if info.blob not in self._bases:
            self._bases[info.blob] = self._base_of(info.blob)
        base, first = self._bases[info.blob]
        key = (info.blob, info.device)
        if key not in self._placed:
            self._placed[key] = place(base, info.device, self._map_location)
        placed = self._placed[key]
        local = info
        if first is not None:  # a part of the blob: offsets relative to it
            if info.stride is not None:
                local = dataclasses.replace(info, offset=info.offset - first if info.numel else 0)
            elif info.numel == 0:
                placed = placed[:0]  # an empty tensor next to others in one blob (not written so, but harmless)
        made = materialize(local, placed)
        self._made[info] = made
        return made


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
    return raw_t.view(_TORCH_DTYPES[dtype]), raw_t.numpy().data.cast("B")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a blob's dtype name stands for."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise CorruptObjectError(f"unknown dtype {name!r}") from None


def rng_state() -> dict[str, Any]:
    """The RNG states of Python's ``random``, numpy's legacy global RNG, torch's CPU
    generator and (when present) every CUDA device. Store it in a commit."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured; missing parts are left alone."""
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
