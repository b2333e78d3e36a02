"""fsck --repair: damage a remote could repair is repaired from it, verified, bit-exact;
damage no remote holds stays named and its only copy stays on disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_state_equal, run
from s3server import S3Server

import ckvc
from ckvc.fsck import BAD_CHECKSUM, MISSING_OBJECT
from ckvc.storage.durable import list_packs
from ckvc.storage.local import LocalBackend
from ckvc.storage.packs import RECORD_HEADER_SIZE, RecordInfo, read_toc

CHUNK = 16 << 10


def state(step: int) -> dict[str, Any]:
    """Drifts a little per step, so later commits store deltas against earlier chunks."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(128, 96, generator=g) + 0.001 * step
    return {"model": {"w": w, "b": torch.full((64, 64), float(step))}, "step": step}


def packs_of(repo: ckvc.Repo) -> dict[str, list[RecordInfo]]:
    found = {}
    for name in list_packs(repo.dir / "packs"):
        toc = read_toc(LocalBackend(repo.dir / "packs"), name)
        assert toc is not None
        found[name] = toc
    return found


def pack_holding(repo: ckvc.Repo, oid: bytes) -> tuple[Path, RecordInfo]:
    for name, toc in packs_of(repo).items():
        for e in toc:
            if e.oid == oid:
                return repo.dir / "packs" / name, e
    raise AssertionError(f"no pack holds {oid.hex()}")


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def chunks_of(repo: ckvc.Repo, commit: str) -> list[bytes]:
    return [c for blob in repo.read_snapshot(repo.read_commit(commit)).blobs for c in blob.chunks]


