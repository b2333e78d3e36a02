"""Async commits: a consistent snapshot at return, errors surfaced, order kept, nothing dropped at exit."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_state_equal

import ckvc


def test_mutation_right_after_async_commit_does_not_leak_into_it(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    with ckvc.Repo.init(tmp_path) as repo:
        before = collections.OrderedDict((k, v.clone()) for k, v in model.state_dict().items())
        pending = repo.commit({"model": model.state_dict()}, message="async", blocking=False)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # in place, at once
        commit_id = pending.result()
        assert pending.done()
        assert_state_equal(repo.load(commit_id)["model"], before)
        # Same id as a blocking commit of the same bytes would get for its snapshot.
        assert repo.read_commit(commit_id).tree == repo.read_commit(repo.commit({"model": before})).tree


def test_background_error_surfaces_on_result_and_at_next_commit(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        repo.commit({"w": torch.zeros(4)})

        def fail(done: int, total: int) -> None:
            raise RuntimeError("injected in the background")

        first = repo.commit({"w": torch.ones(4)}, blocking=False, progress=fail)
        with pytest.raises(RuntimeError, match="injected"):
            first.result()
        repo.commit({"w": torch.ones(4)})  # seen on result(): not raised again

        unseen = repo.commit({"w": torch.full((4,), 2.0)}, blocking=False, progress=fail)
        with pytest.raises(RuntimeError, match="injected"):
            repo.commit({"w": torch.full((4,), 3.0)})  # surfaces here, before anything is written
        assert unseen.done()
        assert len(repo.log()) == 2  # neither failed commit moved the branch


def test_async_and_blocking_commits_land_in_order(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        handles = [
            repo.commit({"i": i, "w": torch.full((1000,), float(i))}, message=str(i), blocking=False) for i in range(5)
        ]
        last = repo.commit({"i": 5}, message="5")
        assert [c.message for c in repo.log()] == ["5", "4", "3", "2", "1", "0"]
        assert [h.result() for h in handles] == [c.id for c in repo.log()][1:][::-1]
        assert repo.resolve("HEAD") == last


def test_pending_commit_completes_at_interpreter_exit(tmp_path: Path) -> None:
    script = f"""
import torch, ckvc
repo = ckvc.Repo.init({str(tmp_path)!r})
repo.commit({{"w": torch.arange(1 << 20, dtype=torch.float32)}}, message="at exit", blocking=False)
"""  # no wait(), no close(): the interpreter just ends
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    with ckvc.Repo.open(tmp_path) as repo:
        assert [c.message for c in repo.log()] == ["at exit"]
        assert torch.equal(repo.load()["w"], torch.arange(1 << 20, dtype=torch.float32))
        assert repo.fsck().ok
