"""Two processes committing to one branch at once: commits in a line, or a clean
RefConflictError; never a silently lost commit."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import ckvc

CHILD = r"""
import json, os, sys, time
import torch
import ckvc

repo_dir, go_file, who, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
repo = ckvc.Repo.open(repo_dir)
open(go_file + "." + who + ".ready", "w").close()  # imported torch, opened the repository
while not os.path.exists(go_file):
    time.sleep(0.001)
done, conflicts = [], 0
for i in range(count):
    state = {"w": torch.full((256, 256), float(i)), "who": who, "i": i}
    try:
        done.append(repo.commit(state, message=f"{who}-{i}"))
    except ckvc.RefConflictError:
        conflicts += 1
repo.close()
print(json.dumps({"done": done, "conflicts": conflicts}))
"""


def test_concurrent_commits_to_one_branch_lose_nothing(tmp_path: Path) -> None:
    repo = ckvc.Repo.init(tmp_path / "r")
    base = repo.commit({"w": torch.zeros(2)}, message="base")
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(repo.path), str(go), who, "25"],
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
    assert sum(r["conflicts"] for r in results) + len(succeeded) == 50
    chain = [c.id for c in repo.log("main", first_parent=True)]
    # Every acknowledged commit is on the branch, and the branch is a line.
    assert set(succeeded) | {base} == set(chain)
    assert all(len(repo.read_commit(c).parents) <= 1 for c in chain)
    assert len(chain) == len(succeeded) + 1
    assert repo.fsck().ok
    repo.close()
