"""Delta residuals: a chunk relative to a base chunk of the same size.

Two transforms (docs/FORMAT.md, "delta payload"):

- ``sub``: per element of ``width`` bytes (2, 4, 8; little-endian), the wrapping
  difference ``new - base`` of the bit patterns, zigzag-mapped so that small
  differences of either sign have zero high bytes. Between consecutive epochs a
  weight moves by a few ulps of its own magnitude, so the difference of the
  patterns is small where XOR would carry across bit boundaries: measured on
  MiniLM fine-tuning, 0.266 of raw for the weights against 0.311 with XOR, and
  0.319 against 0.354 for Adam's second moment (benchmarks/compression.py).
- ``xor``: bytewise XOR, for data without a numeric layout.
- ``scaled sub`` (float32, format version 4): ``sub`` against the base times a factor
  stored in the head. Adam's second moment decays by beta2 every step, so between
  saves 20 steps apart it shrinks by 0.98 throughout: against the scaled base the
  residual of a from-scratch run is 0.40 of raw instead of 0.56 (docs/DESIGN.md,
  "Scaled deltas").

Bytes past the last whole element (odd sizes) are always XORed.

A delta record (codec 3) is a five-byte head (transform, width, chain depth,
age, inner codec), the float32 factor for ``scaled sub``, and the residual stored
with the inner codec.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

from ckvc.codecs import planes
from ckvc.codecs.base import BYTEGROUP, DELTA, RAW, SPARSE, ZSTD
from ckvc.codecs.codec_ids import DELTA_HEAD
from ckvc.codecs.planes import SUPPORTED_WIDTHS, add_residual_planes, as_u8, decode_plane_set, join_planes, scratch
from ckvc.codecs.registry import RecordCodec, decode_chunk_into, register
from ckvc.errors import CorruptObjectError
from ckvc.ids import Buffer

XOR = 1
SUB = 2
SCALED_SUB = 3
SCALE = struct.Struct("<f")
_FLOAT32_MIN_NORMAL = np.float32(np.finfo(np.float32).tiny)
_SCALE_SAMPLE = 1 << 12  # elements the factor is fitted and judged on
# Scaling must shorten the residuals of the sample by this many bits an element on
# average: a parameter's or first moment's factor is ~1 or noise, and a second
# encoding of every such chunk doubled the delta's cost for nothing.
_SCALE_MIN_GAIN_BITS = 0.25
_UINT: dict[int, type[np.unsignedinteger[Any]]] = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {2: np.int16, 4: np.int32, 8: np.int64}


def residual(data: Buffer, base: Buffer, transform: int, width: int, out: np.ndarray | None = None) -> np.ndarray:
    """The residual of ``data`` against ``base`` (same size), as bytes, written
    into ``out`` (uint8 of that size) when given."""
    new, old = as_u8(data), as_u8(base)
    if out is None:
        out = np.empty(len(new), dtype=np.uint8)
    if transform == XOR:
        return np.bitwise_xor(new, old, out=out)
    n = len(new) // width * width
    np.bitwise_xor(new[n:], old[n:], out=out[n:])
    native = planes.native()
    if native is not None:
        native.zigzag_residual(new, old, width, out[:n])
        return out
    diff = new[:n].view(_UINT[width]) - old[:n].view(_UINT[width])  # wraps
    signed = diff.view(_INT[width])
    out[:n].view(_UINT[width])[:] = ((signed << 1) ^ (signed >> (8 * width - 1))).view(_UINT[width])
    return out


def fit_scale(data: Buffer, base: Buffer) -> float | None:
    """The float32 factor that best turns ``base`` into ``data`` (both float32
    elements): the median ratio over a strided sample of pairs of one sign, both
    normal. None where scaling the base would not shorten the sample's residuals
    by _SCALE_MIN_GAIN_BITS (then SUB does as well)."""
    new, old = as_u8(data), as_u8(base)
    n = len(new) // 4
    step = max(1, n // _SCALE_SAMPLE)
    x = np.ascontiguousarray(new[: n * 4].view(np.float32)[::step])
    y = np.ascontiguousarray(old[: n * 4].view(np.float32)[::step])
    with np.errstate(all="ignore"):
        ratio = x / y
        usable = (np.abs(x) >= _FLOAT32_MIN_NORMAL) & (np.abs(y) >= _FLOAT32_MIN_NORMAL) & (ratio > 0)
        usable &= np.isfinite(x) & np.isfinite(y)
    if not usable.any():
        return None
    scale = np.float32(np.median(ratio[usable]))
    if not (np.isfinite(scale) and scale >= _FLOAT32_MIN_NORMAL) or scale == 1:
        return None
    predicted = scaled_base(y.view(np.uint8), float(scale), np.empty(4 * len(y), dtype=np.uint8))
    if _mean_bits(x, y) - _mean_bits(x, predicted.view(np.float32)) < _SCALE_MIN_GAIN_BITS:
        return None
    return float(scale)


def _mean_bits(x: np.ndarray, base: np.ndarray) -> float:
    """The mean bit length of the zigzagged differences of float32 bit patterns."""
    diff = (x.view(np.uint32) - base.view(np.uint32)).view(np.int32)  # wraps
    zigzag = ((diff << 1) ^ (diff >> 31)).view(np.uint32)
    return float(np.mean(np.log2(zigzag.astype(np.float64) + 1.0)))


def scaled_base(base: Buffer | np.ndarray, scale: float, out: np.ndarray) -> np.ndarray:
    """The prediction of a scaled sub delta (FORMAT.md 6.3), in ``out`` (uint8, the
    base's size): each float32 element of the base times ``scale``, rounded to
    nearest; an element whose base or product is not a finite normal number keeps
    the base's bits, so flush-to-zero modes and NaN payloads cannot change it."""
    old = as_u8(base)
    fast = planes.native()
    if fast is not None:
        fast.scaled_base(old, scale, out)
        return out
    n = len(old) // 4 * 4
    b = old[:n].view(np.float32)
    product = out[:n].view(np.float32)
    with np.errstate(all="ignore"):
        np.multiply(b, np.float32(scale), out=product)
        keep = ~(np.isfinite(b) & (np.abs(b) >= _FLOAT32_MIN_NORMAL))
        keep |= ~(np.isfinite(product) & (np.abs(product) >= _FLOAT32_MIN_NORMAL))
    out[:n].view(np.uint32)[keep] = old[:n].view(np.uint32)[keep]
    out[n:] = old[n:]
    return out


def apply_residual(out: np.ndarray, base: Buffer | np.ndarray, transform: int, width: int) -> None:
    """Turn the residual held in ``out`` into the chunk, in place."""
    old = as_u8(base)
    if len(old) != len(out):
        raise CorruptObjectError("delta base has the wrong size")
    if transform == XOR:
        np.bitwise_xor(out, old, out=out)
        return
    if transform != SUB or width not in _UINT:
        raise CorruptObjectError(f"unknown delta transform {transform} (width {width})")
    n = len(out) // width * width
    np.bitwise_xor(out[n:], old[n:], out=out[n:])
    native = planes.native()
    if native is not None:
        native.apply_zigzag(out[:n], old[:n], width)
        return
    zigzag = out[:n].view(_UINT[width])
    sign = scratch(100, len(zigzag), _UINT[width])
    np.bitwise_and(zigzag, 1, out=sign)
    np.negative(sign, out=sign)  # 0 or all ones
    zigzag >>= 1
    zigzag ^= sign
    zigzag += old[:n].view(_UINT[width])  # wraps


class DeltaHeader(NamedTuple):
    transform: int  # SUB, SCALED_SUB or XOR
    width: int  # element width of the SUB transform (1 for XOR)
    depth: int  # links to decode down to a chunk stored whole (>= 1)
    age: int  # commits since the base was written (1..255; saturates)
    inner: int  # the codec of the residual


DELTA_HEAD_SIZE = DELTA_HEAD.size
DELTA_INNER_CODECS = (RAW, ZSTD, BYTEGROUP, SPARSE)
MAX_CHAIN_DEPTH = 255  # one byte; ckvc writes depth 1 (deltas against keyframes, docs/DESIGN.md)


def delta_header(payload: Buffer) -> DeltaHeader:
    """The head of a delta payload, checked."""
    if len(payload) < DELTA_HEAD.size:
        raise CorruptObjectError("delta payload truncated")
    head = DeltaHeader(*DELTA_HEAD.unpack_from(payload, 0))
    valid = (head.transform == XOR and head.width == 1) or (head.transform == SUB and head.width in SUPPORTED_WIDTHS)
    valid |= head.transform == SCALED_SUB and head.width == 4
    if not valid or head.inner not in DELTA_INNER_CODECS or head.depth < 1 or head.age < 1:
        raise CorruptObjectError(f"delta header invalid: {head}")
    return head


def apply_delta(payload: Buffer, out: np.ndarray, base: np.ndarray | None) -> None:
    """Decode a delta record's payload into ``out`` given its base's plain bytes,
    or with ``base`` None, turn ``out``, which holds the base, into the chunk in
    place (a checkout decodes the keyframe straight into the destination)."""
    head = delta_header(payload)
    start, transform = DELTA_HEAD.size, head.transform
    old: np.ndarray = out if base is None else base
    scale: float | None = None
    if transform == SCALED_SUB:
        if len(payload) < start + SCALE.size:
            raise CorruptObjectError("delta payload truncated")
        (scale,) = SCALE.unpack_from(payload, start)
        if not (np.isfinite(scale) and scale >= _FLOAT32_MIN_NORMAL):
            raise CorruptObjectError(f"delta scale {scale} is not a positive normal float32")
        start += SCALE.size
        transform = SUB
    inner = memoryview(payload)[start:]
    decoded = decode_plane_set(inner, len(out)) if head.inner == BYTEGROUP and transform == SUB else None
    if decoded is not None and add_residual_planes(decoded, old, out, head.width, scale):
        return  # one pass: planes joined, the base scaled and the residual added
    if scale is not None:
        old = scaled_base(old, scale, scratch(7, len(out), np.uint8))
    # Where the residual cannot be added while decoding, it needs a buffer of its
    # own when out holds the base.
    diff = scratch(4, len(out), np.uint8) if old is out else out
    if decoded is not None:
        join_planes(*decoded, diff)
    else:
        decode_chunk_into(head.inner, inner, diff)
    apply_residual(diff, old, transform, head.width)
    if diff is not out:
        out[:] = diff


def decode_delta_into(payload: Buffer, out: np.ndarray, base: Buffer | np.ndarray | None = None) -> None:
    if base is None or len(base) != len(out):
        raise CorruptObjectError("delta record without a base of its size")
    apply_delta(payload, out, as_u8(base))


register(RecordCodec(DELTA, "delta", decode_delta_into, whole=False))