def flip_chunk(repo: ckvc.Repo, commit: str) -> bytes:
    """Flip a payload byte of the first chunk of ``commit``; returns that chunk."""
    flipped = chunks_of(repo, commit)[0]
    path, e = pack_holding(repo, flipped)
    flip_byte(path, e.offset + RECORD_HEADER_SIZE + (e.record_size - RECORD_HEADER_SIZE) // 2)
    return flipped


def delete_pack_of(repo: ckvc.Repo, commit: str) -> str:
    """Delete the pack holding ``commit`` (and its snapshot and chunks); returns its name."""
    path, _ = pack_holding(repo, bytes.fromhex(commit))
    path.unlink()
    return path.name


def damage(repo: ckvc.Repo, ids: list[str]) -> tuple[bytes, str]:
    """A flipped byte in a chunk of the first commit, the pack of the last deleted."""
    return flip_chunk(repo, ids[0]), delete_pack_of(repo, ids[-1])


def pushed_history(root: Path, url: str, n: int = 4) -> list[str]:
    with ckvc.Repo.init(root, chunk_size=CHUNK) as repo:
        ids = [repo.commit(state(i), message=f"epoch {i}") for i in range(n)]
        repo.remotes.add("origin", url)
        repo.push("origin")
    return ids


def test_repair_restores_a_flipped_byte_and_a_deleted_pack_bit_exact(tmp_path: Path, url: str) -> None:
    ids = pushed_history(tmp_path / "r", url)
    with ckvc.Repo.open(tmp_path / "r") as repo:
        flipped = flip_chunk(repo, ids[0])
        report = repo.fsck()
        (problem,) = report.problems
        assert (problem.kind, problem.object_id) == (BAD_CHECKSUM, flipped.hex())
        # fsck names the commits and the tensor the flipped chunk breaks (later deltas on it too)
        assert problem.breaks[ids[0]] == ["model.w"]
        assert set(problem.breaks) <= set(ids)

        deleted = delete_pack_of(repo, ids[-1])
        report = repo.fsck()
        assert not report.ok
        missing = {p.object_id for p in report.problems if p.kind == MISSING_OBJECT}
        assert ids[-1] in missing and flipped.hex() in report.damaged_objects(), report.problems

        done = repo.repair(["origin"])
        assert done.after.ok, done.after.problems
        assert done.after.problems == []
        assert done.damaged == len(report.damaged_objects())
        assert done.repaired == {"origin": done.damaged}
        assert done.unrepaired == []
        assert deleted in done.packs_dropped and len(done.packs_dropped) == 2
        # the damaged copies are gone from disk, not only from the index
        assert deleted not in list_packs(repo.dir / "packs")
        for i, commit in enumerate(ids):
            assert_state_equal(repo.load(commit), state(i))
        assert repo.fsck().ok

    # a fresh process sees the repaired repository
    with ckvc.Repo.open(tmp_path / "r") as repo:
        assert repo.fsck().ok
        assert_state_equal(repo.load(ids[-1]), state(len(ids) - 1))


def test_repair_of_an_intact_repository_changes_nothing(tmp_path: Path) -> None:
    ids = pushed_history(tmp_path / "r", str(tmp_path / "remote"), n=2)
    with ckvc.Repo.open(tmp_path / "r") as repo:
        before = sorted(list_packs(repo.dir / "packs"))
        done = repo.repair()
        assert done.damaged == 0 and done.repaired == {} and done.packs_written == 0
        assert sorted(list_packs(repo.dir / "packs")) == before
        assert done.after.ok
        assert_state_equal(repo.load(ids[1]), state(1))


def test_damage_no_remote_holds_stays_named_and_on_disk(tmp_path: Path) -> None:
    """Commit 2 never reached the remote: its damaged chunk cannot be repaired, so
    its only copy (and its pack) stays, fsck still names it; the rest is repaired."""
    root = tmp_path / "r"
    ids = pushed_history(root, str(tmp_path / "remote"), n=2)
    with ckvc.Repo.open(root) as repo:
        local_only = repo.commit({"z": torch.randn(64, 64, generator=torch.Generator().manual_seed(3))}, message="z")
        (z_chunk,) = chunks_of(repo, local_only)
        z_pack, z_entry = pack_holding(repo, z_chunk)
        flip_byte(z_pack, z_entry.offset + z_entry.record_size - 1)
        pushed_chunk = chunks_of(repo, ids[0])[0]
        path, e = pack_holding(repo, pushed_chunk)
        flip_byte(path, e.offset + e.record_size - 1)

        done = repo.repair()
        assert done.repaired == {"origin": 1}
        assert done.unrepaired == [z_chunk.hex()]
        assert not done.after.ok
        (problem,) = [p for p in done.after.problems if p.severity == "error"]
        assert problem.object_id == z_chunk.hex() and problem.breaks == {local_only: ["z"]}
        assert z_pack.exists(), "the only copy of damaged data is never deleted"
        assert path.name in done.packs_dropped and z_pack.name not in done.packs_dropped
        for i in range(2):
            assert_state_equal(repo.load(ids[i]), state(i))
        with pytest.raises(ckvc.CorruptObjectError):
            repo.load(local_only)


def test_unknown_remote_is_refused_before_anything_changes(tmp_path: Path) -> None:
    ids = pushed_history(tmp_path / "r", str(tmp_path / "remote"), n=2)
    with ckvc.Repo.open(tmp_path / "r") as repo:
        flipped, _ = damage(repo, ids)
        before = sorted(list_packs(repo.dir / "packs"))
        with pytest.raises(ckvc.UnknownRemoteError):
            repo.repair(["nowhere"])
        assert sorted(list_packs(repo.dir / "packs")) == before
        assert flipped.hex() in repo.fsck().damaged_objects()


def test_cli_fsck_repair_from_a_bucket(tmp_path: Path, s3_server: S3Server, s3_bucket: str) -> None:
    """The acceptance case through the CLI, the remote an S3 bucket on loopback."""
    root = tmp_path / "r"
    with ckvc.Repo.init(root, chunk_size=CHUNK) as repo:
        ids = [repo.commit(state(i), message=f"epoch {i}") for i in range(3)]
        repo.remotes.add("origin", f"s3://{s3_bucket}/run", endpoint=s3_server.endpoint)
        repo.push("origin")
        flipped = flip_chunk(repo, ids[0])

    r = run(root, "fsck")
    assert r.exit_code == 1
    assert f"bad-checksum: {flipped.hex()}" in r.output
    assert f"breaks commit {ids[0][:12]}: model.w" in r.output

    with ckvc.Repo.open(root) as repo:
        delete_pack_of(repo, ids[-1])
    r = run(root, "fsck", "--repair", "--remote", "origin")
    assert r.exit_code == 0, r.output
    assert "fetched again and verified" in r.output and r.output.rstrip().endswith("ok")

    r = run(root, "fsck", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["ok"] is True
    with ckvc.Repo.open(root) as repo:
        for i, commit in enumerate(ids):
            assert_state_equal(repo.load(commit), state(i))

    r = run(root, "fsck", "--repair", "--sample", "10%")
    assert r.exit_code != 0 and "--repair reads every object" in r.output
