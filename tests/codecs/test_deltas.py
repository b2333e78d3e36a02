"""Deltas in a repository: keyframes, byte-exact checkout, gc keeps bases alive,
damage to a keyframe is found and named, and the codec reports add up."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import assert_state_equal

import ckvc
from ckvc.cli import cli
from ckvc.codecs import BYTEGROUP, DELTA
from ckvc.retention import RetentionPolicy
from ckvc.storage.object_store import ObjectStore
from ckvc.storage.packs import RECORD_HEADER_SIZE


def epochs(n: int, seed: int = 0) -> list[dict[str, object]]:
    """Training-like states: weights drifting by small steps, a fresh moment each epoch."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(256, 1024, generator=g) * 0.02
    out = []
    for i in range(n):
        w = w - 1e-4 * torch.randn(w.shape, generator=g)
        out.append({"model": {"w": w.clone(), "b": torch.full((7,), float(i))}, "step": i})
    return out


@pytest.fixture
def repo(make_repo: Callable[..., ckvc.Repo]) -> ckvc.Repo:
    return make_repo(chunk_size=256 << 10, keyframe_interval=4)


def codecs_of(repo: ckvc.Repo, commit_id: str) -> list[int]:
    snap = repo.read_snapshot(repo.read_commit(commit_id))
    (blob,) = [b for b in snap.blobs if b.path == "model.w"]
    return [repo.store.stat(oid).codec for oid in blob.chunks]


def test_deltas_point_at_keyframes_and_check_out_exactly(repo: ckvc.Repo) -> None:
    states = epochs(9)
    ids = [repo.commit(s, message=f"e{i}") for i, s in enumerate(states)]
    kinds = [set(codecs_of(repo, c)) for c in ids]
    # keyframe_interval 4: whole at commits 0, 4, 8; deltas against them in between.
    assert kinds == [{BYTEGROUP}, {DELTA}, {DELTA}, {DELTA}, {BYTEGROUP}, {DELTA}, {DELTA}, {DELTA}, {BYTEGROUP}]
    for commit_id in ids:
        snap = repo.read_snapshot(repo.read_commit(commit_id))
        for oid in next(b for b in snap.blobs if b.path == "model.w").chunks:
            info = repo.store.base_info(oid)
            if info.base is not None:
                assert repo.store.base_info(info.base).whole  # every base is stored whole
                assert info.age in (1, 2, 3)
    second = repo.read_snapshot(repo.read_commit(ids[2]))
    ages = [repo.store.base_info(o).age for o in second.blobs[0].chunks if not repo.store.base_info(o).whole]
    assert ages and set(ages) == {2}
    with ckvc.Repo.open(repo.path) as fresh:  # a new process: nothing cached
        for commit_id, state in zip(ids, states, strict=True):
            assert_state_equal(fresh.load(commit_id), state)


