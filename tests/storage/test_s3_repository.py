"""A whole repository on the S3 backend: the object store's packs go through
multipart sinks, checkout reads through ranged GETs, the refs through conditional
writes; a second opener (fresh backend, index rebuilt from the packs) sees the
same commits. The parts are assembled as Repository.in_memory assembles them."""

from __future__ import annotations

import torch
from helpers import assert_state_equal
from s3server import S3Server, s3_backend

import ckvc
from ckvc.config import RepoConfig
from ckvc.core import Repository, new_config
from ckvc.executor import Executor
from ckvc.pruned import PruneLog
from ckvc.refs import RefStore, branch_ref
from ckvc.retention_policy import RetentionPolicy
from ckvc.storage.backend import Backend
from ckvc.storage.cloud import MIN_PART_SIZE
from ckvc.storage.object_store import ObjectStore
from ckvc.storage.retry import RetryingBackend


def assemble(backend: Backend, *, new: bool) -> ckvc.Repo:
    if new:
        config = new_config(64 << 10, None, "main", None)
        config.save(backend)
        RefStore(backend).init_head(branch_ref("main"))
    else:
        config = RepoConfig.load(backend)
    core = Repository(
        config=config,
        store=ObjectStore(backend),
        refs=RefStore(backend),
        prune_log=PruneLog(backend),
        executor=Executor(2),
    )
    return ckvc.Repo(core)


def test_commit_checkout_and_reopen_on_s3(s3_server: S3Server, s3_bucket: str) -> None:
    def backend() -> Backend:
        return RetryingBackend(s3_backend(s3_server.endpoint, s3_bucket, part_size=MIN_PART_SIZE))

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(2_000_000, generator=g), torch.randn(300, generator=g)  # 8 MiB: a multipart pack
    first = {"w": w, "b": b, "step": 1}
    second = {"w": w, "b": b + 1, "step": 2}
    repo = assemble(backend(), new=True)
    try:
        one = repo.commit(first, message="one")
        two = repo.commit(second, message="two")
        assert_state_equal(repo.load(one), first)
        assert_state_equal(repo.load(two), second)
    finally:
        repo.close()
    again = assemble(backend(), new=False)
    try:
        assert [c.message for c in again.log()] == ["two", "one"]
        assert_state_equal(again.load("main"), second)
        assert_state_equal(again.load(one), first)
    finally:
        again.close()


def test_retain_gc_and_fsck_on_s3(s3_server: S3Server, s3_bucket: str) -> None:
    """gc's object-store form (retirement records, lease locks) on the S3 backend."""
    backend = RetryingBackend(s3_backend(s3_server.endpoint, s3_bucket))
    repo = assemble(backend, new=True)
    try:
        g = torch.Generator().manual_seed(1)
        states = [{"w": torch.randn(100_000, generator=g), "step": i} for i in range(3)]
        for i, state in enumerate(states):
            repo.commit(state, message=f"c{i}")
        assert len(list(backend.list("packs/"))) == 3
        plan = repo.retain(RetentionPolicy(keep_last=1))
        assert len(plan.released) == 2
        report = repo.gc(now=True)
        assert report.packs_repacked == 2 and report.bytes_freed > 600_000
        assert len(list(backend.list("packs/"))) == 2 and list(backend.list("locks/")) == []
        assert repo.fsck().problems == []
        assert_state_equal(repo.load("main"), states[-1])
    finally:
        repo.close()
