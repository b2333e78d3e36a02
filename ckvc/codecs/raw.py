"""Codec 0, raw: the plain bytes as they are (docs/FORMAT.md §6)."""

from __future__ import annotations

import numpy as np

from ckvc.codecs.base import RAW, Codec
from ckvc.codecs.frames import raw_decode
from ckvc.codecs.planes import as_u8
from ckvc.codecs.registry import RecordCodec, register, register_encoder
from ckvc.ids import Buffer


class RawCodec(Codec):
    codec_id = RAW
    name = "raw"

    def encode(self, data: Buffer) -> Buffer:
        return data

    def decode(self, data: Buffer, raw_size: int) -> Buffer:
        return raw_decode(data, raw_size)


def decode_raw_into(payload: Buffer, out: np.ndarray, base: Buffer | np.ndarray | None = None) -> None:
    out[:] = as_u8(RAW_CODEC.decode(payload, len(out)))


RAW_CODEC = RawCodec()
register(RecordCodec(RAW, "raw", decode_raw_into, whole=True, decoder=RAW_CODEC))
register_encoder("raw", lambda level, format4: RawCodec())
