"""Damage: flipped bytes, truncated and deleted packs, a lost index, broken refs.

Reads of damaged data raise typed errors naming what is damaged and never return
wrong bytes; fsck names exactly the damaged objects; undamaged commits still load
bit-exact; the index is a cache that can be rebuilt from the packs.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_state_equal

import ckvc
from ckvc.codecs import BYTEGROUP, RAW
from ckvc.fsck import BAD_CHECKSUM, BAD_PACK, MISSING_OBJECT, MISSING_PACK
from ckvc.ids import ObjectType
from ckvc.storage.durable import list_packs
from ckvc.storage.local import LocalBackend
from ckvc.storage.packs import FOOTER, RECORD_HEADER_SIZE, RecordInfo, read_toc

CHUNK = 4096
X_PATH = "model.layers.0.weight"


def random_bytes_tensor(n: int, seed: int) -> torch.Tensor:
    """float32 with random bit patterns: incompressible, so stored raw."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (4 * n,), dtype=torch.uint8, generator=g).view(torch.float32)


def pack_entries_of(repo: ckvc.Repo, oid: str) -> tuple[Path, list[RecordInfo]]:
    """The pack holding ``oid`` and its table of contents."""
    raw = bytes.fromhex(oid)
    for name in list_packs(repo.dir / "packs"):
        path = repo.dir / "packs" / name
        toc = read_toc(LocalBackend(path.parent), name)
        assert toc is not None, f"{name} has no intact table of contents"
        if any(e.oid == raw for e in toc):
            return path, toc
    raise AssertionError(f"no pack holds {oid}")


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)
        assert len(old) == 1
        f.seek(offset)
        f.write(bytes([old[0] ^ 0xFF]))


@dataclass
class Setup:
    root: Path
    a: str  # commit A: uses X_PATH (several chunks) and "step"
    b: str  # commit B (child of A): only "y", shares no chunk with A
    state_a: dict[str, Any]
    state_b: dict[str, Any]
    a_pack: Path
    a_entries: list[RecordInfo]
    x_chunks: list[str]  # chunk ids of X_PATH, in order
    a_snapshot: str


