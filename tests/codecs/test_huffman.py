"""Huffman planes (plane codec 2, docs/FORMAT.md 6.2.1): the native coder, the
pure-Python reader, and where the bytegroup encoder chooses them."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvc.codecs import huffman
from ckvc.codecs import planes as planes_module
from ckvc.codecs.planes import (
    PLANE_HUFFMAN,
    PLANE_RAW,
    PLANE_ZSTD,
    decode_planes_into,
    encode_planes,
    sample_planes,
)
from ckvc.errors import CorruptObjectError

native = planes_module.native()
pytestmark = pytest.mark.skipif(native is None, reason="the Huffman encoder is native only")


def skewed(n: int, values: int, seed: int, alpha: float = 1.3) -> np.ndarray:
    """n bytes drawn from a Zipf-like law over ``values`` byte values (an exponent plane's shape)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, values + 1) ** alpha
    symbols = rng.permutation(256)[:values].astype(np.uint8)
    return symbols[rng.choice(values, size=n, p=weights / weights.sum())]


def native_decode(payload: bytes, n: int) -> np.ndarray:
    assert native is not None
    out = np.empty(n, dtype=np.uint8)
    native.huff_decode(payload, out)
    return out


def encode(plane: np.ndarray) -> bytes:
    assert native is not None
    payload = native.huff_encode(plane)
    assert payload is not None and len(payload) == native.huff_size(plane)
    return payload


def plane_codecs(payload: bytes) -> list[int]:
    return [payload[2 + 5 * k] for k in range(payload[0])]


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=6000),
    values=st.integers(min_value=2, max_value=256),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    alpha=st.sampled_from([0.0, 1.0, 1.3, 2.5, 6.0]),
)
def test_round_trip_native_and_python_readers(n: int, values: int, seed: int, alpha: float) -> None:
    plane = skewed(n, values, seed, alpha)
    if len(np.unique(plane)) < 2:
        plane[0] ^= 1
    payload = encode(plane)
    assert native_decode(payload, n).tobytes() == plane.tobytes()
    assert huffman.decode(payload, n).tobytes() == plane.tobytes()


def test_fewer_than_two_values_is_not_coded() -> None:
    assert native is not None
    for plane in (b"", b"\x07", b"\x07" * 5000):
        assert native.huff_encode(plane) is None and native.huff_size(plane) == 0


def test_codes_are_limited_to_eleven_bits_and_complete() -> None:
    # Fibonacci counts would give a Huffman code 24 bits deep.
    counts = [1, 1]
    while len(counts) < 25:
        counts.append(counts[-1] + counts[-2])
    plane = np.repeat(np.arange(25, dtype=np.uint8), counts)
    np.random.default_rng(0).shuffle(plane)
    payload = encode(plane)
    lengths, _ = huffman.code_lengths(payload)  # checks completeness
    present = lengths[lengths > 0]
    assert len(present) == 25 and present.max() == 11 and present.min() == 1
    assert np.sum(2.0**-present) == 1.0
    assert native_decode(payload, len(plane)).tobytes() == plane.tobytes()


def test_uneven_streams_finish_alone() -> None:
    """One stream of one-bit codes fills its output long before the others use up
    their input: those finish on their own (the native decoder's per-stream loop)."""
    n = 40_000
    plane = np.zeros(n, dtype=np.uint8)
    plane[n // 4 :] = skewed(n - n // 4, 200, 5, alpha=0.0)  # streams 1-3: ~8 bits a value
    payload = encode(plane)
    assert native_decode(payload, n).tobytes() == plane.tobytes()
    assert huffman.decode(payload, n).tobytes() == plane.tobytes()


def test_size_is_close_to_the_order0_entropy() -> None:
    plane = skewed(1 << 20, 35, 1)
    counts = np.bincount(plane, minlength=256)
    p = counts[counts > 0] / len(plane)
    entropy_bytes = float(-(p * np.log2(p)).sum()) * len(plane) / 8
    assert len(encode(plane)) <= 1.03 * entropy_bytes


def _decode_outcome(decoder: str, payload: bytes, n: int) -> bytes | None:
    try:
        if decoder == "native":
            try:
                return native_decode(payload, n).tobytes()
            except ValueError as exc:
                raise CorruptObjectError(str(exc)) from None
        return huffman.decode(payload, n).tobytes()
    except CorruptObjectError:
        return None


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=3000),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    edits=st.lists(st.tuples(st.integers(min_value=0, max_value=10**6), st.integers(0, 255)), max_size=4),
    cut=st.integers(min_value=-40, max_value=8),
)
def test_hostile_payloads_are_refused_or_decoded_alike(
    n: int, seed: int, edits: list[tuple[int, int]], cut: int
) -> None:
    """Damaged payloads (bytes changed, cut short, grown) never crash a reader or
    write past its output; the native and the Python readers accept and refuse the
    same payloads and agree on what the accepted ones hold."""
    plane = skewed(max(n, 2), 40, seed)
    plane[:2] = (1, 2)
    payload = bytearray(encode(plane))
    for at, value in edits:
        payload[at % len(payload)] = value
    damaged = bytes(payload[: len(payload) + cut]) if cut < 0 else bytes(payload) + bytes(cut)
    guard = np.full(n + 64, 0xA5, dtype=np.uint8)
    got_native = _decode_outcome("native", damaged, n)
    assert native is not None
    try:
        native.huff_decode(damaged, guard[:n])
    except ValueError:
        pass
    assert (guard[n:] == 0xA5).all()
    assert got_native == _decode_outcome("python", damaged, n)


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p[:20],  # inside the bitmap
        lambda p: p[:33],  # inside the lengths
        lambda p: bytes(32) + p[32:],  # no values occur
        lambda p: p[:32] + bytes([0xFF]) + p[33:],  # a length of 15
        lambda p: p[:32] + bytes([0x11]) + p[33:],  # lengths 1 and 1 then more: oversubscribed
        lambda p: p[:-40],  # the last stream cut short
    ],
)
def test_malformed_payloads_are_corrupt(damage: object) -> None:
    plane = skewed(4000, 30, 9)
    payload = damage(encode(plane))  # type: ignore[operator]
    with pytest.raises(CorruptObjectError):
        huffman.decode(payload, len(plane))
    with pytest.raises(ValueError):
        native_decode(payload, len(plane))


