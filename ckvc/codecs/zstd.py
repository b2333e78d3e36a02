"""Codec 1, zstd: one zstd frame that declares its content size (docs/FORMAT.md §6).
Also how metadata objects are stored."""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from ckvc.codecs.base import ZSTD, Codec
from ckvc.codecs.planes import as_u8, zstd_decode
from ckvc.codecs.registry import RecordCodec, register, register_encoder
from ckvc.ids import Buffer


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


def decode_zstd_into(payload: Buffer, out: np.ndarray, base: Buffer | np.ndarray | None = None) -> None:
    out[:] = as_u8(zstd_decode(payload, len(out)))


register(RecordCodec(ZSTD, "zstd", decode_zstd_into, whole=True, decoder=ZstdCodec()))
register_encoder("zstd", lambda level, format4: ZstdCodec(level if level is not None else 1))
