"""Faults at the start and the end of a multipart upload during push (issue 31): a
pack past the sink's replay limit cannot repeat its own start or completion, so
the whole pack is written again from the local records; a completion whose answer
was lost is recognised as published. A persistent outage is one typed error
naming the remote and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

import torch
from fault_proxy import FaultProxy, Rule
from helpers import assert_state_equal

import ckvc
from ckvc.storage.backend import BackendError

# A 10 MiB pack of bytes that do not compress: two parts of the default 8 MiB, past
# the 8 MiB replay limit.
STATE = {
    "w": torch.randint(-(2**31), 2**31 - 1, (10 << 18,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
}
FAULTS = {
    "start-reset": Rule("reset", method="POST", path="?uploads", count=1),
    "start-answer-cut": Rule("truncate", method="POST", path="?uploads", count=1),
    "start-answer-lost": Rule("reset", method="POST", path="?uploads", after=True, count=1),
    "complete-answer-cut": Rule("truncate", method="POST", path="uploadId=", count=1),
    "complete-answer-lost": Rule("reset", method="POST", path="uploadId=", after=True, count=1),
    "complete-500-after": Rule("status", method="POST", path="uploadId=", after=True, status=500, count=1),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_push_survives_a_fault_at_the_start_or_end_of_a_multipart_upload(
    tmp_path: Path, s3_proxy: FaultProxy, s3_bucket: str, fault: str
) -> None:
    url = f"s3://{s3_bucket}/m"
    with ckvc.Repo.init(tmp_path / "a") as repo:
        head = repo.commit(STATE, message="big")
        repo.remotes.add("origin", url, endpoint=s3_proxy.endpoint)
        s3_proxy.rules = [FAULTS[fault]]
        repo.push("origin")
        assert s3_proxy.fired() == 1
    s3_proxy.rules = []
    clone = ckvc.Repo.clone(url, tmp_path / "b", endpoint=s3_proxy.endpoint)
    try:
        assert clone.resolve("main") == head
        assert_state_equal(clone.load("main"), STATE)
        assert clone.fsck(level="full").ok
    finally:
        clone.close()


def test_a_persistent_outage_at_the_lock_is_one_error_naming_remote_and_key(
    tmp_path: Path, s3_proxy: FaultProxy, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/m"
    with ckvc.Repo.init(tmp_path / "a") as repo:
        repo.commit({"w": torch.zeros(10)}, message="small")
        repo.remotes.add("origin", url, endpoint=s3_proxy.endpoint)
        s3_proxy.rules = [Rule("status", method="PUT", path="/locks/", status=503, count=None)]
        with pytest.raises(BackendError) as info:
            repo.push("origin")
        assert str(info.value).startswith(f"{url}: conditional PUT locks/")
        assert "503" in str(info.value) and info.value.transient
        assert repo.status().tracking == {} or "origin/main" not in repo.status().tracking


def test_fsck_remote_calls_a_denied_read_an_error_not_damage(
    tmp_path: Path, s3_proxy: FaultProxy, s3_bucket: str
) -> None:
    """torture remote: a 403 on reading a pack made fsck --remote report 'DAMAGED: 0
    objects' (exit 1); a store that refuses is an error naming the remote, not damage."""
    from helpers import run

    url = f"s3://{s3_bucket}/m"
    with ckvc.Repo.init(tmp_path / "a") as repo:
        repo.commit({"w": torch.zeros(10)}, message="small")
        repo.remotes.add("origin", url, endpoint=s3_proxy.endpoint)
        repo.push("origin")
    s3_proxy.rules = [Rule("status", method="GET", path="/packs/", status=403, count=1)]
    result = run(tmp_path / "a", "fsck", "--remote", "origin")
    assert s3_proxy.fired() == 1
    assert result.exit_code == BackendError.exit_code, result.output
    assert result.stderr.startswith(f"ckvc: error: {url}: GET packs/") and "access denied" in result.stderr
    assert "DAMAGED" not in result.stdout
    s3_proxy.rules = []
    assert run(tmp_path / "a", "fsck", "--remote", "origin").exit_code == 0
