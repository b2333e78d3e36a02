"""The codec table (ckvc/codecs/registry.py): every id of docs/FORMAT.md §6 is
registered once, by its own module, and decoding dispatches through it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ckvc.codecs import (
    CODEC_NAMES,
    WHOLE_CODECS,
    RawCodec,
    RecordCodec,
    TensorCodec,
    ZstdCodec,
    codec_ids,
    decode_chunk,
    decoder_for,
    make_codec,
    record_codec,
    registered,
)
from ckvc.codecs.registry import CODEC_MODULES, encoder_names, register, register_encoder
from ckvc.errors import UnsupportedFormatError


def test_every_format_id_is_registered_once() -> None:
    assert {i: c.name for i, c in registered().items()} == {
        0: "raw", 1: "zstd", 2: "bytegroup", 3: "delta", 4: "sparse", 5: "quant",
    }  # fmt: skip
    assert list(CODEC_NAMES) == [0, 1, 2, 3, 4, 5]
    assert set(WHOLE_CODECS) == {0, 1, 2, 4}  # delta and quant need their base
    assert {i for i, c in registered().items() if c.decoder is not None} == {0, 1}
    modules = {record_codec(i).decode_into.__module__ for i in registered()}
    assert modules == {f"ckvc.codecs.{m}" for m in ("raw", "zstd", "bytegroup", "delta", "sparse", "lossy")}


def test_the_numpy_free_tables_agree_with_the_codecs() -> None:
    """codec_ids.py repeats what the codec modules register, so that reading metadata,
    du and a config check need no codec (nor numpy): the two must agree."""
    assert {i: c.name for i, c in registered().items()} == codec_ids.CODEC_NAMES
    assert {i for i, c in registered().items() if c.whole} == codec_ids.WHOLE_CODECS
    assert encoder_names() == codec_ids.ENCODER_NAMES
    # The store reads BASE_HEAD_SIZE bytes of a based record: enough for either head.
    from ckvc.codecs.delta import DELTA_HEAD_SIZE
    from ckvc.codecs.lossy import QUANT_HEAD_SIZE
    from ckvc.codecs.records import BASE_HEAD_SIZE

    assert BASE_HEAD_SIZE == max(DELTA_HEAD_SIZE, QUANT_HEAD_SIZE) == 17


def test_the_first_lookup_registers_every_codec() -> None:
    """Whatever a process imports first, a lookup sees the whole table."""
    code = (
        "import sys; from ckvc.codecs import registry; assert 'numpy' not in sys.modules;"
        "print(sorted(registry.registered()), sorted(m.rsplit('.', 1)[1] for m in sys.modules"
        " if m.startswith('ckvc.codecs.') and m.rsplit('.', 1)[1] in registry.CODEC_MODULES))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == f"[0, 1, 2, 3, 4, 5] {sorted(CODEC_MODULES)}"


def test_a_second_registration_of_an_id_or_name_is_refused() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        register(RecordCodec(0, "raw", record_codec(0).decode_into, whole=True))
    with pytest.raises(ValueError, match="registered twice"):
        register_encoder("auto", lambda level, format4: TensorCodec())


def test_unknown_ids_and_names_are_unsupported() -> None:
    for codec_id in (6, 200, 255):
        with pytest.raises(UnsupportedFormatError, match=f"unknown codec id {codec_id}"):
            record_codec(codec_id)
        with pytest.raises(UnsupportedFormatError):
            decode_chunk(codec_id, b"", 0)
    for codec_id in (2, 3, 4, 5):  # chunk codecs: no whole-buffer decoder
        with pytest.raises(UnsupportedFormatError):
            decoder_for(codec_id)
    with pytest.raises(UnsupportedFormatError, match=r"known: \['auto', 'raw', 'zstd'\]"):
        make_codec("lz4")


def test_encoders_by_name() -> None:
    assert type(make_codec("raw")) is RawCodec
    zstd = make_codec("zstd", 7)
    assert isinstance(zstd, ZstdCodec) and zstd.level == 7 and make_codec("zstd").level == 1  # type: ignore[attr-defined]
    assert isinstance(make_codec("auto"), TensorCodec)
    data = np.arange(4096, dtype=np.float32).tobytes()
    for name in ("raw", "zstd", "auto"):
        codec_id, payload = make_codec(name).encode_chunk(data)
        assert bytes(decode_chunk(codec_id, payload, len(data))) == data
