"""Hooks on the multi-rank commit paths (issue 30): a DCP save and a distributed
commit run the post_commit hook once, on the coordinator, with the commit's id."""

from __future__ import annotations

from pathlib import Path

import dcp_fns
import rank_fns
from ranks import run_world

import ckvc
from ckvc.hooks import set_hook, wait_for_hooks

RECORD = 'printf "%s %s %s\\n" "$CKVC_HOOK" "$CKVC_COMMIT" "$CKVC_BRANCH" >> hooks.out'


def test_a_dcp_save_and_a_distributed_commit_run_the_hook_once(tmp_path: Path) -> None:
    for name, fn, args in (
        ("dcp", dcp_fns.save_and_wait_for_hooks, (3,)),
        ("distributed", rank_fns.commit_and_wait_for_hooks, ()),
    ):
        root = tmp_path / name
        with ckvc.Repo.init(root) as repo:
            set_hook(repo.core, "post_commit", RECORD)
        results = run_world(2, fn, (str(root), *args))
        (commit_id,) = {r["id"] for r in results}
        wait_for_hooks()
        assert (root / "hooks.out").read_text() == f"post_commit {commit_id} main\n", name
