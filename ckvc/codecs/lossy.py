"""The opt-in lossy tier: blockwise quantization, alone or of a residual against
a lossless keyframe. Never used unless a commit asks for it (``lossy=``).

Payload of codec 5 (docs/FORMAT.md, "quantized payload")::

    u8 scheme (1: signed absmax, 2: square root of a nonnegative tensor)
    u8 bits (4 or 8)   u8 dtype (1 float32, 2 float16, 3 bfloat16)   u8 flags (bit 0: residual)
    u8 age   u32 block   u64 n (elements)
    scales   ceil(n / block) x f32
    u8 codes codec (0 raw, 1 zstd)   u32 size   codes: n codes of ``bits`` bits, packed low nibble first

A chunk's plain bytes are its *reconstruction*, and its id is taken over those:
the store verifies lossy chunks exactly like lossless ones, and decoding is
deterministic (float32 arithmetic, one rounding per operation, then a cast).

Signed absmax: ``code = round(x / s)`` in [-q, q] with ``s = max|x| / q`` per block,
q = 7 or 127; stored as ``code + q``. Square root (Adam's second moment, always >= 0):
``code = round(sqrt(x) / s)`` in [0, 2q + 1] and the reconstruction is
``(max(code, 1/2) * s)^2``: a small moment never comes back as zero, which would
turn its Adam step into a division by epsilon.
"""

from __future__ import annotations

import math
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
FLAG_RESIDUAL = 1
DEFAULT_BLOCK = 128
_HEAD = QUANT_HEAD
_CODES = struct.Struct("<BI")
QUANT_HEAD_SIZE = _HEAD.size  # >= the delta head: the store reads this much of any based record
_DTYPE_NAMES = {1: "float32", 2: "float16", 3: "bfloat16"}
_ITEMSIZES = {1: 4, 2: 2, 3: 2}
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
MODES = {"q8": (8, False), "q4": (4, False), "residual-q8": (8, True), "residual-q4": (4, True)}


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
    blocks = -(-head.n // head.block)
    padded = torch.zeros(blocks * head.block, dtype=torch.float32)
    if head.scheme == SIGNED:
        padded[: head.n] = codes.float() - q
        values = (padded.view(blocks, head.block) * scales.view(blocks, 1)).view(-1)[: head.n]
    else:
        padded[: head.n] = codes.float().clamp(min=0.5)
        root = (padded.view(blocks, head.block) * scales.view(blocks, 1)).view(-1)[: head.n]
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
    codes_codec, codes_payload = (1, zipped) if len(zipped) < len(packed) else (0, packed)
    payload = b"".join(
        [_HEAD.pack(*head), scales.numpy().tobytes(), _CODES.pack(codes_codec, len(codes_payload)), codes_payload]
    )
    error = torch.from_numpy(plain).view(_torch_dtype(dtype_code)).float() - x
    return Quantized(
        payload,
        plain,
        float(error.abs().max()) if n else 0.0,
        float((error.double() ** 2).sum()),
        float((x.double() ** 2).sum()),
    )


def quant_header(payload: Buffer) -> QuantHeader:
    if len(payload) < _HEAD.size:
        raise CorruptObjectError("quantized payload truncated")
    head = QuantHeader(*_HEAD.unpack_from(payload, 0))
    valid = (
        head.scheme in (SIGNED, SQRT)
        and head.bits in (4, 8)
        and head.dtype in _DTYPE_NAMES
        and not head.flags & ~FLAG_RESIDUAL
        and head.block >= 1
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
    blocks = math.ceil(head.n / head.block)
    pos = _HEAD.size + 4 * blocks
    if len(view) < pos + _CODES.size:
        raise CorruptObjectError("quantized payload truncated")
    scales = torch.frombuffer(bytearray(view[_HEAD.size : pos]), dtype=torch.float32)
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
    else:
        raise CorruptObjectError(f"unknown codes codec {codes_codec}")
    codes = _unpack(packed, head.bits, head.n)
    q = _levels(head.bits)
    if head.scheme == SIGNED and bool((codes > 2 * q).any()):
        raise CorruptObjectError("quantized code out of range")
    base_t = _as_float32(base, head.dtype) if base is not None else None
    out[:] = _reconstruct(head, scales, codes, base_t)


# Its plain bytes are a reconstruction, exact only given its base: never a keyframe.
register(RecordCodec(QUANT, "quant", dequantize_into, whole=False))
