"""A remote kept open between a repository's commits to it
(ckvc.remote.publish.kept_open_for_commit, what distributed.commit(remote=) uses):
reused with its catalog refreshed, closed by a failing commit and with the
repository, and opened afresh when the remote's spec changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_remote_gc import Where, where

import ckvc
from ckvc.remote import publish

__all__ = ["where"]


def test_kept_handle_is_reused_and_sees_other_writers_packs(tmp_path: Path, where: Where) -> None:
    with ckvc.Repo.init(tmp_path / "a") as a, ckvc.Repo.init(tmp_path / "b") as b:
        for repo in (a, b):
            repo.remotes.add("origin", where.url, endpoint=where.endpoint)
        a.commit({"w": torch.arange(10.0)})
        a.push("origin")
        with publish.kept_open_for_commit(a.core, "origin", create=False) as first:
            pass
        b.commit({"w": torch.arange(20.0)}, message="from b")
        b.push("origin", force=True)
        tip = b.head()[1]
        assert tip is not None
        other = b.core.read_snapshot(b.core.read_commit(tip)).blobs[0].chunks[0]
        assert not first.core.store.has(other)
        with publish.kept_open_for_commit(a.core, "origin", create=False) as second:
            assert second is first
            assert second.core.store.has(other)  # the catalog was refreshed on reuse
        a.remotes.remove("origin")
        a.remotes.add("origin", where.url + "-moved", endpoint=where.endpoint)
        with publish.kept_open_for_commit(a.core, "origin", create=True) as third:
            assert third is not first  # the remote's spec changed: opened afresh, there
            assert third.core.refs.read("refs/heads/main") is None


def test_a_failing_commit_closes_its_handle_and_the_next_opens_afresh(tmp_path: Path, where: Where) -> None:
    with ckvc.Repo.init(tmp_path / "a") as a:
        a.remotes.add("origin", where.url, endpoint=where.endpoint)
        a.commit({"w": torch.arange(10.0)})
        a.push("origin")
        with (
            pytest.raises(RuntimeError, match="boom"),
            publish.kept_open_for_commit(a.core, "origin", create=False) as failed,
        ):
            raise RuntimeError("boom")
        with publish.kept_open_for_commit(a.core, "origin", create=False) as fresh:
            assert fresh is not failed
            assert fresh.core.refs.read("refs/heads/main") == a.head()[1]
        kept = a.core.attachments["kept-remotes"]
        assert isinstance(kept, publish._KeptOpen) and list(kept.handles.values()) == [fresh]
    assert kept.handles == {}  # closed with the repository
