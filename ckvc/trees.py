"""Value trees (docs/FORMAT.md §10) assembled from parts, without decoding a
value: :func:`nest_trees` puts each rank's tree under its key with its blob
indices moved past the ranks before it (the tree of a distributed commit), and
:func:`pack_tree` encodes plain values and :class:`BlobNode` tensors (the tree
of a DCP save). Both produce the bytes ckvc.state's encoder would."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from ckvc import state as state_mod
from ckvc.errors import CorruptObjectError, UnsupportedTypeError


def unpack(data: bytes) -> Any:
    # Extension values stay undecoded (msgpack.ExtType): the C decoder is never
    # re-entered from its hook, so deep trees cost no C stack (as in ckvc.state).
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True, ext_hook=msgpack.ExtType)


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True, use_single_float=False)


def _shift(value: Any, offset: int) -> Any:
    """``value`` (an unpacked tree) with every tensor node's blob index moved up by ``offset``."""
    if type(value) is list:
        return [_shift(v, offset) for v in value]
    if type(value) is dict:
        return {k: _shift(v, offset) for k, v in value.items()}
    if type(value) is not msgpack.ExtType:
        return value
    code, data = value.code, value.data
    if code == state_mod.EXT_TENSOR:
        node = msgpack.unpackb(data, raw=False, use_list=True)
        if type(node) is not list or not node or type(node[0]) is not int:
            raise CorruptObjectError(f"malformed tensor node {node!r:.100}")
        node[0] += offset
        return msgpack.ExtType(code, pack(node))
    if code in (state_mod.EXT_TUPLE, state_mod.EXT_ODICT):
        return msgpack.ExtType(code, pack(_shift(unpack(data), offset)))
    if code == state_mod.EXT_FILE:
        content, as_bytes, layout = unpack(data)
        return msgpack.ExtType(code, pack([_shift(content, offset), as_bytes, pack(_shift(unpack(layout), offset))]))
    return value


def nest_trees(parts: Sequence[tuple[str, bytes, int]]) -> bytes:
    """The tree ``{key: tree, ...}`` of ``parts`` (key, encoded tree, its blob count),
    each part's blob indices moved past the blobs of the parts before it: the tree
    of a snapshot whose blob table is the parts' tables one after the other."""
    nested: dict[str, Any] = {}
    offset = 0
    for key, tree, count in parts:
        nested[key] = _shift(unpack(tree), offset)
        offset += count
    return pack(nested)


@dataclass(frozen=True)
class BlobNode:
    """A tensor in a tree built by :func:`pack_tree`: the whole of blob ``blob``
    (contiguous, on the CPU), with ``shape``."""

    blob: int
    shape: tuple[int, ...]


def _wire(value: Any) -> Any:
    t = type(value)
    if t is BlobNode:
        node = [value.blob, list(value.shape), None, 0, state_mod.KIND_TENSOR, "cpu", False]
        return msgpack.ExtType(state_mod.EXT_TENSOR, pack(node))
    if t is tuple:
        return msgpack.ExtType(state_mod.EXT_TUPLE, pack([_wire(v) for v in value]))
    if t is list:
        return [_wire(v) for v in value]
    if t is dict:
        return {k: _wire(v) for k, v in value.items()}
    if value is None or t in (str, int, float, bool, bytes):
        return value
    raise UnsupportedTypeError("", f"{t.__qualname__} in a built tree")


def pack_tree(value: Any) -> bytes:
    """An encoded value tree of plain values (dict, list, tuple, str, int, float,
    bool, bytes, None) and :class:`BlobNode` tensors."""
    return pack(_wire(value))
