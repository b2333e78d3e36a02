"""Serial vs parallel pipelines, async-commit copies (pinned memory on CUDA), CLI progress."""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_state_equal

import ckvc
from ckvc import state as state_mod
from ckvc import write
from ckvc.ids import ObjectType
from ckvc.storage.durable import list_packs
from ckvc.storage.packs import parse_record

CHUNK = 4096  # small chunks: every test tensor spans several


@pytest.fixture
def repo(make_repo: Callable[..., ckvc.Repo]) -> ckvc.Repo:
    return make_repo(chunk_size=CHUNK)


# ---- serial vs parallel ------------------------------------------------------


def pack_records(repo: ckvc.Repo) -> set[tuple[Any, ...]]:
    out = set()
    for name in list_packs(repo.dir / "packs"):
        entries, _ = repo.store.reader.entries(name)
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
    assert not serial.executor.started  # nothing ran on threads
    assert ids[0] == ids[1]
    assert pack_records(serial) == pack_records(parallel)
    assert any(codec != 0 for _, _, codec, *_ in pack_records(serial))
    assert_state_equal(serial.load(), parallel.load())
    assert not serial.executor.started
    for r in repos:
        r.close()


def test_a_commit_holds_a_bounded_window_of_encoded_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunks encoded and waiting to land are bounded in bytes (write.WRITE_WINDOW_BYTES),
    not only in tasks: a commit's extra memory does not grow with the thread count's window."""
    from ckvc import executor, write

    monkeypatch.setattr(write, "WRITE_WINDOW_BYTES", 4 << 20)
    most = 0
    submit = executor.Window.submit

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal most
        most = max(most, len(self._in_flight) + 1)
        submit(self, *args, **kwargs)

    monkeypatch.setattr(executor.Window, "submit", counting)
    state = {"w": torch.randn(3 << 20)}  # 12 chunks of 1 MiB
    with ckvc.Repo.init(tmp_path, chunk_size=1 << 20, threads=2) as repo:
        repo.commit(state)
        assert most == write.write_window_depth(2, 1 << 20) == 4  # two threads busy, two more encoded
        assert_state_equal(repo.load(), state)
    assert write.write_window_depth(2, 4 << 10) == 4  # small chunks: a task of up to 1 MiB of them
    assert write.write_window_depth(16, 4 << 20) == 18  # never fewer than one task a thread + 2


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


# ---- async copies (pinned memory on CUDA) ------------------------------------


def test_async_commit_copies_cpu_tensors_once(repo: ckvc.Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    contiguous = torch.arange(3000, dtype=torch.float32)
    strided = torch.arange(6000, dtype=torch.float32).reshape(60, 100).t()  # .contiguous() copies it
    state = {"a": contiguous, "b": strided}
    blobs = state_mod.encode_state(state, pin_memory=True).blobs
    assert [b.private for b in blobs] == [False, True]
    assert not any(b.owner.is_pinned() for b in blobs)  # no CUDA here: plain host memory
    assert blobs[0].owner.data_ptr() == contiguous.data_ptr()

    copies: list[int] = []
    real_take = write.StagingBuffers._take

    def counting_take(self: write.StagingBuffers, size: int) -> Any:
        copies.append(size)
        return real_take(self, size)

    monkeypatch.setattr(write.StagingBuffers, "_take", counting_take)
    want = {k: v.clone() for k, v in state.items()}
    pending = repo.commit(state, blocking=False)
    monkeypatch.undo()
    contiguous.add_(1)  # mutate at once
    strided.add_(1)
    commit_id = pending.result()
    align = write.StagingBuffers.ALIGN
    assert copies == [-(-3000 * 4 // align) * align]  # only the tensor still shared with the caller was copied
    assert_state_equal(repo.load(commit_id), want)


def test_background_commits_reuse_their_staging_memory(repo: ckvc.Repo) -> None:
    """The second background commit copies into the first one's buffer (warm
    pages: the stall is one memcpy), each commit still byte-exact although the
    caller changes its tensors at once and the buffer is overwritten."""
    state = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.ones(77, dtype=torch.float64)}
    staging = repo._commits.background().staging
    landed, buffers = [], []
    for step in range(3):
        want = {k: v.clone() for k, v in state.items()}
        pending = repo.commit(state, message=str(step), blocking=False)
        assert staging._free == []  # taken (the first commit: made)
        for v in state.values():
            v.add_(1)
        landed.append((pending.result(), want))
        assert len(staging._free) == 1  # given back once it landed
        buffers.append(staging._free[0].data_ptr())
    assert len(set(buffers)) == 1  # the same memory, reused
    for commit_id, want in landed:
        assert_state_equal(repo.load(commit_id), want)
    # A commit twice as large does not fit: a new buffer, and both are kept (double buffering).
    big = {"a": torch.zeros(9000, dtype=torch.float32)}
    repo.commit(big, blocking=False).result()
    assert len(staging._free) == 2
    repo.close()
    assert staging._free == []


def test_a_failed_background_commit_drops_its_staging_memory(repo: ckvc.Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    staging = repo._commits.background().staging

    def fail(*args: Any, **kwargs: Any) -> str:
        raise OSError(5, "injected")

    monkeypatch.setattr(repo._commits, "write", fail)
    pending = repo.commit({"a": torch.ones(100)}, blocking=False)
    with pytest.raises(OSError):
        pending.result()
    assert staging._free == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_async_commit_of_cuda_tensors_uses_pinned_memory(repo: ckvc.Repo) -> None:
    w = torch.randn(1000, device="cuda")
    blobs = state_mod.encode_state({"w": w}, pin_memory=True).blobs
    assert blobs[0].private and blobs[0].owner.is_pinned()
    want = w.cpu()
    pending = repo.commit({"w": w}, blocking=False)
    w.add_(1)
    assert torch.equal(repo.load(pending.result(), map_location="cpu")["w"], want)


# ---- progress in the CLI -----------------------------------------------------


def test_cli_progress_bar_shows_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckvc.cli import _progress_bar

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    with _progress_bar("checkout", True) as update:
        assert update is not None
        update(512 << 10, 1 << 20)
    assert "checkout" in err.getvalue() and "512k" in err.getvalue().lower()
    with _progress_bar("checkout", False) as update:  # --json
        assert update is None


# ---- cold-read prefetch ---------------------------------------------------------


def test_checkout_prefetches_every_chunk_it_reads(repo: ckvc.Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": torch.randn(10_000), "b": torch.arange(3000, dtype=torch.int64)}
    cid = repo.commit(state, message="x")
    advised: list[tuple[str, int, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_WILLNEED
        advised.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    assert_state_equal(repo.load(cid), state)
    blobs = repo.show(cid).tensors
    chunk_count = sum(len(range(0, t.nbytes, CHUNK)) for t in blobs)
    assert 1 <= len(advised) < chunk_count  # neighbouring records in one hint
    (path,) = {p for p, _, _ in advised}
    entries = [e for e in _entries(repo, Path(path).name) if e.kind == ObjectType.CHUNK]
    assert len(entries) == chunk_count
    starts, ends = {e.offset for e in entries}, {e.offset + e.record_size for e in entries}
    for _, offset, length in advised:
        assert offset in starts and offset + length in ends  # whole records, nothing past them
    for e in entries:  # every record read was announced
        assert any(o <= e.offset and e.offset + e.record_size <= o + n for _, o, n in advised)


def _entries(repo: ckvc.Repo, name: str) -> list[Any]:
    return repo.store.reader.entries(name)[0]


def test_prefetch_is_only_a_hint(repo: ckvc.Repo) -> None:
    cid = repo.commit({"w": torch.randn(5000)}, message="x")
    repo.store.prefetch(b"\x01" * 32)  # unknown object: nothing to do, no error
    for name in list_packs(repo.dir / "packs"):
        repo.store.reader.prefetch(name, 0, 1 << 30)  # past the end of the file: fine
    repo.store.reader.prefetch("no-such.pack", 0, 10)  # the read, not the hint, reports a missing pack
    assert repo.load(cid)["w"].shape == (5000,)


def test_tasks_of_small_chunks_run_on_the_calling_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tasks whose chunks average under executor.INLINE_MEAN_CHUNK_BYTES are the
    interpreter's work, which the GIL serializes anyway: they run inline, and the
    records are those a serial repository writes."""
    monkeypatch.setenv("CKVC_AUTHOR", "tester")
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_000_000_000)
    g = torch.Generator().manual_seed(1)
    tiny = {f"t{i}": torch.randn(64, generator=g) for i in range(300)}
    with (
        ckvc.Repo.init(tmp_path / "pool", threads=2, chunk_size=1 << 20) as pool,
        ckvc.Repo.init(tmp_path / "serial", threads=1, chunk_size=1 << 20) as serial,
    ):
        first = pool.commit(tiny)
        assert_state_equal(pool.load(first), tiny)
        assert not pool.executor.started  # every task ran inline
        assert serial.commit(tiny) == first
        assert pack_records(pool) == pack_records(serial)
        big = {**tiny, "w": torch.randn(1 << 20, generator=g)}  # 4 chunks of 1 MiB: the pool's
        second = pool.commit(big)
        assert pool.executor.started
        assert_state_equal(pool.load(second), big)
        assert serial.commit(big) == second
        assert pack_records(pool) == pack_records(serial)