def make_setup(root: Path, *, compressible: bool = False) -> Setup:
    if compressible:
        x = torch.arange(4 * CHUNK // 4, dtype=torch.float32) % 7  # zstd shrinks it
    else:
        x = random_bytes_tensor(4 * CHUNK // 4, seed=1)  # four chunks
    state_a = {"model": {"layers": [{"weight": x}]}, "step": 1}
    state_b = {"y": random_bytes_tensor(3 * CHUNK // 4, seed=2), "step": 2}
    with ckvc.Repo.init(root, chunk_size=CHUNK) as repo:
        a = repo.commit(state_a, message="A")
        b = repo.commit(state_b, message="B")
        snap = repo.read_snapshot(repo.read_commit(a))
        x_chunks = [c.hex() for c in snap.blobs[0].chunks]
        b_chunks = {c.hex() for blob in repo.read_snapshot(repo.read_commit(b)).blobs for c in blob.chunks}
        assert snap.blobs[0].path == X_PATH
        assert len(x_chunks) == 4 and not set(x_chunks) & b_chunks
        a_pack, a_entries = pack_entries_of(repo, a)
        assert pack_entries_of(repo, b)[0] != a_pack, "each commit writes its own pack"
        a_snapshot = repo.read_commit(a).tree
    return Setup(root, a, b, state_a, state_b, a_pack, a_entries, x_chunks, a_snapshot)


def entry(setup: Setup, oid: str) -> RecordInfo:
    (e,) = [e for e in setup.a_entries if e.oid.hex() == oid]
    return e


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    return make_setup(tmp_path / "r")


# ---- flipped bytes -------------------------------------------------------------
@pytest.mark.parametrize("compressible", [False, True], ids=["raw-codec", "bytegroup-codec"])
@pytest.mark.parametrize("where", ["payload-start", "payload-middle", "payload-end", "header"])
def test_flipped_chunk_byte(tmp_path: Path, compressible: bool, where: str) -> None:
    s = make_setup(tmp_path / "r", compressible=compressible)
    target = s.x_chunks[1]
    e = entry(s, target)
    assert e.kind == ObjectType.CHUNK
    assert e.codec == (BYTEGROUP if compressible else RAW)
    payload = e.offset + RECORD_HEADER_SIZE
    offset = {
        "payload-start": payload,
        "payload-middle": payload + (e.record_size - RECORD_HEADER_SIZE) // 2,
        "payload-end": e.offset + e.record_size - 1,
        "header": e.offset + 20,  # inside raw_size: caught by the header checksum
    }[where]
    flip_byte(s.a_pack, offset)

    with ckvc.Repo.open(s.root) as repo:
        with pytest.raises(ckvc.CorruptObjectError) as info:
            repo.load(s.a)
        err = info.value
        assert err.object_id == target
        assert err.tensor == X_PATH
        assert err.commit == s.a
        assert target in str(err) and repr(X_PATH) in str(err)
        assert isinstance(err, ckvc.CkvcError) and err.exit_code == 7

        # Loading B does not touch the damaged chunk.
        assert_state_equal(repo.load(s.b), s.state_b)
        # Metadata of A is intact: history and show still work.
        assert [c.id for c in repo.log("main")] == [s.b, s.a]
        assert [t.path for t in repo.show(s.a).tensors] == [X_PATH]

        report = repo.fsck()
        assert not report.ok
        assert report.damaged_objects() == [target]
        assert [(p.kind, p.object_id) for p in report.problems] == [(BAD_CHECKSUM, target)]


def test_flipped_snapshot_byte(setup: Setup) -> None:
    e = entry(setup, setup.a_snapshot)
    flip_byte(setup.a_pack, e.offset + e.record_size - 3)
    with ckvc.Repo.open(setup.root) as repo:
        with pytest.raises(ckvc.CorruptObjectError) as info:
            repo.load(setup.a)
        assert info.value.object_id == setup.a_snapshot
        assert info.value.commit == setup.a
        assert_state_equal(repo.load(setup.b), setup.state_b)
        report = repo.fsck()
        assert not report.ok
        assert report.damaged_objects() == [setup.a_snapshot]


def test_flipped_commit_byte(setup: Setup) -> None:
    e = entry(setup, setup.a)
    flip_byte(setup.a_pack, e.offset + RECORD_HEADER_SIZE + 1)
    with ckvc.Repo.open(setup.root) as repo:
        with pytest.raises(ckvc.CorruptObjectError) as info:
            repo.load(setup.a)
        assert info.value.object_id == setup.a
        with pytest.raises(ckvc.CorruptObjectError):
            repo.log("main")  # walking into the damaged parent
        assert_state_equal(repo.load("main"), setup.state_b)
        report = repo.fsck()
        assert not report.ok
        assert report.damaged_objects() == [setup.a]


def test_random_flips_never_return_wrong_bytes(setup: Setup) -> None:
    """Any single flipped byte anywhere in A's pack: loading A raises a ckvc error
    or returns exactly the original state (a flip in the table of contents is not
    on the read path). fsck never reports a damaged pack as ok."""
    size = setup.a_pack.stat().st_size
    rng = torch.Generator().manual_seed(0)
    offsets = torch.randint(0, size, (40,), generator=rng).tolist()
    outcomes = {"error": 0, "intact": 0}
    with ckvc.Repo.open(setup.root) as repo:
        for offset in offsets:
            flip_byte(setup.a_pack, offset)
            try:
                try:
                    out = repo.load(setup.a)
                except ckvc.CkvcError:
                    outcomes["error"] += 1
                else:
                    assert_state_equal(out, setup.state_a)
                    outcomes["intact"] += 1
            finally:
                flip_byte(setup.a_pack, offset)
        assert outcomes["error"] > 0
        assert repo.fsck().ok  # all flips undone
        flip_byte(setup.a_pack, offsets[0])
        assert not repo.fsck().ok


def test_damaged_table_of_contents(setup: Setup) -> None:
    """A TOC flip is reported as a bad pack; objects stay readable (through the
    index, and through a scan when the index is rebuilt)."""
    flip_byte(setup.a_pack, setup.a_pack.stat().st_size - FOOTER.size - 5)
    with ckvc.Repo.open(setup.root) as repo:
        assert_state_equal(repo.load(setup.a), setup.state_a)
        report = repo.fsck()
        assert not report.ok
        assert report.damaged_objects() == []
        assert [p.kind for p in report.problems] == [BAD_PACK]
        assert setup.a_pack.name in report.problems[0].detail
        report = repo.fsck(rebuild_index=True)
        assert [p.kind for p in report.problems] == [BAD_PACK]
        assert_state_equal(repo.load(setup.a), setup.state_a)
        assert_state_equal(repo.load(setup.b), setup.state_b)


# ---- truncated and deleted packs -----------------------------------------------
def test_truncated_pack(setup: Setup) -> None:
    cut_entry = entry(setup, setup.x_chunks[2])
    cut = cut_entry.offset + RECORD_HEADER_SIZE + 100  # in the middle of the third chunk
    os.truncate(setup.a_pack, cut)
    lost = sorted(e.oid.hex() for e in setup.a_entries if e.offset + e.record_size > cut)
    assert setup.x_chunks[2] in lost and setup.a in lost and setup.a_snapshot in lost
    assert setup.x_chunks[0] not in lost

    with ckvc.Repo.open(setup.root) as repo:
        with pytest.raises(ckvc.CorruptObjectError) as info:
            repo.load(setup.a)
        assert info.value.object_id == setup.a
        assert_state_equal(repo.load(setup.b), setup.state_b)
        report = repo.fsck()
        assert not report.ok
        assert report.damaged_objects() == lost
        assert any(p.kind == BAD_PACK and setup.a_pack.name in p.detail for p in report.problems)


def test_truncated_pack_with_index_rebuilt(setup: Setup) -> None:
    """After a rebuild, the objects a scan recovers from a truncated pack are
    indexed again; the lost ones are missing, and reported as such."""
    cut_entry = entry(setup, setup.x_chunks[2])
    os.truncate(setup.a_pack, cut_entry.offset + RECORD_HEADER_SIZE + 100)
    with ckvc.Repo.open(setup.root) as repo:
        report = repo.fsck(rebuild_index=True)
        assert report.rebuilt_index and not report.ok
        for oid in setup.x_chunks[:2]:
            assert repo.store.has(bytes.fromhex(oid))
        assert not repo.store.has(bytes.fromhex(setup.a))
        # B's commit names A as parent: A is now a missing object.
        assert setup.a in report.damaged_objects()
        assert any(p.kind == MISSING_OBJECT and p.object_id == setup.a for p in report.problems)
        with pytest.raises(ckvc.InvalidRevisionError, match="unknown revision"):
            repo.load(setup.a)  # no longer in the index: an unknown id
        assert_state_equal(repo.load(setup.b), setup.state_b)


def test_deleted_pack(setup: Setup) -> None:
    setup.a_pack.unlink()
    with ckvc.Repo.open(setup.root) as repo:
        with pytest.raises(ckvc.ObjectNotFoundError) as info:
            repo.load(setup.a)
        assert isinstance(info.value, ckvc.CkvcError)
        assert_state_equal(repo.load(setup.b), setup.state_b)
        report = repo.fsck()
        assert not report.ok
        assert report.damaged_objects() == sorted(e.oid.hex() for e in setup.a_entries)
        for e in setup.a_entries:
            assert any(p.kind == MISSING_OBJECT and p.object_id == e.oid.hex() for p in report.problems)


def test_deleted_pack_is_reported_as_missing_only(setup: Setup) -> None:
    setup.a_pack.unlink()
    with ckvc.Repo.open(setup.root) as repo:
        report = repo.fsck()
        assert {p.kind for p in report.problems} == {MISSING_OBJECT, MISSING_PACK}
        assert [p.pack for p in report.problems if p.kind == MISSING_PACK] == [setup.a_pack.name]


# ---- the index is a cache ------------------------------------------------------
@pytest.mark.parametrize("how", ["fsck-rebuild", "fresh-open-prefix-first", "fresh-open-load-first"])
def test_deleted_index_is_rebuilt(setup: Setup, how: str) -> None:
    index_dir = setup.root / ".ckvc" / "index"
    assert index_dir.is_dir()
    shutil.rmtree(index_dir)
    with ckvc.Repo.open(setup.root) as repo:
        if how == "fsck-rebuild":
            report = repo.fsck(rebuild_index=True)
            assert report.ok, report.problems
            assert report.rebuilt_index
            assert report.commits_reachable == 2
        if how == "fresh-open-prefix-first":
            assert repo.resolve(setup.b[:8]) == setup.b
        assert_state_equal(repo.load(setup.a), setup.state_a)
        assert_state_equal(repo.load(setup.b), setup.state_b)
        assert repo.resolve(setup.a[:8]) == setup.a
        assert repo.resolve(setup.b[:10]) == setup.b
        assert repo.resolve("main~1") == setup.a
        assert [c.id for c in repo.log()] == [setup.b, setup.a]
        report = repo.fsck()
        assert report.ok, report.problems
        assert report.damaged_objects() == []
        assert report.objects_checked == repo.store.index.count() == 2 * 2 + 4 + 3
        # And the repository takes new commits.
        c = repo.commit({"z": torch.ones(3)})
        assert repo.resolve("HEAD") == c
    assert index_dir.is_dir()


# ---- refs -----------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"garbage\n", b"", b"abc" * 30, b"\n\n", b"ab" * 32 + b"0\n"])
def test_damaged_branch_ref(setup: Setup, content: bytes) -> None:
    ref = setup.root / ".ckvc" / "refs" / "heads" / "main"
    ref.write_bytes(content)
    with ckvc.Repo.open(setup.root) as repo:
        packs = sorted(list_packs(repo.dir / "packs"))
        for op in (lambda: repo.load(), lambda: repo.resolve("main"), lambda: repo.commit({"x": torch.ones(2)})):
            with pytest.raises(ckvc.CkvcError) as info:
                op()
            assert type(info.value) is ckvc.RefNotFoundError
            assert "refs/heads/main" in str(info.value) and "damaged" in str(info.value)
        assert sorted(list_packs(repo.dir / "packs")) == packs  # the refused commit wrote nothing
        # Objects are fine: full ids still load.
        assert_state_equal(repo.load(setup.b), setup.state_b)
        ref.write_text(setup.b + "\n")
        assert repo.fsck().ok


def test_non_utf8_ref_is_typed(setup: Setup) -> None:
    (setup.root / ".ckvc" / "refs" / "heads" / "main").write_bytes(b"\xff\xfe\xfd\n")
    with ckvc.Repo.open(setup.root) as repo, pytest.raises(ckvc.RefNotFoundError):
        repo.load()


def test_damaged_head(setup: Setup) -> None:
    (setup.root / ".ckvc" / "HEAD").write_text("nonsense\n")
    with ckvc.Repo.open(setup.root) as repo:
        with pytest.raises(ckvc.RefNotFoundError, match="HEAD is damaged"):
            repo.load()
        with pytest.raises(ckvc.RefNotFoundError):
            repo.commit({})
        assert_state_equal(repo.load("main"), setup.state_b)


def test_ref_to_missing_object(setup: Setup) -> None:
    missing = "ab" * 32
    (setup.root / ".ckvc" / "refs" / "heads" / "main").write_text(missing + "\n")
    with ckvc.Repo.open(setup.root) as repo:
        with pytest.raises(ckvc.ObjectNotFoundError):
            repo.load()
        report = repo.fsck()
        assert not report.ok
        assert report.damaged_objects() == [missing]


def test_fsck_reports_damaged_ref(setup: Setup) -> None:
    (setup.root / ".ckvc" / "refs" / "heads" / "main").write_text("garbage\n")
    with ckvc.Repo.open(setup.root) as repo:
        report = repo.fsck()
        assert not report.ok
        assert any("refs/heads/main" in p.detail for p in report.problems)


def test_damage_among_small_tensors_read_together_names_its_tensor(tmp_path: Path) -> None:
    """Small chunks share one pool task on checkout (chunking.size_batches): a
    damaged one is still named with its own tensor, and nothing is returned."""
    state = {f"norm{i}": random_bytes_tensor(64, seed=10 + i) for i in range(12)}
    with ckvc.Repo.init(tmp_path / "r") as repo:
        a = repo.commit(state, message="small tensors")
        blobs = {b.path: b for b in repo.read_snapshot(repo.read_commit(a)).blobs}
        target = blobs["norm7"].chunks[0].hex()
        pack, entries = pack_entries_of(repo, target)
    (e,) = [e for e in entries if e.oid.hex() == target]
    flip_byte(pack, e.offset + RECORD_HEADER_SIZE + 5)
    with ckvc.Repo.open(tmp_path / "r") as repo:
        with pytest.raises(ckvc.CorruptObjectError) as info:
            repo.load(a)
        assert (info.value.object_id, info.value.tensor, info.value.commit) == (target, "norm7", a)
        loaded = repo.load(a, keys=["norm6", "norm8"])
        assert_state_equal(loaded, {"norm6": state["norm6"], "norm8": state["norm8"]})
