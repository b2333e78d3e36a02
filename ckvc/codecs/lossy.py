"""The opt-in lossy tier: blockwise quantization, alone or of a residual against
a lossless keyframe. Never used unless a commit asks for it (``lossy=``).

Payload of codec 5 (docs/FORMAT.md, "quantized payload")::

    u8 scheme (1: signed, 2: square root of a nonnegative tensor, 3: powers of two)
    u8 bits (4 or 8)   u8 dtype (1 float32, 2 float16, 3 bfloat16)   u8 flags (bit 0: residual)
    u8 age   u32 block   u64 n (elements)
    scales   ceil(n / block) x f32 (schemes 1 and 2)
    u8 codes codec (0 raw, 1 zstd, 2 Huffman)   u32 size   codes: n codes of ``bits`` bits, packed low nibble first

A chunk's plain bytes are its *reconstruction*, and its id is taken over those:
the store verifies lossy chunks exactly like lossless ones, and decoding is
deterministic (float32 arithmetic, one rounding per operation, then a cast).

Signed absmax: ``code = round(x / s)`` in [-q, q] with ``s = max|x| / q`` per block,
q = 7 or 127; stored as ``code + q``. Square root (Adam's second moment, always >= 0):
``code = round(sqrt(x) / s)`` in [0, 2q + 1] and the reconstruction is
``(max(code, 1/2) * s)^2``: a small moment never comes back as zero, which would
turn its Adam step into a division by epsilon.

The *tracking* modes (format version 5; docs/DESIGN.md, "The compact lossy tier")
code each chunk against the parent commit's chunk, lossy or exact, so every save
corrects the error of the one before instead of adding to it: ``track`` (weights:
the residual on a step of one RMS of that residual), ``coarse`` (first moments:
standalone, a step of two RMS) and ``log2`` (second moments: rounded to a power of
two, coded as the change of exponent since the parent). Their codes are one byte
each, coded like a byte plane (raw, zstd or Huffman).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch  # imported where used: reading a store must not import torch (fast CLI)

from ckvc.codecs.base import QUANT
from ckvc.codecs.codec_ids import QUANT_HEAD
from ckvc.codecs.planes import as_u8, zstd_decode, zstd_plane_encode
from ckvc.codecs.registry import RecordCodec, register
from ckvc.errors import CorruptObjectError
from ckvc.ids import Buffer

SIGNED = 1
SQRT = 2
LOG2 = 3
FLAG_RESIDUAL = 1
DEFAULT_BLOCK = 128
TRACK_BLOCK = 4096  # one f32 scale per 4096 codes: 0.008 bits an element
CODES_HUFFMAN = 2  # a byte plane's codec ids (planes.PLANE_*): 0 raw, 1 zstd, 2 Huffman
_HEAD = QUANT_HEAD
_CODES = struct.Struct("<BI")
QUANT_HEAD_SIZE = _HEAD.size  # >= the delta head: the store reads this much of any based record
_DTYPE_NAMES = {1: "float32", 2: "float16", 3: "bfloat16"}
_ITEMSIZES = {1: 4, 2: 2, 3: 2}
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
MODES = {"q8": (8, False), "q4": (4, False), "residual-q8": (8, True), "residual-q4": (4, True)}
# The compact tier (format version 5): ``track`` and ``log2`` are coded against the
# parent commit's chunk (a chain of at most keyframe_interval records).
COMPACT_MODES = ("track", "coarse", "log2")
# First moments: a step of 1.25 RMS of the block (most codes 0). The resumed loss
# moves with this step and little else (docs/DESIGN.md, "The compact lossy tier").
COARSE_STEP_RMS = 1.25
TRACK_STEP_RMS = 1.0  # weight residuals: a step of one RMS of the block's residual
# A residual is never coded finer than this fraction of its base's RMS: weight decay
# alone moves every weight a little, and coding that costs bits and changes nothing.
# The error it allows (half the step) is below what a cast to bfloat16 does to a
# typical weight; four times coarser changes a resumed fine-tune's loss by 8 %.
TRACK_FLOOR = 2.0**-9
# A track chain's first link: 8 bits over the block's range, but never finer than
# 1/16 of its RMS. A Gaussian block's range is ~8 RMS, so this doubles the step of
# most blocks (one bit an element less); the error is random and the next link
# corrects it (docs/DESIGN.md, "The compact lossy tier").
FIRST_LINK_STEP_RMS = 1 / 16
_LOG2_DTYPES = (1, 3)  # float32 and bfloat16 share float32's 8-bit exponent
# A float32 mantissa at least (sqrt(2) - 1) * 2^23 is nearer the next power of two in log2.
_LOG2_ROUND_UP = 3474676
_LOG2_MAX_EXPONENT = 254  # biased; 255 would be infinity
_LOG2_RESIDUAL_ZERO = 128  # a residual code is the change of exponent plus 128


class QuantHeader(NamedTuple):
    scheme: int
    bits: int
    dtype: int
    flags: int
    age: int
    block: int
    n: int

    @property
    def residual(self) -> bool:
        return bool(self.flags & FLAG_RESIDUAL)

    @property
    def blocks(self) -> int:
        """How many f32 scales follow the head (none for powers of two)."""
        return 0 if self.scheme == LOG2 else -(-self.n // self.block)


class Quantized(NamedTuple):
    payload: bytes
    plain: np.ndarray  # the reconstruction's bytes: what the chunk id is taken over
    max_abs_error: float
    sum_sq_error: float
    sum_sq_value: float


def _levels(bits: int) -> int:
    return (1 << (bits - 1)) - 1  # q: 7 or 127


def _torch_dtype(code: int) -> torch.dtype:
    import torch

    dtype: torch.dtype = getattr(torch, _DTYPE_NAMES[code])
    return dtype


def _as_float32(data: Buffer | np.ndarray, dtype: int) -> torch.Tensor:
    import torch

    raw = torch.frombuffer(bytearray(as_u8(data)), dtype=torch.uint8)
    return raw.view(_torch_dtype(dtype)).float()


def _reconstruct(head: QuantHeader, scales: torch.Tensor, codes: torch.Tensor, base: torch.Tensor | None) -> np.ndarray:
    """The reconstruction's bytes; the one definition both encoder and decoder use."""
    import torch

    q = _levels(head.bits)
    # A block longer than the chunk is one block of the chunk's length (compact modes
    # write 4096 for smaller chunks): padding to the header's block would let four
    # bytes of a damaged header ask for gigabytes.
    block = min(head.block, head.n)
    blocks = -(-head.n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32)
    if head.scheme == SIGNED:
        padded[: head.n] = codes.float() - q
        values = (padded.view(blocks, block) * scales.view(blocks, 1)).view(-1)[: head.n]
    else:
        padded[: head.n] = codes.float().clamp(min=0.5)
        root = (padded.view(blocks, block) * scales.view(blocks, 1)).view(-1)[: head.n]
        values = root * root
    if base is not None:
        values = values + base
    out = values.to(_torch_dtype(head.dtype))
    return out.view(torch.uint8).numpy().copy()


