"""ckvc mirror: a directory remote to the S3 test server and one bucket prefix to
another, only the objects the target lacks moved (re-run: none), the mirror cloned
bit-exact, a mirror killed midway resumed without resending what it published,
--prune, and push --mirror from a repository."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_state_equal, run
from test_remote import assert_same_history, history, new_repo, reachable, state, stored_size

import ckvc
from ckvc.remote.location import RemoteSpec
from ckvc.remote.repository import open_remote

pytest.importorskip("obstore")
pytest.importorskip("moto")


@pytest.fixture
def s3(s3_server: Any, s3_bucket: str) -> tuple[str, str]:
    return f"s3://{s3_bucket}", s3_server.endpoint


def _objects_on(url: str, endpoint: str | None) -> int:
    handle = open_remote(None, RemoteSpec("x", url, endpoint))
    try:
        return len(list(handle.core.store.iter_stored()))
    finally:
        handle.close()


def test_directory_remote_to_s3_then_prefix_to_prefix(tmp_path: Path, s3: tuple[str, str]) -> None:
    bucket, endpoint = s3
    a = new_repo(tmp_path, "a")
    history(a)  # main, dev and tag v1
    live = reachable(a)
    a.remotes.add("origin", str(tmp_path / "dir-remote"))
    a.push("origin", ["main", "dev"], tags=True)
    first = ckvc.Repo.mirror(str(tmp_path / "dir-remote"), f"{bucket}/one", target_endpoint=endpoint)
    assert first.stats.objects == len(live) and first.stats.record_bytes == stored_size(a, live)
    assert sorted(u.ref for u in first.updated) == sorted(a.ls_remote("origin").keys() - {"HEAD"})
    again = ckvc.Repo.mirror(str(tmp_path / "dir-remote"), f"{bucket}/one", target_endpoint=endpoint)
    assert again.stats.objects == 0 and again.stats.packs == 0 and not again.updated
    # bucket to bucket writes nothing locally: no temporary file, nothing in the working directory
    scratch, cwd = tmp_path / "scratch", tmp_path / "cwd"
    scratch.mkdir()
    cwd.mkdir()
    with pytest.MonkeyPatch.context() as local:  # its own: the S3 fixtures' credentials stay patched
        local.setattr(tempfile, "tempdir", str(scratch))
        local.chdir(cwd)
        second = ckvc.Repo.mirror(f"{bucket}/one", f"{bucket}/two", source_endpoint=endpoint, target_endpoint=endpoint)
    assert second.stats.objects == len(live)
    assert not any(scratch.iterdir()) and not any(cwd.iterdir())
    b = ckvc.Repo.clone(f"{bucket}/two", tmp_path / "b", endpoint=endpoint)
    assert_same_history(a, b)
    assert_state_equal(b.load("v1"), a.load("v1"))
    # one more commit: only it moves
    a.commit(state(7), "epoch 7")
    new = reachable(a) - live
    a.push("origin", ["main"])
    third = ckvc.Repo.mirror(str(tmp_path / "dir-remote"), f"{bucket}/one", target_endpoint=endpoint)
    assert third.stats.objects == len(new) and [u.ref for u in third.updated] == ["refs/heads/main"]
    a.close()
    b.close()


def test_prune_and_push_mirror(tmp_path: Path) -> None:
    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", str(tmp_path / "remote"))
    a.push("origin", ["main", "dev"])
    target = str(tmp_path / "copy")
    ckvc.Repo.mirror(str(tmp_path / "remote"), target)
    a.delete_branch("dev")
    a.push_mirror("origin")  # dev goes from origin too
    assert set(a.ls_remote("origin")) == {"HEAD", "refs/heads/main", *(f"refs/tags/{t}" for t in a.tags())}
    kept = ckvc.Repo.mirror(str(tmp_path / "remote"), target)
    assert not kept.deleted  # without --prune the copy keeps dev
    pruned = run(tmp_path, "mirror", str(tmp_path / "remote"), target, "--prune", "--json")
    assert pruned.exit_code == 0, pruned.output
    assert list(json.loads(pruned.stdout)["deleted"]) == ["refs/heads/dev"]
    a.close()


def test_a_killed_mirror_resumes_sending_only_what_is_missing(tmp_path: Path, s3: tuple[str, str]) -> None:
    bucket, endpoint = s3
    a = new_repo(tmp_path, "a")
    history(a, 5)
    live = reachable(a)
    source = str(tmp_path / "a")
    code = f"""
import os, signal
import ckvc.remote.push as push
original = push.upload_packs
def upload_packs(store, backend, groups, executor, landed, verifier):
    def then(pack):
        landed(pack)
        os.kill(os.getpid(), signal.SIGKILL)  # once the first pack is published
    original(store, backend, groups, executor, then, verifier)
push.upload_packs = upload_packs
import ckvc
ckvc.Repo.mirror({source!r}, {bucket + "/k"!r}, target_endpoint={endpoint!r})
"""
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    there = _objects_on(f"{bucket}/k", endpoint)
    assert 0 < there < len(live)
    rest = ckvc.Repo.mirror(source, f"{bucket}/k", target_endpoint=endpoint)
    assert rest.stats.objects == len(live) - there
    b = ckvc.Repo.clone(f"{bucket}/k", tmp_path / "b", endpoint=endpoint)
    assert_same_history(a, b)
    a.close()
    b.close()
