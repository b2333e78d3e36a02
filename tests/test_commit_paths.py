"""Every commit path keeps the same promises: Repo.commit, a DCP save and a
distributed commit all get the repository's commit observers (stats, retention,
the cache and auto_push), and ``status`` says "backed up" only of a commit the
remote's branch holds."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from helpers import run

import ckvc
import ckvc.dcp
from ckvc import write
from ckvc.errors import DurabilityWarning
from ckvc.retention_policy import RetentionPolicy


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 64, generator=g)}, "step": seed}


def _with_remote(tmp_path: Path, auto_push: bool) -> ckvc.Repo:
    repo = ckvc.Repo.init(tmp_path / "src", chunk_size=16 << 10)
    repo.remotes.add("origin", str(tmp_path / "remote"))
    if auto_push:
        repo.set_config(auto_push="origin")
    return repo


def _remote_main(tmp_path: Path) -> str | None:
    remote = ckvc.Repo.open(tmp_path / "src")
    try:
        return remote.ls_remote("origin").get("refs/heads/main")
    finally:
        remote.close()


def test_a_dcp_save_is_pushed_by_auto_push(tmp_path: Path) -> None:
    repo = _with_remote(tmp_path, auto_push=True)
    writer = ckvc.dcp.Writer(repo, message="dcp save")
    dcp.save(_state(1), storage_writer=writer, no_dist=True)
    assert writer.commit_id is not None
    assert repo.wait_for_backup(60), repo.backup_status()
    assert _remote_main(tmp_path) == writer.commit_id
    status = repo.status()
    assert status.backed_up is True and status.remote == "origin" and status.remote_commit == writer.commit_id
    repo.close()


def test_a_dcp_save_by_path_gets_the_observers(tmp_path: Path) -> None:
    """A writer given a path (async_save's process mode pickles it so) opens the
    repository as a Repo: auto_push and the stats observer run."""
    _with_remote(tmp_path, auto_push=True).close()
    writer = ckvc.dcp.Writer(tmp_path / "src", message="by path")
    dcp.save(_state(2), storage_writer=writer, no_dist=True)
    with ckvc.Repo.open(tmp_path / "src") as repo:
        assert repo.wait_for_backup(60)
    from ckvc.integrations import dcp as dcp_mod

    for opened in list(dcp_mod._OPENED.values()):
        assert opened.wait_for_backup(60)
        opened.close()
    dcp_mod._OPENED.clear()
    assert _remote_main(tmp_path) == writer.commit_id


def test_status_never_claims_a_backup_the_remote_lacks(tmp_path: Path) -> None:
    """Commits made before auto_push was set were never queued: an empty backlog
    is no backup (today's status said "backed up to origin")."""
    repo = _with_remote(tmp_path, auto_push=False)
    first = repo.commit(_state(1), message="one")
    repo.push("origin")
    second = repo.commit(_state(2), message="two")
    repo.set_config(auto_push="origin")  # nothing queued for "two"
    status = repo.status()
    assert status.backed_up is False and status.not_backed_up == second
    assert (status.ahead, status.behind, status.remote_commit) == (1, 0, first)
    repo.close()
    text = run(tmp_path / "src", "status").output
    assert "backed up to origin" not in text.replace("not backed up to origin", "")
    assert second[:12] in text and "not backed up to origin" in text
    data = json.loads(run(tmp_path / "src", "status", "--json").stdout)
    assert data["backed_up"] is False and data["not_backed_up"] == second and data["ahead"] == 1
    with ckvc.Repo.open(tmp_path / "src") as repo:
        repo.push("origin")
        assert repo.status().backed_up is True
    assert "backed up to origin" in run(tmp_path / "src", "status").output


def test_status_without_a_remote_claims_nothing(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path / "r") as repo:
        repo.commit(_state(0))
        status = repo.status()
        assert status.remote is None and status.backed_up is None
    assert "backed up" not in run(tmp_path / "r", "status").output


def test_observers_run_after_the_pin_and_a_failing_one_is_a_warning(tmp_path: Path) -> None:
    """An observer sees the landed commit with its stats; one that raises leaves the
    commit standing and says so (DurabilityWarning), as a failed retention does."""
    with ckvc.Repo.init(tmp_path / "r") as repo:
        seen: list[write.Committed] = []

        def broken_hook(event: write.Committed) -> None:
            seen.append(event)
            raise OSError("disk on fire")

        repo.core.commit_observers.append(broken_hook)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            commit_id = repo.commit(_state(3), message="three")
        assert repo.head()[1] == commit_id
        assert [e.commit for e in seen] == [commit_id]
        assert seen[0].stats is not None and seen[0].stats.logical_bytes == 64 * 64 * 4
        assert seen[0].head.target == "refs/heads/main"
        assert repo.last_commit_stats is not None and repo.last_commit_stats.commit == commit_id
        messages = [str(w.message) for w in caught if issubclass(w.category, DurabilityWarning)]
        assert any("broken hook failed: disk on fire" in m and commit_id[:12] in m for m in messages), messages


def test_retention_runs_after_a_dcp_save(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path / "r", chunk_size=16 << 10) as repo:
        repo.set_retention(RetentionPolicy(keep_last=2, auto=True))
        for i in range(4):
            dcp.save(_state(i), storage_writer=ckvc.dcp.Writer(repo, message=f"save {i}"), no_dist=True)
        kept = [c for c in repo.log() if c.id not in repo.pruned()]
        assert len(kept) == 2, [c.message for c in kept]
