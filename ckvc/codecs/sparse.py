"""Sparse payloads: mostly-zero chunks as a bitmap of nonzero elements plus their values.

Layout (docs/FORMAT.md, "sparse payload")::

    u8 width  u8 flags(bit 0: sign swap)  u64 element count  u64 nonzero count  u32 mask size  u32 values size
    mask    zstd frame of ceil(n / 8) bytes: bit i (little-endian bit order) set when element i is nonzero
    values  the nonzero elements in order: a bytegroup payload (width 2, 4, 8) or raw bytes (width 1)
    tail    raw_size % width bytes, raw

A zero element is one whose bytes are all zero (so -0.0 is nonzero and kept exactly).
"""

from __future__ import annotations

import struct

import numpy as np

from ckvc.codecs.base import SPARSE
from ckvc.codecs.planes import (
    FLAG_SIGN_SWAP,
    SUPPORTED_WIDTHS,
    as_u8,
    decode_planes_into,
    encode_planes,
    zstd_decode,
    zstd_plane_encode,
)
from ckvc.codecs.registry import RecordCodec, register
from ckvc.errors import CorruptObjectError
from ckvc.ids import Buffer

_HEAD = struct.Struct("<BBQQII")
SPARSE_WIDTHS = (1, *SUPPORTED_WIDTHS)


def _elements(raw: np.ndarray, width: int) -> np.ndarray:
    """Each element as one unsigned integer (or a byte row for width 1)."""
    n = len(raw) // width
    return raw[: n * width].view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width])


# A strided sample of at least _ZERO_SAMPLE_MIN elements decides for most chunks
# whether the full count is needed: its zero fraction is within 0.1 of the chunk's
# at six standard errors. Strides are primes, so that no row length of a real
# tensor lines up with them; the longest that leaves the sample that many elements
# is taken (each sampled element is a cache miss: one in 61 read half of a chunk's
# cache lines).
_ZERO_SAMPLE_STRIDES = (8191, 4093, 2039, 1021, 509, 251, 127, 61)
_ZERO_SAMPLE_MIN = 1024
_ZERO_SAMPLE_MARGIN = 0.1


def zero_sample_stride(n: int) -> int:
    """The sample's stride for a chunk of ``n`` elements (61 where none leaves
    _ZERO_SAMPLE_MIN of them)."""
    return next((p for p in _ZERO_SAMPLE_STRIDES if n // p >= _ZERO_SAMPLE_MIN), _ZERO_SAMPLE_STRIDES[-1])


def mostly_zero(data: Buffer, width: int, threshold: float) -> bool:
    """Whether at least ``threshold`` of the elements are zero. A strided sample
    rules a chunk out when it shows fewer than ``threshold - 0.1`` zeros: counting
    every element was a tenth of a dense chunk's encode. A chunk whose zeros avoid
    the sampled positions is coded as a dense one: still exact, and larger (a 4 MiB
    chunk holding one value in 61, exactly off a 1-in-61 sample: 102 KB against
    70 KB)."""
    raw = as_u8(data)
    n = len(raw) // width
    if n == 0:
        return False
    elements = _elements(raw, width)
    stride = zero_sample_stride(n)
    if n >= 64 * stride:
        sample = elements[::stride]
        if 1.0 - np.count_nonzero(sample) / len(sample) < threshold - _ZERO_SAMPLE_MARGIN:
            return False
    return bool(1.0 - np.count_nonzero(elements) / n >= threshold)


def encode_sparse(data: Buffer, width: int, sign_swap: bool, huffman: bool = False) -> bytes:
    if width not in SPARSE_WIDTHS:
        raise ValueError(f"unsupported element width {width}")
    raw = as_u8(data)
    n = len(raw) // width
    elements = _elements(raw, width)
    nonzero = elements != 0
    mask = zstd_plane_encode(np.packbits(nonzero, bitorder="little").tobytes())
    values = elements[nonzero].view(np.uint8)
    packed_values = encode_planes(values.data, width, sign_swap, huffman=huffman) if width > 1 else values.tobytes()
    nnz = int(np.count_nonzero(nonzero))
    flags = FLAG_SIGN_SWAP if sign_swap and width > 1 else 0
    head = _HEAD.pack(width, flags, n, nnz, len(mask), len(packed_values))
    return b"".join([head, mask, packed_values, raw[n * width :].tobytes()])


def decode_sparse_into(payload: Buffer, out: np.ndarray, base: Buffer | np.ndarray | None = None) -> None:
    view = memoryview(payload)
    if len(view) < _HEAD.size:
        raise CorruptObjectError("sparse payload truncated")
    width, flags, count, nnz, mask_size, values_size = _HEAD.unpack_from(view, 0)
    if width not in SPARSE_WIDTHS or flags & ~FLAG_SIGN_SWAP:
        raise CorruptObjectError(f"sparse header invalid (width {width}, flags {flags})")
    n = len(out) // width
    if count != n:
        raise CorruptObjectError(f"sparse payload holds {count} elements, expected {n}")
    if nnz > n:
        raise CorruptObjectError(f"sparse payload claims {nnz} nonzero elements of {n}")
    pos = _HEAD.size
    mask_frame = view[pos : pos + mask_size]
    values = view[pos + mask_size : pos + mask_size + values_size]
    tail = view[pos + mask_size + values_size :]
    if len(mask_frame) != mask_size or len(values) != values_size or len(tail) != len(out) - n * width:
        raise CorruptObjectError("sparse payload sections do not add up to its size")
    bits = np.unpackbits(as_u8(zstd_decode(mask_frame, (n + 7) // 8)), count=n, bitorder="little").view(bool)
    if int(np.count_nonzero(bits)) != nnz:
        raise CorruptObjectError("sparse mask does not match its nonzero count")
    decoded = np.empty(nnz * width, dtype=np.uint8)
    if width > 1:
        decode_planes_into(values, decoded)
    elif len(values) == nnz:
        decoded[:] = as_u8(values)
    else:
        raise CorruptObjectError("sparse values have the wrong size")
    elements = _elements(out, width)
    elements[:] = 0
    elements[bits] = _elements(decoded, width)
    out[n * width :] = as_u8(tail)


register(RecordCodec(SPARSE, "sparse", decode_sparse_into, whole=True))
