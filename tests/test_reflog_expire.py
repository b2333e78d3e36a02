"""Disk back when you ask (issue 32): a deleted branch's commits stay while a
reflog names them; ``reflog expire`` drops the entries, and gc then frees them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run

import ckvc
from ckvc.core import Repository
from ckvc.errors import InvalidInputError, RefNotFoundError


def _pack_bytes(repo: ckvc.Repo) -> int:
    return sum(p.stat().st_size for p in (repo.dir / "packs").iterdir())


def _experiment(repo: ckvc.Repo) -> list[str]:
    """Three commits of 1 MiB each, only on branch exp; HEAD back on main."""
    repo.switch("HEAD", new_branch="exp")
    made = [repo.commit({"w": torch.randn(1 << 18, generator=torch.Generator().manual_seed(i))}) for i in range(3)]
    repo.switch("main")
    return made


def test_a_deleted_branch_is_freed_once_its_reflog_entries_expire(repo: ckvc.Repo) -> None:
    repo.commit({"w": torch.zeros(8)}, message="base")
    before = _pack_bytes(repo)
    exp = _experiment(repo)
    grown = _pack_bytes(repo) - before
    assert run(repo.path, "branch", "-D", "exp").exit_code == 0
    assert repo.gc(now=True).bytes_freed == 0  # HEAD's reflog still names them
    assert all(repo.store.has(bytes.fromhex(c)) for c in exp)
    done = json.loads(run(repo.path, "reflog", "expire", "--all", "--expire=now", "--json").stdout)
    assert done["dropped"] >= 6  # exp's commits and checkouts in HEAD's reflog, and main's
    report = repo.gc(now=True)
    assert not any(repo.store.has(bytes.fromhex(c)) for c in exp)
    assert _pack_bytes(repo) == pytest.approx(before, rel=0.01)
    assert report.bytes_freed == pytest.approx(grown, rel=0.01)  # what the three commits added
    # Each log keeps one entry, naming its ref's value and no old one: the next open
    # finds nothing to repair, and fsck is clean.
    assert [(e.old, e.new) for e in repo.reflog("HEAD")] == [(None, repo.head()[1])]
    again = ckvc.Repo.open(repo.path)
    assert again.fsck().ok
    again.close()


def test_expire_keeps_what_is_younger_than_the_age_asked(repo: ckvc.Repo) -> None:
    repo.commit({"w": torch.zeros(8)})
    repo.commit({"w": torch.ones(8)})
    entries = repo.reflog("main")
    assert run(repo.path, "reflog", "expire", "--all").output == "dropped 0 reflog entries\n"  # 90 days
    assert run(repo.path, "reflog", "expire", "--expire", "1h", "main").exit_code == 0
    assert repo.reflog("main") == entries
    assert repo.expire_reflogs(0, ["main"]) == 2 and len(repo.reflog("main")) == 1
    assert len(repo.reflog("HEAD")) == 2  # only the ref asked for


def test_expire_refuses_bad_requests_and_changes_nothing(repo: ckvc.Repo) -> None:
    repo.commit({"w": torch.zeros(8)})
    entries = repo.reflog("HEAD")
    for args in (["reflog", "expire"], ["reflog", "expire", "--all", "main"]):
        assert run(repo.path, *args).exit_code == InvalidInputError.exit_code
    assert run(repo.path, "reflog", "expire", "--expire", "soon", "--all").exit_code == InvalidInputError.exit_code
    assert run(repo.path, "reflog", "expire", "nope").exit_code == RefNotFoundError.exit_code
    assert repo.reflog("HEAD") == entries
    assert run(repo.path, "reflog", "show", "main").output == run(repo.path, "reflog", "main").output


def test_expire_on_an_object_store_layout_drops_whole_entries(tmp_path: Path) -> None:
    """Where logs are one immutable key per entry (a bucket), expiry deletes keys."""
    repo = ckvc.Repo(Repository.in_memory(chunk_size=64 << 10, object_store_semantics=True))
    repo.commit({"w": torch.zeros(8)})
    repo.commit({"w": torch.ones(8)})
    assert repo.expire_reflogs(0) == 4  # two entries in main's log, two in HEAD's
    tip = repo.head()[1]
    assert [(e.old, e.new) for e in repo.reflog("main")] == [(None, tip)]
    assert repo.fsck().ok
    repo.close()


def test_gc_says_what_the_reflog_and_the_grace_period_keep(repo: ckvc.Repo) -> None:
    repo.commit({"w": torch.zeros(8)}, message="base")
    exp = _experiment(repo)
    repo.delete_branch("exp")
    plan = json.loads(run(repo.path, "gc", "--dry-run", "--json").stdout)
    entries = [repo.store.index.get(bytes.fromhex(c)) for c in exp]
    unique = sum(e.record_size for e in entries if e is not None)
    assert plan["reclaimable_bytes"] == 0 and plan["reflog_commits"] == 3 and plan["reflog_bytes"] > unique
    text = run(repo.path, "gc", "--dry-run").output
    assert "kept by reflog entries younger than 90d: 3 commit(s)" in text
    assert "ckvc reflog expire --all --expire=now" in text
    repo.expire_reflogs(0)
    plan = json.loads(run(repo.path, "gc", "--dry-run", "--json").stdout)
    assert plan["reflog_commits"] == 0 and plan["reclaimable_bytes"] == 0  # the packs are young
    assert plan["grace_bytes"] >= unique  # exp's packs, whole: nothing needs them
    assert "`ckvc gc --now` does not wait for it" in run(repo.path, "gc", "--dry-run").output
    repo.gc(now=True)
    assert "nothing to reclaim" in run(repo.path, "gc", "--dry-run").output
