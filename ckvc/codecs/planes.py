"""Byte planes: the tensor-aware transform under the bytegroup, delta and sparse codecs.

A float's bytes are far from equally compressible: the exponent byte of a
trained weight holds ~2.5 bits of entropy, the low mantissa bytes ~8. Split
each element's bytes into planes by significance (plane 0 = least significant
byte) and each plane compresses on its own statistics; the exponent plane
shrinks to about a third while incompressible planes are stored as they are.

For floats the sign bit trades places with the lowest exponent bit ("sign
swap": bit 7 of the top byte with bit 7 of the next byte), so that the most
significant plane holds all eight exponent bits of an fp32 or bf16 and the
random sign joins the mantissa. ZipNN rotates the sign out for the same gain
(0.0025 of raw on MiniLM fp32); the swap is its own inverse and costs three
vector operations per plane pair instead of seven.

Layout of an encoded plane set (docs/FORMAT.md, "bytegroup payload")::

    u8 width  u8 flags(bit 0: sign swap)  (u8 plane codec, u32 stored size) * width
    plane payloads, plane 0 first   tail (raw_size % width bytes, raw)

Plane codecs: 0 raw, 1 zstd frame (with its content size), 2 Huffman (huffman.py;
written only with the native loops, into repositories of format version 4).
"""

from __future__ import annotations

import struct
import sys
import threading
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import zstandard

from ckvc.codecs import huffman as huffman_plane
from ckvc.codecs.frames import zstd_decode
from ckvc.errors import CorruptObjectError
from ckvc.ids import Buffer

try:
    from ckvc import _native
except ImportError:  # installed without a C compiler: the numpy loops below give the same bytes, slower
    _native = None  # type: ignore[assignment]

PLANE_RAW = 0
PLANE_ZSTD = 1
PLANE_HUFFMAN = 2
FLAG_SIGN_SWAP = 1
SUPPORTED_WIDTHS = (2, 4, 8)
_HEAD = struct.Struct("<BB")
_PLANE = struct.Struct("<BI")
# A plane is compressed only when a sample of it shrinks below this fraction:
# the low mantissa planes of trained weights never do, and skipping them is
# most of the CPU budget on incompressible data.
_SAMPLE_SIZE = 64 << 10
_SAMPLE_KEEP_RATIO = 0.97
# Huffman is kept over zstd up to this size ratio: it decodes an exponent plane
# about twice as fast, and zstd wins by more only on planes with long repeats
# (docs/DESIGN.md, "Huffman planes").
_HUFFMAN_MAX_OVER_ZSTD = 1.01
_HUFFMAN_TRY_BELOW = 0.9
_MEDIUM_SAMPLE = 16 << 10  # what decides a plane too short for the 64 KiB sample
# A probe of 16 K elements, eight stretches spread over the sample, decides on its own
# where the verdict is clear there (zstd's trial on the whole sample was most of the
# sampling time): Huffman, or raw where neither coder leaves less than
# _PROBE_RAW_RATIO. Repeats or structure that lie between the stretches are the blind
# spot: such a plane is Huffman-coded or stored raw, larger than zstd would make it
# (docs/DESIGN.md, "Huffman planes"). Eight stretches, not the sample's head: judged
# on its head (or four stretches), MiniLM's fp32 chunks whose low mantissa planes
# compress only further in were stored raw (1.0038x ZipNN's size, now 1.0015x).
_PROBE_SIZE = 16 << 10
_PROBE_STRETCHES = 8
_PROBE_RAW_RATIO = 0.99
# A plane this small is not sampled: zstd is tried on it only when at most half of
# the byte values it could hold occur in it. A random (mantissa) plane of a tiny
# tensor holds more and never shrinks, and the zstd call that finds so is a fixed
# cost of the kind that dominates tiny tensors (docs/DESIGN.md, "Many small tensors").
_TINY_PLANE = 1024
# zstd tuned towards its Huffman literal coder: byte planes have skewed symbol
# statistics but few long repeats. Measured on MiniLM's exponent plane: 0.325 of
# raw at 0.77 GB/s compress / 2.2 GB/s decompress, against 0.361 at 0.29 / 1.2
# for level 1 (benchmarks/compression.py reports the figures).
_PLANE_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=17,
    chain_log=6,
    hash_log=6,
    search_log=1,
    min_match=7,
    target_length=0,
    strategy=zstandard.STRATEGY_FAST,
    write_content_size=True,
)

_local = threading.local()


