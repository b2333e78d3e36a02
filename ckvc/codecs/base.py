"""What every codec shares: the one-byte codec ids (docs/FORMAT.md §6), how a
chunk's bytes group into elements, and the interface of a configured encoder.
Pure definitions: the id -> codec table is registry.py's."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple

import numpy as np

# The ids live in ids.py (no numpy); the codecs keep finding them here too.
from ckvc.codecs.codec_ids import BYTEGROUP as BYTEGROUP
from ckvc.codecs.codec_ids import DELTA as DELTA
from ckvc.codecs.codec_ids import QUANT as QUANT
from ckvc.codecs.codec_ids import RAW as RAW
from ckvc.codecs.codec_ids import SPARSE as SPARSE
from ckvc.codecs.codec_ids import ZSTD as ZSTD
from ckvc.codecs.planes import SUPPORTED_WIDTHS
from ckvc.ids import Buffer


class ChunkLayout(NamedTuple):
    """How a chunk's bytes group into elements: the width of one scalar and
    whether it is a float whose sign bit should move below the exponent."""

    width: int
    is_float: bool

    @property
    def planes(self) -> bool:
        return self.width in SUPPORTED_WIDTHS


BYTES = ChunkLayout(1, False)
_FLOAT_DTYPES = {
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 2, "complex64": 4, "complex128": 8,
}  # fmt: skip
_INT_DTYPES = {"int16": 2, "int32": 4, "int64": 8, "uint16": 2, "uint32": 4, "uint64": 8}


def layout_for(dtype: str) -> ChunkLayout:
    """The element layout of a blob dtype name ("float32", "numpy:<f4")."""
    if dtype in _FLOAT_DTYPES:  # complex: the real and imaginary parts are floats of half the size
        return ChunkLayout(_FLOAT_DTYPES[dtype], True)
    if dtype in _INT_DTYPES:
        return ChunkLayout(_INT_DTYPES[dtype], False)
    if dtype.startswith("numpy:"):
        try:
            np_dtype = np.dtype(dtype[6:])
        except TypeError:
            return BYTES
        if np_dtype.byteorder == ">":  # big-endian bytes do not sort low to high
            return BYTES
        if np_dtype.kind in "fc":
            width = np_dtype.itemsize // (2 if np_dtype.kind == "c" else 1)
            return ChunkLayout(width, True) if width in SUPPORTED_WIDTHS else BYTES
        if np_dtype.kind in "iumM" and np_dtype.itemsize in SUPPORTED_WIDTHS:
            return ChunkLayout(np_dtype.itemsize, False)
    return BYTES


class DeltaBase(NamedTuple):
    """The chunk a new chunk may be stored as a delta against."""

    oid: bytes
    plain: Buffer
    depth: int  # the base's own chain depth (0: stored without a base)
    age: int = 0  # how many commits ago the base was written, along this tensor


class Codec(ABC):
    """A repository's chunk encoder, as configured (``{"name": ..., "level": ...}``)."""

    codec_id: ClassVar[int]
    name: ClassVar[str]
    uses_bases: ClassVar[bool] = False

    @abstractmethod
    def encode(self, data: Buffer) -> bytes | Buffer:
        """Encoded bytes; may return ``data`` itself when the codec is the identity."""

    @abstractmethod
    def decode(self, data: Buffer, raw_size: int) -> Buffer:
        """Exactly ``raw_size`` plain bytes, or CorruptObjectError."""

    def encode_chunk(
        self, data: Buffer, layout: ChunkLayout = BYTES, base: DeltaBase | None = None
    ) -> tuple[int, Buffer]:
        """(codec id, payload) for one chunk; raw when nothing is smaller."""
        return encode_smallest(self, data)


def encode_smallest(codec: Codec, data: Buffer) -> tuple[int, Buffer]:
    """(codec id, stored bytes): the codec's output, or raw when that does not shrink."""
    encoded = codec.encode(data)
    if codec.codec_id != RAW and len(encoded) < len(data):
        return codec.codec_id, encoded
    return RAW, data
