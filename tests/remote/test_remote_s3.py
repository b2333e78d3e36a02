"""Remotes on a real S3 server (moto on 127.0.0.1, the ``s3_server`` / ``s3_bucket``
fixtures of tests/s3server.py): the same round trip, exact bytes, lost race and
corrupt object as on the directory and memory remotes, through the object-store
backend and its retry wrapper. Skipped where the ``remote`` extra is not installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ckvc.storage.cloud")
pytest.importorskip("obstore")
pytest.importorskip("moto")

from helpers import assert_state_equal
from test_remote import assert_same_history, flip_byte_in_a_chunk, history, new_repo, reachable, state, stored_size

import ckvc
from ckvc.errors import CorruptObjectError, RefConflictError
from ckvc.remote.repository import open_remote


@pytest.fixture
def s3(s3_server: Any, s3_bucket: str) -> tuple[str, str]:
    """(URL, endpoint) of an empty prefix in a fresh bucket."""
    return f"s3://{s3_bucket}/models", s3_server.endpoint


def test_s3_round_trip_and_exact_bytes(tmp_path: Path, s3: tuple[str, str]) -> None:
    url, endpoint = s3
    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", url, endpoint=endpoint)
    live = reachable(a)
    pushed = a.push("origin", ["main", "dev"], tags=True)
    assert pushed.stats.objects == len(live) and pushed.stats.record_bytes == stored_size(a, live)
    assert a.push("origin", ["main", "dev"], tags=True).stats.packs == 0
    b = ckvc.Repo.clone(url, tmp_path / "b", endpoint=endpoint)
    assert_same_history(a, b)
    assert b.tags() == a.tags() and b.remote_branches() == a.remote_branches()
    a.commit(state(5), message="epoch 5")
    new = reachable(a) - live
    more = a.push()
    assert more.stats.objects == len(new) and more.stats.record_bytes == stored_size(a, new)
    assert b.pull().fast_forward and b.fetch().stats.objects == 0
    assert_state_equal(b.load("HEAD"), a.load("HEAD"))
    remote = open_remote(a.core, a.remotes.get("origin"))
    try:
        from ckvc.fsck import run_fsck

        assert run_fsck(remote.core).ok
    finally:
        remote.close()
    assert a.fsck().ok and b.fsck().ok
    a.close()
    b.close()


def test_s3_lost_race_and_corrupt_object(tmp_path: Path, s3: tuple[str, str]) -> None:
    url, endpoint = s3
    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", url, endpoint=endpoint)
    a.push()
    b = ckvc.Repo.clone(url, tmp_path / "b", endpoint=endpoint)
    a.commit(state(11, base=5), message="a")
    b_tip = b.commit(state(12, base=6), message="b")
    once: list[int] = []

    def b_first(done: int, total: int) -> None:
        if done == total and total and not once:
            once.append(1)
            b.push()

    with pytest.raises(RefConflictError):
        a.push(progress=b_first)
    assert a.ls_remote()["refs/heads/main"] == b_tip

    key = flip_byte_in_a_chunk(url, endpoint, among=reachable(b))  # not one of a's unreferenced uploads
    c = new_repo(tmp_path, "c")
    c.remotes.add("origin", url, endpoint=endpoint)
    with pytest.raises(CorruptObjectError) as info:
        c.fetch()
    assert url in str(info.value) and key in str(info.value)
    assert c.remote_branches() == {} and c.fsck().ok
    for repo in (a, b, c):
        repo.close()