def test_a_stream_size_past_the_payload_is_corrupt() -> None:
    plane = skewed(4000, 30, 9)
    payload = bytearray(encode(plane))
    k = len(np.unique(plane))
    at = 32 + (k + 1) // 2
    struct.pack_into("<I", payload, at, len(payload))
    with pytest.raises(CorruptObjectError):
        huffman.decode(bytes(payload), len(plane))
    with pytest.raises(ValueError):
        native_decode(bytes(payload), len(plane))


def bf16_weights(n: int, seed: int) -> bytes:
    values = (np.random.default_rng(seed).standard_normal(n) * 0.02).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype("<u2").tobytes()


@pytest.mark.parametrize("n", [3000, 300_000], ids=["whole-plane", "sampled"])
def test_the_exponent_plane_of_weights_is_huffman_coded(n: int) -> None:
    data = bf16_weights(n, 1) + b"\x01"
    payload = encode_planes(data, 2, True, sample_planes(data, 2, True, True), huffman=True)
    assert plane_codecs(payload) == [PLANE_RAW, PLANE_HUFFMAN]
    assert plane_codecs(encode_planes(data, 2, True)) == [PLANE_RAW, PLANE_ZSTD]  # format version 3
    for reader in ("native", "numpy"):
        out = np.empty(len(data), dtype=np.uint8)
        with pytest.MonkeyPatch.context() as patch:
            if reader == "numpy":
                patch.setattr(planes_module, "_native", None)
            decode_planes_into(payload, out)
        assert out.tobytes() == data


def test_every_plane_huffman_coded_decodes_into_its_own_buffer() -> None:
    """Four Huffman planes in one payload: each decodes into a buffer of its own."""
    grid = np.stack([skewed(50_000, 20 + 10 * k, k) for k in range(4)], axis=1)
    data = grid.tobytes()
    payload = encode_planes(data, 4, False, huffman=True)
    assert plane_codecs(payload) == [PLANE_HUFFMAN] * 4
    out = np.empty(len(data), dtype=np.uint8)
    decode_planes_into(payload, out)
    assert out.tobytes() == data


def test_zstd_is_kept_where_it_wins_by_more_than_a_percent() -> None:
    """Repeats Huffman cannot see (a short pattern over and over) stay with zstd."""
    pattern = skewed(97, 30, 4)
    data = np.tile(pattern, 3000)
    assert planes_module._encode_plane(data, None, True)[0] == PLANE_ZSTD
    assert planes_module._encode_plane(skewed(len(data), 30, 4), None, True)[0] == PLANE_HUFFMAN


def test_without_the_native_loops_no_huffman_plane_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planes_module, "_native", None)
    assert not planes_module.can_write_huffman()
    data = bf16_weights(300_000, 2)
    payload = encode_planes(data, 2, True, sample_planes(data, 2, True, True), huffman=True)
    assert PLANE_HUFFMAN not in plane_codecs(payload)


SAMPLED_N = 1 << 20  # at least the native coder's HUF_SAMPLED_MIN: the code comes from a sample
# Where _native.c's sample pieces lie in a plane of SAMPLED_N: 16 of 4 KiB, evenly spread.
SAMPLE_STEP = (SAMPLED_N - 4096) // 15


