"""Metadata objects and their canonical encoding (pure: bytes in, bytes out).

Every metadata object is one msgpack map whose keys appear in a fixed order, with
integers in their shortest form and floats as float64, so equal objects always
encode to equal bytes and therefore to equal ids. docs/FORMAT.md spells it out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ckvc.chunking import chunk_count
from ckvc.errors import MalformedObjectError
from ckvc.ids import ID_SIZE

OBJECT_VERSION = 1


def pack_canonical(value: Any) -> bytes:
    # strict_types keeps tuples, subclasses and the like from slipping in silently.
    return msgpack.packb(value, use_bin_type=True, strict_types=True, use_single_float=False)


def _unpack(data: bytes | bytearray | memoryview, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:
        raise MalformedObjectError(f"malformed {what} object: {exc}") from None


def _require(cond: bool, what: str, detail: str) -> None:
    if not cond:
        raise MalformedObjectError(f"malformed {what} object: {detail}")


def _check_fields(obj: Any, what: str, keys: tuple[str, ...]) -> None:
    _require(isinstance(obj, dict), what, "not a map")
    _require(tuple(obj) == keys, what, f"fields {tuple(obj)} != {keys}")
    _require(type(obj["v"]) is int and obj["v"] == OBJECT_VERSION, what, f"unknown version {obj['v']!r}")


def _is_id(value: Any) -> bool:
    return isinstance(value, bytes) and len(value) == ID_SIZE


@dataclass(frozen=True)
class Blob:
    """The bytes of one tensor (or of a storage span several tensors share),
    as dtype-aligned fixed-size chunks."""

    path: str  # the first state path that uses it (names it in errors; delta base key)
    dtype: str
    nbytes: int
    chunk_size: int
    chunks: tuple[bytes, ...]

    def to_wire(self) -> list[Any]:
        return [self.path, self.dtype, self.nbytes, self.chunk_size, b"".join(self.chunks)]

    @classmethod
    def from_wire(cls, wire: Any) -> Blob:
        ok = (
            isinstance(wire, list)
            and len(wire) == 5
            and isinstance(wire[0], str)
            and isinstance(wire[1], str)
            and type(wire[2]) is int
            and type(wire[3]) is int
            and isinstance(wire[4], bytes)
            and wire[2] >= 0
            and wire[3] > 0
            and len(wire[4]) % ID_SIZE == 0
        )
        _require(ok, "snapshot", "bad blob entry")
        path, dtype, nbytes, chunk_size, ids = wire
        chunks = tuple(ids[i : i + ID_SIZE] for i in range(0, len(ids), ID_SIZE))
        _require(len(chunks) == chunk_count(nbytes, chunk_size), "snapshot", "chunk count does not cover the blob")
        return cls(path, dtype, nbytes, chunk_size, chunks)


@dataclass(frozen=True)
class Snapshot:
    """A whole state: the blob table and the encoded value tree (see ckvc.state)."""

    blobs: tuple[Blob, ...]
    tree: bytes

    def encode(self) -> bytes:
        return pack_canonical({"v": OBJECT_VERSION, "blobs": [b.to_wire() for b in self.blobs], "tree": self.tree})

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Snapshot:
        obj = _unpack(data, "snapshot")
        _check_fields(obj, "snapshot", ("v", "blobs", "tree"))
        _require(isinstance(obj["blobs"], list) and isinstance(obj["tree"], bytes), "snapshot", "bad field types")
        return cls(tuple(Blob.from_wire(b) for b in obj["blobs"]), obj["tree"])


LOSSY_REPORT_FIELDS = {"codec": str, "max_abs_error": float, "rel_rms_error": float, "rms_error": float}


def lossy_report_problem(report: Any) -> str | None:
    """What is wrong with one tensor's lossy report (docs/FORMAT.md 9.3), or None:
    show and fsck format its numbers, so a missing or mistyped field is a malformed
    commit, refused where commits are decoded."""
    if not isinstance(report, dict):
        return "not a map"
    for name, kind in LOSSY_REPORT_FIELDS.items():
        if name not in report:
            return f"{name} is missing"
        if type(report[name]) is not kind:
            return f"{name} is {type(report[name]).__name__}, not {kind.__name__}"
    extra = sorted(str(k) for k in report if k not in LOSSY_REPORT_FIELDS)
    return f"unknown field {extra[0]!r:.100}" if extra else None


@dataclass(frozen=True)
class Commit:
    tree: str  # snapshot id (hex)
    parents: tuple[str, ...]
    author: str
    time_ns: int  # UTC, nanoseconds since the Unix epoch
    message: str
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)  # JSON-like values (validate_metadata)
    pickled: bool = False  # holds pickled values: refused on read unless allowed
    # Tensors stored by the opt-in lossy tier: path -> {"codec", "max_abs_error",
    # "rms_error", "rel_rms_error"}. Encoded only when non-empty, so exact commits
    # keep the layout (and ids) of format version 1.
    lossy: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    id: str = ""  # filled in when read from or written to a store; not encoded

    @property
    def is_lossy(self) -> bool:
        return bool(self.lossy)

    def encode(self) -> bytes:
        return pack_canonical(
            {
                "v": OBJECT_VERSION,
                "tree": bytes.fromhex(self.tree),
                "parents": [bytes.fromhex(p) for p in self.parents],
                "author": self.author,
                "time": self.time_ns,
                "message": self.message,
                # Sorted: the caller's insertion order must not change the id.
                "metrics": {k: float(self.metrics[k]) for k in sorted(self.metrics)},
                "metadata": canonical_metadata(self.metadata),
                "pickled": self.pickled,
                **({"lossy": self._lossy_map()} if self.lossy else {}),
            }
        )

    def _lossy_map(self) -> dict[str, dict[str, Any]]:
        return {path: {k: self.lossy[path][k] for k in sorted(self.lossy[path])} for path in sorted(self.lossy)}

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, oid: str = "") -> Commit:
        obj = _unpack(data, "commit")
        fields = ("v", "tree", "parents", "author", "time", "message", "metrics", "metadata", "pickled")
        _check_fields(obj, "commit", (*fields, "lossy") if isinstance(obj, dict) and "lossy" in obj else fields)
        lossy = obj.get("lossy", {})
        _require(isinstance(lossy, dict) and (lossy != {} or "lossy" not in obj), "commit", "bad lossy field")
        for path, report in lossy.items():
            problem = "path is not a string" if not isinstance(path, str) else lossy_report_problem(report)
            _require(problem is None, "commit", f"lossy report for {str(path)!r:.200}: {problem}")
        ok = (
            _is_id(obj["tree"])
            and isinstance(obj["parents"], list)
            and all(_is_id(p) for p in obj["parents"])
            and isinstance(obj["author"], str)
            and type(obj["time"]) is int
            and isinstance(obj["message"], str)
            and isinstance(obj["metrics"], dict)
            and all(isinstance(k, str) and isinstance(v, float) for k, v in obj["metrics"].items())
            and list(obj["metrics"]) == sorted(obj["metrics"])
            and _is_metadata_value(obj["metadata"])
            and isinstance(obj["metadata"], dict)
            and isinstance(obj["pickled"], bool)
        )
        _require(ok, "commit", "bad field types")
        return cls(
            tree=obj["tree"].hex(),
            parents=tuple(p.hex() for p in obj["parents"]),
            author=obj["author"],
            time_ns=obj["time"],
            message=obj["message"],
            metrics=obj["metrics"],
            metadata=obj["metadata"],
            pickled=obj["pickled"],
            lossy=lossy,
            id=oid,
        )


@dataclass(frozen=True)
class Tag:
    """An annotated tag. Lightweight tags are plain refs and have no object."""

    target: str  # commit id (hex)
    name: str
    tagger: str
    time_ns: int
    message: str
    id: str = ""

    def encode(self) -> bytes:
        return pack_canonical(
            {
                "v": OBJECT_VERSION,
                "object": bytes.fromhex(self.target),
                "name": self.name,
                "tagger": self.tagger,
                "time": self.time_ns,
                "message": self.message,
            }
        )

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, oid: str = "") -> Tag:
        obj = _unpack(data, "tag")
        _check_fields(obj, "tag", ("v", "object", "name", "tagger", "time", "message"))
        ok = (
            _is_id(obj["object"])
            and isinstance(obj["name"], str)
            and isinstance(obj["tagger"], str)
            and type(obj["time"]) is int
            and isinstance(obj["message"], str)
        )
        _require(ok, "tag", "bad field types")
        return cls(obj["object"].hex(), obj["name"], obj["tagger"], obj["time"], obj["message"], id=oid)


def validate_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """Metrics are str -> finite or non-finite float; anything else is refused."""
    out: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"metric names must be non-empty strings, got {key!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metric {key!r} must be a number, got {value!r}") from None
        if isinstance(value, bool):
            raise ValueError(f"metric {key!r} must be a number, got a bool")
        out[key] = number
    return out


# Nesting limit of metadata values: deep enough for any config, and no recursion bomb.
MAX_METADATA_DEPTH = 32
_INT_RANGE = (-(1 << 63), (1 << 64) - 1)  # what msgpack encodes


def _is_metadata_value(v: Any, depth: int = 0) -> bool:
    """A canonical metadata value as read: str, int, float, bool, None, lists, and
    maps with str keys in sorted order, nested at most MAX_METADATA_DEPTH deep."""
    if v is None or isinstance(v, (str, bool, int, float)):
        return True
    if depth >= MAX_METADATA_DEPTH:
        return False
    if isinstance(v, list):
        return all(_is_metadata_value(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return (
            all(isinstance(k, str) for k in v)
            and list(v) == sorted(v)
            and all(_is_metadata_value(x, depth + 1) for x in v.values())
        )
    return False


def canonical_metadata(value: Any, depth: int = 0, where: str = "metadata") -> Any:
    """``value`` as stored: maps sorted by key (at every level), tuples as lists.
    ValueError naming the place of anything that is not JSON-like data."""
    if value is None or isinstance(value, (str, bool, float)):
        return value
    if isinstance(value, int):
        if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise ValueError(f"{where} = {value} does not fit in 64 bits")
        return int(value)  # an IntEnum or other subclass becomes a plain int
    if depth >= MAX_METADATA_DEPTH:
        raise ValueError(f"{where} is nested deeper than {MAX_METADATA_DEPTH} levels")
    if isinstance(value, (list, tuple)):
        return [canonical_metadata(x, depth + 1, f"{where}[{i}]") for i, x in enumerate(value)]
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise ValueError(f"{where} has a key {key!r} that is not a str")
        return {k: canonical_metadata(value[k], depth + 1, f"{where}[{k!r}]") for k in sorted(value)}
    raise ValueError(
        f"{where} is a {type(value).__name__}; metadata values are str, int, float, bool, None, "
        "lists and dicts (convert it, e.g. str(path))"
    )


def validate_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metadata is a str-keyed map of JSON-like values (``vars(args)`` with plain
    values works), stored canonically (sorted maps, tuples as lists) and read back
    equal to what was given."""
    if metadata is not None and not isinstance(metadata, Mapping):
        raise ValueError(f"metadata must be a mapping, got {type(metadata).__name__}")
    out: dict[str, Any] = canonical_metadata(dict(metadata or {}))
    return out
