"""gc: what it keeps (refs, young reflog entries, unpruned commits, young packs,
objects a writer revived meanwhile), what it deletes and repacks, the leftovers it
reclaims, and fsck's levels on healthy, damaged and pruned repositories."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_state_equal

import ckvc
from ckvc.fsck import BAD_CHECKSUM, UNFINISHED_PACK, UNREFERENCED
from ckvc.gc import execute_gc, plan_gc
from ckvc.ids import ObjectType
from ckvc.retention import RetentionPolicy
from ckvc.storage.durable import list_packs
from ckvc.storage.local import LocalBackend
from ckvc.storage.packs import FOOTER, PACK_HEADER, RECORD_HEADER_SIZE, TOC_ENTRY, TOC_HEADER, read_toc

CHUNK = 4096
CHUNKS_PER_STATE = 4
DEFAULT_EXPIRY_S = 90 * 86400


# ---- helpers ----------------------------------------------------------------------
def state(seed: int) -> dict[str, Any]:
    """16 KiB of random floats: CHUNKS_PER_STATE chunks, none shared across seeds."""
    g = torch.Generator().manual_seed(7000 + seed)
    return {"w": torch.randn(CHUNKS_PER_STATE * CHUNK // 4, generator=g), "step": seed}


def commits(repo: ckvc.Repo, n: int, *, seed: int = 0) -> list[str]:
    return [repo.commit(state(seed + i), message=f"c{seed + i}", metrics={"loss": float(i)}) for i in range(n)]


def ckvc_files(repo: ckvc.Repo) -> dict[str, bytes]:
    # The LMDB lock file changes on every open; it is not repository content.
    return {
        str(p.relative_to(repo.dir)): p.read_bytes()
        for p in sorted(repo.dir.rglob("*"))
        if p.is_file() and p.name != "lock.mdb"
    }


def pack_files(repo: ckvc.Repo) -> dict[str, bytes]:
    """Every file in packs/ (sealed, temporary, trash) with its bytes."""
    return {p.name: p.read_bytes() for p in sorted((repo.dir / "packs").iterdir())}


def pack_total(repo: ckvc.Repo) -> int:
    return sum((repo.dir / "packs" / n).stat().st_size for n in list_packs(repo.dir / "packs"))


def pack_of(repo: ckvc.Repo, oid: str) -> str:
    return repo.store.stat(bytes.fromhex(oid)).pack


def toc_of(repo: ckvc.Repo, name: str) -> list[Any]:
    toc = read_toc(LocalBackend(repo.dir / "packs"), name)
    assert toc is not None
    return toc


def data_objects(repo: ckvc.Repo, commit_id: str) -> set[bytes]:
    """The snapshot and chunks a commit's data consists of."""
    commit = repo.read_commit(commit_id)
    chunks = {c for blob in repo.read_snapshot(commit).blobs for c in blob.chunks}
    return {bytes.fromhex(commit.tree), *chunks}


def age_packs(repo: ckvc.Repo, seconds: float) -> None:
    old = time.time() - seconds
    for name in list_packs(repo.dir / "packs"):
        os.utime(repo.dir / "packs" / name, (old, old))


def make_dead_branch(repo: ckvc.Repo, n: int = 2, *, seed: int = 100) -> list[str]:
    """Commits made on branch ``dead``, which is then deleted (HEAD back on main)."""
    repo.branch("dead")
    repo.switch("dead")
    ids = commits(repo, n, seed=seed)
    repo.switch("main")
    repo.delete_branch("dead")
    return ids


@pytest.fixture
def repo(make_repo: Callable[..., ckvc.Repo]) -> ckvc.Repo:
    return make_repo(chunk_size=CHUNK)


def test_state_has_the_assumed_shape(repo: ckvc.Repo) -> None:
    (c,) = commits(repo, 1)
    assert len(data_objects(repo, c)) == 1 + CHUNKS_PER_STATE
    assert len(list_packs(repo.dir / "packs")) == 1