def coded_symbols(payload: bytes) -> set[int]:
    bitmap = np.unpackbits(np.frombuffer(payload[:32], dtype=np.uint8), bitorder="little")
    return set(np.flatnonzero(bitmap).tolist())


def test_a_long_planes_code_covers_values_its_sample_missed() -> None:
    """Values the sample never sees but which lie within the plane's range get a code
    (one each, at most 11 bits); where too many candidates lie outside the sample the
    full histogram decides, and only the values that occur get a code."""
    base = np.random.default_rng(3).integers(10, 21, SAMPLED_N, dtype=np.uint8)  # 10..20 in every sample piece
    off_sample = SAMPLE_STEP // 2  # between the first two pieces
    for rare, expected in ((30, set(range(10, 31))), (60, {*range(10, 21), 60})):
        plane = base.copy()
        plane[off_sample] = rare
        payload = encode(plane)
        assert coded_symbols(payload) == expected
        assert native_decode(payload, len(plane)).tobytes() == plane.tobytes()
        assert huffman.decode(payload, len(plane)).tobytes() == plane.tobytes()


def test_an_exponent_plane_with_zeros_is_coded_from_its_sample() -> None:
    """A sign-swapped exponent byte is a contiguous range only rotated by a bit; zero
    bytes (zeros, subnormals) are a candidate of their own, not the range's bottom."""
    data = bf16_weights(SAMPLED_N, 4)
    grid = np.frombuffer(data, dtype=np.uint8).reshape(-1, 2).copy()
    grid[SAMPLE_STEP // 2 : SAMPLE_STEP // 2 + 100] = 0  # 100 zero elements the sample misses
    planes, _ = planes_module.split_planes(grid.tobytes(), 2, True)
    exponent = planes[1]
    present = set(np.unique(exponent).tolist())
    payload = encode(exponent)
    assert present <= coded_symbols(payload) and 0 in coded_symbols(payload)
    assert len(coded_symbols(payload)) <= len(present) + 12
    assert native_decode(payload, len(exponent)).tobytes() == exponent.tobytes()


@pytest.mark.parametrize(
    ("width", "sign_swap", "tail", "n"),
    [
        (2, True, b"", 300_000),  # a sampled code
        (2, True, b"\x07", 200_000),  # sampled verdicts, a code from the whole histogram
        (4, True, b"\x01\x02\x03", 300_000),
        (4, False, b"", 300_000),
        (8, False, b"\x05", 300_000),
    ],
)
def test_the_fused_payload_is_the_general_paths_bytes(width: int, sign_swap: bool, tail: bytes, n: int) -> None:
    rng = np.random.default_rng(width)
    values = (rng.standard_normal(n) * 0.02).astype(np.float32)
    elements = {
        2: (values.view(np.uint32) >> 16).astype("<u2").tobytes(),
        4: values.tobytes(),
        # seven random planes below one of an exponent's shape
        8: np.stack([*(rng.integers(0, 256, n, dtype=np.uint8) for _ in range(7)), skewed(n, 30, 1)], axis=1).tobytes(),
    }[width]
    data = elements + tail
    verdicts = sample_planes(data, width, sign_swap, True)
    assert verdicts is not None and planes_module._raw_then_huffman(verdicts) is not None
    fused = encode_planes(data, width, sign_swap, verdicts, huffman=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planes_module, "_raw_then_huffman", lambda _verdicts: None)
        general = encode_planes(data, width, sign_swap, verdicts, huffman=True)
    assert fused == general
    out = np.empty(len(data), dtype=np.uint8)
    decode_planes_into(fused, out)
    assert out.tobytes() == data


def test_the_fused_payload_declines_a_plane_that_does_not_shrink() -> None:
    """A Huffman verdict the whole plane does not bear out: the general path codes it
    (zstd or raw), as it would have without the fused one."""
    assert native is not None
    n = 300_000
    grid = np.stack([skewed(n, 20, 1), np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)], axis=1)
    data = grid.tobytes()
    assert native.plane_payload(data, 2, False, 0, np.empty(2 * n, dtype=np.uint8)) is None
    payload = encode_planes(data, 2, False, [PLANE_HUFFMAN, PLANE_HUFFMAN], huffman=True)
    assert plane_codecs(payload) == [PLANE_HUFFMAN, PLANE_RAW]
    out = np.empty(len(data), dtype=np.uint8)
    decode_planes_into(payload, out)
    assert out.tobytes() == data


def test_the_fused_payload_checks_its_arguments() -> None:
    assert native is not None
    data = bytes(4000)
    with pytest.raises(ValueError, match="raw_planes"):
        native.plane_payload(data, 2, True, 2, np.empty(4000, dtype=np.uint8))
    with pytest.raises(ValueError, match="scratch"):
        native.plane_payload(data, 2, True, 1, np.empty(1999, dtype=np.uint8))
    with pytest.raises(ValueError, match="width"):
        native.plane_payload(data, 3, True, 1, np.empty(4000, dtype=np.uint8))


