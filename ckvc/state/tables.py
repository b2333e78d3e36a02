"""What the value tree format (docs/FORMAT.md §10) names: the extension codes,
tensor node kinds, dtype tables, the blob checks, and the two records that cross
from the encoder to the writer (:class:`PendingBlob`) and from the file formats to
the encoder (:class:`StoredFile`).

Imports no torch: the parser (ckvc.state.parse) and the torch-free readers
(ckvc.numpy, ckvc.jax) use these tables too. ``TORCH_DTYPES`` and
``TORCH_DTYPE_NAMES`` are built on first use, importing torch then."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ckvc.chunking import MAX_CHUNK_SIZE
from ckvc.errors import (
    CorruptObjectError,
)
from ckvc.objects import Blob

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch

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


# Every torch dtype a blob may hold (docs/FORMAT.md §10.5): its bytes per element,
# and whether a tensor of it may require grad (floating point or complex). Written
# out rather than asked of torch, so the parser and the NumPy reader need no torch;
# tests/state check it against torch.
DTYPE_FACTS: dict[str, tuple[int, bool]] = {
    "float64": (8, True), "float32": (4, True), "float16": (2, True), "bfloat16": (2, True),
    "float8_e4m3fn": (1, True), "float8_e4m3fnuz": (1, True), "float8_e5m2": (1, True),
    "float8_e5m2fnuz": (1, True), "float8_e8m0fnu": (1, True), "float4_e2m1fn_x2": (1, True),
    "int8": (1, False), "int16": (2, False), "int32": (4, False), "int64": (8, False),
    "uint8": (1, False), "uint16": (2, False), "uint32": (4, False), "uint64": (8, False),
    "bool": (1, False), "complex32": (4, True), "complex64": (8, True), "complex128": (16, True),
}  # fmt: skip


if TYPE_CHECKING:
    TORCH_DTYPES: dict[str, torch.dtype]
    TORCH_DTYPE_NAMES: dict[torch.dtype, str]


@functools.cache
def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    import torch

    names = {name: getattr(torch, name) for name in DTYPE_FACTS if hasattr(torch, name)}
    return names, {dtype: name for name, dtype in names.items()}


def __getattr__(name: str) -> Any:
    """TORCH_DTYPES (name -> torch.dtype) and TORCH_DTYPE_NAMES, made on first use."""
    if name == "TORCH_DTYPES":
        return _torch_tables()[0]
    if name == "TORCH_DTYPE_NAMES":
        return _torch_tables()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Numpy kinds with a fixed-size, pointer-free representation.
NUMPY_KINDS = set("biufcSUmM")


INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1


INT64_MAX = (1 << 63) - 1


# The deepest nesting of containers (dict, list, tuple, OrderedDict) a state may
# have (docs/FORMAT.md §10.8): refused at commit, and a stored tree that nests
# deeper is corrupt. Keeps every walk over a tree (ours and the caller's) far from
# Python's recursion limit.
MAX_DEPTH = 128


# A span shared by several views is stored once only while it is no larger than
# this many times the bytes the views cover; beyond that each view is stored alone.
MAX_SHARED_SPAN_OVERHEAD = 2


if TYPE_CHECKING:
    MapLocation: TypeAlias = str | torch.device | dict[str, str] | Callable[[Any, str], Any] | None
else:
    MapLocation = Any  # only ever an annotation; the real alias needs torch


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


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _torch_tables()[1][dtype]
    except KeyError:
        raise KeyError(f"unsupported torch dtype {dtype}") from None


def caller_stacklevel() -> int:
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


@functools.lru_cache(maxsize=256)
def blob_itemsize(dtype: str) -> int:
    """Bytes per element of a blob dtype string (docs/FORMAT.md §10.5);
    CorruptObjectError for one this reader does not know or allow."""
    if dtype.startswith(NUMPY_DTYPE_PREFIX):
        try:
            np_dtype = np.dtype(dtype[len(NUMPY_DTYPE_PREFIX) :])
        except Exception:
            raise CorruptObjectError(f"unknown dtype {dtype!r:.100}") from None
        if np_dtype.kind not in NUMPY_KINDS or np_dtype.fields is not None or not np_dtype.itemsize:
            raise CorruptObjectError(f"numpy dtype {dtype!r:.100} is not allowed in a blob")
        return int(np_dtype.itemsize)
    try:
        return DTYPE_FACTS[dtype][0]
    except KeyError:
        raise CorruptObjectError(f"unknown dtype {dtype!r:.100}") from None


def check_blob(blob: Blob) -> int:
    """A blob's own consistency (dtype, size, chunk size), before anything is
    allocated for it; returns its itemsize. CorruptObjectError naming the blob's path."""
    try:
        itemsize = blob_itemsize(blob.dtype)
    except CorruptObjectError as exc:
        raise exc.with_context(tensor=blob.path) from None
    if blob.nbytes % itemsize or blob.nbytes > INT64_MAX:
        raise CorruptObjectError(f"blob of {blob.nbytes} bytes cannot hold {blob.dtype}", tensor=blob.path)
    if blob.chunk_size > max(MAX_CHUNK_SIZE, itemsize):
        raise CorruptObjectError(f"blob chunk size {blob.chunk_size} is over the maximum", tensor=blob.path)
    return itemsize


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a blob's dtype name stands for."""
    try:
        return _torch_tables()[0][name]
    except KeyError:
        raise CorruptObjectError(f"unknown dtype {name!r}") from None
