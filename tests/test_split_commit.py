"""A commit written in parts: the state's tensors split between ``write_blobs`` in
two separate processes (spawned, each opening the same local repository), then
``finish`` in a third, is the same commit (same id) as one ``repo.commit`` of the
state in a fresh repository, and checks out byte for byte."""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_state_equal

import ckvc
from ckvc.codecs.policy import LossySpec
from ckvc.core import Repository
from ckvc.objects import Blob
from ckvc.write import CommitRequest, WriteReport, chunk_policy, finish, stage, write_blobs

CHUNK_SIZE = 16 << 10
AUTHOR = "rank0@cluster"
TIME_NS = 1_700_000_000_123_456_789
MESSAGE = "step 100\n\nwritten by two ranks"
METRICS = {"loss": 0.25, "tokens": 1e9}


def make_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(96, 256, generator=g)  # 96 KiB: six chunks
    return {
        "model": {
            "weight": weight,
            "weight_t": weight.t(),  # shares the weight's storage: one blob for both
            "bias": torch.randn(256, generator=g).to(torch.bfloat16),
            "steps": torch.arange(7, dtype=torch.int64),
        },
        "optimizer": {"exp_avg": torch.randn(64, 128, generator=g), "lr": 3e-4, "betas": (0.9, 0.999)},
        "table": np.arange(5000, dtype=np.float64).reshape(50, 100),
        "epoch": 3,
    }


def _write_part(repo_dir: str, seed: int, part: int, parts: int, lossy: LossySpec) -> tuple[list[int], bytes]:
    """One writer process: stage the whole state (the tree is the same everywhere),
    write every ``parts``-th blob from ``part`` on. Returns their indices and the
    pickled (blobs, report): plain data, as a rank would send it to the coordinator."""
    core = Repository.open_local(repo_dir)
    try:
        staged = stage(core, make_state(seed), lossy=lossy)
        indices = list(range(part, len(staged.pending), parts))
        report = WriteReport()
        blobs = write_blobs(core, [staged.pending[i] for i in indices], policy=chunk_policy(core, lossy), report=report)
        return indices, pickle.dumps((blobs, report))
    finally:
        core.close()


def _finish(repo_dir: str, seed: int, blobs: list[Blob], report: WriteReport) -> str:
    """The coordinator: the snapshot and commit over every rank's blobs, then the branch."""
    core = Repository.open_local(repo_dir)
    try:
        staged = stage(core, make_state(seed))  # the tree only; nothing is written
        request = CommitRequest.checked(MESSAGE, METRICS, author=AUTHOR, time_ns=TIME_NS)
        request = dataclasses.replace(request, tree=staged.tree, lossy=report.lossy)
        return finish(core, blobs, request)
    finally:
        core.close()


@pytest.mark.parametrize("lossy", [None, {"optimizer.*": "q8"}], ids=["exact", "lossy"])
def test_blobs_written_by_two_processes_and_finished_by_a_third_make_the_same_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lossy: LossySpec
) -> None:
    seed = 11
    split_dir, whole_dir = tmp_path / "split", tmp_path / "whole"
    ckvc.Repo.init(split_dir, chunk_size=CHUNK_SIZE).close()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        parts = pool.starmap(_write_part, [(str(split_dir), seed, part, 2, lossy) for part in range(2)])
    staged_count = sum(len(indices) for indices, _ in parts)
    ordered: list[Blob | None] = [None] * staged_count
    report = WriteReport()
    for indices, payload in parts:
        blobs, part_report = pickle.loads(payload)
        assert all(type(b) is Blob for b in blobs) and len(blobs) == len(indices)
        for index, blob in zip(indices, blobs, strict=True):
            ordered[index] = blob
        report.merge(part_report)
    assert all(len(indices) >= 1 for indices, _ in parts)  # both processes wrote something
    with ctx.Pool(1) as pool:
        split_id = pool.apply(_finish, (str(split_dir), seed, ordered, report))

    monkeypatch.setenv("CKVC_AUTHOR", AUTHOR)
    with ckvc.Repo.init(whole_dir, chunk_size=CHUNK_SIZE) as whole:
        whole_id = whole.commit(make_state(seed), MESSAGE, METRICS, time_ns=TIME_NS, lossy=lossy)
        stats = whole.last_commit_stats
        assert stats is not None
        whole_state = whole.load()
        assert (stats.chunks, stats.logical_bytes) == (report.chunks, report.logical_bytes)

    assert split_id == whole_id
    with ckvc.Repo.open(split_dir) as split:
        assert split.head() == ("main", split_id)
        commit = split.read_commit(split_id)
        assert (commit.author, commit.time_ns, commit.message, commit.metrics) == (AUTHOR, TIME_NS, MESSAGE, METRICS)
        assert set(commit.lossy) == ({"optimizer.exp_avg"} if lossy else set())
        loaded = split.checkout("main")
        table, whole_table, original = loaded.pop("table"), whole_state.pop("table"), make_state(seed)
        assert_state_equal(loaded, whole_state)
        assert (table.dtype, table.shape, table.tobytes()) == (
            whole_table.dtype,
            whole_table.shape,
            whole_table.tobytes(),
        )
        assert table.tobytes() == original["table"].tobytes()
        assert_state_equal(loaded["model"], original["model"])
        if lossy is None:
            assert_state_equal(loaded["optimizer"], original["optimizer"])
        assert split.fsck().ok
