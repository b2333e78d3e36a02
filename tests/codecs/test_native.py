"""The C loops of ckvc._native against the numpy fallbacks: the same bytes both
ways, so a repository written with either decodes with the other."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvc.codecs import delta, planes
from ckvc.codecs.delta import SUB, apply_residual, residual
from ckvc.codecs.planes import (
    add_residual_planes,
    decode_plane_set,
    decode_planes_into,
    encode_planes,
    join_planes,
    split_planes,
)

native = planes._native
T = TypeVar("T")


@pytest.fixture
def numpy_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(planes, "_native", None)
    yield


def test_extension_is_built() -> None:
    # CI machines have a C compiler: a silent fallback there would hide a 3-10x slowdown.
    assert native is not None, "ckvc._native did not build; run `pip install -e .` with gcc available"


def _both(fn: Callable[[], T]) -> tuple[T, T]:
    """fn's result with the native loops, then with the numpy fallbacks."""
    fast = fn()
    with mock.patch.object(planes, "_native", None):
        return fast, fn()


SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 255, 4096, 4099, 65_541]


@pytest.mark.skipif(native is None, reason="extension not built")
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("sign_swap", [False, True])
@pytest.mark.parametrize("size", SIZES)
def test_split_join_match_numpy(width: int, sign_swap: bool, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    data = np.random.default_rng(size * 31 + width).bytes(size)
    (fast, fast_tail), (slow, slow_tail) = _both(lambda: split_planes(data, width, sign_swap))
    assert [p.tobytes() for p in fast] == [p.tobytes() for p in slow]
    assert fast_tail.tobytes() == slow_tail.tobytes() == data[size // width * width :]
    for use_native in (True, False):
        monkeypatch.setattr(planes, "_native", native if use_native else None)
        out = np.full(size + 8, 0xEE, dtype=np.uint8)  # guard bytes must survive
        join_planes(fast, fast_tail, width, sign_swap, out[:size])
        assert out[:size].tobytes() == data and out[size:].tobytes() == b"\xee" * 8


@pytest.mark.skipif(native is None, reason="extension not built")
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("size", SIZES)
def test_zigzag_match_numpy(width: int, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(size + width)
    base = rng.bytes(size)
    # Near the base (small differences of either sign) and far from it (wrapping).
    near = (np.frombuffer(base, np.uint8).astype(np.int16) + rng.integers(-2, 3, size)).astype(np.uint8).tobytes()
    for new in (near, rng.bytes(size), base):
        fast, slow = _both(lambda new=new: residual(new, base, SUB, width))  # type: ignore[misc]
        assert fast.tobytes() == slow.tobytes()
        for use_native in (True, False):
            monkeypatch.setattr(planes, "_native", native if use_native else None)
            out = fast.copy()
            apply_residual(out, base, SUB, width)
            assert out.tobytes() == new


@pytest.mark.skipif(native is None, reason="extension not built")
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("size", SIZES)
def test_fused_delta_decode_matches_join_then_apply(width: int, size: int) -> None:
    rng = np.random.default_rng(size * 7 + width)
    base = rng.bytes(size)
    new = (np.frombuffer(base, np.uint8).astype(np.int16) + rng.integers(-3, 4, size)).astype(np.uint8).tobytes()
    payload = encode_planes(residual(new, base, SUB, width).data, width, False)
    base_arr = np.frombuffer(base, np.uint8)
    decoded = decode_plane_set(payload, size)
    out = np.full(size + 8, 0xEE, dtype=np.uint8)
    assert add_residual_planes(decoded, base_arr, out[:size], width)
    assert out[:size].tobytes() == new and out[size:].tobytes() == b"\xee" * 8
    in_place = base_arr.copy()  # out holding the base: a checkout's keyframe
    assert add_residual_planes(decoded, in_place, in_place, width)
    assert in_place.tobytes() == new
    # Where the fused loop does not apply, nothing is written.
    for use_native, plane_width in ((False, width), (True, 2 if width != 2 else 4)):
        with mock.patch.object(planes, "_native", native if use_native else None):
            untouched = base_arr.copy()
            assert not add_residual_planes(decoded, untouched, untouched, plane_width)
            assert untouched.tobytes() == base
    assert native is not None
    with pytest.raises(ValueError, match="sizes differ"):
        native.join_planes_add([bytes(4)] * 4, bytes(15), bytearray(16))


@pytest.mark.skipif(native is None, reason="extension not built")
@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=3000), width=st.sampled_from([2, 4, 8]), sign_swap=st.booleans())
def test_payloads_decode_across_implementations(data: bytes, width: int, sign_swap: bool) -> None:
    encoded = encode_planes(data, width, sign_swap)
    with mock.patch.object(planes, "_native", None):
        assert encode_planes(data, width, sign_swap) == encoded
        out = np.empty(len(data), dtype=np.uint8)
        decode_planes_into(encoded, out)
        assert out.tobytes() == data


@pytest.mark.skipif(native is None, reason="extension not built")
def test_native_checks_its_buffers() -> None:
    assert native is not None
    src = bytes(16)
    with pytest.raises(ValueError, match="width"):
        native.split_planes(src, 3, False, bytearray(15))
    with pytest.raises(ValueError, match="dst is"):
        native.split_planes(src, 4, False, bytearray(15))
    with pytest.raises(TypeError):
        native.split_planes(src, 4, False, bytes(16))  # read-only destination
    with pytest.raises(ValueError, match="differ in length"):
        native.join_planes([bytes(4), bytes(3)], False, bytearray(8))
    with pytest.raises(ValueError, match="width"):
        native.join_planes([bytes(4)] * 3, False, bytearray(12))
    with pytest.raises(ValueError, match="sizes differ"):
        native.zigzag_residual(bytes(8), bytes(4), 4, bytearray(8))
    with pytest.raises(ValueError, match="shorter"):
        native.apply_zigzag(bytearray(8), bytes(4), 4)


def test_fallback_round_trips(numpy_only: None) -> None:
    assert planes._native is None and delta.planes._native is None
    data = (np.random.default_rng(5).standard_normal(10_001) * 0.02).astype(np.float32).tobytes() + b"xyz"
    for width in (2, 4, 8):
        out = np.empty(len(data), dtype=np.uint8)
        decode_planes_into(encode_planes(data, width, True), out)
        assert out.tobytes() == data


def test_version_says_whether_native_loops_are_built() -> None:
    from click.testing import CliRunner

    from ckvc.cli import cli

    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert ("native codec loops: built" in result.output) == (native is not None)


@pytest.mark.skipif(native is None, reason="extension not built")
@pytest.mark.parametrize("size", SIZES)
def test_distinct_bytes_match_numpy(size: int) -> None:
    rng = np.random.default_rng(size)
    for data in (rng.integers(0, 256, size, dtype=np.uint8), rng.integers(7, 12, size, dtype=np.uint8)):
        fast, slow = _both(lambda data=data: planes.distinct_bytes(data))  # type: ignore[misc]
        assert fast == slow == len(set(data.tobytes()))