def _drift(w: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return w - 1e-4 * torch.randn(w.shape, generator=g)


def test_a_delta_lost_to_an_old_keyframe_does_not_back_off(make_repo: Callable[..., ckvc.Repo]) -> None:
    """A delta that loses against a keyframe two commits old leaves this commit's
    chunk whole, a fresh keyframe: the next commit still tries (and wins) a delta
    against it. One that loses against the parent's own chunk backs off a commit."""
    repo = make_repo(chunk_size=256 << 10, keyframe_interval=16)
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(256, 1024, generator=g) * 0.02
    jump = torch.randn(256, 1024, generator=g) * 0.02  # unrelated to w0: no delta pays
    # w: drift (delta vs w0), jump (loses vs w0, two commits old), drift (delta vs the jump)
    aged = [w0, _drift(w0, g), jump, _drift(jump, g)]
    ids = [repo.commit({"model": {"w": w}}) for w in aged]
    assert [set(codecs_of(repo, c)) for c in ids] == [{BYTEGROUP}, {DELTA}, {BYTEGROUP}, {DELTA}]
    # v: jumps right after its keyframe (loses vs the parent's own chunk): the next commit skips deltas
    fresh = make_repo("fresh", chunk_size=256 << 10, keyframe_interval=16)
    lost = [w0, jump, _drift(jump, g), _drift(jump, g)]
    ids = [fresh.commit({"model": {"w": w}}) for w in lost]
    assert [set(codecs_of(fresh, c)) for c in ids] == [{BYTEGROUP}, {BYTEGROUP}, {BYTEGROUP}, {DELTA}]


def test_a_delta_is_much_smaller_than_a_keyframe(repo: ckvc.Repo) -> None:
    states = epochs(2)
    repo.commit(states[0])
    first = repo.last_commit_stats
    repo.commit(states[1])
    second = repo.last_commit_stats
    assert first is not None and second is not None
    assert second.new_chunk_stored_bytes < 0.75 * first.new_chunk_stored_bytes


def test_gc_keeps_keyframes_of_retained_commits(repo: ckvc.Repo) -> None:
    states = epochs(4)
    ids = [repo.commit(s, message=f"e{i}", metrics={"loss": float(-i)}) for i, s in enumerate(states)]
    repo.set_config(reflog_expiry_s=0)
    # Keep only the last commit: its chunks are deltas against commit 0's keyframes.
    repo.retain(RetentionPolicy(keep_last=1))
    report = repo.gc(now=True)
    assert report.packs_deleted or report.packs_repacked
    with ckvc.Repo.open(repo.path) as fresh:
        assert_state_equal(fresh.load(ids[-1]), states[-1])
        assert fresh.fsck().ok
        with pytest.raises(ckvc.PrunedCommitError):
            fresh.load(ids[1])


def test_damaged_keyframe_is_named_by_load_and_fsck(repo: ckvc.Repo) -> None:
    states = epochs(3)
    ids = [repo.commit(s) for s in states]
    delta_chunk = next(o for o in repo.read_snapshot(repo.read_commit(ids[2])).blobs[0].chunks)
    keyframe = repo.store.base_info(delta_chunk).base
    assert keyframe is not None
    entry = repo.store.locate(keyframe)
    path = repo.dir / "packs" / entry.pack
    data = bytearray(path.read_bytes())
    data[entry.offset + RECORD_HEADER_SIZE + 40] ^= 0xFF  # inside a raw mantissa plane
    path.write_bytes(bytes(data))
    with ckvc.Repo.open(repo.path) as fresh:
        with pytest.raises(ckvc.CorruptObjectError) as err:
            fresh.load(ids[2])
        assert err.value.object_id == keyframe.hex()  # the damaged base, not the delta
        problems = fresh.fsck().problems
        assert any(p.object_id == keyframe.hex() for p in problems)


def test_keyframe_interval_one_turns_deltas_off(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path / "r", keyframe_interval=1) as repo:
        ids = [repo.commit(s) for s in epochs(3)]
        for commit_id in ids:
            assert DELTA not in codecs_of(repo, commit_id)


def test_codec_reports_add_up(repo: ckvc.Repo) -> None:
    for s in epochs(3):
        repo.commit(s)
    info = repo.show()
    assert info.stored_bytes == sum(c.stored_bytes for c in info.by_codec.values())
    assert "delta" in info.by_codec and info.by_codec["delta"].ratio < 0.75
    usage = repo.du()
    assert usage.stored_chunk_bytes == sum(c.stored_bytes for c in usage.by_codec.values())
    assert usage.unique_raw_bytes == sum(c.raw_bytes for c in usage.by_codec.values())
    runner = CliRunner()
    shown = json.loads(runner.invoke(cli, ["-C", str(repo.path), "show", "--json"]).output)
    assert shown["by_codec"]["delta"]["stored_bytes"] == info.by_codec["delta"].stored_bytes
    du_json = json.loads(runner.invoke(cli, ["-C", str(repo.path), "du", "--json"]).output)
    assert set(du_json["by_codec"]) == set(usage.by_codec)
    text = runner.invoke(cli, ["-C", str(repo.path), "du"]).output
    assert "by codec:" in text and "delta" in text


def test_fsck_counts_kept_keyframes_as_referenced(repo: ckvc.Repo) -> None:
    states = epochs(3)
    for i, s in enumerate(states):
        repo.commit(s, metrics={"e": float(i)})
    repo.set_config(reflog_expiry_s=0)
    repo.retain(RetentionPolicy(keep_last=1))
    repo.gc(now=True)
    report = repo.fsck(level="metadata")
    # Commit 0's keyframes (256 KiB chunks) are still needed; only its small dead
    # snapshot may remain, in a pack that was too live to rewrite.
    assert report.ok and report.unreferenced_bytes < 1024


def test_fsck_names_a_missing_keyframe(repo: ckvc.Repo) -> None:
    ids = [repo.commit(s) for s in epochs(3)]
    snap = repo.read_snapshot(repo.read_commit(ids[-1]))
    delta_chunk = next(o for b in snap.blobs for o in b.chunks if not repo.store.base_info(o).whole)
    keyframe = repo.store.base_info(delta_chunk).base
    assert keyframe is not None
    pack = repo.store.locate(keyframe).pack
    assert pack != repo.store.locate(delta_chunk).pack
    (repo.dir / "packs" / pack).unlink()  # commit 0's pack: its keyframes are gone
    with ckvc.Repo.open(repo.path) as fresh:
        fresh.store.rebuild_index()
        problems = fresh.fsck(level="metadata").problems
        assert any(p.object_id == keyframe.hex() and "delta base" in p.detail for p in problems)
        with pytest.raises(ckvc.ObjectNotFoundError):
            fresh.load(ids[-1])


def drifting(dtype: torch.dtype, n: int) -> list[dict[str, torch.Tensor]]:
    """States of one dtype that change a little per epoch (deltas win), odd byte sizes included."""
    g = torch.Generator().manual_seed(3)
    if dtype.is_floating_point:
        step = {torch.bfloat16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]  # a few ulps
        base = torch.randn(70_001, generator=g, dtype=torch.float64)
        return [
            {"t": (base * (1 + step * i * torch.randn(70_001, generator=g, dtype=torch.float64))).to(dtype)}
            for i in range(n)
        ]
    base = torch.randint(0, 100, (70_001,), generator=g, dtype=dtype)
    out = []
    for i in range(n):
        t = base.clone()
        t[:: 97 + i] += 1
        out.append({"t": t})
    return out


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.uint8])
def test_checkout_decodes_keyframes_in_place(tmp_path: Path, dtype: torch.dtype, native: bool) -> None:
    """A fresh process checks out deltas by decoding each keyframe straight into the
    destination and adding the residual in place: nothing goes through the base cache."""
    from unittest import mock

    from ckvc.codecs import planes

    states = drifting(dtype, 4)
    with ckvc.Repo.init(tmp_path / "r", chunk_size=64 << 10) as repo:
        ids = [repo.commit(s, message=str(i)) for i, s in enumerate(states)]
        assert DELTA in {
            repo.store.stat(o).codec for o in repo.read_snapshot(repo.read_commit(ids[-1])).blobs[0].chunks
        }
    never = mock.Mock(side_effect=AssertionError("a checkout went through the base cache"))
    with (
        mock.patch.object(planes, "_native", planes._native if native else None),
        mock.patch.object(ObjectStore, "_plain_unverified", never),
        ckvc.Repo.open(tmp_path / "r") as fresh,
    ):
        for commit_id, state in zip(ids, states, strict=True):
            assert_state_equal(fresh.load(commit_id), state)
    assert not never.called