def _pack(codes: torch.Tensor, bits: int) -> bytes:
    import torch

    c = codes.to(torch.uint8).numpy()
    if bits == 8:
        return c.tobytes()
    if len(c) % 2:
        c = np.append(c, np.uint8(0))
    return (c[0::2] | (c[1::2] << 4)).tobytes()


def _unpack(packed: Buffer, bits: int, n: int) -> torch.Tensor:
    import torch

    raw = as_u8(packed)
    if bits == 8:
        return torch.from_numpy(raw[:n].astype(np.int32))
    codes = np.empty(2 * len(raw), dtype=np.int32)
    codes[0::2] = raw & 0x0F
    codes[1::2] = raw >> 4
    return torch.from_numpy(codes[:n])


def quantize(
    data: Buffer, dtype: str, bits: int, base: Buffer | None, age: int, block: int = DEFAULT_BLOCK
) -> Quantized | None:
    """Quantize one chunk (its residual against ``base`` when given). None when the
    chunk cannot be quantized safely (non-finite values): store it losslessly."""
    import torch

    dtype_code = DTYPE_CODES[dtype]
    x = _as_float32(data, dtype_code)
    if not bool(torch.isfinite(x).all()):
        return None
    base_t = _as_float32(base, dtype_code) if base is not None else None
    target = x - base_t if base_t is not None else x
    n = x.numel()
    blocks = -(-n // block)
    q = _levels(bits)
    padded = torch.zeros(blocks * block, dtype=torch.float32)
    scheme = SQRT if base_t is None and bool((x >= 0).all()) else SIGNED
    if scheme == SIGNED:
        padded[:n] = target
        grid = padded.view(blocks, block)
        scales = grid.abs().amax(dim=1) / q
        codes = torch.round(grid / scales.clamp(min=torch.finfo(torch.float32).tiny).view(-1, 1)).clamp(-q, q) + q
    else:
        padded[:n] = target.sqrt()
        grid = padded.view(blocks, block)
        scales = grid.amax(dim=1) / (2 * q + 1)
        codes = torch.round(grid / scales.clamp(min=torch.finfo(torch.float32).tiny).view(-1, 1)).clamp(0, 2 * q + 1)
    codes = codes.view(-1)[:n].to(torch.int32)
    head = QuantHeader(scheme, bits, dtype_code, FLAG_RESIDUAL if base_t is not None else 0, age, block, n)
    plain = _reconstruct(head, scales, codes, base_t)
    packed = _pack(codes, bits)
    zipped = zstd_plane_encode(packed)
    return _result(head, scales, (1, zipped) if len(zipped) < len(packed) else (0, packed), plain, x)


def _result(
    head: QuantHeader, scales: torch.Tensor | None, codes: tuple[int, Buffer], plain: np.ndarray, x: torch.Tensor
) -> Quantized:
    """The payload, and the reconstruction's errors against the exact values ``x``."""
    import torch

    codes_codec, codes_payload = codes
    parts = [_HEAD.pack(*head), scales.numpy().tobytes() if scales is not None else b""]
    payload = b"".join([*parts, _CODES.pack(codes_codec, len(codes_payload)), codes_payload])
    error = torch.from_numpy(plain).view(_torch_dtype(head.dtype)).float() - x
    return Quantized(
        payload,
        plain,
        float(error.abs().max()) if head.n else 0.0,
        float((error.double() ** 2).sum()),
        float((x.double() ** 2).sum()),
    )


def _byte_codes(codes: torch.Tensor) -> tuple[int, Buffer]:
    """One byte a code, coded like a byte plane: raw, zstd or Huffman, the smallest."""
    import torch

    from ckvc.codecs.planes import smallest_plane

    return smallest_plane(codes.to(torch.uint8).numpy(), huffman=True)


def quantize_compact(
    data: Buffer, dtype: str, mode: str, base: Buffer | np.ndarray | None, age: int
) -> Quantized | None:
    """A chunk in one of the COMPACT_MODES: ``base`` is the parent commit's chunk
    (its plain bytes) for ``track`` and ``log2``, None for a chain's first link.
    None when the chunk cannot be quantized safely: store it losslessly."""
    import torch

    dtype_code = DTYPE_CODES[dtype]
    x = _as_float32(data, dtype_code)
    if not bool(torch.isfinite(x).all()):
        return None
    if mode == "log2":
        return _quantize_log2(x, dtype_code, base, age)
    base_t = _as_float32(base, dtype_code) if base is not None and mode == "track" else None
    target = x - base_t if base_t is not None else x
    n = x.numel()
    blocks = -(-n // TRACK_BLOCK)
    grid = torch.zeros(blocks * TRACK_BLOCK, dtype=torch.float32)
    grid[:n] = target
    grid = grid.view(blocks, TRACK_BLOCK)
    # Never a code past +-127: the step covers the block's largest value.
    step = grid.abs().amax(dim=1) / 127
    rms = grid.square().mean(dim=1).sqrt()
    if mode == "coarse":
        step = torch.maximum(step, COARSE_STEP_RMS * rms)
    elif base_t is not None:
        base_grid = torch.zeros(blocks * TRACK_BLOCK, dtype=torch.float32)
        base_grid[:n] = base_t
        floor = TRACK_FLOOR * base_grid.view(blocks, TRACK_BLOCK).square().mean(dim=1).sqrt()
        step = torch.maximum(torch.maximum(step, TRACK_STEP_RMS * rms), floor)
    else:
        step = torch.maximum(step, FIRST_LINK_STEP_RMS * rms)
    step = step.clamp(min=torch.finfo(torch.float32).tiny)
    codes = (torch.round(grid / step.view(-1, 1)).clamp(-127, 127) + 127).view(-1)[:n].to(torch.int32)
    flags = FLAG_RESIDUAL if base_t is not None else 0
    head = QuantHeader(SIGNED, 8, dtype_code, flags, age if base_t is not None else 1, TRACK_BLOCK, n)
    plain = _reconstruct(head, step, codes, base_t)
    return _result(head, step, _byte_codes(codes), plain, x)


def _exponents(x: torch.Tensor) -> torch.Tensor:
    """Biased float32 exponents of the powers of two nearest ``x`` (>= 0) in log2;
    0 for zero and subnormals, never infinity."""
    import torch

    bits = x.view(torch.int32) & 0x7FFFFFFF  # -0.0 is zero
    exponent = bits >> 23
    rounded = exponent + ((bits & 0x7FFFFF) >= _LOG2_ROUND_UP).to(torch.int32)
    return torch.where(exponent == 0, 0, rounded).clamp(max=_LOG2_MAX_EXPONENT)


def _base_exponents(base: Buffer | np.ndarray, dtype: int) -> torch.Tensor | None:
    """The biased exponents of a base holding only powers of two and zeros, else None."""
    import torch

    bits = _as_float32(base, dtype).view(torch.int32) if base is not None else None
    if bits is None or bool((bits & ~(0xFF << 23)).any()):
        return None
    return bits >> 23


def _quantize_log2(x: torch.Tensor, dtype: int, base: Buffer | np.ndarray | None, age: int) -> Quantized | None:
    if dtype not in _LOG2_DTYPES or bool((x < 0).any()):
        return None
    exponents = _exponents(x)
    base_exponents = _base_exponents(base, dtype) if base is not None else None
    codes = exponents
    if base_exponents is not None:
        change = exponents - base_exponents + _LOG2_RESIDUAL_ZERO
        if int(change.min()) >= 0 and int(change.max()) <= 255:
            codes = change
        else:
            base_exponents = None  # a jump past +-128 binades: this link starts a chain
    residual = base_exponents is not None
    head = QuantHeader(LOG2, 8, dtype, FLAG_RESIDUAL if residual else 0, age if residual else 1, 1, x.numel())
    plain = _log2_plain(head, codes, base_exponents)
    return _result(head, None, _byte_codes(codes), plain, x)


def _log2_plain(head: QuantHeader, codes: torch.Tensor, base_exponents: torch.Tensor | None) -> np.ndarray:
    """The reconstruction of powers-of-two codes: exact (an exponent and nothing else)."""
    import torch

    exponents = codes if base_exponents is None else base_exponents + codes - _LOG2_RESIDUAL_ZERO
    if bool((exponents < 0).any()) or bool((exponents > _LOG2_MAX_EXPONENT).any()):
        raise CorruptObjectError("powers-of-two code out of range")
    values = (exponents << 23).view(torch.float32).to(_torch_dtype(head.dtype))
    return values.view(torch.uint8).numpy().copy()


def quant_header(payload: Buffer) -> QuantHeader:
    if len(payload) < _HEAD.size:
        raise CorruptObjectError("quantized payload truncated")
    head = QuantHeader(*_HEAD.unpack_from(payload, 0))
    valid = (
        head.scheme in (SIGNED, SQRT, LOG2)
        and head.bits in (4, 8)
        and (head.scheme != LOG2 or (head.bits == 8 and head.dtype in _LOG2_DTYPES and head.block == 1))
        and head.dtype in _DTYPE_NAMES
        and not head.flags & ~FLAG_RESIDUAL
        and head.block >= 1
        and head.n >= 1
        and head.age >= 1
    )
    if not valid:
        raise CorruptObjectError(f"quantized header invalid: {head}")
    return head


def dequantize_into(payload: Buffer, out: np.ndarray, base: Buffer | np.ndarray | None) -> None:
    import torch

    view = memoryview(payload)
    head = quant_header(view)
    itemsize = _ITEMSIZES[head.dtype]
    if head.n * itemsize != len(out):
        raise CorruptObjectError(f"quantized payload holds {head.n} elements, expected {len(out) // itemsize}")
    if head.residual != (base is not None):
        raise CorruptObjectError("quantized residual without its base (or a base it does not use)")
    if base is not None and len(as_u8(base)) != len(out):
        raise CorruptObjectError(f"quantized residual's base is {len(as_u8(base))} bytes, expected {len(out)}")
    pos = _HEAD.size + 4 * head.blocks
    if len(view) < pos + _CODES.size:
        raise CorruptObjectError("quantized payload truncated")
    scales = torch.frombuffer(bytearray(view[_HEAD.size : pos]), dtype=torch.float32) if pos > _HEAD.size else None
    codes_codec, size = _CODES.unpack_from(view, pos)
    body = view[pos + _CODES.size :]
    packed_size = head.n if head.bits == 8 else (head.n + 1) // 2
    if len(body) != size:
        raise CorruptObjectError("quantized codes have the wrong size")
    if codes_codec == 0:
        if size != packed_size:
            raise CorruptObjectError("quantized codes have the wrong size")
        packed: Buffer = body
    elif codes_codec == 1:
        packed = zstd_decode(body, packed_size)
    elif codes_codec == CODES_HUFFMAN and head.bits == 8:
        from ckvc.codecs.planes import decode_plane

        packed = decode_plane(CODES_HUFFMAN, body, packed_size, 0).data
    else:
        raise CorruptObjectError(f"unknown codes codec {codes_codec}")
    codes = _unpack(packed, head.bits, head.n)
    if head.scheme == LOG2:
        base_exponents = _base_exponents(base, head.dtype) if base is not None else None
        if base is not None and base_exponents is None:
            raise CorruptObjectError("a powers-of-two residual on a base that holds other values")
        out[:] = _log2_plain(head, codes, base_exponents)
        return
    assert scales is not None  # schemes 1 and 2 have a scale a block, and n >= 1
    q = _levels(head.bits)
    if head.scheme == SIGNED and bool((codes > 2 * q).any()):
        raise CorruptObjectError("quantized code out of range")
    base_t = _as_float32(base, head.dtype) if base is not None else None
    out[:] = _reconstruct(head, scales, codes, base_t)


# Its plain bytes are a reconstruction, exact only given its base: never a keyframe.
register(RecordCodec(QUANT, "quant", dequantize_into, whole=False))
