"""Training state <-> (value tree, tensor byte buffers), without pickle.

A state is a nested structure of dicts, lists, tuples, tensors, numpy arrays and
plain Python values. :func:`encode_state` turns it into an encoded *tree* (msgpack
with the extension types below) plus a list of :class:`PendingBlob`: the raw
bytes of every tensor, to be chunked and stored. :func:`decode_state` reverses it.

Tensors that share one storage (tied weights, views of one buffer) share one blob,
and are restored sharing one storage again.
"""

from __future__ import annotations

import collections
import pickle
import random
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from ckvc.errors import CorruptObjectError, UnsafeContentError, UnsupportedTypeError

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
EXT_FILE = 10  # a file's content plus how to rebuild its exact bytes (ckvc.files)

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
# A span shared by several views is stored once only while it is no larger than
# this many times the bytes the views cover; beyond that each view is stored alone.
_MAX_SHARED_SPAN_OVERHEAD = 2

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
    """A file of a committed file or directory (ckvc.files): ``content`` is what
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


def private_copy(data: memoryview) -> dict[str, Any]:
    """``data`` copied into memory ckvc owns, as PendingBlob fields. torch copies
    large buffers on all cores (a bytearray copy runs on one), and the first touch
    of fresh pages dominates an async commit's stall in these VMs."""
    copy = torch.empty(len(data), dtype=torch.uint8)
    if len(data):
        copy.copy_(torch.frombuffer(data, dtype=torch.uint8))
    return {"data": copy.numpy().data.cast("B"), "owner": copy}


def _caller_stacklevel() -> int:
    """The warnings stacklevel of the first frame outside ckvc, as seen from the
    function that calls warnings.warn (which calls this)."""
    frame = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("ckvc"):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _is_utf8(text: str) -> bool:
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

    def encode(self, value: Any, path: str) -> Any:
        t = type(value)
        if value is None or t in (bool, bytes, float):
            return value
        if t is str:
            return value if _is_utf8(value) else self._fallback(value, path, "string is not valid UTF-8")
        if t is int:
            if _INT64_MIN <= value <= _UINT64_MAX:
                return value
            return msgpack.ExtType(EXT_BIGINT, value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True))
        if t is list:
            return [self.encode(v, _join(path, i)) for i, v in enumerate(value)]
        if t is tuple:
            return _Tuple(self.encode(v, _join(path, i)) for i, v in enumerate(value))
        if t is dict or t is collections.OrderedDict:
            encoded = {}
            for k, v in value.items():
                if not ((type(k) is str and _is_utf8(k)) or (type(k) is int and _INT64_MIN <= k <= _UINT64_MAX)):
                    return self._fallback(value, path, f"dict key {k!r:.50} is not a UTF-8 str or a 64-bit int")
                encoded[k] = self.encode(v, _join(path, k))
            return encoded if t is dict else _ODict(encoded)
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if t is StoredFile:
            # Content first: its tensors give shared blobs their path (delta bases).
            content = self.encode(value.content, path)
            return _File([content, value.as_bytes, self.encode(value.layout, path + "/layout")])
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


def encode_state(
    state: Any, *, allow_pickle: bool = False, pin_memory: bool = False
) -> tuple[bytes, list[PendingBlob], bool]:
    """(encoded tree, blobs, whether anything was pickled). Raises UnsupportedTypeError
    naming the path of the first value it cannot store. ``pin_memory``: copy CUDA
    tensors into pinned host memory (when CUDA is available), for async commits."""
    encoder = _Encoder(allow_pickle, pin_memory)
    markers = encoder.encode(state, "")
    encoder.assign_blobs()
    return _pack(_wire(markers)), encoder.blobs, encoder.pickled


def _unpack_tree(data: bytes, hook: Callable[[int, bytes], Any]) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True, ext_hook=hook)


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
        return int(np.prod(self.shape)) if self.shape else 1

    @classmethod
    def from_node(cls, node: Any) -> TensorInfo:
        ok = (
            isinstance(node, list)
            and len(node) == 7
            and isinstance(node[0], int)
            and node[0] >= 0
            and isinstance(node[1], list)
            and all(isinstance(n, int) and n >= 0 for n in node[1])
            and (
                node[2] is None
                or (
                    isinstance(node[2], list)
                    and len(node[2]) == len(node[1])
                    and all(isinstance(n, int) and n >= 0 for n in node[2])
                )
            )
            and isinstance(node[3], int)
            and node[3] >= 0
            and node[4] in (KIND_TENSOR, KIND_PARAMETER, KIND_NUMPY)
            and isinstance(node[5], str)
            and isinstance(node[6], bool)
        )
        if not ok:
            raise CorruptObjectError(f"malformed tensor node {node!r:.200}")
        stride = None if node[2] is None else tuple(node[2])
        return cls(node[0], tuple(node[1]), stride, node[3], node[4], node[5], node[6])


@dataclass(frozen=True)
class PickledValue:
    """Stands for a pickled value when a tree is described without unpickling."""

    nbytes: int


