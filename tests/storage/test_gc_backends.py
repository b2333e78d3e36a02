"""gc's pack retirement through the Backend, on a backend with object-store
semantics (no rename: a retirement record instead of ``*.trash``).

The refs stay in the local repository (a Repo on a Backend is the core's part);
its object store is swapped for one on a MemoryBackend(object_store_semantics=True)
holding copies of the packs, so plan, copy, critical section, retirement and
purge all run through that backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import ckvc
import ckvc.gc as ckvc_gc
from ckvc.storage.durable import list_packs
from ckvc.storage.memory import MemoryBackend
from ckvc.storage.object_store import RETIRED_PREFIX, ObjectStore
from ckvc.storage.packs import pack_key

CHUNK = 4096


def assert_state_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(9000 + seed)
    return {"w": torch.randn(4 * CHUNK // 4, generator=g), "step": seed}


@pytest.fixture
def repo(make_repo: Callable[..., ckvc.Repo]) -> ckvc.Repo:
    return make_repo(chunk_size=CHUNK)


def on_object_store(repo: ckvc.Repo) -> MemoryBackend:
    """Move the repository's packs into a MemoryBackend with object-store semantics."""
    backend = MemoryBackend(object_store_semantics=True)
    for name in list_packs(repo.dir / "packs"):
        backend.put(pack_key(name), (repo.dir / "packs" / name).read_bytes())
    repo.store.close()
    repo.store = ObjectStore(backend)
    return backend


def with_dead_branch(repo: ckvc.Repo) -> tuple[str, set[str]]:
    """main with one commit; two commits on a branch that is then deleted.
    Returns main's commit and the dead commits' packs."""
    main = repo.commit(state(0), "main")
    repo.branch("dead")
    repo.switch("dead")
    dead = [repo.commit(state(i), f"dead {i}") for i in (1, 2)]
    repo.switch("main")
    repo.delete_branch("dead")
    repo.set_config(reflog_expiry_s=0)
    return main, {repo.store.stat(bytes.fromhex(c)).pack for c in dead}


def keys(backend: MemoryBackend) -> set[str]:
    return set(backend.list(""))


def test_gc_deletes_through_a_retirement_record(repo: ckvc.Repo) -> None:
    main, dead_packs = with_dead_branch(repo)
    backend = on_object_store(repo)
    assert {pack_key(p) for p in dead_packs} <= keys(backend)
    report = repo.gc(now=True)
    assert report.executed and report.packs_deleted == len(dead_packs) == 2
    assert not {pack_key(p) for p in dead_packs} & keys(backend)
    assert not [k for k in keys(backend) if RETIRED_PREFIX in k]  # the record went with its packs
    assert not [k for k in keys(backend) if k.endswith(".trash")]
    assert_state_equal(repo.load(main), state(0))
    assert repo.fsck().ok
    again = repo.gc(dry_run=True, now=True).plan
    assert again.reclaimable_bytes == 0 and again.leftovers == []


def test_a_gc_killed_before_its_purge_is_finished_by_the_next(repo: ckvc.Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    main, dead_packs = with_dead_branch(repo)
    backend = on_object_store(repo)
    with monkeypatch.context() as m:
        m.setattr(ckvc_gc, "purge_retired", lambda store: None)  # as if killed right after the critical section
        repo.gc(now=True)
    (record,) = [k for k in keys(backend) if RETIRED_PREFIX in k]
    assert {pack_key(p) for p in dead_packs} <= keys(backend)  # still there, but retired:
    assert not dead_packs & set(repo.store.packs())
    assert repo.store.refresh() == 0  # never indexed again
    plan = repo.gc(dry_run=True, now=True).plan
    assert plan.leftovers == [record.rpartition("/")[2]]
    assert plan.leftover_bytes == sum(len(backend.get(pack_key(p)) or b"") for p in dead_packs)
    repo.gc(now=True)
    assert not {pack_key(p) for p in dead_packs} & keys(backend)
    assert record not in keys(backend)
    assert_state_equal(repo.load(main), state(0))
    assert repo.fsck().ok


def test_repack_on_an_object_store_keeps_the_live_objects(repo: ckvc.Repo) -> None:
    # The dead commit's pack also holds the chunks of "a", which main still needs.
    repo.commit(state(0), "base")
    repo.branch("dead")
    repo.switch("dead")
    a, b = state(1)["w"], state(2)["w"]
    dead = repo.commit({"a": a, "b": b}, "dead")
    dead_pack = repo.store.stat(bytes.fromhex(dead)).pack
    repo.switch("main")
    live = repo.commit({"a": a}, "live: a only, deduplicated against the dead commit's pack")
    repo.delete_branch("dead")
    repo.set_config(reflog_expiry_s=0)
    backend = on_object_store(repo)
    report = repo.gc(now=True)
    assert report.executed and report.packs_repacked == 1 and report.packs_written == 1
    assert pack_key(dead_pack) not in keys(backend)
    assert not [k for k in keys(backend) if RETIRED_PREFIX in k]
    assert_state_equal(repo.load(live), {"a": a})
    with pytest.raises(ckvc.CkvcError):
        repo.load(dead)
    assert repo.fsck().ok