def probe_positions(n: int) -> np.ndarray:
    """The positions of a plane of n values that its probe holds."""
    return np.frombuffer(planes_module.probe_of(np.arange(n, dtype=np.uint32).tobytes(), 4), dtype=np.uint32)


def test_repeats_between_the_probes_stretches_are_the_samples_blind_spot() -> None:
    """A plane that our coder clearly shrinks in its probe (stretches spread over
    the sample), with no repeats there for zstd, is decided on those alone: repeats
    between the stretches go unseen, and the plane is Huffman-coded although zstd
    would make it far smaller (the documented limit; repeats within the probe keep
    zstd, above)."""
    assert native is not None
    data = np.tile(skewed(97, 30, 7), 3100)[:300_000]
    at = probe_positions(len(data))
    data[at] = skewed(len(at), 30, 6)
    assert planes_module._encode_plane(data, None, True)[0] == PLANE_HUFFMAN
    assert len(planes_module.zstd_plane_encode(data.data)) < 0.3 * len(native.huff_encode(data) or b"")


def _plane_set_outcome(payload: bytes, size: int, fused: bool) -> bytes | None:
    out = np.full(size + 64, 0xA5, dtype=np.uint8)
    with pytest.MonkeyPatch.context() as patch:
        if not fused:
            patch.setattr(planes_module, "_native", None)
        try:
            decode_planes_into(payload, out[:size])
        except CorruptObjectError:
            return None
    assert (out[size:] == 0xA5).all()
    return out[:size].tobytes()


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=2500),
    width=st.sampled_from([2, 4]),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    edits=st.lists(st.tuples(st.integers(min_value=0, max_value=10**6), st.integers(0, 255)), max_size=3),
    cut=st.integers(min_value=-12, max_value=4),
)
def test_the_native_plane_set_decoder_refuses_and_decodes_as_the_python_one(
    n: int, width: int, seed: int, edits: list[tuple[int, int]], cut: int
) -> None:
    """plane_decode (raw and Huffman planes in one call) against the Python path on
    damaged payloads: the same payloads refused (CorruptObjectError), the same bytes
    from the others, and nothing written past the output."""
    rng = np.random.default_rng(seed)
    grid = np.stack(
        [skewed(n, 30, seed) if k == width - 1 else rng.integers(0, 256, n, dtype=np.uint8) for k in range(width)],
        axis=1,
    )
    data = grid.tobytes() + bytes(range(seed % width))
    payload = bytearray(encode_planes(data, width, True, [PLANE_RAW] * (width - 1) + [PLANE_HUFFMAN], huffman=True))
    for at, value in edits:
        payload[at % len(payload)] = value
    damaged = bytes(payload[: len(payload) + cut]) if cut < 0 else bytes(payload) + bytes(cut)
    assert _plane_set_outcome(damaged, len(data), fused=True) == _plane_set_outcome(damaged, len(data), fused=False)


def test_the_native_plane_set_decoder_hands_back_zstd_planes() -> None:
    """A payload with a zstd plane, or a scratch too small, is left to the Python
    path: False, with the output untouched."""
    assert native is not None
    data = bf16_weights(3000, 5)
    payload = encode_planes(data, 2, True)  # version 3 verdicts: a zstd exponent plane
    assert plane_codecs(payload) == [PLANE_RAW, PLANE_ZSTD]
    out = np.full(len(data), 7, dtype=np.uint8)
    assert native.plane_decode(payload, out, np.empty(len(data), dtype=np.uint8)) is False
    assert (out == 7).all()
    huffman_payload = encode_planes(data, 2, True, [PLANE_RAW, PLANE_HUFFMAN], huffman=True)
    assert native.plane_decode(huffman_payload, out, np.empty(10, dtype=np.uint8)) is False
    assert (out == 7).all()
    assert native.plane_decode(huffman_payload, out, np.empty(len(data), dtype=np.uint8)) is True
    assert out.tobytes() == data


def test_a_plane_random_in_its_probe_is_raw_whatever_lies_between() -> None:
    """Neither coder shrinks the probe: the plane is stored raw without the whole
    sample's trial, even where the rest of it would compress (the documented limit
    of the probe)."""
    plane = np.zeros(300_000, dtype=np.uint8)
    at = probe_positions(len(plane))
    plane[at] = np.random.default_rng(9).integers(0, 256, len(at), dtype=np.uint8)
    assert planes_module._encode_plane(plane, None, True)[0] == PLANE_RAW
    assert planes_module._encode_plane(plane, None, False)[0] == PLANE_ZSTD  # version 3: the whole sample decides