def scratch(slot: int, n: int, dtype: type[np.unsignedinteger[Any]]) -> np.ndarray:
    """A per-thread reusable array: fresh memory costs a page fault per 4 KiB, which
    in these VMs is slower than the arithmetic done on it."""
    buffers: dict[int, np.ndarray] = _local.__dict__.setdefault("scratch", {})
    nbytes = n * np.dtype(dtype).itemsize
    buf = buffers.get(slot)
    if buf is None or len(buf) < nbytes:
        buf = buffers[slot] = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buf[:nbytes].view(dtype)


def _compressor() -> zstandard.ZstdCompressor:
    # One per thread: a zstandard (de)compressor shared across threads has crashed here.
    c = getattr(_local, "compressor", None)
    if c is None:
        c = _local.compressor = zstandard.ZstdCompressor(compression_params=_PLANE_PARAMS)
    return c


def native() -> ModuleType | None:
    """The C loops (ckvc._native), or None when they did not build. Looked up on
    each call, so a test that sets ``planes._native = None`` covers the fallbacks."""
    return _native


def as_u8(data: Buffer | np.ndarray) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data.view(np.uint8).reshape(-1)
    return np.frombuffer(data, dtype=np.uint8)


def split_planes(
    data: Buffer, width: int, sign_swap: bool, out: np.ndarray | None = None
) -> tuple[list[np.ndarray], np.ndarray]:
    """(planes, tail): the element bytes grouped by significance, plane 0 lowest.
    With the native loops the planes are views of ``out`` (uint8, the whole
    elements' size) when it is given, else of a new array."""
    raw = as_u8(data)
    n = len(raw) // width
    if _native is not None:
        grouped = np.empty(n * width, dtype=np.uint8) if out is None else out
        _native.split_planes(raw, width, sign_swap, grouped)
        return [grouped[k * n : (k + 1) * n] for k in range(width)], raw[n * width :]
    grid = raw[: n * width].reshape(n, width)
    planes = [grid[:, k].copy() for k in range(width)]  # always copies (the sign swap writes them)
    if sign_swap and n:
        hi, nxt = planes[-1], planes[-2]  # fresh copies: safe to change in place
        swap = np.bitwise_xor(hi, nxt)
        swap &= 0x80
        hi ^= swap
        nxt ^= swap
    return planes, raw[n * width :]


def join_planes(
    planes: list[np.ndarray], tail: Buffer | np.ndarray, width: int, sign_swap: bool, out: np.ndarray
) -> None:
    """Inverse of :func:`split_planes`, written into ``out`` (uint8, exact size)."""
    n = len(planes[0]) if planes else 0
    if _native is not None and planes:
        _native.join_planes(planes, sign_swap, out[: n * width])
        out[n * width :] = as_u8(tail)
        return
    if sign_swap and n:
        hi, nxt = planes[-1], planes[-2]  # possibly read-only views of the payload
        swap, new_nxt = scratch(0, n, np.uint8), scratch(1, n, np.uint8)
        np.bitwise_xor(hi, nxt, out=swap)
        swap &= 0x80
        np.bitwise_xor(nxt, swap, out=new_nxt)
        np.bitwise_xor(hi, swap, out=swap)
        planes = [*planes[:-2], new_nxt, swap]
    _interleave(planes, out[: n * width])
    out[n * width :] = as_u8(tail)


def _interleave(planes: list[np.ndarray], out: np.ndarray) -> None:
    """Write planes back as whole elements. Two planes (16-bit types) merge as
    ``lo | hi << 8`` on little-endian words: 0.6 ms for 4 MiB here against 1.3 ms
    for strided byte columns; for 4 and 8 planes the word merges cost more passes
    than they save (1.9 / 3.5 ms), so those are written column by column."""
    if len(planes) == 2 and sys.byteorder == "little":
        word = out.view(np.uint16)
        np.left_shift(planes[1], 8, out=word, dtype=np.uint16, casting="unsafe")
        np.bitwise_or(word, planes[0], out=word)
        return
    grid = out.reshape(-1, len(planes))
    for k, plane in enumerate(planes):
        grid[:, k] = plane


def can_write_huffman() -> bool:
    """Whether this build writes Huffman planes (the encoder is native only)."""
    return _native is not None


def _choose(sample: Buffer, huffman: bool) -> int:
    """The plane codec for a large plane, judged by what each coder makes of its sample."""
    probed = _probe_verdict(probe_of(sample, 1), huffman)
    return _sample_verdict(sample, huffman) if probed is None else probed


