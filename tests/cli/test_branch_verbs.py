"""git's branch verbs (issue 32): branch -f, -d refusing an unmerged branch, -D,
reset, push --all; each leaves everything as it was when it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import files_of, run

import ckvc
from ckvc.errors import InvalidInputError


def _history(repo: ckvc.Repo) -> list[str]:
    return [repo.commit({"w": torch.full((64,), float(i))}, message=f"c{i}") for i in range(3)]


def test_branch_force_moves_an_existing_branch_but_not_the_current_one(repo: ckvc.Repo) -> None:
    c0, c1, c2 = _history(repo)
    assert run(repo.path, "branch", "exp", c0[:12]).exit_code == 0
    refused = run(repo.path, "branch", "exp", c1[:12])
    assert refused.exit_code == ckvc.RefConflictError.exit_code and "already exists" in refused.stderr
    moved = json.loads(run(repo.path, "branch", "-f", "exp", c1[:12], "--json").output)
    assert moved == {"moved": "exp", "was": c0, "commit": c1}
    assert repo.branches()["exp"] == c1
    assert repo.reflog("exp")[0].message == f"branch: reset to {c1[:12]}"
    created = run(repo.path, "branch", "-f", "new", "HEAD~2")  # -f on a new name creates it
    assert created.exit_code == 0 and repo.branches()["new"] == c0
    before = files_of(repo.dir)
    current = run(repo.path, "branch", "-f", "main", c0[:12])
    assert current.exit_code == InvalidInputError.exit_code and "use reset" in current.stderr
    assert files_of(repo.dir) == before and repo.head() == ("main", c2)


def test_delete_refuses_an_unmerged_branch_unless_forced(repo: ckvc.Repo) -> None:
    c0, _, c2 = _history(repo)
    repo.branch("merged", c0)  # HEAD holds its commit
    assert run(repo.path, "branch", "-d", "merged").exit_code == 0
    repo.switch(c0, new_branch="side")
    side = repo.commit({"w": torch.ones(64)}, message="only on side")
    repo.switch("main")
    before = files_of(repo.dir)
    refused = run(repo.path, "branch", "-d", "side")
    assert refused.exit_code == InvalidInputError.exit_code
    assert "not fully merged" in refused.stderr and "ckvc branch -D side" in refused.stderr
    assert files_of(repo.dir) == before and repo.branches()["side"] == side
    assert run(repo.path, "branch", "-D", "side").exit_code == 0
    assert "side" not in repo.branches() and repo.head() == ("main", c2)


def test_reset_moves_the_current_branch_and_keeps_head_on_it(repo: ckvc.Repo) -> None:
    c0, c1, c2 = _history(repo)
    result = json.loads(run(repo.path, "reset", "--hard", "HEAD~2", "--json").output)
    assert result == {"branch": "main", "was": c2, "commit": c0}
    assert repo.head() == ("main", c0)
    assert repo.reflog("main")[0].message == "reset: moving to HEAD~2"
    nxt = repo.commit({"w": torch.zeros(64)}, message="after reset")
    assert repo.read_commit(nxt).parents == (c0,)
    assert repo.reset(c2) == c2 and repo.head() == ("main", c2)  # back, through the commit the reflog kept
    repo.switch(c1)  # detached: reset moves HEAD itself
    assert repo.reset(c0) == c0 and repo.head() == (None, c0)
    bad = run(repo.path, "reset", "nope")
    assert bad.exit_code == ckvc.InvalidRevisionError.exit_code and repo.head() == (None, c0)


def test_push_all_sends_every_branch(repo: ckvc.Repo, tmp_path: Path) -> None:
    c0, _, c2 = _history(repo)
    repo.branch("exp", c0)
    ckvc.Repo.init(tmp_path / "remote").close()
    repo.remotes.add("origin", str(tmp_path / "remote"))
    refused = run(repo.path, "push", "--all", "origin", "main")
    assert refused.exit_code == InvalidInputError.exit_code
    assert run(repo.path, "push", "--all").exit_code == 0
    remote_refs = repo.ls_remote("origin")
    assert (remote_refs["refs/heads/main"], remote_refs["refs/heads/exp"]) == (c2, c0)


def test_json_before_the_command_and_config_of_one_key(repo: ckvc.Repo) -> None:
    """`ckvc --json log` as `ckvc log --json`; `config KEY` reads one setting and
    `config KEY VALUE` says only what it set (issue 32's smaller items)."""
    _history(repo)
    assert json.loads(run(repo.path, "--json", "log").output) == json.loads(run(repo.path, "log", "--json").output)
    assert run(repo.path, "config", "gc_grace", "2h").output == "gc_grace_s = 7200.0\n"
    assert json.loads(run(repo.path, "--json", "config", "gc_grace").output) == {"gc_grace_s": 7200.0}
    bad = run(repo.path, "--json", "config", "nope")
    assert bad.exit_code == InvalidInputError.exit_code
    assert json.loads(bad.stderr)["error"]["type"] == "InvalidInputError"


def test_status_says_ahead_and_behind_for_every_remote(repo: ckvc.Repo, tmp_path: Path) -> None:
    c0, c1, c2 = _history(repo)
    for name in ("origin", "backup"):
        ckvc.Repo.init(tmp_path / name).close()
        repo.remotes.add(name, str(tmp_path / name))
    repo.push("origin")
    repo.reset(c0)
    repo.push("backup")
    repo.reset(c2)  # 2 ahead of backup/main; origin/main holds HEAD
    state = json.loads(run(repo.path, "status", "--json").output)
    assert sorted(state["tracking"], key=lambda t: t["remote"]) == [
        {"remote": "backup", "commit": c0, "ahead": 2, "behind": 0},
        {"remote": "origin", "commit": c2, "ahead": 0, "behind": 0},
    ]
    text = run(repo.path, "status").output
    assert "backed up to origin" in text and "ahead of backup/main by 2 commit(s)" in text
    repo.reset(c1)  # origin/main is 1 ahead of HEAD now
    assert "behind origin/main by 1 commit(s)" in run(repo.path, "status").output
