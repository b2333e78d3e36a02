"""Hooks (issue 30): a post_commit command runs after a commit lands on every commit
path (Repo.commit, a DCP save, a distributed commit: once, on the coordinator), with
the commit in its environment; a failing or hanging hook leaves the commit landed and
says so; post_push after a push; CKVC_NO_HOOKS=1 skips them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import run

import ckvc
from ckvc.errors import CkvcWarning, InvalidInputError
from ckvc.hooks import HookSettings, set_hook, wait_for_hooks

RECORD = 'printf "%s %s %s %s\\n" "$CKVC_HOOK" "$CKVC_COMMIT" "$CKVC_BRANCH" "$CKVC_METRICS" >> hooks.out'


def hook_lines(root: Path) -> list[list[str]]:
    wait_for_hooks()
    path = root / "hooks.out"
    return [line.split(" ", 3) for line in path.read_text().splitlines()] if path.exists() else []


def log_records(root: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (root / ".ckvc" / "logs" / "hooks.log").read_text().splitlines()]


def test_post_commit_runs_with_the_commit_in_its_environment(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        set_hook(repo.core, "post_commit", RECORD)
        one = repo.commit({"w": torch.zeros(3)}, message="one", metrics={"loss": 0.5})
        two = repo.commit({"w": torch.ones(3)}, message="two", blocking=False).result()
    assert hook_lines(tmp_path) == [
        ["post_commit", one, "main", '{"loss": 0.5}'],
        ["post_commit", two, "main", "{}"],
    ]
    assert [r["outcome"] for r in log_records(tmp_path)] == ["exit 0", "exit 0"]


def test_a_failing_hook_leaves_the_commit_and_says_so(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        set_hook(repo.core, "post_commit", "echo broken >&2; exit 3")
        with pytest.warns(CkvcWarning, match=r"post_commit hook for [0-9a-f]{12} failed \(exit 3\); the commit stands"):
            cid = repo.commit({"w": torch.zeros(3)}, message="one")
            wait_for_hooks()
        assert repo.resolve("main") == cid
    (record,) = log_records(tmp_path)
    assert record["outcome"] == "exit 3" and record["output"] == "broken\n" and record["for"] == cid[:12]


def test_a_hanging_hook_is_killed_after_its_timeout(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        set_hook(repo.core, "timeout", "0.5")
        set_hook(repo.core, "post_commit", f"{sys.executable} -c 'import time; time.sleep(600)'")
        with pytest.warns(CkvcWarning, match="killed after 0.5 s"):
            cid = repo.commit({"w": torch.zeros(3)}, message="one")
            wait_for_hooks()
        assert repo.resolve("main") == cid
    (record,) = log_records(tmp_path)
    assert record["outcome"] == "killed after 0.5 s"


def test_post_push_and_the_cli_setting(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path / "r") as repo:
        repo.remotes.add("origin", str(tmp_path / "remote"))
        cid = repo.commit({"w": torch.zeros(3)}, message="one")
    root = tmp_path / "r"
    assert (
        run(root, "config", "hooks.post_push", 'echo "$CKVC_HOOK $CKVC_REMOTE $CKVC_REFS" >> hooks.out').exit_code == 0
    )
    shown = run(root, "config", "hooks.post_push", "--json")
    assert json.loads(shown.stdout) == {"hooks.post_push": 'echo "$CKVC_HOOK $CKVC_REMOTE $CKVC_REFS" >> hooks.out'}
    assert run(root, "push", "origin").exit_code == 0
    wait_for_hooks()  # the CLI runs in this process here; a real one waits at exit
    assert (root / "hooks.out").read_text() == f"post_push origin refs/heads/main={cid}\n"
    assert run(root, "config", "hooks.post_push", "none").exit_code == 0
    assert HookSettings.load(root / ".ckvc").post_push is None


def test_no_hooks_skips_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKVC_NO_HOOKS", "1")
    with ckvc.Repo.init(tmp_path) as repo:
        set_hook(repo.core, "post_commit", RECORD)
        repo.commit({"w": torch.zeros(3)}, message="one")
    assert hook_lines(tmp_path) == []


def test_bad_settings_are_typed_errors(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        for key, value in (("post_commit", "   "), ("timeout", "0"), ("timeout", "soon"), ("pre_commit", "x")):
            with pytest.raises(InvalidInputError):
                set_hook(repo.core, key, value)
    assert not (tmp_path / ".ckvc" / "hooks.json").exists()
