"""The compact lossy tier (format version 5): each save coded against the one
before, so errors are corrected instead of accumulated; second moments rounded to
powers of two; chains bounded by the keyframe interval, verified like any chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ckvc
from ckvc.codecs import QUANT
from ckvc.codecs.lossy import (
    COARSE_STEP_RMS,
    FIRST_LINK_STEP_RMS,
    FLAG_RESIDUAL,
    LOG2,
    TRACK_BLOCK,
    QuantHeader,
    dequantize_into,
    quant_header,
    quantize_compact,
)
from ckvc.codecs.policy import MIN_COMPACT_ELEMENTS
from ckvc.codecs.records import base_to_decode, check_base_link
from ckvc.errors import CorruptObjectError

STEPS = 6


def training_run(steps: int = STEPS) -> list[dict[str, object]]:
    """Weights that drift a little each save, Adam-like moments, a counter."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 512, generator=g) * 0.02
    states = []
    for step in range(steps):
        grad = torch.randn(w.shape, generator=g) * 1e-3
        w = w - 1e-3 * torch.sign(grad) * torch.rand(w.shape, generator=g)
        v = grad.square() * (1 + torch.rand(w.shape, generator=g))
        v[0, :7] = 0.0  # never updated: must stay exactly zero
        states.append(
            {
                "model": {"w": w.clone(), "bias": torch.randn(8, generator=g)},
                "optimizer": {"state": {"0": {"exp_avg": grad * 0.1, "exp_avg_sq": v, "step": torch.tensor(step)}}},
            }
        )
    return states


def chunk_of(repo: ckvc.Repo, commit_id: str, path: str) -> bytes:
    snapshot = repo.read_snapshot(repo.read_commit(commit_id))
    (blob,) = [b for b in snapshot.blobs if b.path == path]
    assert len(blob.chunks) == 1
    return blob.chunks[0]


def test_compact_chains_restore_the_same_bytes_in_a_fresh_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    states = training_run()
    with ckvc.Repo.init(tmp_path / "r", keyframe_interval=3) as repo:
        ids = [repo.commit(s, message="save", lossy="compact") for s in states]
        assert repo.config.format_version == 5
        loaded = [repo.load(i) for i in ids]
        ages = []
        for i, commit_id in enumerate(ids):
            oid = chunk_of(repo, commit_id, "model.w")
            assert repo.store.stat(oid).codec == QUANT
            info = repo.store.base_info(oid)
            ages.append(info.age)
            # Each link builds on the save before it; a checkout decodes at most
            # keyframe_interval - 1 lossy links (a standalone first link counts one).
            assert info.base == (chunk_of(repo, ids[i - 1], "model.w") if info.age > 1 else None)
        assert ages == [1, 2, 1, 2, 1, 2]
        report = repo.read_commit(ids[-1]).lossy
        assert {p: r["codec"] for p, r in report.items()} == {
            "model.w": "track",
            "optimizer.state.0.exp_avg": "coarse",
            "optimizer.state.0.exp_avg_sq": "log2",
        }
    with ckvc.Repo.open(tmp_path / "r") as fresh:
        assert fresh.fsck().ok
        for commit_id, before in zip(ids, loaded, strict=True):
            again = fresh.load(commit_id)
            assert torch.equal(again["model"]["w"].view(torch.int32), before["model"]["w"].view(torch.int32))
            opt, opt_before = again["optimizer"]["state"]["0"], before["optimizer"]["state"]["0"]
            assert torch.equal(opt["exp_avg_sq"], opt_before["exp_avg_sq"])
    # Exact where it must be: the counter and the small bias.
    assert torch.equal(loaded[-1]["model"]["bias"], states[-1]["model"]["bias"])  # type: ignore[index]
    assert torch.equal(loaded[-1]["optimizer"]["state"]["0"]["step"], torch.tensor(STEPS - 1))


