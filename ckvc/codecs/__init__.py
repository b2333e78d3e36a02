"""Codecs: pure byte transforms between an object's plain bytes and its stored bytes.

Each stored record names its codec by a one-byte id (docs/FORMAT.md §6):

    0 raw   1 zstd   2 bytegroup (byte planes, codecs/planes.py)
    3 delta against a base chunk named in the record (codecs/delta.py)   4 sparse (codecs/sparse.py)
    5 quant: the opt-in lossy tier, blockwise quantization (codecs/lossy.py)

Decoding never produces more than the declared raw size, and any malformed
input raises :class:`ckvc.errors.CorruptObjectError`. Codecs do no I/O: a
delta's base bytes are handed in by the object store.
"""

from __future__ import annotations

import struct
import threading
from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple

import numpy as np
import zstandard

from ckvc.codecs.delta import SUB, XOR, apply_residual, residual
from ckvc.codecs.lossy import dequantize_into
from ckvc.codecs.planes import (
    SUPPORTED_WIDTHS,
    add_residual_planes,
    as_u8,
    decode_plane_set,
    decode_planes_into,
    encode_planes,
    join_planes,
    sample_planes,
    scratch,
    zstd_decode,
)
from ckvc.codecs.sparse import SPARSE_WIDTHS, decode_sparse_into, encode_sparse, zero_fraction
from ckvc.errors import CorruptObjectError, UnsupportedFormatError

Buffer = bytes | bytearray | memoryview

RAW, ZSTD, BYTEGROUP, DELTA, SPARSE, QUANT = 0, 1, 2, 3, 4, 5
CODEC_NAMES = {RAW: "raw", ZSTD: "zstd", BYTEGROUP: "bytegroup", DELTA: "delta", SPARSE: "sparse", QUANT: "quant"}
# Codecs whose plain bytes need no other object: only these may serve as keyframes.
WHOLE_CODECS = frozenset({RAW, ZSTD, BYTEGROUP, SPARSE})


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


class RawCodec(Codec):
    codec_id = RAW
    name = "raw"

    def encode(self, data: Buffer) -> Buffer:
        return data

    def decode(self, data: Buffer, raw_size: int) -> Buffer:
        if len(data) != raw_size:
            raise CorruptObjectError(f"raw payload is {len(data)} bytes, expected {raw_size}")
        return data


class ZstdCodec(Codec):
    """zstd frames. Compressor objects are kept per thread: sharing one across
    threads has crashed the process on these machines."""

    codec_id = ZSTD
    name = "zstd"

    def __init__(self, level: int = 1) -> None:
        self.level = level
        self._local = threading.local()

    def _compressor(self) -> zstandard.ZstdCompressor:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            # write_content_size lets the decoder check the size before allocating.
            compressor = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
            self._local.compressor = compressor
        return compressor

    def encode(self, data: Buffer) -> bytes:
        return self._compressor().compress(data)

    def decode(self, data: Buffer, raw_size: int) -> bytes:
        return zstd_decode(data, raw_size)


class DeltaBase(NamedTuple):
    """The chunk a new chunk may be stored as a delta against."""

    oid: bytes
    plain: Buffer
    depth: int  # the base's own chain depth (0: stored without a base)
    age: int = 0  # how many commits ago the base was written, along this tensor


class DeltaHeader(NamedTuple):
    transform: int  # delta.SUB or delta.XOR
    width: int  # element width of the SUB transform (1 for XOR)
    depth: int  # links to decode down to a chunk stored whole (>= 1)
    age: int  # commits since the base was written (1..255; saturates)
    inner: int  # the codec of the residual


_DELTA_HEAD = struct.Struct("<BBBBB")
DELTA_HEAD_SIZE = _DELTA_HEAD.size
DELTA_INNER_CODECS = (RAW, ZSTD, BYTEGROUP, SPARSE)
MAX_CHAIN_DEPTH = 255  # one byte; ckvc writes depth 1 (deltas against keyframes, docs/DESIGN.md)
MAX_AGE = 255
SPARSE_MIN_ZERO_FRACTION = 0.5
DELTA_MIN_GAIN = 0.8  # a delta must be under this fraction of the standalone encoding (docs/DESIGN.md)


class TensorCodec(Codec):
    """The tensor-aware chunk encoder ("auto"): byte planes for multi-byte
    elements, a delta against the tensor's keyframe when that saves enough,
    sparse for mostly-zero data, plain zstd for bytes, raw when nothing helps.
    Whole-buffer ``encode`` (metadata objects) is plain zstd."""

    codec_id = ZSTD
    name = "auto"
    uses_bases = True

    def __init__(self, level: int = 1) -> None:
        self._zstd = ZstdCodec(level)

    def encode(self, data: Buffer) -> bytes | Buffer:
        return self._zstd.encode(data)

    def decode(self, data: Buffer, raw_size: int) -> Buffer:
        return self._zstd.decode(data, raw_size)

    def encode_chunk(
        self, data: Buffer, layout: ChunkLayout = BYTES, base: DeltaBase | None = None
    ) -> tuple[int, Buffer]:
        best: tuple[int, Buffer] = (RAW, data)
        if base is not None and len(base.plain) == len(data) and base.depth < MAX_CHAIN_DEPTH:
            transform, width = (SUB, layout.width) if layout.planes else (XOR, 1)
            # The residual lives until its payload is encoded: a per-thread buffer.
            diff = residual(data, base.plain, transform, width, scratch(3, len(data), np.uint8))
            inner, payload = self._encode_standalone(diff.data, ChunkLayout(width, False) if width > 1 else layout)
            if inner != RAW:
                head = _DELTA_HEAD.pack(transform, width, base.depth + 1, min(base.age + 1, MAX_AGE), inner)
                best = (DELTA, head + payload)
        own = self._encode_standalone(data, layout)
        # A delta costs a second decode (its keyframe) on every checkout: keep it
        # only when it saves enough. Adam's first moment barely gains from one
        # (0.397 vs 0.401 of raw on MiniLM) and decodes 1.8x slower with it.
        if best[0] != DELTA or len(best[1]) >= DELTA_MIN_GAIN * len(own[1]):
            best = own
        return best

    def _encode_standalone(self, data: Buffer, layout: ChunkLayout) -> tuple[int, Buffer]:
        candidates: list[tuple[int, Buffer]] = [(RAW, data)]
        if layout.width in SPARSE_WIDTHS and zero_fraction(data, layout.width) >= SPARSE_MIN_ZERO_FRACTION:
            candidates.append((SPARSE, encode_sparse(data, layout.width, layout.is_float)))
        elif layout.planes:
            sampled = sample_planes(data, layout.width, layout.is_float)
            if sampled is None or any(sampled):  # else every plane would be stored raw: raw wins
                candidates.append((BYTEGROUP, encode_planes(data, layout.width, layout.is_float, sampled)))
        if not layout.planes:
            candidates.append((ZSTD, self._zstd.encode(data)))
        return min(candidates, key=lambda c: len(c[1]))


