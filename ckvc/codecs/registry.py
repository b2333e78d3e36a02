"""The codec table: codec id -> how its records decode, and configured name ->
encoder. Each codec's module registers itself, and the first lookup imports them
all (CODEC_MODULES), so the table is complete whatever was imported first;
decoding looks the id up here and nowhere else, so a new codec is one module, one
register call and its id in ids.py."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from ckvc.errors import UnsupportedFormatError
from ckvc.ids import Buffer

if TYPE_CHECKING:  # numpy loads with the codecs, not with the table
    import numpy as np

    from ckvc.codecs.base import Codec

# (payload, out: uint8 of exactly the raw size, the base's plain bytes or None)
DecodeInto = Callable[[Buffer, "np.ndarray", "Buffer | np.ndarray | None"], None]


@dataclass(frozen=True)
class RecordCodec:
    """How the records stored with one codec id decode."""

    codec_id: int
    name: str  # as du and fsck report it
    decode_into: DecodeInto
    whole: bool  # plain bytes need no other object: may serve as a delta keyframe
    decoder: Codec | None = None  # whole-buffer decoding (metadata records: raw, zstd)


_BY_ID: dict[int, RecordCodec] = {}
_ENCODERS: dict[str, Callable[[int | None, bool], Codec]] = {}
# Every module that registers a codec or an encoder.
CODEC_MODULES = ("raw", "zstd", "bytegroup", "delta", "sparse", "lossy", "auto")
_complete = False


def _load_all() -> None:
    global _complete
    if not _complete:
        for name in CODEC_MODULES:
            importlib.import_module(f"ckvc.codecs.{name}")
        _complete = True


def register(codec: RecordCodec) -> RecordCodec:
    if codec.codec_id in _BY_ID:
        raise ValueError(f"codec id {codec.codec_id} is registered twice")
    _BY_ID[codec.codec_id] = codec
    return codec


def register_encoder(name: str, make: Callable[[int | None, bool], Codec]) -> None:
    """``make(level, format4)``: the encoder a repository config names (``{"name": name,
    "level": n}``); ``format4``: the repository's format version is 4 or more."""
    if name in _ENCODERS:
        raise ValueError(f"encoder {name!r} is registered twice")
    _ENCODERS[name] = make


def registered() -> Mapping[int, RecordCodec]:
    _load_all()
    return MappingProxyType(_BY_ID)


def encoder_names() -> frozenset[str]:
    _load_all()
    return frozenset(_ENCODERS)


def record_codec(codec_id: int) -> RecordCodec:
    _load_all()
    try:
        return _BY_ID[codec_id]
    except KeyError:
        raise UnsupportedFormatError(f"unknown codec id {codec_id}") from None


def decode_chunk_into(codec_id: int, payload: Buffer, out: np.ndarray, base: Buffer | np.ndarray | None = None) -> None:
    """Decode a record payload into ``out`` (uint8, exactly the raw size).
    ``base`` is the plain bytes of the record's base, for delta records."""
    record_codec(codec_id).decode_into(payload, out, base)


def decode_chunk(codec_id: int, payload: Buffer, raw_size: int, base: Buffer | np.ndarray | None = None) -> Buffer:
    """The plain bytes of one record's payload."""
    codec = record_codec(codec_id)
    if codec.decoder is not None:
        return codec.decoder.decode(payload, raw_size)
    import numpy as np

    out = np.empty(raw_size, dtype=np.uint8)
    codec.decode_into(payload, out, base)
    return out.data


def decoder_for(codec_id: int) -> Codec:
    """The codec that decodes whole-buffer records (raw, zstd) stored with ``codec_id``."""
    _load_all()
    decoder = _BY_ID[codec_id].decoder if codec_id in _BY_ID else None
    if decoder is None:
        raise UnsupportedFormatError(f"unknown codec id {codec_id}")
    return decoder


def make_codec(name: str, level: int | None = None, format4: bool = False) -> Codec:
    """An encoder configured by the repo config (``{"name": ..., "level": ...}``);
    ``format4``: it may write what format version 4 adds (Huffman planes, scaled deltas)."""
    _load_all()
    try:
        make = _ENCODERS[name]
    except KeyError:
        raise UnsupportedFormatError(f"unknown codec {name!r}; known: {sorted(_ENCODERS)}") from None
    return make(level, format4)