def test_track_corrects_the_error_of_the_save_before(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Against the parent's reconstruction, the error stays within half a step of
    this save's own residual: it does not grow along the chain."""
    states = training_run()
    with ckvc.Repo.init(tmp_path / "r") as repo:
        ids = [repo.commit(s, lossy={"model.*": "track"}) for s in states]
        errors = []
        for state, commit_id in zip(states, ids, strict=True):
            got = repo.load(commit_id)["model"]["w"]
            error = (got - state["model"]["w"]).abs().max().item()  # type: ignore[index]
            assert error == pytest.approx(repo.read_commit(commit_id).lossy["model.w"]["max_abs_error"], rel=1e-6)
            errors.append(error)
    # The first link is 8 bits over the range; later ones half an RMS of one save's change.
    step_change = (states[1]["model"]["w"] - states[0]["model"]["w"]).square().mean().sqrt().item()  # type: ignore[index]
    assert max(errors[1:]) <= 2 * step_change
    assert errors[-1] <= 1.5 * max(errors[1:3])


def test_log2_rounds_to_the_nearest_power_and_keeps_zeros() -> None:
    g = torch.Generator().manual_seed(1)
    v = torch.rand(8192, generator=g).pow(8) * 1e-3
    v[:5] = torch.tensor([0.0, 1.0, 1.4142, 1.4143, 3.0e38])
    result = quantize_compact(v.numpy().tobytes(), "float32", "log2", None, 1)
    assert result is not None
    got = torch.from_numpy(result.plain.copy()).view(torch.float32)
    bits = got.view(torch.int32)
    assert bool(((bits & 0x807FFFFF) == 0).all())  # a power of two (or zero), nothing else
    assert got[:5].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0**127]
    ratio = got[5:] / v[5:]
    assert float(ratio.max()) <= 2**0.5 and float(ratio.min()) >= 2**-0.5
    head = quant_header(result.payload)
    assert (head.scheme, head.flags, head.block) == (LOG2, 0, 1)


def test_log2_residual_against_the_parent_and_its_refusals() -> None:
    g = torch.Generator().manual_seed(2)
    v0 = torch.rand(8192, generator=g) * 1e-4
    first = quantize_compact(v0.numpy().tobytes(), "float32", "log2", None, 1)
    assert first is not None
    v1 = v0 * 0.97
    second = quantize_compact(v1.numpy().tobytes(), "float32", "log2", first.plain, 2)
    assert second is not None and quant_header(second.payload).residual
    out = np.empty(len(second.plain), dtype=np.uint8)
    dequantize_into(second.payload, out, first.plain)
    assert out.tobytes() == second.plain.tobytes()
    # A base that is not powers of two cannot carry exponent changes.
    damaged = first.plain.copy()
    damaged[0] ^= 1
    with pytest.raises(CorruptObjectError, match="powers-of-two residual"):
        dequantize_into(second.payload, out, damaged)
    # Exponents driven out of range by the change are corrupt, never infinity.
    high = np.frombuffer((torch.full((8192,), 2.0**120)).numpy().tobytes(), dtype=np.uint8)
    jump = quantize_compact((torch.full((8192,), 2.0**126)).numpy().tobytes(), "float32", "log2", high, 2)
    assert jump is not None and quant_header(jump.payload).residual
    low = np.frombuffer((torch.full((8192,), 2.0**-100)).numpy().tobytes(), dtype=np.uint8)
    dequantize_into(jump.payload, out, low)  # still in range: fine
    top = np.frombuffer((torch.full((8192,), 2.0**127)).numpy().tobytes(), dtype=np.uint8)
    with pytest.raises(CorruptObjectError, match="out of range"):
        dequantize_into(jump.payload, out, top)
    # A jump past 128 binades starts a new chain instead.
    far = quantize_compact((torch.full((8192,), 2.0**-120)).numpy().tobytes(), "float32", "log2", high, 2)
    assert far is not None and not quant_header(far.payload).residual


def test_negative_or_half_precision_second_moments_stay_exact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    negative = -torch.rand(8192)
    assert quantize_compact(negative.numpy().tobytes(), "float32", "log2", None, 1) is None
    half = torch.rand(8192).half()
    assert quantize_compact(half.numpy().tobytes(), "float16", "log2", None, 1) is None
    bf16 = torch.rand(8192).bfloat16()
    result = quantize_compact(bf16.view(torch.int16).numpy().tobytes(), "bfloat16", "log2", None, 1)
    assert result is not None
    assert bool((torch.from_numpy(result.plain.copy()).view(torch.int16) & 0x807F == 0).all())


def block_steps(blocks: torch.Tensor, rms_factor: float) -> torch.Tensor:
    """The standalone step rule: the block's range over 254 codes, or ``rms_factor``
    of its RMS, whichever is coarser."""
    return torch.maximum(blocks.abs().amax(dim=1) / 127, rms_factor * blocks.square().mean(dim=1).sqrt())