# ---- dry run ------------------------------------------------------------------------
def test_dry_run_reports_reclaimable_bytes_and_changes_nothing(repo: ckvc.Repo) -> None:
    ids = commits(repo, 6)
    repo.retain(RetentionPolicy(keep_last=2))
    before = ckvc_files(repo)
    total_before = pack_total(repo)

    young = repo.gc(dry_run=True)  # default grace: every pack is too young to touch
    assert not young.executed and young.bytes_freed == 0
    assert young.plan.count("young") == 6 and young.plan.reclaimable_bytes == 0

    dry = repo.gc(dry_run=True, now=True)
    assert not dry.executed and dry.bytes_freed == 0 and dry.packs_repacked == 0
    assert ckvc_files(repo) == before
    plan = dry.plan
    # Live: two kept commits with snapshot and chunks, four pruned commit objects.
    assert plan.live_objects == 2 * (2 + CHUNKS_PER_STATE) + 4
    assert (plan.count("repack"), plan.count("keep"), plan.count("delete")) == (4, 2, 0)
    pruned_packs = {pack_of(repo, c) for c in ids[:4]}
    assert {p.name for p in plan.packs if p.action == "repack"} == pruned_packs
    as_json = dry.to_json()
    assert as_json["executed"] is False and as_json["packs_to_repack"] == 4
    assert as_json["reclaimable_bytes"] == plan.reclaimable_bytes > 0

    report = repo.gc(now=True)
    assert report.executed and report.packs_repacked == 4 and report.packs_written == 1
    total_after = pack_total(repo)
    assert report.bytes_freed == total_before - total_after
    # The estimate is exact up to the new pack's own header, table of contents and footer.
    overhead = PACK_HEADER.size + TOC_HEADER.size + TOC_ENTRY.size * report.objects_copied + FOOTER.size
    assert total_after == total_before - plan.reclaimable_bytes + overhead
    for i in (4, 5):
        assert_state_equal(repo.load(ids[i]), state(i))


# ---- unreachable commits of a deleted branch --------------------------------------------
def test_deleted_branch_is_kept_by_the_head_reflog_until_it_expires(repo: ckvc.Repo) -> None:
    main = commits(repo, 2)
    dead = make_dead_branch(repo)
    dead_packs = {pack_of(repo, c) for c in dead}
    # The commits were made with HEAD on the branch, so HEAD's reflog names them;
    # the branch's own reflog went with the branch.
    assert set(dead) <= {e.new for e in repo.reflog("HEAD")}
    assert not (repo.dir / "logs/refs/heads/dead").exists()

    # Default expiry (90 days): the HEAD reflog keeps them, data and all.
    report = repo.gc(now=True)
    assert report.packs_deleted == 0
    assert dead_packs <= set(list_packs(repo.dir / "packs"))
    assert_state_equal(repo.load(dead[1]), state(101))
    assert_state_equal(repo.load(dead[0]), state(100))

    # Expiry 0: nothing keeps them; gc --now deletes their packs.
    repo.set_config(reflog_expiry_s=0)
    report = repo.gc(now=True)
    assert report.packs_deleted == 2
    assert not dead_packs & set(list_packs(repo.dir / "packs"))
    for c in dead:
        with pytest.raises(ckvc.InvalidRevisionError):
            repo.resolve(c)
        with pytest.raises(ckvc.InvalidRevisionError):
            repo.load(c)
    for i, c in enumerate(main):
        assert_state_equal(repo.load(c), state(i))
    fsck = repo.fsck()
    assert fsck.ok and fsck.problems == []

    # Back to the default expiry, the HEAD reflog names commits gc removed: gc
    # tolerates that (no "reachable object missing") and removes nothing else.
    repo.set_config(reflog_expiry_s=DEFAULT_EXPIRY_S)
    before = pack_files(repo)
    report = repo.gc(now=True)
    assert report.packs_deleted == report.packs_repacked == 0
    assert pack_files(repo) == before


# ---- grace period ---------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["now", "aged"])
def test_grace_period_protects_young_packs(repo: ckvc.Repo, how: str) -> None:
    ids = commits(repo, 4)
    dead = make_dead_branch(repo)
    repo.set_config(reflog_expiry_s=0)
    repo.retain(RetentionPolicy(keep_last=1))
    before = pack_files(repo)

    report = repo.gc()  # default grace 3600 s; every pack was written just now
    assert report.executed
    assert report.plan.count("young") == 6
    assert (report.packs_deleted, report.packs_repacked, report.packs_written, report.bytes_freed) == (0, 0, 0, 0)
    assert pack_files(repo) == before

    if how == "now":
        report = repo.gc(now=True)
    else:  # packs older than the grace period: the same default gc acts
        age_packs(repo, 2 * 3600)
        report = repo.gc()
    assert (report.packs_deleted, report.packs_repacked) == (2, 3)
    assert_state_equal(repo.load(ids[3]), state(3))
    for c in dead:
        with pytest.raises(ckvc.InvalidRevisionError):
            repo.resolve(c)


