"""Two processes committing to one branch at once: commits in a line, or a clean
RefConflictError; never a silently lost commit."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckvc

CHILD = r"""
import json, os, sys, time
import torch
import ckvc

repo_dir, go_file, who, count, on_conflict = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
repo = ckvc.Repo.open(repo_dir)
open(go_file + "." + who + ".ready", "w").close()  # imported torch, opened the repository
while not os.path.exists(go_file):
    time.sleep(0.001)
done, conflicts, advice = [], 0, True
for i in range(count):
    state = {"w": torch.full((256, 256), float(i)), "who": who, "i": i}
    try:
        done.append(repo.commit(state, message=f"{who}-{i}", on_conflict=on_conflict))
    except ckvc.RefConflictError as exc:
        conflicts += 1
        advice = advice and "nothing was committed" in str(exc) and "on_conflict='retry'" in str(exc)
repo.close()
print(json.dumps({"done": done, "conflicts": conflicts, "advice": advice}))
"""


@pytest.mark.parametrize("on_conflict", ["fail", "retry"])
def test_concurrent_commits_to_one_branch_lose_nothing(tmp_path: Path, on_conflict: str) -> None:
    """``fail``: each commit lands or raises RefConflictError saying what to do;
    ``retry``: every commit lands, on top of the other writer's (issue 32)."""
    repo = ckvc.Repo.init(tmp_path / "r")
    base = repo.commit({"w": torch.zeros(2)}, message="base")
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(repo.path), str(go), who, "20", on_conflict],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for who in ("a", "b")
    ]
    ready = [tmp_path / f"go.{who}.ready" for who in ("a", "b")]
    while not all(r.exists() for r in ready):  # both children imported torch and opened the repository
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)
    go.write_text("go")
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    succeeded = [cid for r in results for cid in r["done"]]
    assert sum(r["conflicts"] for r in results) + len(succeeded) == 40
    assert all(r["advice"] for r in results)
    if on_conflict == "retry":
        assert len(succeeded) == 40
    chain = [c.id for c in repo.log("main", first_parent=True)]
    # Every acknowledged commit is on the branch, and the branch is a line.
    assert set(succeeded) | {base} == set(chain)
    assert all(len(repo.read_commit(c).parents) <= 1 for c in chain)
    assert len(chain) == len(succeeded) + 1
    assert repo.fsck().ok
    repo.close()


def test_a_commit_meets_a_writer_that_moved_the_branch_at_the_chosen_instant(
    repo: ckvc.Repo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other writer's commit lands just before our compare-and-swap (a hook
    chooses the instant): without retry a RefConflictError that says what happened
    and changes nothing; with it, our commit on top; a branch moved backwards
    meanwhile is never built on."""
    repo.commit({"w": torch.zeros(8)}, message="base")
    other = ckvc.Repo.open(repo.path)
    real = repo.core.refs.set_if_equals
    landed: list[str] = []

    def racing(name: str, old: str | None, new: str, message: str) -> None:
        if not landed:
            landed.append(other.commit({"w": torch.full((8,), 2.0)}, message="other"))
        real(name, old, new, message)

    monkeypatch.setattr(repo.core.refs, "set_if_equals", racing)
    with pytest.raises(ckvc.RefConflictError, match=r"another writer moved main to .*on_conflict='retry'"):
        repo.commit({"w": torch.ones(8)}, message="mine")
    assert repo.head() == ("main", landed[0])
    landed.clear()
    mine = repo.commit({"w": torch.ones(8)}, message="mine", on_conflict="retry")
    assert repo.read_commit(mine).parents == (landed[0],) and repo.head() == ("main", mine)
    assert repo.reflog("main")[0].message == f"commit: mine (on top of {landed[0][:12]}, committed meanwhile)"

    def backwards(name: str, old: str | None, new: str, message: str) -> None:
        if not landed:
            landed.append(other.reset("HEAD~2"))
        real(name, old, new, message)

    landed.clear()
    monkeypatch.setattr(repo.core.refs, "set_if_equals", backwards)
    with pytest.raises(ckvc.RefConflictError, match="not forward"):
        repo.commit({"w": torch.ones(8)}, message="again", on_conflict="retry")
    assert repo.head() == ("main", landed[0])
    other.close()
