"""The one validating parser of a state's value tree (docs/FORMAT.md §10): every
node checked against the snapshot's blob table before anything is allocated, the
result a :class:`ParsedTree` whose tensor nodes are :class:`TensorInfo` until
someone builds them (ckvc.state.decode makes torch tensors of them,
ckvc.state.arrays NumPy arrays). Imports no torch: with ``torch_free`` the
torch-only values (dtypes, devices, sizes) come back as their names and tuples."""

from __future__ import annotations

import collections
import functools
import math
import pickle
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from ckvc.bulk import gc_paused
from ckvc.errors import CkvcError, CorruptObjectError, UnsafeContentError
from ckvc.objects import Blob, Snapshot
from ckvc.state.tables import (
    DTYPE_FACTS,
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
    StoredFile,
    check_blob,
    torch_dtype,
)


class TorchSize(tuple[int, ...]):
    """A ``torch.Size`` read without torch (``torch_free``): a tuple, and one leaf
    where a state is flattened, as the torch.Size is."""

    __slots__ = ()


def join_path(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


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


# A device name as torch writes one ("cpu", "cuda:1"): what the torch-free parser
# accepts, torch itself being the judge of the type otherwise.
_DEVICE_NAME = re.compile(r"[a-z][a-z0-9_]*(:[0-9]{1,9})?")


# torch's device types (c10's DeviceType names): a name of one of these, with or
# without an index, is one torch accepts, so reading a snapshot's structure
# (diff --stat, log, show) need not import torch (a second) to judge it.
_TORCH_DEVICE_TYPES = frozenset(
    [
        "cpu",
        "cuda",
        "opengl",
        "opencl",
        "ideep",
        "hip",
        "ve",
        "fpga",
        "maia",
        "xla",
        "lazy",
        "vulkan",
        "mps",
        "meta",
        "hpu",
        "mtia",
        "xpu",
        "ipu",
    ]
)


@functools.lru_cache(maxsize=64)
def _device_ok(name: str, torch_free: bool) -> bool:
    well_formed = _DEVICE_NAME.fullmatch(name) is not None
    if torch_free:
        return well_formed
    if well_formed and name.partition(":")[0] in _TORCH_DEVICE_TYPES:
        return True
    import torch  # any other name (a backend's privateuse device): torch is the judge

    try:
        torch.device(name)
    except Exception:
        return False
    return True


class _TensorChecker:
    """The checks a tensor node must pass against the snapshot's blobs before
    anything is allocated or read for it (docs/FORMAT.md §10.3, 10.8)."""

    def __init__(self, blobs: Sequence[Blob], torch_free: bool) -> None:
        self.blobs = blobs
        self.torch_free = torch_free
        # Per blob: (elements, is numpy, may require grad).
        self.facts: list[tuple[int, bool, bool]] = []
        for blob in blobs:
            itemsize = check_blob(blob)
            is_numpy = blob.dtype.startswith(NUMPY_DTYPE_PREFIX)
            grad = is_numpy or DTYPE_FACTS[blob.dtype][1]
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
        if not _device_ok(info.device, self.torch_free):
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
        with gc_paused():
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


def parse_tree(
    tree: bytes, blobs: Sequence[Blob] | None, *, allow_pickle: bool | None, files: bool = False,
    torch_free: bool = False,
) -> ParsedTree:  # fmt: skip
    """Read and check a state tree without recursion: at most MAX_DEPTH nested
    containers, str or int dict keys, known extension codes, well-formed tensor
    nodes and (with ``blobs``) every tensor node consistent with its blob. Pickled
    values are unpickled when allow_pickle is True, refused when False
    (UnsafeContentError), and PickledValue placeholders when None. Errors are
    CorruptObjectError naming the path. File nodes (ext 10) become their content,
    or with ``files`` a StoredFile with its layout read too. The one validator:
    load, views, show and fsck all read trees through it. ``torch_free``: torch
    dtypes and devices come back as their names, sizes as tuples, and torch is
    not imported (ckvc.numpy)."""
    with gc_paused():
        return _parse_tree(tree, blobs, allow_pickle, files, torch_free)


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


def _parse_tree(
    tree: bytes, blobs: Sequence[Blob] | None, allow_pickle: bool | None, files: bool, torch_free: bool
) -> ParsedTree:
    try:
        root = _unpack_shallow(tree)
    except Exception as exc:
        raise CorruptObjectError(f"malformed state tree: {exc}") from None
    checker = _TensorChecker(blobs, torch_free) if blobs is not None else None
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
                container[key] = _leaf(code, value.data, allow_pickle, torch_free)
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


def _leaf(code: int, data: bytes, allow_pickle: bool | None, torch_free: bool) -> Any:
    """The value of an extension type that holds no further tree."""
    if code == EXT_BIGINT:
        return int.from_bytes(data, "big", signed=True)
    if code == EXT_DTYPE:
        name = data.decode()
        if name not in DTYPE_FACTS:
            raise CorruptObjectError(f"unknown dtype {name!r:.100}")
        return name if torch_free else torch_dtype(name)
    if code == EXT_DEVICE:
        name = data.decode()
        if not _device_ok(name, torch_free):
            raise CorruptObjectError(f"unknown device {name!r:.50}")
        return name if torch_free else _torch().device(name)
    if code == EXT_SIZE:
        dims = _unpack_plain(data)
        if type(dims) is not list or not _counts(dims):
            raise CorruptObjectError("malformed torch.Size")
        return TorchSize(dims) if torch_free else _torch().Size(dims)
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
    snapshot: Snapshot, commit_id: str | None = None, *, allow_pickle: bool | None, files: bool = False,
    torch_free: bool = False,
) -> ParsedTree:  # fmt: skip
    """``snapshot``'s tree read and checked against its blobs (:func:`parse_tree`),
    every blob checked too (:func:`check_blob`): what load, views and show
    require before anything is allocated, and what fsck checks on every
    reachable commit. Errors name ``commit_id``."""
    try:
        return parse_tree(snapshot.tree, snapshot.blobs, allow_pickle=allow_pickle, files=files, torch_free=torch_free)
    except CorruptObjectError as exc:
        raise exc.with_context(commit=commit_id) from None


def flatten(value: Any, path: str = "") -> dict[str, Any]:
    """Leaves of a nested state by dotted path ("optimizer.state.3.exp_avg").
    Empty containers are leaves too, so nothing disappears; a torch.Size is one leaf."""
    out: dict[str, Any] = {}
    torch = sys.modules.get("torch")  # without torch imported no value is a torch.Size
    size_type: Any = (torch.Size, TorchSize) if torch is not None else TorchSize

    def walk(v: Any, p: str) -> None:
        if isinstance(v, dict) and v:
            for k, x in v.items():
                walk(x, join_path(p, k))
        elif isinstance(v, (list, tuple)) and not isinstance(v, size_type) and v:
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


def _torch() -> Any:
    import torch

    return torch