def test_a_window_finishes_inline_and_pool_tasks_in_submission_order() -> None:
    from ckvc.executor import Executor

    executor = Executor(2)
    landed: list[int] = []

    def task(n: int) -> int:
        if n == 5:
            raise ValueError("task 5")
        return n

    with pytest.raises(ValueError, match="task 5"), executor.window(3) as window:
        for n in range(8):
            window.submit(task, n, then=landed.append, inline=n % 2 == 1)
    assert landed == [0, 1, 2, 3, 4]  # the failure surfaces in its turn, after the tasks before it

    def interrupted(n: int) -> int:
        raise KeyboardInterrupt

    landed.clear()
    with pytest.raises(KeyboardInterrupt), executor.window(8) as window:
        window.submit(task, 0, then=landed.append)
        window.submit(interrupted, 1, then=landed.append, inline=True)  # at once, not in its turn
        window.submit(task, 2, then=landed.append)
    assert landed == []  # nothing after the interrupt ran; the task before it was waited for
    executor.close()


def test_the_collector_is_paused_during_commits_and_loads(tmp_path: Path) -> None:
    """A commit and a load allocate objects per tensor: the cyclic collector is off
    while they run (bulk.gc_paused) and back on after, also after a failure."""
    import gc

    from ckvc.bulk import gc_paused

    seen: list[bool] = []
    state = {"w": torch.randn(4096), "b": torch.randn(10)}
    assert gc.isenabled()
    with ckvc.Repo.init(tmp_path, chunk_size=CHUNK) as repo:
        commit = repo.commit(state, progress=lambda done, total: seen.append(gc.isenabled()))
        assert gc.isenabled()
        repo.load(commit, progress=lambda done, total: seen.append(gc.isenabled()))
        assert gc.isenabled() and seen and not any(seen)
        with pytest.raises(ckvc.UnknownKeyError):
            repo.load(commit, keys=["missing"])
        assert gc.isenabled()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