# ---- repack -------------------------------------------------------------------------------------
def test_mostly_dead_pack_is_rewritten_fully_live_pack_is_left_alone(repo: ckvc.Repo) -> None:
    ids = commits(repo, 3)
    repo.retain(RetentionPolicy(keep_last=1))
    packs = {c: pack_of(repo, c) for c in ids}
    kept_bytes = (repo.dir / "packs" / packs[ids[2]]).read_bytes()

    report = repo.gc(now=True)
    assert (report.packs_repacked, report.packs_deleted, report.packs_written) == (2, 0, 1)
    assert report.objects_copied == 2
    now = set(list_packs(repo.dir / "packs"))
    (new,) = now - set(packs.values())
    assert now == {new, packs[ids[2]]}
    # The new pack holds exactly the live objects of the rewritten packs: two commit objects.
    assert {(e.oid.hex(), e.kind) for e in toc_of(repo, new)} == {(c, ObjectType.COMMIT) for c in ids[:2]}
    assert pack_of(repo, ids[0]) == pack_of(repo, ids[1]) == new
    assert repo.read_commit(ids[0]).metrics == {"loss": 0.0}
    assert [c.id for c in repo.log()] == ids[::-1]
    # The fully live pack: same name, same bytes.
    assert pack_of(repo, ids[2]) == packs[ids[2]]
    assert (repo.dir / "packs" / packs[ids[2]]).read_bytes() == kept_bytes
    assert_state_equal(repo.load(ids[2]), state(2))


def test_gc_reaches_a_fixed_point(repo: ckvc.Repo) -> None:
    ids = commits(repo, 4)
    repo.tag("release", ids[3], message="annotated")
    tag_pack = pack_of(repo, repo.refs.read("refs/tags/release") or "")
    repo.retain(RetentionPolicy(keep_last=1))
    first = repo.gc(now=True)
    assert first.packs_repacked == 3  # the pruned commits' packs, not the live tag pack
    assert tag_pack in list_packs(repo.dir / "packs")
    before = pack_files(repo)
    second = repo.gc(now=True)
    assert (second.packs_repacked, second.objects_copied, second.packs_written) == (0, 0, 0)
    assert pack_files(repo) == before


def test_repack_threshold_zero_only_deletes_fully_dead_packs(repo: ckvc.Repo) -> None:
    ids = commits(repo, 3)
    dead = make_dead_branch(repo, 1)
    repo.set_config(reflog_expiry_s=0, repack_threshold=0.0)
    repo.retain(RetentionPolicy(keep_last=1))
    packs = [pack_of(repo, c) for c in ids]
    report = repo.gc(now=True)
    assert (report.packs_deleted, report.packs_repacked, report.packs_written) == (1, 0, 0)
    assert [pack_of(repo, c) for c in ids] == packs  # the mostly dead packs stay where they were
    assert set(list_packs(repo.dir / "packs")) == set(packs)
    with pytest.raises(ckvc.InvalidRevisionError):
        repo.resolve(dead[0])


# ---- a writer revives an object gc planned to delete -------------------------------------------
@pytest.mark.parametrize("how", ["dedup", "branch"])
def test_object_revived_between_plan_and_execute_is_spared(repo: ckvc.Repo, how: str) -> None:
    (m0,) = commits(repo, 1)
    repo.branch("tmp")
    repo.switch("tmp")
    x_state = state(42)
    x = repo.commit(x_state, message="X")
    repo.switch("main")
    repo.delete_branch("tmp")
    repo.set_config(reflog_expiry_s=0)
    x_pack = pack_of(repo, x)

    expiry = repo.config.reflog_expiry_s
    plan = plan_gc(repo.core, grace_s=0, repack_threshold=repo.config.repack_threshold, reflog_expiry_s=expiry)
    assert {p.name: p.action for p in plan.packs}[x_pack] == "delete"

    if how == "dedup":
        # Meanwhile a commit on main stores X's tensor again: deduplicated against X's chunks.
        revived_state: dict[str, Any] = {"again": x_state["w"].clone(), "note": "same bytes as X"}
        revived = repo.commit(revived_state, message="Y")
        stats = repo.last_commit_stats
        assert stats is not None and (stats.chunks, stats.new_chunks) == (CHUNKS_PER_STATE, 0)
        y_chunks = data_objects(repo, revived) - {bytes.fromhex(repo.read_commit(revived).tree)}
        assert y_chunks <= {e.oid for e in toc_of(repo, x_pack)}
    else:
        # Meanwhile someone names X again.
        revived, revived_state = repo.branch("back", x), x_state
        assert revived == x

    report = execute_gc(repo.core, plan, reflog_expiry_s=expiry)
    assert report.kept_revived == [x_pack]
    assert report.packs_deleted == 0
    assert x_pack in list_packs(repo.dir / "packs")
    assert_state_equal(repo.load(revived), revived_state)
    assert_state_equal(repo.load(m0), state(0))
    fsck = repo.fsck()
    assert fsck.ok and fsck.damaged_objects() == []

    # A later gc still keeps everything the revived commit needs.
    repo.gc(now=True)
    assert_state_equal(repo.load(revived), revived_state)
    assert repo.fsck().ok