def _parse_tree(
    tree: bytes, on_tensor: Callable[[TensorInfo], Any], allow_pickle: bool | None, files: bool = False
) -> Any:
    """Decode the tree; tensor nodes become ``on_tensor(info)``. Pickled values are
    unpickled when allow_pickle is True, refused when False, and left as
    PickledValue placeholders when None. File nodes become their content, or
    StoredFile with ``files``."""

    def hook(code: int, data: bytes) -> Any:
        try:
            if code == EXT_TUPLE:
                return tuple(_unpack_tree(data, hook))
            if code == EXT_BIGINT:
                return int.from_bytes(data, "big", signed=True)
            if code == EXT_DTYPE:
                return _TORCH_DTYPES[data.decode()]
            if code == EXT_DEVICE:
                return torch.device(data.decode())
            if code == EXT_SIZE:
                return torch.Size(_unpack_tree(data, hook))
            if code == EXT_ODICT:
                return collections.OrderedDict(_unpack_tree(data, hook))
            if code == EXT_NPSCALAR:
                dtype_str, raw = _unpack_tree(data, hook)
                dtype = np.dtype(dtype_str)
                if dtype.kind not in _NUMPY_KINDS or len(raw) != dtype.itemsize:
                    raise CorruptObjectError("malformed numpy scalar")
                return np.frombuffer(raw, dtype=dtype)[0]
            if code == EXT_TENSOR:
                return on_tensor(TensorInfo.from_node(_unpack_tree(data, hook)))
            if code == EXT_PICKLE:
                if allow_pickle is None:
                    return PickledValue(len(data))
                if not allow_pickle:
                    raise UnsafeContentError(
                        "this commit holds pickled values; load with allow_pickle=True to run them"
                    )
                return pickle.loads(data)  # noqa: S301 - explicit opt-in above
            if code == EXT_FILE:
                content, as_bytes, layout = _unpack_tree(data, hook)
                if not isinstance(as_bytes, bool) or not isinstance(layout, bytes):
                    raise CorruptObjectError("malformed file node")
                if as_bytes:
                    if not isinstance(content, (np.ndarray, TensorInfo)):
                        raise CorruptObjectError("file node's bytes are not an array")
                    if isinstance(content, np.ndarray):
                        content = content.tobytes()
                if not files:
                    return content
                parsed = _unpack_tree(layout, hook)
                if not isinstance(parsed, dict):
                    raise CorruptObjectError("file node's layout is not a map")
                return StoredFile(content, parsed, as_bytes)
        except (CorruptObjectError, UnsafeContentError):
            raise
        except Exception as exc:
            raise CorruptObjectError(f"malformed value of extension type {code}: {exc}") from None
        raise CorruptObjectError(f"unknown extension type {code} in state tree")

    try:
        return _unpack_tree(tree, hook)
    except (CorruptObjectError, UnsafeContentError):
        raise
    except Exception as exc:
        raise CorruptObjectError(f"malformed state tree: {exc}") from None


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


def skeleton(tree: bytes, *, allow_pickle: bool | None = False) -> Any:
    """The state's structure with a TensorInfo in place of every tensor: reads no
    tensor bytes. Pickled values follow ``allow_pickle`` as in ``_parse_tree``."""
    return _parse_tree(tree, lambda info: info, allow_pickle)


def describe_state(tree: bytes) -> dict[str, Any]:
    """Leaves by path, with TensorInfo for tensors and PickledValue for pickles;
    reads no tensor bytes and runs no pickle."""
    return flatten(_parse_tree(tree, lambda info: info, None))


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
    files: bool = False,
) -> Any:
    """Rebuild the state from its encoded tree. ``load_blob(index)`` returns the
    blob as a flat CPU tensor (or numpy array) of its dtype; each blob is loaded
    at most once. Tensors sharing a blob come back sharing storage. ``files``:
    file nodes come back as StoredFile (content and layout) instead of content."""
    cpu_bases: dict[int, Any] = {}
    placed: dict[tuple[int, str], Any] = {}
    made: dict[TensorInfo, Any] = {}

    def base_for(info: TensorInfo) -> Any:
        key = (info.blob, info.device)
        if key not in placed:
            if info.blob not in cpu_bases:
                cpu_bases[info.blob] = load_blob(info.blob)
            placed[key] = place(cpu_bases[info.blob], info.device, map_location)
        return placed[key]

    def on_tensor(info: TensorInfo) -> Any:
        if info not in made:
            made[info] = materialize(info, base_for(info))
        return made[info]

    return _parse_tree(tree, on_tensor, allow_pickle, files)


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
    """A flat, uninitialised CPU buffer for a blob, and a writable byte view of it."""
    if dtype.startswith(NUMPY_DTYPE_PREFIX):
        np_dtype = np.dtype(dtype[len(NUMPY_DTYPE_PREFIX) :])
        if np_dtype.kind not in _NUMPY_KINDS or np_dtype.itemsize == 0 or nbytes % np_dtype.itemsize:
            raise CorruptObjectError(f"blob of {nbytes} bytes cannot hold numpy dtype {np_dtype}")
        raw = np.empty(nbytes, dtype=np.uint8)
        return raw.view(np_dtype), raw.data.cast("B")
    try:
        torch_dtype = _TORCH_DTYPES[dtype]
    except KeyError:
        raise CorruptObjectError(f"unknown dtype {dtype!r}") from None
    if nbytes % torch_dtype.itemsize:
        raise CorruptObjectError(f"blob of {nbytes} bytes cannot hold {dtype}")
    raw_t = torch.empty(nbytes, dtype=torch.uint8)
    view = raw_t.numpy().data.cast("B")
    return raw_t.view(torch_dtype), view


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a blob's dtype name stands for."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise CorruptObjectError(f"unknown dtype {name!r}") from None


def blob_itemsize(dtype: str) -> int:
    if dtype.startswith(NUMPY_DTYPE_PREFIX):
        return np.dtype(dtype[len(NUMPY_DTYPE_PREFIX) :]).itemsize
    return _TORCH_DTYPES[dtype].itemsize


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
