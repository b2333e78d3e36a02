"""Retention on a remote (issue 30, `retain --remote`): the same rules over the
remote's own branches, its records (FORMAT 17, "remote_retention") covering commits
that came whole, gc --remote freeing their packs, clones still bit-exact."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import assert_state_equal

# the where_s3 fixture (directory, memory and S3 remotes) is test_remote_gc's
from test_remote_gc import Where, packs, where_s3  # noqa: F401

import ckvc
from ckvc.cli import cli
from ckvc.errors import PrunedCommitError
from ckvc.remote.location import open_backend
from ckvc.remote.repository import open_remote
from ckvc.retention import KeepBest, RetentionPolicy
from ckvc.storage.backend import Backend


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)  # no chunk shared between commits
    return {"w": torch.randn(64, 64, generator=g), "step": step}


class Pushed:
    def __init__(self, tmp_path: Path, where: Where, n: int = 5) -> None:
        self.repo = ckvc.Repo.init(tmp_path / "a")
        self.repo.remotes.add("origin", where.url, endpoint=where.endpoint)
        self.where = where
        self.backend: Backend = open_backend(where.url, endpoint=where.endpoint)
        self.commits: list[str] = []
        self.packs_of: dict[str, dict[str, int]] = {}  # commit -> the packs its push sent
        for i in range(n):
            before = packs(self.backend)
            commit = self.repo.commit(state(i), message=f"epoch {i}", metrics={"loss": 1.0 - 0.1 * i})
            self.repo.push()
            self.commits.append(commit)
            self.packs_of[commit] = {k: v for k, v in packs(self.backend).items() if k not in before}

    def chunk_pack(self, commit: str) -> tuple[str, int]:
        """The pack holding the commit's chunks: the larger of the two its push sent."""
        sent = self.packs_of[commit]
        assert len(sent) == 2  # chunks, then metadata
        return max(sent.items(), key=lambda kv: kv[1])

    def prune_lines(self) -> list[dict[str, Any]]:
        handle = open_remote(self.repo.core, self.repo.remotes.get("origin"))
        try:
            lines = handle.core.prune_log.journal.lines(handle.core.prune_log.name)
        finally:
            handle.close()
        return [json.loads(line) for line in lines]


@pytest.fixture
def pushed(tmp_path: Path, where_s3: Where) -> Iterator[Pushed]:  # noqa: F811
    p = Pushed(tmp_path, where_s3)
    yield p
    p.repo.close()


def test_retain_remote_releases_what_no_rule_keeps_and_gc_frees_it(tmp_path: Path, pushed: Pushed) -> None:
    repo, c = pushed.repo, pushed.commits
    # a note, pushed, makes epoch 0 the best: keep-best sees it on the remote too
    repo.note(c[0], metrics={"loss": 0.01})
    repo.push()
    policy = RetentionPolicy(keep_last=2, keep_best=(KeepBest.parse("loss:min:1"),))
    listing = packs(pushed.backend)
    dry = repo.retain_remote("origin", policy, dry_run=True)
    assert dry.released == [c[2], c[1]]  # newest first
    assert set(dry.kept) == {c[4], c[3], c[0]} and any("keep-best" in r for r in dry.kept[c[0]])
    assert dry.summaries[c[2]] == "epoch 2"
    assert pushed.prune_lines() == [] and packs(pushed.backend) == listing  # a dry run writes nothing

    done = repo.retain_remote("origin", policy)
    assert done.released == [c[2], c[1]]
    trees = {x: repo.core.read_commit(x).tree for x in (c[1], c[2])}
    assert [(d["commit"], d["remote_retention"]) for d in pushed.prune_lines()] == [
        (c[2], trees[c[2]]), (c[1], trees[c[1]]),
    ]  # fmt: skip
    # the local repository is not the remote's retention's business
    assert repo.pruned() == {} and torch.equal(repo.load(c[1])["w"], state(1)["w"])

    freed = repo.gc_remote(now=True)
    released_packs = dict(pushed.chunk_pack(x) for x in (c[1], c[2]))
    assert freed.packs_deleted == 2 and freed.bytes_freed == sum(released_packs.values())
    assert packs(pushed.backend) == {k: v for k, v in listing.items() if k not in released_packs}
    assert repo.fsck_remote().ok

    clone = ckvc.Repo.clone(pushed.where.url, tmp_path / "clone", endpoint=pushed.where.endpoint)
    try:
        for kept in (c[0], c[3], c[4]):
            assert_state_equal(clone.load(kept), repo.load(kept))
        for gone in (c[1], c[2]):
            with pytest.raises(PrunedCommitError):
                clone.load(gone)
        assert [x.message for x in clone.log()] == [f"epoch {i}" for i in range(4, -1, -1)]  # history stays
        assert clone.fsck().ok
    finally:
        clone.close()
    again = repo.retain_remote("origin", policy)
    assert again.released == [] and again.already_pruned == [c[2], c[1]]

    # The same state committed again: its snapshot is the released one's, present
    # on the remote without its chunks (hollow), so the push sends them again.
    same = repo.commit(state(1), message="epoch 1 again")
    assert repo.core.read_commit(same).tree == trees[c[1]]
    repo.push()
    assert repo.gc_remote(now=True).packs_deleted == 0 and repo.fsck_remote().ok
    fresh = ckvc.Repo.clone(pushed.where.url, tmp_path / "fresh", endpoint=pushed.where.endpoint)
    try:
        assert_state_equal(fresh.load(same), state(1))
    finally:
        fresh.close()


