"""An encoded value tree -> its state: the one validating parser (every node
checked against the snapshot's blob table before anything is allocated), then
the tensors made from their blobs, each blob placed once per device, so tensors
that shared storage share it again. Reading chunks lives in ckvc.read."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib
import math
import pickle
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from ckvc.errors import (
    CkvcError,
    CorruptObjectError,
    InsufficientMemoryError,
    UnsafeContentError,
)
from ckvc.objects import Blob, Snapshot
from ckvc.state.encode import join_path
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
    INT64_MAX,
    KIND_NUMPY,
    KIND_PARAMETER,
    KIND_TENSOR,
    MAX_DEPTH,
    NUMPY_DTYPE_PREFIX,
    NUMPY_KINDS,
    TORCH_DTYPES,
    MapLocation,
    StoredFile,
    blob_itemsize,
    check_blob,
)

# The stdlib's gc, imported by name: mypy takes benchmarks/gc.py for it.
_gc: Any = importlib.import_module("gc")


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
    return all(type(n) is int and 0 <= n <= INT64_MAX for n in values)


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
                and 0 <= blob <= INT64_MAX
                and type(shape) is list
                and _counts(shape)
                and (stride is None or (type(stride) is list and len(stride) == len(shape) and _counts(stride)))
                and type(offset) is int
                and 0 <= offset <= INT64_MAX
                and type(kind) is int
                and kind in (KIND_TENSOR, KIND_PARAMETER, KIND_NUMPY)
                and type(device) is str
                and type(requires_grad) is bool
            )
        if not ok:
            raise CorruptObjectError(f"malformed tensor node {node!r:.200}")
        info = cls(blob, tuple(shape), None if stride is None else tuple(stride), offset, kind, device, requires_grad)
        if len(shape) > 1 and info.numel > INT64_MAX:
            raise CorruptObjectError(f"tensor of shape {shape} has more than 2^63 elements")
        return info


@dataclass(frozen=True)
class PickledValue:
    """Stands for a pickled value when a tree is described without unpickling."""

    nbytes: int


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
            grad = is_numpy or TORCH_DTYPES[blob.dtype].is_floating_point or TORCH_DTYPES[blob.dtype].is_complex
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
        return TORCH_DTYPES[data.decode()]
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
        if dtype.kind not in NUMPY_KINDS or dtype.fields is not None or len(pair[1]) != dtype.itemsize:
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
                walk(x, join_path(p, k))
        elif isinstance(v, (list, tuple)) and not isinstance(v, torch.Size) and v:
            for i, x in enumerate(v):
                walk(x, join_path(p, i))
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
    return raw_t.view(TORCH_DTYPES[dtype]), raw_t.numpy().data.cast("B")