def probe_of(data: Buffer, width: int) -> Buffer:
    """_PROBE_STRETCHES stretches of ``width``-byte elements, _PROBE_SIZE elements in
    all, evenly spread over the first _SAMPLE_SIZE elements of ``data`` (all of it
    where that is no longer than the probe)."""
    view = memoryview(data).cast("B")
    n = min(len(view) // width, _SAMPLE_SIZE)
    if n <= _PROBE_SIZE:
        return view[: n * width]
    stretch = _PROBE_SIZE // _PROBE_STRETCHES
    step = (n - stretch) // (_PROBE_STRETCHES - 1)
    return b"".join(view[k * step * width : (k * step + stretch) * width] for k in range(_PROBE_STRETCHES))


def _sample_verdict(sample: Buffer, huffman: bool) -> int:
    """The plane codec by what zstd and (where zstd leaves under _HUFFMAN_TRY_BELOW)
    our coder make of the whole sample."""
    zstd_size = len(_compressor().compress(sample))
    huffman_size = 0
    if huffman and _native is not None and zstd_size <= _HUFFMAN_TRY_BELOW * len(sample):
        huffman_size = _native.huff_size(sample)
    smallest = min(zstd_size, huffman_size) if huffman_size else zstd_size
    if smallest > _SAMPLE_KEEP_RATIO * len(sample):
        return PLANE_RAW
    if huffman_size and huffman_size <= _HUFFMAN_MAX_OVER_ZSTD * zstd_size:
        return PLANE_HUFFMAN
    return PLANE_ZSTD


def _probe_verdict(probe: Buffer, huffman: bool) -> int | None:
    """The plane codec decided on the probe (:func:`probe_of` the plane's sample)
    where it is clear, else None. Clear are: our coder leaves at most
    _HUFFMAN_TRY_BELOW of it and at most _HUFFMAN_MAX_OVER_ZSTD times what zstd,
    whose literals are Huffman-coded too, leaves (Huffman: an exponent plane); and
    both leave over _PROBE_RAW_RATIO of it (raw: a mantissa plane). Only where
    Huffman planes may be written, so that version 3 repositories keep their
    verdicts."""
    if not huffman or _native is None:
        return None
    huffman_size = _native.huff_size(probe)
    if not huffman_size:  # one value: zstd's case
        return None
    if huffman_size <= _HUFFMAN_TRY_BELOW * len(probe):
        zstd_size = len(_compressor().compress(probe))
        return PLANE_HUFFMAN if huffman_size <= _HUFFMAN_MAX_OVER_ZSTD * zstd_size else None
    if huffman_size > _PROBE_RAW_RATIO * len(probe):
        zstd_size = len(_compressor().compress(probe))
        return PLANE_RAW if zstd_size > _PROBE_RAW_RATIO * len(probe) else None
    return None


def smallest_plane(plane: np.ndarray, huffman: bool) -> tuple[int, Buffer]:
    """A plane too short to sample, coded each way: the smallest, Huffman where it
    is within _HUFFMAN_MAX_OVER_ZSTD of zstd."""
    data = plane.data
    best: tuple[int, Buffer] = (PLANE_RAW, data)
    packed = _compressor().compress(data)
    if len(packed) < len(data):
        best = (PLANE_ZSTD, packed)
    # Where zstd, whose literals are Huffman-coded too, barely shrinks the plane, our
    # coder cannot win by much: it is not tried, which keeps small chunks' encode near
    # the cost of zstd alone (docs/DESIGN.md, "Huffman planes").
    if not huffman or _native is None or len(packed) > _HUFFMAN_TRY_BELOW * len(data):
        return best
    coded = _native.huff_encode(data)
    if coded is not None and len(coded) < len(data) and len(coded) <= _HUFFMAN_MAX_OVER_ZSTD * len(best[1]):
        best = (PLANE_HUFFMAN, coded)
    return best


def sample_planes(data: Buffer, width: int, sign_swap: bool, huffman: bool = False) -> list[int] | None:
    """The plane codec for each plane, judged on its probe (:func:`probe_of`) where
    that is clear, else on the planes of the first _SAMPLE_SIZE elements (the same
    bytes :func:`encode_planes` would judge), or None when ``data`` is too short to
    sample. All PLANE_RAW means a bytegroup payload would hold every plane raw and
    lose to storing the chunk raw: the caller can skip splitting the whole chunk
    (half the CPU of an incompressible chunk's encode)."""
    if len(data) // width <= 2 * _SAMPLE_SIZE:
        return None
    # The probes first: they decide a weight's planes alone, and reading the chunk's
    # first 64 K elements from memory was much of the sampling's cost.
    probe = probe_of(data, width)
    planes, _ = split_planes(probe, width, sign_swap, scratch(5, len(probe), np.uint8))
    verdicts = [_probe_verdict(p.data, huffman) for p in planes]
    if None not in verdicts:
        return [v for v in verdicts if v is not None]
    head = memoryview(data)[: _SAMPLE_SIZE * width]
    planes, _ = split_planes(head, width, sign_swap, scratch(5, len(head), np.uint8))
    return [_sample_verdict(p.data, huffman) if v is None else v for v, p in zip(verdicts, planes, strict=True)]


def distinct_bytes(plane: np.ndarray) -> int:
    """How many of the 256 byte values occur in ``plane`` (uint8)."""
    if _native is not None:
        return _native.distinct_bytes(plane)
    return int(np.count_nonzero(np.bincount(plane, minlength=256)))


def _encode_plane(plane: np.ndarray, verdict: int | None, huffman: bool) -> tuple[int, Buffer]:
    data = plane.data
    if verdict is None and len(plane) > 2 * _SAMPLE_SIZE:
        verdict = _choose(data[:_SAMPLE_SIZE], huffman)
    elif verdict is None and len(plane) <= _TINY_PLANE:
        # A Huffman header (~50 bytes) is a large share of a plane this small.
        verdict = PLANE_ZSTD if 2 * distinct_bytes(plane) <= min(len(plane), 256) else PLANE_RAW
    elif verdict is None and (not huffman or len(plane) <= _MEDIUM_SAMPLE):
        return smallest_plane(plane, huffman)
    elif verdict is None:
        # Coding a plane both ways and keeping the smaller made chunks of 64-256 KiB
        # twice as slow to encode as zstd alone: a sample decides here too.
        verdict = _choose(data[:_MEDIUM_SAMPLE], huffman)
    packed: bytes | None = None
    if verdict == PLANE_HUFFMAN and _native is not None:
        packed = _native.huff_encode(data)
        if packed is not None and len(packed) < len(plane):
            return PLANE_HUFFMAN, packed
    if verdict != PLANE_RAW:
        packed = _compressor().compress(data)
        if len(packed) < len(plane):
            return PLANE_ZSTD, packed
    return PLANE_RAW, data


def encode_planes(
    data: Buffer, width: int, sign_swap: bool, sampled: list[int] | None = None, huffman: bool = False
) -> bytes:
    """The bytegroup payload for ``data`` (any length; the tail is kept raw).
    ``sampled``: :func:`sample_planes`' verdicts for the same arguments, if taken
    (the payload is the same either way). ``huffman``: Huffman planes may be
    written (the repository's format version allows them)."""
    if width not in SUPPORTED_WIDTHS:
        raise ValueError(f"unsupported element width {width}")
    raw_planes = _raw_then_huffman(sampled) if huffman and _native is not None else None
    if raw_planes is not None:
        # A weight's usual verdicts: one native pass splits the raw planes straight
        # into the payload; the same bytes as below without their two copies.
        coded = (width - raw_planes) * (len(data) // width)
        payload = _native.plane_payload(data, width, sign_swap, raw_planes, scratch(2, coded, np.uint8))
        if payload is not None:
            return payload
    whole = len(data) // width * width
    # The planes live only until the payload is joined below: a per-thread buffer
    # spares a page fault per 4 KiB of fresh memory.
    planes, tail = split_planes(data, width, sign_swap, scratch(2, whole, np.uint8))
    verdicts: list[int | None] = list(sampled) if sampled is not None else [None] * width
    encoded = [_encode_plane(p, v, huffman) for p, v in zip(planes, verdicts, strict=True)]
    head = [_HEAD.pack(width, FLAG_SIGN_SWAP if sign_swap else 0)]
    head += [_PLANE.pack(codec, len(payload)) for codec, payload in encoded]
    return b"".join([*head, *(payload for _, payload in encoded), tail.tobytes()])


def _raw_then_huffman(verdicts: list[int] | None) -> int | None:
    """How many planes come raw before Huffman-coded ones only, or None where the
    verdicts are not of that form."""
    if not verdicts:
        return None
    raw = next((k for k, v in enumerate(verdicts) if v != PLANE_RAW), len(verdicts))
    return raw if raw < len(verdicts) and all(v == PLANE_HUFFMAN for v in verdicts[raw:]) else None


class PlaneSet(NamedTuple):
    """A decoded bytegroup payload: planes (plane 0 lowest) and the raw tail."""

    planes: list[np.ndarray]
    tail: memoryview
    width: int
    sign_swap: bool


def decode_planes_into(payload: Buffer, out: np.ndarray) -> None:
    """Decode a bytegroup payload into ``out`` (uint8 of the declared raw size).
    Never writes past ``out``; malformed input raises CorruptObjectError."""
    if _native is not None:
        # Raw and Huffman planes (every weight's payload in a version 4 repository) in
        # one native call: the Python around each plane was a tenth of a decode.
        try:
            if _native.plane_decode(payload, out, scratch(24, len(out), np.uint8)):
                return
        except ValueError as exc:
            raise CorruptObjectError(str(exc)) from None
    join_planes(*decode_plane_set(payload, len(out)), out)


def add_residual_planes(
    decoded: PlaneSet, base: np.ndarray, out: np.ndarray, width: int, scale: float | None = None
) -> bool:
    """``out = base + residual`` in one native pass, where ``decoded`` holds a delta's
    ``sub`` residual of ``width``-byte elements (codecs/delta.py; bytes past the last
    whole element are XORed). With ``scale`` (float32 elements), the base's elements
    are predicted as ``delta.scaled_base`` does, in the same pass. ``base`` may be
    ``out`` itself. Returns False, having written nothing, where the fused loop does
    not apply (no native loops, a sign swap, another plane width)."""
    if _native is None or decoded.sign_swap or decoded.width != width or (scale is not None and width != 4):
        return False
    n = len(decoded.planes[0]) * width
    if scale is None:
        _native.join_planes_add(decoded.planes, base, out[:n])
    else:
        _native.join_planes_add(decoded.planes, base, out[:n], scale)
    np.bitwise_xor(as_u8(decoded.tail), base[n:], out=out[n:])
    return True


def decode_plane_set(payload: Buffer, raw_size: int) -> PlaneSet:
    """The planes and tail of a bytegroup payload of ``raw_size`` plain bytes, decoded."""
    view = memoryview(payload)
    if len(view) < _HEAD.size:
        raise CorruptObjectError("bytegroup payload truncated")
    width, flags = _HEAD.unpack_from(view, 0)
    if width not in SUPPORTED_WIDTHS or flags & ~FLAG_SIGN_SWAP:
        raise CorruptObjectError(f"bytegroup header invalid (width {width}, flags {flags})")
    n = raw_size // width
    pos = _HEAD.size + width * _PLANE.size
    if len(view) < pos:
        raise CorruptObjectError("bytegroup plane table truncated")
    planes: list[np.ndarray] = []
    for k in range(width):
        codec, size = _PLANE.unpack_from(view, _HEAD.size + k * _PLANE.size)
        chunk = view[pos : pos + size]
        if len(chunk) != size:
            raise CorruptObjectError("bytegroup plane truncated")
        pos += size
        planes.append(decode_plane(codec, chunk, n, k))
    tail = view[pos:]
    if len(tail) != raw_size - n * width:
        raise CorruptObjectError(f"bytegroup tail is {len(tail)} bytes, expected {raw_size - n * width}")
    return PlaneSet(planes, tail, width, bool(flags & FLAG_SIGN_SWAP))


def decode_plane(codec: int, chunk: memoryview, n: int, k: int) -> np.ndarray:
    if codec == PLANE_RAW:
        if len(chunk) != n:
            raise CorruptObjectError(f"raw plane is {len(chunk)} bytes, expected {n}")
        return as_u8(chunk)
    if codec == PLANE_ZSTD:
        return as_u8(zstd_decode(chunk, n))
    if codec == PLANE_HUFFMAN:
        if _native is None:
            return huffman_plane.decode(chunk, n)
        # Lives until the planes are joined, like the encoder's: one buffer per plane and thread.
        plane = scratch(16 + k, n, np.uint8)
        try:
            _native.huff_decode(chunk, plane)
        except ValueError as exc:
            raise CorruptObjectError(str(exc)) from None
        return plane
    raise CorruptObjectError(f"unknown plane codec {codec}")


def zstd_plane_encode(data: Buffer) -> bytes:
    """A zstd frame with the plane parameters (used for sparse masks too)."""
    return _compressor().compress(data)
