"""Serial vs parallel pipelines, async-commit copies (pinned memory on CUDA), CLI progress."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_state_equal

import ckvc
from ckvc.storage.packs import list_packs, pack_entries, parse_record

CHUNK = 4096  # small chunks: every test tensor spans several


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[ckvc.Repo]:
    with ckvc.Repo.init(tmp_path / "r", chunk_size=CHUNK) as r:
        yield r


# ---- serial vs parallel ------------------------------------------------------


def pack_records(repo: ckvc.Repo) -> set[tuple[Any, ...]]:
    out = set()
    for name in list_packs(repo.dir / "packs"):
        with repo.store.reader.opened(name) as fd:
            entries, _ = pack_entries(fd, name)
        for e in entries:
            r = parse_record(repo.store.reader.read(name, e.offset, e.record_size), e.record_size)
            out.add((r.oid, r.kind, r.codec, r.raw_size, r.base, bytes(r.payload)))
    return out


def test_serial_and_parallel_commits_are_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKVC_AUTHOR", "tester")
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_000_000_000)
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(64, 1024, generator=g)  # 256 KiB
    states = [
        {"w": weights.clone(), "b": torch.zeros(10, dtype=torch.bfloat16), "step": 0},
        {
            "w": weights + 1e-3 * torch.randn(64, 1024, generator=g),
            "b": torch.ones(10, dtype=torch.bfloat16),
            "step": 1,
        },
    ]
    repos = [
        ckvc.Repo.init(tmp_path / "serial", threads=1, chunk_size=16384),
        ckvc.Repo.init(tmp_path / "pool", chunk_size=16384),
    ]
    ids = [[r.commit(s, message=f"step {s['step']}") for s in states] for r in repos]
    serial, parallel = repos
    assert serial.threads == 1 and parallel.threads == (os.cpu_count() or 2)
    assert serial._pool is None  # nothing ran on threads
    assert ids[0] == ids[1]
    assert pack_records(serial) == pack_records(parallel)
    assert any(codec != 0 for _, _, codec, *_ in pack_records(serial))
    assert_state_equal(serial.load(), parallel.load())
    assert serial._pool is None
    for r in repos:
        r.close()


def test_thread_count_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckvc.Repo.init(tmp_path).close()
    monkeypatch.setenv("CKVC_THREADS", "1")
    with ckvc.Repo.open(tmp_path) as r:
        assert r.threads == 1
    with ckvc.Repo.open(tmp_path, threads=3) as r:
        assert r.threads == 3
    monkeypatch.setenv("CKVC_THREADS", "many")
    with pytest.raises(ckvc.InvalidInputError, match="CKVC_THREADS"):
        ckvc.Repo.open(tmp_path)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ckvc.InvalidInputError):
            ckvc.Repo.open(tmp_path, threads=bad)  # type: ignore[arg-type]
