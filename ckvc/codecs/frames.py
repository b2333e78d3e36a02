"""Whole-buffer records without numpy: one zstd frame (codec 1) or the raw bytes
(codec 0), how every metadata object is stored. The metadata read path decodes
with these alone; the chunk codecs build on them."""

from __future__ import annotations

import threading

import zstandard

from ckvc.codecs.codec_ids import RAW, ZSTD
from ckvc.errors import CorruptObjectError
from ckvc.ids import Buffer

_local = threading.local()


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor: one shared across threads has crashed the process here."""
    found: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if found is None:
        found = _local.decompressor = zstandard.ZstdDecompressor()
    return found


def zstd_decode(frame: Buffer, raw_size: int) -> bytes:
    """Decode one zstd frame that must declare and hold exactly ``raw_size`` bytes."""
    try:
        declared = zstandard.get_frame_parameters(frame).content_size
    except zstandard.ZstdError as exc:
        raise CorruptObjectError(f"bad zstd frame header: {exc}") from None
    if declared != raw_size:
        raise CorruptObjectError(f"zstd frame declares {declared} bytes, expected {raw_size}")
    try:
        plain = decompressor().decompress(frame, max_output_size=raw_size)
    except zstandard.ZstdError as exc:
        raise CorruptObjectError(f"zstd decode failed: {exc}") from None
    if len(plain) != raw_size:
        raise CorruptObjectError(f"zstd produced {len(plain)} bytes, expected {raw_size}")
    return plain


def raw_decode(data: Buffer, raw_size: int) -> Buffer:
    if len(data) != raw_size:
        raise CorruptObjectError(f"raw payload is {len(data)} bytes, expected {raw_size}")
    return data


WHOLE_DECODERS = {RAW: raw_decode, ZSTD: zstd_decode}