def test_coarse_first_moments_round_on_a_step_of_the_block_rms() -> None:
    m = torch.randn(65536, generator=torch.Generator().manual_seed(3)) * 1e-3
    m[5] = 0.5  # an outlier: its own block's step grows with it
    result = quantize_compact(m.numpy().tobytes(), "float32", "coarse", None, 1)
    assert result is not None
    got = torch.from_numpy(result.plain.copy()).view(torch.float32)
    blocks = m.view(-1, TRACK_BLOCK)
    step = block_steps(blocks, COARSE_STEP_RMS)
    expected = (torch.round(blocks / step[:, None]) * step[:, None]).view(-1)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0)
    assert abs(float(got[5]) - 0.5) <= float(step[0]) / 2 and float(step[0]) > 5 * float(step[1])
    # Most codes are zero or one step either side: the payload is a small fraction.
    assert float((got[TRACK_BLOCK:] == 0).float().mean()) > 0.4
    assert len(result.payload) < len(m.numpy().tobytes()) / 12


def test_a_chains_first_weight_link_rounds_on_its_range_or_a_sixteenth_of_its_rms() -> None:
    w = torch.randn(3 * TRACK_BLOCK, generator=torch.Generator().manual_seed(4)) * 0.02
    w[TRACK_BLOCK + 7] = 40.0  # one block with an outlier: its range sets the step
    result = quantize_compact(w.numpy().tobytes(), "float32", "track", None, 1)
    assert result is not None and not quant_header(result.payload).flags & FLAG_RESIDUAL
    got = torch.from_numpy(result.plain.copy()).view(torch.float32)
    blocks = w.view(-1, TRACK_BLOCK)
    rms = blocks.square().mean(dim=1).sqrt()
    step = block_steps(blocks, FIRST_LINK_STEP_RMS)
    assert torch.allclose(got, (torch.round(blocks / step[:, None]) * step[:, None]).view(-1), rtol=1e-6, atol=0)
    # Gaussian blocks: the RMS rule wins (a range of ~8 RMS over 254 codes is finer).
    assert float(step[0]) == pytest.approx(float(rms[0]) / 16, rel=1e-6)
    assert float(step[1]) == pytest.approx(40.0 / 127, rel=1e-6)
    # Uniform rounding error on the Gaussian blocks: step / sqrt(12), random.
    error = (got.view(-1, TRACK_BLOCK) - blocks)[[0, 2]]
    assert float(error.square().mean().sqrt()) == pytest.approx(0.02 / 16 / 12**0.5, rel=0.05)


def test_compact_modes_reach_norm_sized_tensors_but_never_counters(tmp_path) -> None:  # type: ignore[no-untyped-def]
    state = {
        "model": {"norm": torch.randn(MIN_COMPACT_ELEMENTS), "tiny": torch.randn(MIN_COMPACT_ELEMENTS - 1)},
        "optimizer": {"state": {"0": {"exp_avg": torch.randn(384), "step": torch.tensor(7.0)}}},
    }
    with ckvc.Repo.init(tmp_path / "r") as repo:
        compact = repo.read_commit(repo.commit(state, lossy="compact")).lossy
        q8 = repo.read_commit(repo.commit(state, lossy={"*": "q8"})).lossy
    assert set(compact) == {"model.norm", "optimizer.state.0.exp_avg"}
    assert q8 == {}  # the older modes keep their 4096-element threshold


def test_chain_links_must_be_exactly_as_old_as_their_depth() -> None:
    head = QuantHeader(1, 8, 1, FLAG_RESIDUAL, 3, 4096, 4096)
    payload = b"".join([__import__("struct").pack("<BBBBBIQ", *head)])
    base = b"\x01" * 32
    assert base_to_decode(QUANT, base, payload) == (base, 2)
    assert check_base_link(b"\x02" * 32, QUANT, base, payload, 3) == base
    with pytest.raises(CorruptObjectError, match="age 3 met at depth 2"):
        check_base_link(b"\x02" * 32, QUANT, base, payload, 2)
    standalone = __import__("struct").pack("<BBBBBIQ", 1, 8, 1, 0, 1, 4096, 4096)
    assert check_base_link(b"\x02" * 32, QUANT, None, standalone, 5) is None
