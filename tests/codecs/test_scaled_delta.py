"""Scaled sub deltas (delta transform 3, docs/FORMAT.md 6.3): float32 chunks coded
against their base times a factor, as Adam's second moment decays between saves."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from ckvc.codecs import TensorCodec, decode_chunk, layout_for
from ckvc.codecs import planes as planes_module
from ckvc.codecs.base import DeltaBase
from ckvc.codecs.delta import SCALED_SUB, SUB, apply_delta, fit_scale, scaled_base
from ckvc.errors import CorruptObjectError
from ckvc.ids import ObjectType, object_id

FLOAT32 = layout_for("float32")


def second_moment(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(base, new): a second moment, then 20 steps of beta2 = 0.999 later, where the
    gradients were small against its history (late in training)."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(n) * 1e-3).astype(np.float32) ** 2
    fresh = (rng.standard_normal(n) * 1e-5).astype(np.float32) ** 2
    new = (base * np.float32(0.999**20) + fresh * np.float32(1 - 0.999**20)).astype(np.float32)
    return base, new


def delta_base(plain: bytes) -> DeltaBase:
    return DeltaBase(object_id(ObjectType.CHUNK, plain), plain, 0, 0)


def encode(new: bytes, base: bytes, format4: bool = True) -> tuple[int, bytes]:
    codec_id, payload = TensorCodec(format4=format4).encode_chunk(new, FLOAT32, delta_base(base))
    return codec_id, bytes(payload)


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_a_decaying_moment_is_coded_against_its_scaled_base(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    base, new = second_moment(300_000, 1)
    codec_id, payload = encode(new.tobytes() + b"\x09", base.tobytes() + b"\x01")
    assert codec_id == 3 and payload[0] == SCALED_SUB
    (scale,) = struct.unpack_from("<f", payload, 5)
    assert abs(scale - 0.999**20) < 0.01
    _, unscaled = encode(new.tobytes() + b"\x09", base.tobytes() + b"\x01", format4=False)
    assert unscaled[0] == SUB and len(payload) < 0.85 * len(unscaled)
    if not native:
        monkeypatch.setattr(planes_module, "_native", None)
    plain = new.tobytes() + b"\x09"
    assert bytes(decode_chunk(codec_id, payload, len(plain), base.tobytes() + b"\x01")) == plain
    # A checkout decodes the keyframe into the destination, then the delta in place.
    out = np.frombuffer(base.tobytes() + b"\x01", dtype=np.uint8).copy()
    apply_delta(payload, out, None)
    assert out.tobytes() == plain


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_values_that_do_not_scale_keep_their_bits(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Zeros, subnormals, infinities, NaNs (their payloads too) and products that
    would overflow are predicted by the base's own bits, so they round-trip exactly,
    decoded in one fused pass (native) or step by step (numpy), against a base or in place."""
    base, new = second_moment(50_000, 2)
    special = np.array([0, 0x80000000, 1, 0x007FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFA00000, 0x7F7FFFFF])
    base.view(np.uint32)[: len(special)] = special
    new.view(np.uint32)[: len(special)] = special[::-1]
    codec_id, payload = encode(new.tobytes(), base.tobytes())
    assert payload[0] == SCALED_SUB
    if not native:
        monkeypatch.setattr(planes_module, "_native", None)
    assert bytes(decode_chunk(codec_id, payload, len(new.tobytes()), base.tobytes())) == new.tobytes()
    in_place = base.view(np.uint8).copy()
    apply_delta(payload, in_place, None)
    assert in_place.tobytes() == new.tobytes()
    predicted = scaled_base(base.tobytes(), 2.0, np.empty(len(base) * 4, dtype=np.uint8)).view(np.uint32)
    assert predicted[: len(special)].tolist() == special.tolist()  # 0x7F7FFFFF * 2 overflows: kept
    assert predicted[len(special)] == (base[len(special)] * np.float32(2)).view(np.uint32)