# ---- leftovers ------------------------------------------------------------------------------------
def test_stale_tmp_and_trash_are_reclaimed_young_tmp_survives(repo: ckvc.Repo) -> None:
    ids = commits(repo, 2)
    packs = repo.dir / "packs"
    stale_tmp = packs / f"pack-{uuid.uuid4().hex}.pack.tmp"
    trash = packs / f"pack-{uuid.uuid4().hex}.pack.trash"
    young_tmp = packs / f"pack-{uuid.uuid4().hex}.pack.tmp"
    stale_tmp.write_bytes(b"s" * 1000)
    trash.write_bytes(b"t" * 3000)
    young_tmp.write_bytes(b"y" * 500)
    old = time.time() - 2 * 3600
    os.utime(stale_tmp, (old, old))
    sealed = pack_files(repo)
    del sealed[stale_tmp.name], sealed[trash.name], sealed[young_tmp.name]

    dry = repo.gc(dry_run=True)
    assert set(dry.plan.leftovers) == {stale_tmp.name, trash.name}
    assert dry.plan.leftover_bytes == 4000
    assert stale_tmp.exists() and trash.exists()

    report = repo.gc()  # default grace
    assert not stale_tmp.exists() and not trash.exists()
    assert young_tmp.exists()  # maybe a writer's pack in progress
    assert report.bytes_freed == 4000
    fsck = repo.fsck()
    assert fsck.ok and [p.kind for p in fsck.problems] == [UNFINISHED_PACK]

    repo.gc(now=True)
    assert not young_tmp.exists()
    assert pack_files(repo) == sealed
    for i, c in enumerate(ids):
        assert_state_equal(repo.load(c), state(i))
    fsck = repo.fsck()
    assert fsck.ok and fsck.problems == []


def test_unindexed_duplicate_pack_is_reclaimed(repo: ckvc.Repo) -> None:
    ids = commits(repo, 3)
    first = repo.gc(now=True)
    assert first.executed and first.plan.count("keep") == 3
    source = repo.dir / "packs" / pack_of(repo, ids[2])
    duplicate = repo.dir / "packs" / f"pack-{uuid.uuid4().hex}.pack"
    shutil.copyfile(source, duplicate)
    before = pack_files(repo)
    del before[duplicate.name]

    report = repo.gc(now=True)
    assert report.packs_deleted == 1 and report.packs_repacked == 0
    assert report.bytes_freed == source.stat().st_size
    assert not duplicate.exists()
    assert pack_files(repo) == before
    for i, c in enumerate(ids):
        assert_state_equal(repo.load(c), state(i))
    fsck = repo.fsck()
    assert fsck.ok and fsck.problems == []


# ---- fsck levels --------------------------------------------------------------------------------
def test_fsck_levels_on_a_healthy_repository(repo: ckvc.Repo) -> None:
    commits(repo, 3)
    repo.tag("t", message="annotated")
    total = sum(1 for _ in repo.store.iter_stored())
    assert total == 3 * (2 + CHUNKS_PER_STATE) + 1
    variants = [("refs", None, 0), ("metadata", None, 0), ("full", None, total), ("full", 0.5, round(total * 0.5))]
    for level, sample, checked in variants:
        report = repo.fsck(level=level, sample=sample)
        assert report.ok and report.problems == [], level
        assert report.commits_reachable == 3
        assert report.objects_checked == checked, (level, sample)
    with pytest.raises(ValueError):
        repo.fsck(level="quick")


