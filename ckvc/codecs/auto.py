"""The tensor-aware encoder a repository uses by default (config name "auto"):
per chunk, the smallest of byte planes, sparse, plain zstd and raw, or a delta
against the tensor's keyframe when that saves enough. It only encodes: every
record it writes decodes by its codec id (registry.py)."""

from __future__ import annotations

import numpy as np

from ckvc.codecs.base import BYTEGROUP, BYTES, DELTA, RAW, SPARSE, ZSTD, ChunkLayout, Codec, DeltaBase
from ckvc.codecs.codec_ids import MAX_AGE
from ckvc.codecs.delta import DELTA_HEAD, MAX_CHAIN_DEPTH, SCALE, SCALED_SUB, SUB, XOR, fit_scale, residual, scaled_base
from ckvc.codecs.planes import encode_planes, sample_planes, scratch
from ckvc.codecs.registry import register_encoder
from ckvc.codecs.sparse import SPARSE_WIDTHS, encode_sparse, mostly_zero
from ckvc.codecs.zstd import ZstdCodec
from ckvc.ids import Buffer

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

    def __init__(self, level: int = 1, format4: bool = True) -> None:
        self._zstd = ZstdCodec(level)
        self.format4 = format4  # may write what format version 4 adds: Huffman planes, scaled deltas

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
                head = DELTA_HEAD.pack(transform, width, base.depth + 1, min(base.age + 1, MAX_AGE), inner)
                best = (DELTA, head + payload)
            # The scale's test on a sample only says it may help: where weight decay
            # scales a mostly untouched embedding, residuals shorter on average still
            # compressed to twice the unscaled ones (MiniLM), so sizes decide.
            scale = fit_scale(data, base.plain) if self.format4 and width == 4 and layout.is_float else None
            if scale is not None:
                best = min(best, self._scaled_delta(data, base, scale), key=lambda c: len(c[1]))
        own = self._encode_standalone(data, layout)
        # A delta costs a second decode (its keyframe) on every checkout: keep it
        # only when it saves enough. Adam's first moment barely gains from one
        # (0.397 vs 0.401 of raw on MiniLM) and decodes 1.8x slower with it.
        if best[0] != DELTA or len(best[1]) >= DELTA_MIN_GAIN * len(own[1]):
            best = own
        return best

    def _scaled_delta(self, data: Buffer, base: DeltaBase, scale: float) -> tuple[int, Buffer]:
        """A scaled sub delta of float32 elements, or (RAW, data) where its residual
        does not compress."""
        predicted = scaled_base(base.plain, scale, scratch(6, len(data), np.uint8))
        diff = residual(data, predicted.data, SUB, 4, scratch(3, len(data), np.uint8))
        inner, payload = self._encode_standalone(diff.data, ChunkLayout(4, False))
        if inner == RAW:
            return RAW, data
        head = DELTA_HEAD.pack(SCALED_SUB, 4, base.depth + 1, min(base.age + 1, MAX_AGE), inner)
        return DELTA, head + SCALE.pack(scale) + payload

    def _encode_standalone(self, data: Buffer, layout: ChunkLayout) -> tuple[int, Buffer]:
        candidates: list[tuple[int, Buffer]] = [(RAW, data)]
        if layout.width in SPARSE_WIDTHS and mostly_zero(data, layout.width, SPARSE_MIN_ZERO_FRACTION):
            candidates.append((SPARSE, encode_sparse(data, layout.width, layout.is_float, self.format4)))
        elif layout.planes:
            sampled = sample_planes(data, layout.width, layout.is_float, self.format4)
            if sampled is None or any(sampled):  # else every plane would be stored raw: raw wins
                payload = encode_planes(data, layout.width, layout.is_float, sampled, self.format4)
                candidates.append((BYTEGROUP, payload))
        if not layout.planes:
            candidates.append((ZSTD, self._zstd.encode(data)))
        return min(candidates, key=lambda c: len(c[1]))


register_encoder("auto", lambda level, format4: TensorCodec(level if level is not None else 1, format4))