@pytest.mark.skipif(planes_module.native() is None, reason="the native loops did not build")
@pytest.mark.parametrize("scale", [0.98, 2.0, 1e-30, 1e30, 0.5])
def test_native_prediction_matches_numpy_bit_for_bit(scale: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bit pattern (random words cover NaN payloads, infinities, subnormals and
    every exponent; the scales make products underflow and overflow) is predicted
    alike by the C loop and the numpy fallback, in place too, tail bytes copied."""
    words = np.random.default_rng(7).integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    base = words.view(np.uint8).tobytes() + b"\x05\x06\x07"
    native = scaled_base(base, scale, np.empty(len(base), dtype=np.uint8)).tobytes()
    in_place = np.frombuffer(base, dtype=np.uint8).copy()
    scaled_base(in_place, scale, in_place)
    monkeypatch.setattr(planes_module, "_native", None)
    fallback = scaled_base(base, scale, np.empty(len(base), dtype=np.uint8)).tobytes()
    assert native == fallback == in_place.tobytes()
    assert native[-3:] == b"\x05\x06\x07"


def test_no_factor_where_scaling_does_not_shorten_the_residuals() -> None:
    rng = np.random.default_rng(3)
    weights = (rng.standard_normal(100_000) * 0.02).astype(np.float32)
    moved = (weights - rng.standard_normal(100_000).astype(np.float32) * 1e-6).astype(np.float32)
    assert fit_scale(moved.tobytes(), weights.tobytes()) is None  # a parameter after a few steps
    assert fit_scale(bytes(400), bytes(400)) is None  # nothing usable
    assert fit_scale(weights.tobytes(), weights.tobytes()) is None  # unchanged: the factor is 1
    codec_id, payload = encode(moved.tobytes(), weights.tobytes())
    assert codec_id == 3 and payload[0] == SUB


@pytest.mark.parametrize(
    ("head", "scale"),
    [
        (bytes([3, 2, 1, 1, 2]), 0.98),  # width 2
        (bytes([3, 4, 1, 1, 2]), float("nan")),
        (bytes([3, 4, 1, 1, 2]), 0.0),
        (bytes([3, 4, 1, 1, 2]), -0.98),
        (bytes([3, 4, 1, 1, 2]), 1e-40),  # subnormal
        (bytes([3, 4, 1, 1, 2]), None),  # the scale cut off
    ],
)
def test_malformed_scaled_deltas_are_corrupt(head: bytes, scale: float | None) -> None:
    base, new = second_moment(1000, 4)
    _, payload = encode(new.tobytes(), base.tobytes())
    damaged = head + (b"" if scale is None else struct.pack("<f", scale) + payload[9:])
    with pytest.raises(CorruptObjectError):
        decode_chunk(3, damaged, len(new.tobytes()), base.tobytes())


def test_only_a_version_4_repository_gets_the_version_4_codecs(tmp_path: Path) -> None:
    """New repositories are version 4; a version 3 one keeps zstd planes and
    unscaled deltas, stays version 3 after commits, and reads back exactly."""
    import ckvc

    base, new = second_moment(300_000, 5)
    ckvc.Repo.init(tmp_path / "new").close()
    ckvc.Repo.init(tmp_path / "old").close()
    config_path = tmp_path / "old" / ".ckvc" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "format_version": 3}))
    stored = {}
    for name, format4 in (("new", True), ("old", False)):
        with ckvc.Repo.open(tmp_path / name) as repo:
            assert isinstance(repo.core.codec, TensorCodec) and repo.core.codec.format4 is format4
            repo.commit({"v": torch.from_numpy(base)})
            commit = repo.commit({"v": torch.from_numpy(new)})
            assert torch.equal(repo.load("HEAD")["v"], torch.from_numpy(new))
            assert repo.config.format_version == (4 if format4 else 3)
            (blob,) = repo.read_snapshot(repo.read_commit(commit)).blobs
            stored[name] = sum(repo.store.stat(oid).stored_size for oid in blob.chunks)
            assert repo.fsck().ok
    assert stored["new"] < 0.85 * stored["old"]  # the scaled delta
    # A build without the native loops reads the version 4 records (Huffman planes too).
    with pytest.MonkeyPatch.context() as patch, ckvc.Repo.open(tmp_path / "new") as repo:
        patch.setattr(planes_module, "_native", None)
        assert torch.equal(repo.load("HEAD")["v"], torch.from_numpy(new))
