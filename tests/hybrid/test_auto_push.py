"""auto_push against the S3 server through the fault proxy: 20 commits, the remote
unreachable for the middle 10. Every commit is acknowledged locally at once;
``status`` shows the backlog while it exists; after recovery all 20 are on the
remote in order and fsck is clean on both sides. A process closing with pushes
pending warns, and the next one resumes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("ckvc.storage.cloud")
pytest.importorskip("obstore")
pytest.importorskip("moto")

from fault_proxy import FaultProxy, Rule
from helpers import assert_state_equal, run
from hybrid_util import remote_of, source_repo, train_state
from s3server import FAKE_CREDENTIALS

import ckvc
from ckvc.errors import BackupIncompleteError, CkvcWarning
from ckvc.storage import leases


def test_twenty_commits_with_the_remote_down_for_ten(
    tmp_path: Path, s3_bucket: str, s3_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An outage that begins while a push waits for its lease ends the wait after
    # UNREACHABLE_S (10 s); 1 s here, the behaviour the same.
    monkeypatch.setattr(leases, "UNREACHABLE_S", 1.0)
    repo = source_repo(tmp_path)
    repo.remotes.add("origin", f"s3://{s3_bucket}/run", endpoint=s3_proxy.endpoint)
    repo.set_config(auto_push="origin")
    ids: list[str] = []
    seen_backlog = 0
    for i in range(20):
        if i == 5:
            s3_proxy.rules.append(Rule("reset", count=None))  # unreachable: every connection reset
        if i == 15:
            s3_proxy.rules.clear()
        ids.append(repo.commit(train_state(i), message=f"epoch {i}"))  # returns: durable locally
        assert repo.head()[1] == ids[-1]
        if 5 <= i < 15:
            backlog = repo.backup_status()
            assert backlog is not None and backlog.entries
            seen_backlog = max(seen_backlog, len(backlog.entries))
            if i == 14:
                # The outage lasts until a push attempt has failed (its retries spent).
                for _ in range(1200):
                    if repo.backup_status().failures:  # type: ignore[union-attr]
                        break
                    time.sleep(0.05)
                assert repo.backup_status().failures >= 1  # type: ignore[union-attr]
                status = json.loads(run(tmp_path / "src", "status", "--json").stdout)  # stderr may warn of the backlog
                assert status["backup"]["pending"] >= 10 and status["backup"]["last_error"]
    assert seen_backlog >= 5
    assert repo.wait_for_backup(120), repo.backup_status()
    assert not repo.backup_status().entries  # type: ignore[union-attr]
    remote = remote_of(repo)
    try:
        assert remote.core.refs.read("refs/heads/main") == ids[-1]
        from ckvc import graph
        from ckvc.fsck import run_fsck

        assert [c.id for c in graph.log(remote.core, "main")] == ids[::-1]  # all 20, in order
        assert run_fsck(remote.core).ok
    finally:
        remote.close()
    assert repo.fsck().ok
    text = run(tmp_path / "src", "status").output
    assert "backed up to origin" in text
    repo.close()


def test_pending_pushes_warn_at_exit_and_resume_next_time(tmp_path: Path, s3_bucket: str, s3_proxy: FaultProxy) -> None:
    repo = source_repo(tmp_path)
    repo.remotes.add("origin", f"s3://{s3_bucket}/run", endpoint=s3_proxy.endpoint)
    repo.set_config(auto_push="origin")
    s3_proxy.rules.append(Rule("status", status=403, count=None))  # refused: fails at once
    tip = repo.commit(train_state(0), message="offline")
    assert not repo.wait_for_backup(1.0)
    text = run(tmp_path / "src", "status").output
    assert f"not backed up to origin: 1 commit(s) not on origin/main, the newest {tip[:12]}" in text
    assert "auto_push to origin: 1 commit(s) queued on main" in text and "last attempt failed" in text
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repo.close()
    assert any(issubclass(w.category, CkvcWarning) and "not yet backed up" in str(w.message) for w in caught)
    assert (tmp_path / "src" / ".ckvc" / "backup.json").is_file()
    s3_proxy.rules.clear()
    again = ckvc.Repo.open(tmp_path / "src")  # resumes the backlog
    assert again.backup_status() is not None
    assert again.wait_for_backup(60)
    assert again.ls_remote()["refs/heads/main"] == tip
    assert_state_equal(again.load(tip), train_state(0))
    again.close()


# A training script that never closes its Repo: what auto_push holds at exit.
UNCLOSED_SCRIPT = """
import sys, torch, ckvc
repo = ckvc.Repo.open(sys.argv[1])
for i in range(3):
    last = repo.commit({"w": torch.full((1000,), float(i))}, message=f"epoch {i}")
print(last)
"""


def _run_unclosed(repo_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", UNCLOSED_SCRIPT, str(repo_dir)],
        capture_output=True, text=True, check=False, timeout=300,
        env={**os.environ, **FAKE_CREDENTIALS, "CKVC_AUTHOR": "test", **env},
    )  # fmt: skip


def test_a_script_that_never_closes_its_repo_still_backs_up_its_last_commit(
    tmp_path: Path, s3_bucket: str, s3_proxy: FaultProxy
) -> None:
    with source_repo(tmp_path) as repo:
        repo.remotes.add("origin", f"s3://{s3_bucket}/run", endpoint=s3_proxy.endpoint)
        repo.set_config(auto_push="origin")
    done = _run_unclosed(tmp_path / "src")
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip()
    assert "not yet backed up" not in done.stderr
    with ckvc.Repo.open(tmp_path / "src") as repo:
        assert repo.ls_remote("origin")["refs/heads/main"] == last
        assert repo.backup_status().entries == []  # type: ignore[union-attr]


@pytest.mark.parametrize("require", [False, True])
def test_a_script_ending_with_the_remote_down_names_what_is_not_backed_up(
    tmp_path: Path, s3_bucket: str, s3_proxy: FaultProxy, require: bool
) -> None:
    with source_repo(tmp_path) as repo:
        repo.remotes.add("origin", f"s3://{s3_bucket}/run", endpoint=s3_proxy.endpoint)
        repo.set_config(auto_push="origin")
    s3_proxy.rules.append(Rule("status", status=403, count=None))  # refused: each attempt fails at once
    done = _run_unclosed(tmp_path / "src", **({"CKVC_REQUIRE_BACKUP": "1"} if require else {}))
    last = done.stdout.strip()
    assert done.returncode == (BackupIncompleteError.exit_code if require else 0), done.stderr
    assert f"commit(s) not yet backed up to origin: main at {last[:12]}" in done.stderr
    assert "Traceback" not in done.stderr
    s3_proxy.rules.clear()
    with ckvc.Repo.open(tmp_path / "src") as repo:  # the next process resumes the backlog
        assert repo.wait_for_backup(60)
        assert repo.ls_remote("origin")["refs/heads/main"] == last
