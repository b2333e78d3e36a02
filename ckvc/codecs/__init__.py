"""Codecs: pure byte transforms between an object's plain bytes and its stored bytes.

Each stored record names its codec by a one-byte id. Decoding never produces
more than the declared raw size, and any malformed input raises
:class:`ckvc.errors.CorruptObjectError`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import ClassVar

import zstandard

from ckvc.errors import CorruptObjectError, UnsupportedFormatError

Buffer = bytes | bytearray | memoryview


class Codec(ABC):
    codec_id: ClassVar[int]
    name: ClassVar[str]

    @abstractmethod
    def encode(self, data: Buffer) -> bytes | Buffer:
        """Encoded bytes; may return ``data`` itself when the codec is the identity."""

    @abstractmethod
    def decode(self, data: Buffer, raw_size: int) -> Buffer:
        """Exactly ``raw_size`` plain bytes, or CorruptObjectError."""


class RawCodec(Codec):
    codec_id = 0
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

    codec_id = 1
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

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = zstandard.ZstdDecompressor()
            self._local.decompressor = decompressor
        return decompressor

    def encode(self, data: Buffer) -> bytes:
        return self._compressor().compress(data)

    def decode(self, data: Buffer, raw_size: int) -> bytes:
        try:
            params = zstandard.get_frame_parameters(data)
        except zstandard.ZstdError as exc:
            raise CorruptObjectError(f"bad zstd frame header: {exc}") from None
        if params.content_size != raw_size:
            raise CorruptObjectError(f"zstd frame declares {params.content_size} bytes, expected {raw_size}")
        try:
            out = self._decompressor().decompress(data, max_output_size=raw_size)
        except zstandard.ZstdError as exc:
            raise CorruptObjectError(f"zstd decode failed: {exc}") from None
        if len(out) != raw_size:
            raise CorruptObjectError(f"zstd produced {len(out)} bytes, expected {raw_size}")
        return out


_REGISTRY: dict[int, Codec] = {RawCodec.codec_id: RawCodec(), ZstdCodec.codec_id: ZstdCodec()}
_BY_NAME: dict[str, type[Codec]] = {"raw": RawCodec, "zstd": ZstdCodec}


def decoder_for(codec_id: int) -> Codec:
    """The codec that decodes records stored with ``codec_id``."""
    try:
        return _REGISTRY[codec_id]
    except KeyError:
        raise UnsupportedFormatError(f"unknown codec id {codec_id}") from None


def make_codec(name: str, level: int | None = None) -> Codec:
    """An encoder configured by the repo config (``{"name": ..., "level": ...}``)."""
    if name == "zstd":
        return ZstdCodec(level if level is not None else 1)
    if name == "raw":
        return RawCodec()
    raise UnsupportedFormatError(f"unknown codec {name!r}; known: {sorted(_BY_NAME)}")


def encode_smallest(codec: Codec, data: Buffer) -> tuple[int, Buffer]:
    """(codec id, stored bytes): the codec's output, or raw when that does not shrink."""
    encoded = codec.encode(data)
    if codec.codec_id != RawCodec.codec_id and len(encoded) < len(data):
        return codec.codec_id, encoded
    return RawCodec.codec_id, data