def test_fsck_levels_on_a_flipped_chunk_byte(repo: ckvc.Repo) -> None:
    ids = commits(repo, 2)
    name = pack_of(repo, ids[0])
    (chunk, *_) = [e for e in toc_of(repo, name) if e.kind == ObjectType.CHUNK]
    path = repo.dir / "packs" / name
    with open(path, "r+b") as f:
        f.seek(chunk.offset + RECORD_HEADER_SIZE + 100)
        byte = f.read(1)
        f.seek(chunk.offset + RECORD_HEADER_SIZE + 100)
        f.write(bytes([byte[0] ^ 0x5A]))

    full = repo.fsck(level="full")
    assert not full.ok
    assert [(p.kind, p.object_id) for p in full.problems] == [(BAD_CHECKSUM, chunk.oid.hex())]
    # "metadata" checks that every chunk is present, without reading chunk data.
    metadata = repo.fsck(level="metadata")
    assert metadata.ok and metadata.problems == [] and metadata.objects_checked == 0
    refs = repo.fsck(level="refs")
    assert refs.ok and refs.problems == []
    with pytest.raises(ckvc.CorruptObjectError):
        repo.load(ids[0])
    assert_state_equal(repo.load(ids[1]), state(1))


def test_fsck_warns_about_pruned_but_not_collected_objects(repo: ckvc.Repo) -> None:
    ids = commits(repo, 4)
    repo.retain(RetentionPolicy(keep_last=2))
    released = data_objects(repo, ids[0]) | data_objects(repo, ids[1])
    size = sum(repo.store.stat(o).stored_size for o in released)
    for level in ("metadata", "full"):
        report = repo.fsck(level=level)
        assert report.ok, level
        assert [(p.kind, p.severity, p.object_id) for p in report.problems] == [(UNREFERENCED, "warning", None)]
        assert (report.unreferenced_objects, report.unreferenced_bytes) == (len(released), size)
    refs = repo.fsck(level="refs")
    assert refs.ok and refs.problems == []
    repo.gc(now=True)
    report = repo.fsck()
    assert report.ok and report.problems == [] and report.unreferenced_objects == 0


# ---- gc refuses to work on a damaged repository ------------------------------------------------
@pytest.mark.parametrize("which", ["branch", "tag", "HEAD"])
def test_gc_refuses_with_a_damaged_ref(repo: ckvc.Repo, which: str) -> None:
    ids = commits(repo, 3)
    repo.branch("side", ids[2])
    repo.tag("t", ids[2])
    make_dead_branch(repo, 1)
    repo.set_config(reflog_expiry_s=0)
    repo.retain(RetentionPolicy(keep_last=1))  # gc would have work to do
    ref = {"branch": "refs/heads/side", "tag": "refs/tags/t", "HEAD": "HEAD"}[which]
    good = (repo.dir / ref).read_bytes()
    (repo.dir / ref).write_bytes(b"garbage\n")
    before = ckvc_files(repo)

    for kwargs in ({"now": True}, {"now": True, "dry_run": True}, {}):
        with pytest.raises(ckvc.CorruptObjectError, match="damaged"):
            repo.gc(**kwargs)
    assert ckvc_files(repo) == before

    (repo.dir / ref).write_bytes(good)
    report = repo.gc(now=True)
    assert (report.packs_deleted, report.packs_repacked) == (1, 2)
    assert_state_equal(repo.load("side"), state(2))


def test_gc_refuses_when_a_reachable_commit_is_missing(repo: ckvc.Repo) -> None:
    ids = commits(repo, 3)
    make_dead_branch(repo, 1)
    repo.set_config(reflog_expiry_s=0)
    root_pack = pack_of(repo, ids[0])
    (repo.dir / "packs" / root_pack).unlink()  # the root commit, reached through parents
    repo.store.reader.forget(root_pack)  # as a new process would see it: no cached descriptor
    before = ckvc_files(repo)
    with pytest.raises(ckvc.CkvcError):
        repo.gc(now=True)
    assert ckvc_files(repo) == before


def test_nested_pin_does_not_deadlock_against_a_waiting_gc(repo: ckvc.Repo) -> None:
    """A pinned writer whose lookup misses the index refreshes it, which pins
    again. With a gc waiting (holding the intent lock), a second real pin would
    wait for gc while gc waits for the first pin."""
    import fcntl

    commits(repo, 1)
    intent = os.open(repo.dir / "gc-intent.lock", os.O_RDWR)
    try:
        with repo.store.pin():
            fcntl.flock(intent, fcntl.LOCK_EX)  # a gc now waits for our pin
            with repo.store.pin(timeout=1.0):
                assert repo.store.refresh() == 0
    finally:
        os.close(intent)