def test_a_pushers_record_of_a_commit_that_came_whole_is_decided_again(pushed: Pushed) -> None:
    """FORMAT 18.2: a plain record covers nothing once the commit's snapshot is there;
    the remote's retention records it again with its own flag, and gc frees it."""
    repo, c = pushed.repo, pushed.commits
    handle = open_remote(repo.core, repo.remotes.get("origin"))
    try:
        handle.core.prune_log.add([c[1]], "a pusher's keep-last 1")
    finally:
        handle.close()
    assert repo.gc_remote(now=True).packs_deleted == 0  # the snapshot is there: the record covers nothing
    plan = repo.retain_remote("origin", RetentionPolicy(keep_last=3))
    assert plan.released == [c[1], c[0]] and plan.already_pruned == []
    assert ["remote_retention" in d for d in pushed.prune_lines()] == [False, True, True]
    freed = repo.gc_remote(now=True)
    assert freed.bytes_freed == sum(pushed.chunk_pack(x)[1] for x in (c[0], c[1]))


def test_retain_remote_cli(tmp_path: Path, pushed: Pushed, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path / "a")
    c = pushed.commits
    runner = CliRunner()
    dry = runner.invoke(cli, ["retain", "--remote", "origin", "--keep-last", "3", "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)["released"] == [c[1], c[0]] and json.loads(dry.output)["dry_run"] is True
    done = runner.invoke(cli, ["retain", "--remote", "origin", "--keep-last", "3"])
    assert done.exit_code == 0, done.output
    assert f"release {c[1][:12]}  epoch 1" in done.output and "ckvc gc --remote origin" in done.output
    assert pushed.repo.retention_policy() is None  # the bucket's rules are not stored as this repository's
    refused = runner.invoke(cli, ["retain", "--remote", "origin", "--keep-last", "1", "--auto"])
    assert refused.exit_code == 14 and "--auto" in refused.output
    unknown = runner.invoke(cli, ["retain", "--remote", "nowhere", "--keep-last", "1"])
    assert unknown.exit_code != 0 and "nowhere" in unknown.output
    assert [d["commit"] for d in pushed.prune_lines()] == [c[1], c[0]]


def test_max_size_on_a_remote_frees_what_the_dry_run_says(tmp_path: Path) -> None:
    p = Pushed(tmp_path, Where(str(tmp_path / "remote")))
    try:
        budget = 5 * p.chunk_pack(p.commits[0])[1] // 2  # room for two commits (chunks and snapshot), not three
        policy = RetentionPolicy(keep_last=1, max_size=budget)
        dry = p.repo.retain_remote("origin", policy, dry_run=True)
        assert dry.kept_bytes is not None and dry.kept_bytes <= budget and dry.over_budget is None
        assert dry.released == p.commits[:3][::-1]
        p.repo.retain_remote("origin", policy)
        freed = p.repo.gc_remote(now=True).bytes_freed
        assert abs(freed - sum(dry.frees.values())) <= 0.01 * freed  # whole chunk packs, one per push
    finally:
        p.repo.close()


def test_a_pushers_record_on_a_hollow_snapshot_covers_its_commit(tmp_path: Path, pushed: Pushed) -> None:
    """A commit another repository pruned and pushed alone, whose state is one the
    remote's retention released: its snapshot is there but hollow, so the pusher's
    record covers it (FORMAT 18.2), and gc, fsck and clones see a pruned commit."""
    repo, c = pushed.repo, pushed.commits
    repo.retain_remote("origin", RetentionPolicy(keep_last=3))  # releases epochs 1 and 0
    repo.gc_remote(now=True)
    other = ckvc.Repo.clone(pushed.where.url, tmp_path / "other", endpoint=pushed.where.endpoint)
    try:
        again = other.commit(state(0), message="epoch 0 again")
        assert other.core.read_commit(again).tree == repo.core.read_commit(c[0]).tree
        other.commit(state(9), message="newer")
        other.retain(RetentionPolicy(keep_last=1))
        assert again in other.pruned()
        other.push()
    finally:
        other.close()
    assert repo.gc_remote(now=True).executed and repo.fsck_remote().ok
    clone = ckvc.Repo.clone(pushed.where.url, tmp_path / "clone", endpoint=pushed.where.endpoint)
    try:
        with pytest.raises(PrunedCommitError):
            clone.load(again)
        assert_state_equal(clone.load("HEAD"), state(9))
    finally:
        clone.close()


def test_a_lazy_clone_learns_what_the_remote_released(tmp_path: Path, pushed: Pushed) -> None:
    """A lazy clone holds the history and leaves chunks on the bucket: after the
    bucket's retention freed a commit's data, its fetch brings the record, and
    loading the commit says it was pruned rather than failing on a missing chunk."""
    repo, c = pushed.repo, pushed.commits
    lazy = ckvc.Repo.clone(pushed.where.url, tmp_path / "lazy", endpoint=pushed.where.endpoint, lazy=True)
    try:
        assert_state_equal(lazy.load(c[3]), state(3))  # fetched on first read: stays local
        repo.retain_remote("origin", RetentionPolicy(keep_last=2))  # releases epochs 2, 1, 0
        repo.gc_remote(now=True)
        lazy.fetch()
        for gone in (c[0], c[1], c[2]):
            with pytest.raises(PrunedCommitError):
                lazy.load(gone)
        assert_state_equal(lazy.load(c[4]), state(4))
        # a whole repository keeps its own data: the records stay on the bucket
        repo.fetch()
        assert repo.pruned() == {} and torch.equal(repo.load(c[0])["w"], state(0)["w"])
    finally:
        lazy.close()