def decode_chunk_into(codec_id: int, payload: Buffer, out: np.ndarray, base: Buffer | np.ndarray | None = None) -> None:
    """Decode a record payload into ``out`` (uint8, exactly the raw size).
    ``base`` is the plain bytes of the record's base, for delta records."""
    if codec_id == DELTA:
        if base is None or len(base) != len(out):
            raise CorruptObjectError("delta record without a base of its size")
        apply_delta(payload, out, as_u8(base))
    elif codec_id == BYTEGROUP:
        decode_planes_into(payload, out)
    elif codec_id == SPARSE:
        decode_sparse_into(payload, out)
    elif codec_id == QUANT:
        dequantize_into(payload, out, base)
    elif codec_id in _REGISTRY:
        plain = _REGISTRY[codec_id].decode(payload, len(out))
        out[:] = as_u8(plain)
    else:
        raise UnsupportedFormatError(f"unknown codec id {codec_id}")


def apply_delta(payload: Buffer, out: np.ndarray, base: np.ndarray | None) -> None:
    """Decode a delta record's payload into ``out`` given its base's plain bytes,
    or with ``base`` None, turn ``out``, which holds the base, into the chunk in
    place (a checkout decodes the keyframe straight into the destination)."""
    head = delta_header(payload)
    inner = memoryview(payload)[_DELTA_HEAD.size :]
    old = out if base is None else base
    # Where the residual cannot be added while decoding, it needs a buffer of its
    # own when out holds the base.
    residual = scratch(4, len(out), np.uint8) if base is None else out
    if head.inner == BYTEGROUP and head.transform == SUB:
        decoded = decode_plane_set(inner, len(out))
        if add_residual_planes(decoded, old, out, head.width):
            return
        join_planes(*decoded, residual)
    else:
        decode_chunk_into(head.inner, inner, residual)
    apply_residual(residual, old, head.transform, head.width)
    if residual is not out:
        out[:] = residual


def delta_header(payload: Buffer) -> DeltaHeader:
    """The head of a delta payload, checked."""
    if len(payload) < _DELTA_HEAD.size:
        raise CorruptObjectError("delta payload truncated")
    head = DeltaHeader(*_DELTA_HEAD.unpack_from(payload, 0))
    valid = (head.transform == XOR and head.width == 1) or (head.transform == SUB and head.width in SUPPORTED_WIDTHS)
    if not valid or head.inner not in DELTA_INNER_CODECS or head.depth < 1 or head.age < 1:
        raise CorruptObjectError(f"delta header invalid: {head}")
    return head


def decode_chunk(codec_id: int, payload: Buffer, raw_size: int, base: Buffer | np.ndarray | None = None) -> Buffer:
    """The plain bytes of one record's payload."""
    if codec_id in _REGISTRY:
        return _REGISTRY[codec_id].decode(payload, raw_size)
    out = np.empty(raw_size, dtype=np.uint8)
    decode_chunk_into(codec_id, payload, out, base)
    return out.data


_REGISTRY: dict[int, Codec] = {RAW: RawCodec(), ZSTD: ZstdCodec()}
_BY_NAME: dict[str, type[Codec]] = {"raw": RawCodec, "zstd": ZstdCodec, "auto": TensorCodec}


def decoder_for(codec_id: int) -> Codec:
    """The codec that decodes whole-buffer records (raw, zstd) stored with ``codec_id``."""
    try:
        return _REGISTRY[codec_id]
    except KeyError:
        raise UnsupportedFormatError(f"unknown codec id {codec_id}") from None


def make_codec(name: str, level: int | None = None) -> Codec:
    """An encoder configured by the repo config (``{"name": ..., "level": ...}``)."""
    if name == "zstd":
        return ZstdCodec(level if level is not None else 1)
    if name == "auto":
        return TensorCodec(level if level is not None else 1)
    if name == "raw":
        return RawCodec()
    raise UnsupportedFormatError(f"unknown codec {name!r}; known: {sorted(_BY_NAME)}")


def encode_smallest(codec: Codec, data: Buffer) -> tuple[int, Buffer]:
    """(codec id, stored bytes): the codec's output, or raw when that does not shrink."""
    encoded = codec.encode(data)
    if codec.codec_id != RawCodec.codec_id and len(encoded) < len(data):
        return codec.codec_id, encoded
    return RawCodec.codec_id, data
