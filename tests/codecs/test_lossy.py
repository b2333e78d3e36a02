"""The opt-in lossy tier: never by default, recorded in the commit with measured
errors, shown by log and show, exact where it must be, verifiable like any chunk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ckvc
from ckvc.cli import cli
from ckvc.codecs import QUANT
from ckvc.codecs.lossy import dequantize_into, quantize
from ckvc.errors import CorruptObjectError
from ckvc.retention import RetentionPolicy


def train_state(epoch: int, seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(128, 256, generator=g) * 0.02
    m = torch.randn(128, 256, generator=g) * 1e-3
    w = w - 1e-4 * epoch * torch.randn(w.shape, generator=torch.Generator().manual_seed(epoch))
    return {
        "model": {"w": w, "bias": torch.randn(16, generator=g)},
        "optimizer": {"m": m * (0.9**epoch), "v": m**2 + 1e-10, "step": torch.tensor(float(epoch))},
        "epoch": epoch,
    }


def files(repo: ckvc.Repo) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(repo.dir.rglob("*")) if p.is_file() and p.name != "lock.mdb"}


def test_nothing_is_lossy_by_default(repo: ckvc.Repo) -> None:
    state = train_state(0)
    commit_id = repo.commit(state)
    assert repo.read_commit(commit_id).lossy == {}
    assert not repo.read_commit(commit_id).is_lossy
    assert "quant" not in repo.show().by_codec


def test_lossy_commit_records_errors_and_restores_dtype_and_shape(repo: ckvc.Repo) -> None:
    state = train_state(0)
    commit_id = repo.commit(state, lossy={"optimizer.*": "q8", "model.w": "q4"})
    report = repo.read_commit(commit_id).lossy
    assert set(report) == {"optimizer.m", "optimizer.v", "model.w"}  # step and bias are too small to quantize
    with ckvc.Repo.open(repo.path) as fresh:
        restored = fresh.load(commit_id)
    for path, original in (("optimizer.m", state["optimizer"]["m"]), ("model.w", state["model"]["w"])):  # type: ignore[index]
        key, name = path.split(".")
        got = restored[key][name]
        assert got.dtype == original.dtype and got.shape == original.shape
        err = (got - original).abs().max().item()
        assert err == pytest.approx(report[path]["max_abs_error"], rel=1e-6)
        rel = ((got - original).double().norm() / original.double().norm()).item()
        assert rel == pytest.approx(report[path]["rel_rms_error"], rel=1e-4)
    assert report["optimizer.m"]["rel_rms_error"] < 0.01  # 8 bits
    assert report["model.w"]["rel_rms_error"] < 0.2  # 4 bits
    # Exact where it must be: counters, small tensors, non-tensor values.
    assert torch.equal(restored["optimizer"]["step"], state["optimizer"]["step"])  # type: ignore[index]
    assert torch.equal(restored["model"]["bias"], state["model"]["bias"])  # type: ignore[index]
    assert restored["epoch"] == 0
    # The second moment never comes back as zero (an Adam step would divide by eps).
    assert bool((restored["optimizer"]["v"] > 0).all())


def test_lossy_chunks_verify_like_any_other(repo: ckvc.Repo) -> None:
    commit_id = repo.commit(train_state(0), lossy="optimizer-q4")
    first = repo.load(commit_id)
    with ckvc.Repo.open(repo.path) as fresh:
        second = fresh.load(commit_id)
        assert fresh.fsck().ok
    for key in ("m", "v"):
        assert torch.equal(first["optimizer"][key], second["optimizer"][key])
    snap = repo.read_snapshot(repo.read_commit(commit_id))
    quant = [o for b in snap.blobs for o in b.chunks if repo.store.stat(o).codec == QUANT]
    assert quant
    entry = repo.store.locate(quant[0])
    path = repo.dir / "packs" / entry.pack
    data = bytearray(path.read_bytes())
    data[entry.offset + entry.record_size - 3] ^= 0x10  # inside the codes
    path.write_bytes(bytes(data))
    with ckvc.Repo.open(repo.path) as fresh, pytest.raises(CorruptObjectError):
        fresh.load(commit_id)


def test_residual_mode_keeps_exact_keyframes(repo: ckvc.Repo) -> None:
    states = [train_state(e) for e in range(4)]
    ids = [repo.commit(s, lossy={"model.*": "residual-q8"}, metrics={"e": float(i)}) for i, s in enumerate(states)]
    reports = [repo.read_commit(c).lossy for c in ids]
    assert reports[0] == {}  # the first commit is the exact keyframe
    assert all(set(r) == {"model.w"} for r in reports[1:])
    assert all(r["model.w"]["codec"] == "residual-q8" for r in reports[1:])
    exact = repo.load(ids[0])
    assert torch.equal(exact["model"]["w"], states[0]["model"]["w"])  # type: ignore[index]
    # Residual errors are relative to the change, not to the weights: tiny.
    assert reports[3]["model.w"]["max_abs_error"] < 1e-5
    repo.set_config(reflog_expiry_s=0)
    repo.retain(RetentionPolicy(keep_last=1))
    repo.gc(now=True)
    with ckvc.Repo.open(repo.path) as fresh:
        last = fresh.load(ids[-1])  # its keyframe lives on although commit 0 was pruned
        assert fresh.fsck().ok
    assert (last["model"]["w"] - states[-1]["model"]["w"]).abs().max().item() < 1e-5  # type: ignore[index]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_half_precision_round_trips_its_dtype(repo: ckvc.Repo, dtype: torch.dtype) -> None:
    w = (torch.randn(64, 128) * 0.05).to(dtype)
    commit_id = repo.commit({"model": {"w": w}}, lossy={"model.*": "q8"})
    got = repo.load(commit_id)["model"]["w"]
    assert got.dtype == dtype and got.shape == w.shape
    assert (got.float() - w.float()).abs().max().item() <= repo.read_commit(commit_id).lossy["model.w"]["max_abs_error"]


def test_non_finite_tensors_stay_exact(repo: ckvc.Repo) -> None:
    w = torch.randn(8192)
    w[17] = float("nan")
    commit_id = repo.commit({"w": w}, lossy={"*": "q4"})
    assert repo.read_commit(commit_id).lossy == {}
    assert torch.equal(repo.load(commit_id)["w"].view(torch.int32), w.view(torch.int32))


@pytest.mark.parametrize("spec", ["no-such-preset", {"model.*": "q3"}, {"model.*": "lossless"}])
def test_bad_specs_are_refused_before_anything_is_written(repo: ckvc.Repo, spec: object) -> None:
    repo.commit(train_state(0))
    before = files(repo)
    with pytest.raises(ckvc.InvalidInputError):
        repo.commit(train_state(1), lossy=spec)  # type: ignore[call-overload]
    assert files(repo) == before


def test_cli_marks_lossy_commits(repo: ckvc.Repo, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.randn(64, 128)}, "optimizer": {"m": torch.randn(64, 128)}}, ckpt)
    runner = CliRunner()
    base = ["-C", str(repo.path)]
    out = runner.invoke(cli, [*base, "commit", str(ckpt), "-m", "exact"])
    assert out.exit_code == 0, out.output
    out = runner.invoke(cli, [*base, "commit", str(ckpt), "-m", "small", "--lossy", "optimizer.*=q4", "--json"])
    assert out.exit_code == 0, out.output
    assert set(json.loads(out.output)["lossy"]) == {"optimizer.m"}
    log = runner.invoke(cli, [*base, "log", "--oneline"]).output.splitlines()
    assert "[lossy]" in log[0] and "[lossy]" not in log[1]
    shown = runner.invoke(cli, [*base, "show"]).output
    assert "LOSSY: 1 tensors" in shown and "optimizer.m  q4" in shown
    as_json = json.loads(runner.invoke(cli, [*base, "log", "--json"]).output)
    assert as_json[0]["lossy"]["optimizer.m"]["codec"] == "q4" and as_json[1]["lossy"] == {}
    out = runner.invoke(cli, [*base, "commit", str(ckpt), "--lossy", "bogus"])
    assert out.exit_code == ckvc.InvalidInputError.exit_code


def test_codec_level_corruption_is_typed() -> None:
    x = (torch.randn(5000) * 0.1).numpy().tobytes()
    q = quantize(x, "float32", 4, None, 1)
    assert q is not None
    out = np.empty(len(x), dtype=np.uint8)
    dequantize_into(q.payload, out, None)
    assert out.tobytes() == q.plain.tobytes()
    for bad in (q.payload[:10], q.payload[:-1], b"\x09" + q.payload[1:], q.payload[:1] + b"\x05" + q.payload[2:]):
        with pytest.raises(CorruptObjectError):
            dequantize_into(bad, out, None)
    with pytest.raises(CorruptObjectError):
        dequantize_into(q.payload, np.empty(len(x) - 4, dtype=np.uint8), None)
    with pytest.raises(CorruptObjectError):
        dequantize_into(q.payload, out, x)  # a base it does not use


def test_a_block_longer_than_the_chunk_costs_no_memory() -> None:
    """Four bytes of a damaged header (the block length) cannot make a decode pad
    the chunk to gigabytes: a block past the chunk is one block of the chunk."""
    import struct
    import tracemalloc

    x = np.linspace(-1, 1, 64, dtype=np.float32)
    q = quantize(x.tobytes(), "float32", 8, None, 1)
    assert q is not None
    damaged = bytearray(q.payload)
    struct.pack_into("<I", damaged, 5, 0xFFFFFFFF)  # the header's block field
    out = np.empty(x.nbytes, dtype=np.uint8)
    tracemalloc.start()
    try:
        dequantize_into(bytes(damaged), out, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.tobytes() == q.plain.tobytes()  # one scale either way: the same values
    assert peak < 1 << 20


def test_a_residual_against_a_base_of_another_size_is_corrupt() -> None:
    base = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    q = quantize((base * 1.01).tobytes(), "float32", 8, base.tobytes(), 1)
    assert q is not None
    out = np.empty(base.nbytes, dtype=np.uint8)
    dequantize_into(q.payload, out, base.tobytes())
    assert out.tobytes() == q.plain.tobytes()
    for wrong in (base.tobytes()[:252], base.tobytes()[:254], b"", base.tobytes() + b"\0\0\0\0"):
        with pytest.raises(CorruptObjectError, match="base is"):
            dequantize_into(q.payload, out, wrong)


def test_a_lossy_commit_upgrades_a_version_1_repository(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path, codec={"name": "zstd"}) as repo:
        exact = repo.commit(train_state(0))
    config = json.loads((tmp_path / ".ckvc" / "config.json").read_text())
    config["format_version"] = 1
    (tmp_path / ".ckvc" / "config.json").write_text(json.dumps(config))
    with ckvc.Repo.open(tmp_path) as repo:
        repo.commit(train_state(1))  # exact commits keep version 1
        assert repo.config.format_version == 1
        repo.commit(train_state(2), lossy="optimizer-q8")
        assert repo.config.format_version == 2
        assert json.loads((tmp_path / ".ckvc" / "config.json").read_text())["format_version"] == 2
        assert torch.equal(repo.load(exact)["model"]["w"], train_state(0)["model"]["w"])  # type: ignore[index]
