"""Codecs: pure byte transforms between an object's plain bytes and its stored bytes.

Each stored record names its codec by a one-byte id (docs/FORMAT.md §6), one
module per codec, each registering itself in registry.py:

    0 raw (raw.py)   1 zstd (zstd.py)   2 bytegroup: byte planes (bytegroup.py over planes.py)
    3 delta against a base chunk named in the record (delta.py)   4 sparse (sparse.py)
    5 quant: the opt-in lossy tier, blockwise quantization (lossy.py)

A repository's encoder is chosen by name ("raw", "zstd", "auto": auto.py, the
tensor-aware one) through :func:`make_codec`. Decoding never produces more than
the declared raw size, and any malformed input raises
:class:`ckvc.errors.CorruptObjectError`. Codecs do no I/O: a delta's base bytes
are handed in by the object store. Importing this package loads no codec (nor numpy): each name below is imported on
first use (PEP 562), and the first registry lookup registers every codec.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckvc.codecs.codec_ids import BYTEGROUP, CODEC_NAMES, DELTA, MAX_AGE, QUANT, RAW, SPARSE, WHOLE_CODECS, ZSTD
from ckvc.ids import Buffer

# Name -> the module that defines it (ckvc.codecs.<module>).
_LAZY: dict[str, str] = {
    **dict.fromkeys(("DELTA_MIN_GAIN", "SPARSE_MIN_ZERO_FRACTION", "TensorCodec"), "auto"),
    **dict.fromkeys(("BYTES", "ChunkLayout", "Codec", "DeltaBase", "encode_smallest", "layout_for"), "base"),
    **dict.fromkeys(
        ("DELTA_HEAD_SIZE", "DELTA_INNER_CODECS", "MAX_CHAIN_DEPTH", "DeltaHeader", "apply_delta", "delta_header"),
        "delta",
    ),
    "RawCodec": "raw",
    **dict.fromkeys(
        ("RecordCodec", "decode_chunk", "decode_chunk_into", "decoder_for", "make_codec", "record_codec", "registered"),
        "registry",
    ),
    "ZstdCodec": "zstd",
}

if TYPE_CHECKING:
    from ckvc.codecs.auto import DELTA_MIN_GAIN, SPARSE_MIN_ZERO_FRACTION, TensorCodec
    from ckvc.codecs.base import BYTES, ChunkLayout, Codec, DeltaBase, encode_smallest, layout_for
    from ckvc.codecs.delta import (
        DELTA_HEAD_SIZE,
        DELTA_INNER_CODECS,
        MAX_CHAIN_DEPTH,
        DeltaHeader,
        apply_delta,
        delta_header,
    )
    from ckvc.codecs.raw import RawCodec
    from ckvc.codecs.registry import (
        RecordCodec,
        decode_chunk,
        decode_chunk_into,
        decoder_for,
        make_codec,
        record_codec,
        registered,
    )
    from ckvc.codecs.zstd import ZstdCodec


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckvc.codecs' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ckvc.codecs.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


__all__ = [
    "BYTEGROUP",
    "BYTES",
    "CODEC_NAMES",
    "DELTA",
    "DELTA_HEAD_SIZE",
    "DELTA_INNER_CODECS",
    "DELTA_MIN_GAIN",
    "MAX_AGE",
    "MAX_CHAIN_DEPTH",
    "QUANT",
    "RAW",
    "SPARSE",
    "SPARSE_MIN_ZERO_FRACTION",
    "WHOLE_CODECS",
    "ZSTD",
    "Buffer",
    "ChunkLayout",
    "Codec",
    "DeltaBase",
    "DeltaHeader",
    "RawCodec",
    "RecordCodec",
    "TensorCodec",
    "ZstdCodec",
    "apply_delta",
    "decode_chunk",
    "decode_chunk_into",
    "decoder_for",
    "delta_header",
    "encode_smallest",
    "layout_for",
    "make_codec",
    "record_codec",
    "registered",
]
