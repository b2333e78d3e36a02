"""A checkout through a Backend that counts requests: the read engine and the store
issue at most one read per contiguous run of a commit's records per pack (what makes
a high-latency backend cheap to read from), with the same bytes as the state."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import assert_state_equal, counted, runs_of

import ckvc
from ckvc.core import Repository
from ckvc.storage.packs import pack_key

TENSORS = 200


def state_of(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Mixed sizes: most tensors one chunk, some several (64 KiB chunks), some tiny.
    return {f"layer.{i}": torch.randn(((i % 7) + 1) * 3000 + (i % 5), generator=g) for i in range(TENSORS)}


@pytest.fixture(params=["local", "memory"])
def repo(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ckvc.Repo]:
    if request.param == "local":
        r = ckvc.Repo.init(tmp_path / "r", chunk_size=64 << 10)
    else:
        r = ckvc.Repo(Repository.in_memory(chunk_size=64 << 10))
    yield r
    r.close()


def test_a_200_tensor_checkout_reads_each_run_once(repo: ckvc.Repo) -> None:
    first = state_of(1)
    repo.commit(first, message="one")
    second = {k: (v + 1 if i % 2 else v) for i, (k, v) in enumerate(first.items())}  # half changed
    tip = repo.commit(second, message="two")
    commit = repo.read_commit(tip)
    snapshot = repo.read_snapshot(commit)
    chunks = [oid for blob in snapshot.blobs for oid in blob.chunks]
    assert len(snapshot.blobs) == TENSORS and len(chunks) > TENSORS
    counting = counted(repo.store)
    # Requests are what a remote pays for: the wrapper says so, as an object store would.
    counting.capabilities = dataclasses.replace(counting.capabilities, latency="remote")
    loaded = repo.load(tip)
    assert_state_equal(loaded, second)

    # Metadata objects (commit, snapshot) are one read each, and each run of
    # back-to-back chunk records one request: the unchanged half lies every other
    # record in the first commit's pack (100 runs), the changed half back to back
    # in the second's (1 run, 100 records and more).
    metadata = Counter(pack_key(repo.store.stat(bytes.fromhex(oid)).pack) for oid in (tip, commit.tree))
    runs = runs_of(repo.store, chunks)
    assert sorted(runs.values()) == [1, TENSORS // 2]
    assert counting.reads == runs + metadata
