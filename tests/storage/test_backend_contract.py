"""The Backend contract: one suite, run against every implementation.

LocalBackend on a temporary directory, MemoryBackend, MemoryBackend with
object-store semantics (no rename, no append, no file locks), and the S3 backend
(ObjectStoreBackend) on a real S3 server on loopback (tests/s3server.py) and over
obstore's in-process store.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3server import obstore_available, s3_backend

from ckvc.errors import (
    CorruptObjectError,
    InvalidInputError,
    ObjectNotFoundError,
    RefConflictError,
    RepositoryLockedError,
)
from ckvc.storage import local
from ckvc.storage.backend import Backend
from ckvc.storage.cloud import open_object_store
from ckvc.storage.local import LocalBackend
from ckvc.storage.memory import MemoryBackend

KINDS = ["local", "memory", "memory-object-store", "s3", "obstore-memory"]


@pytest.fixture(params=KINDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "local":
        b: Backend = LocalBackend(tmp_path)
    elif request.param == "memory":
        b = MemoryBackend()
    elif request.param == "s3":
        b = s3_backend(request.getfixturevalue("s3_server").endpoint, request.getfixturevalue("s3_bucket"))
    elif request.param == "obstore-memory":  # the same backend over obstore's in-process store
        b = open_object_store("memory://") if obstore_available() else pytest.skip("obstore is not installed")
    else:
        b = MemoryBackend(object_store_semantics=True)
    yield b
    b.close()


def test_get_put_and_atomic_replace(backend: Backend) -> None:
    assert backend.get("refs/heads/main") is None
    backend.put("refs/heads/main", b"one")
    assert backend.get("refs/heads/main") == b"one"
    backend.put("refs/heads/main", bytearray(b"two, longer"))
    assert backend.get("refs/heads/main") == b"two, longer"
    assert list(backend.list("refs/")) == ["refs/heads/main"]  # no temporary left beside it


def test_read_into_exact_and_short(backend: Backend) -> None:
    data = bytes(range(256)) * 40
    with backend.open_sink("packs/a.pack") as sink:
        sink.write(data)
        sink.publish()
    out = bytearray(1000)
    backend.read_into("packs/a.pack", 300, memoryview(out))
    assert out == data[300:1300]
    head, rest = bytearray(10), bytearray(90)
    backend.readv_into("packs/a.pack", 5, [memoryview(head), memoryview(rest)])
    assert head + rest == data[5:105]
    assert backend.size("packs/a.pack") == len(data)
    with pytest.raises(CorruptObjectError, match="truncated"):
        backend.read_into("packs/a.pack", len(data) - 10, memoryview(bytearray(11)))
    with pytest.raises(ObjectNotFoundError, match="missing"):
        backend.read_into("packs/nope.pack", 0, memoryview(bytearray(1)))
    with pytest.raises(ObjectNotFoundError):
        backend.size("packs/nope.pack")
    backend.prefetch("packs/a.pack", 0, 1 << 30)  # a hint: never fails
    backend.prefetch("packs/nope.pack", 0, 10)


def test_read_ranges_in_order(backend: Backend) -> None:
    data = os.urandom(5000)
    backend.put("blob", data)
    ranges = [(4000, 100), (0, 10), (10, 990), (4999, 1)]
    got = [(off, bytes(buf)) for off, buf in backend.read_ranges("blob", ranges)]
    assert got == [(off, data[off : off + size]) for off, size in ranges]


def test_read_stream_pieces(backend: Backend) -> None:
    data = os.urandom(50_000)
    backend.put("packs/s.pack", data)
    pieces = [bytes(p) for p in backend.read_stream("packs/s.pack", 1000, 45_000, piece=8192)]
    assert b"".join(pieces) == data[1000:46_000]
    assert all(pieces)  # no empty piece (an in-memory store may hand over all at once)
    assert b"".join(bytes(p) for p in backend.read_stream("packs/s.pack", 0, len(data))) == data
    # from the start but short of the end (a pack without its TOC): exactly that much
    assert b"".join(bytes(p) for p in backend.read_stream("packs/s.pack", 0, 30_001, piece=8192)) == data[:30_001]
    with pytest.raises(CorruptObjectError, match="truncated"):
        list(backend.read_stream("packs/s.pack", 0, len(data) + 1))
    assert list(backend.read_stream("packs/s.pack", 10, 0)) == []
    with pytest.raises(CorruptObjectError, match="truncated"):
        list(backend.read_stream("packs/s.pack", 40_000, 10_001))
    with pytest.raises(ObjectNotFoundError):
        list(backend.read_stream("packs/nope.pack", 0, 10))


def test_read_tail(backend: Backend) -> None:
    data = os.urandom(5000)
    backend.put("packs/t.pack", data)
    size, tail = backend.read_tail("packs/t.pack", 100)
    assert (size, bytes(tail)) == (5000, data[-100:])
    size, tail = backend.read_tail("packs/t.pack", 1 << 20)  # more than there is: all of it
    assert (size, bytes(tail)) == (5000, data)
    backend.put("packs/empty.pack", b"")
    assert [(n, bytes(b)) for n, b in [backend.read_tail("packs/empty.pack", 64)]] == [(0, b"")]
    with pytest.raises(ObjectNotFoundError):
        backend.read_tail("packs/nope.pack", 10)


def test_sink_invisible_until_publish(backend: Backend) -> None:
    sink = backend.open_sink("packs/b.pack")
    sink.writev([b"abc", memoryview(b"defg")])
    sink.write(b"h")
    assert sink.size == 8
    assert backend.get("packs/b.pack") is None
    assert backend.stat("packs/b.pack") is None
    assert list(backend.list("packs/")) == []
    sink.publish()
    assert backend.get("packs/b.pack") == b"abcdefgh"
    assert list(backend.list("packs/")) == ["packs/b.pack"]
    assert backend.temporaries("packs/") == []


def test_abort_leaves_nothing(backend: Backend) -> None:
    sink = backend.open_sink("packs/c.pack")
    sink.write(b"x" * 100)
    sink.abort()
    assert backend.get("packs/c.pack") is None
    assert list(backend.list("")) == []
    assert backend.temporaries("packs/") == []
    with pytest.raises(RuntimeError), backend.open_sink("packs/d.pack") as failing:
        failing.write(b"y")
        raise RuntimeError("writer failed")
    assert list(backend.list("")) == [] and backend.temporaries("packs/") == []


def test_put_if_absent_race(backend: Backend) -> None:
    results: list[tuple[int, bool]] = []
    barrier = threading.Barrier(8)

    def create(i: int) -> None:
        barrier.wait()
        results.append((i, backend.put_if_absent("refs/tags/v1", f"writer {i}".encode())))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in results if won]
    assert len(results) == 8 and len(winners) == 1
    assert backend.get("refs/tags/v1") == f"writer {winners[0]}".encode()
    assert list(backend.list("refs/")) == ["refs/tags/v1"]


def test_compare_and_swap_conflict_never_overwrites(backend: Backend) -> None:
    v1 = backend.compare_and_swap("refs/heads/main", None, b"a")
    with pytest.raises(RefConflictError):
        backend.compare_and_swap("refs/heads/main", None, b"b")  # it exists now
    got = backend.get_versioned("refs/heads/main")
    assert got == (b"a", v1)
    v2 = backend.compare_and_swap("refs/heads/main", v1, b"c")
    assert v2 != v1
    with pytest.raises(RefConflictError):
        backend.compare_and_swap("refs/heads/main", v1, b"d")  # stale version
    assert backend.get("refs/heads/main") == b"c"
    backend.delete("refs/heads/main")
    with pytest.raises(RefConflictError):
        backend.compare_and_swap("refs/heads/main", v2, b"e")
    assert backend.get("refs/heads/main") is None


def test_compare_and_swap_race_has_one_winner(backend: Backend) -> None:
    base = backend.compare_and_swap("refs/heads/main", None, b"base")
    barrier = threading.Barrier(6)
    won: list[int] = []
    lost: list[int] = []

    def swap(i: int) -> None:
        barrier.wait()
        try:
            backend.compare_and_swap("refs/heads/main", base, f"w{i}".encode())
            won.append(i)
        except RefConflictError:
            lost.append(i)

    threads = [threading.Thread(target=swap, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == 5
    assert backend.get("refs/heads/main") == f"w{won[0]}".encode()


def test_list_order_prefix_and_folders(backend: Backend) -> None:
    for key in ["refs/heads/b", "refs/heads/a/x", "refs/heads/a/y", "refs/tags/t", "refs/headsup", "packs/p.pack"]:
        backend.put(key, key.encode())
    assert list(backend.list("refs/heads/")) == ["refs/heads/a/x", "refs/heads/a/y", "refs/heads/b"]
    assert list(backend.list("refs/heads")) == ["refs/heads/a/x", "refs/heads/a/y", "refs/heads/b", "refs/headsup"]
    flat = list(backend.list("refs/heads/", recursive=False))
    assert flat[-1] == "refs/heads/b" and not any(k.startswith("refs/heads/a/") for k in flat)
    assert list(backend.list("refs/tags/t")) == ["refs/tags/t"]
    assert list(backend.list("nothing/")) == []
    assert list(backend.list("")) == sorted([*list(backend.list("refs/")), "packs/p.pack"])


def test_list_sizes_is_the_listing_with_each_size(backend: Backend) -> None:
    data = {"packs/a.pack": b"x" * 1000, "packs/a.pack.toc": b"y" * 92, "packs/sub/b.pack": b"", "refs/x": b"r"}
    for key, body in data.items():
        backend.put(key, body)
    assert backend.list_sizes("packs/") == {k: len(v) for k, v in data.items() if k.startswith("packs/")}
    flat = backend.list_sizes("packs/", recursive=False)
    assert {k: v for k, v in flat.items() if not k.startswith("packs/sub")} == {
        "packs/a.pack": 1000,
        "packs/a.pack.toc": 92,
    }
    assert sorted(flat) == list(backend.list("packs/", recursive=False))
    assert backend.list_sizes("nothing/") == {}


def test_stat(backend: Backend) -> None:
    assert backend.stat("config") is None
    before = time.time()
    backend.put("config", b"12345")
    info = backend.stat("config")
    assert info is not None and info.key == "config" and info.size == 5
    assert before - 5 <= info.mtime <= time.time() + 5
    backend.put("config", b"67890")
    again = backend.stat("config")
    assert again is not None and again.version != info.version


def test_delete_is_idempotent(backend: Backend) -> None:
    backend.put("packs/x.pack", b"x")
    backend.delete("packs/x.pack")
    backend.delete("packs/x.pack")
    backend.sync("packs/")
    assert backend.get("packs/x.pack") is None and backend.stat("packs/x.pack") is None
    with pytest.raises(ObjectNotFoundError):
        backend.read_into("packs/x.pack", 0, memoryview(bytearray(1)))


def test_keys_that_escape_are_refused(backend: Backend) -> None:
    for bad in [
        "",
        "/etc/passwd",
        "../x",
        "refs/../../x",
        "a//b",
        "a/./b",
        "x\0y",
        "packs/p.pack.tmp",
        ".",
        "a/",
        "a/..",
    ]:
        with pytest.raises(InvalidInputError):
            backend.put(bad, b"x")
        with pytest.raises(InvalidInputError):
            backend.get(bad)


def test_lock_exclusion_between_threads(backend: Backend) -> None:
    inside: list[str] = []
    order: list[str] = []
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with backend.lock("gc.lock"):
            inside.append("holder")
            entered.set()
            release.wait(60)  # until the refused taker below has been refused
            order.append("holder out")

    t = threading.Thread(target=hold)
    t.start()
    entered.wait()
    with pytest.raises(RepositoryLockedError), backend.lock("gc.lock", shared=True, timeout=0):
        pass
    release.set()
    with backend.lock("gc.lock", timeout=60):
        order.append("waiter in")
    t.join()
    assert order == ["holder out", "waiter in"]
    # Shared holders do not exclude each other, and do exclude an exclusive one.
    with (
        backend.lock("gc.lock", shared=True),
        backend.lock("gc.lock", shared=True, timeout=0),
        pytest.raises(RepositoryLockedError),
        backend.lock("gc.lock", timeout=0),
    ):
        pass


def _hold_lock(root: str, ready: multiprocessing.synchronize.Event, release: multiprocessing.synchronize.Event) -> None:
    with LocalBackend(Path(root)).lock("gc.lock"):
        ready.set()
        release.wait(30)


def test_local_lock_excludes_another_process(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold_lock, args=(str(tmp_path), ready, release))
    proc.start()
    try:
        assert ready.wait(60)
        backend = LocalBackend(tmp_path)
        with pytest.raises(RepositoryLockedError), backend.lock("gc.lock", shared=True, timeout=0):
            pass
        release.set()
        proc.join(60)
        with backend.lock("gc.lock", timeout=10):
            pass
    finally:
        release.set()
        proc.join(60)


def test_append_where_capable(backend: Backend) -> None:
    if not backend.capabilities.append:
        with pytest.raises(NotImplementedError):
            backend.append("logs/HEAD", b"one\n")
        assert backend.get("logs/HEAD") is None
        return
    backend.append("logs/HEAD", b"one\n")
    backend.append("logs/HEAD", b"two\n")
    assert backend.get("logs/HEAD") == b"one\ntwo\n"


def test_rename_where_capable(backend: Backend) -> None:
    backend.put("packs/p.pack", b"pack")
    if not backend.capabilities.atomic_rename:
        with pytest.raises(NotImplementedError):
            backend.rename("packs/p.pack", "packs/p.pack.trash")
        assert backend.get("packs/p.pack") == b"pack"
        return
    backend.rename("packs/p.pack", "packs/p.pack.trash")
    backend.sync("packs/")
    assert backend.get("packs/p.pack") is None and backend.get("packs/p.pack.trash") == b"pack"


def test_local_sweep_removes_dead_writers_temporaries_only(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    live = backend.open_sink("packs/live.pack")
    live.write(b"header")
    dead = backend.open_sink("packs/dead.pack")
    dead.write(b"header")
    dead.release()  # as a killed process's lock goes with its descriptor
    # Created and never locked: its writer died (or failed) before its first byte.
    (tmp_path / "packs" / "empty.pack.tmp").write_bytes(b"")
    assert [t.key for t in backend.temporaries("packs/")] == [
        "packs/dead.pack.tmp",
        "packs/empty.pack.tmp",
        "packs/live.pack.tmp",
    ]
    assert backend.sweep("packs/") == ["packs/dead.pack.tmp", "packs/empty.pack.tmp"]
    assert [t.key for t in backend.temporaries("packs/")] == ["packs/live.pack.tmp"]
    live.publish()
    assert backend.get("packs/live.pack") == b"header"
    assert backend.temporaries("packs/") == []


def test_a_sink_swept_before_its_lock_starts_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep can lock and remove a sink's file in the instant between its creation
    and its writer's lock; the writer sees its name gone and creates it again."""
    backend = LocalBackend(tmp_path)
    real_flock = local.fcntl.flock
    swept: list[str] = []

    def sweep_first(fd: int, op: int) -> None:
        if op == local.fcntl.LOCK_EX and not swept:
            swept.extend(backend.sweep("packs/"))
        real_flock(fd, op)

    monkeypatch.setattr(local.fcntl, "flock", sweep_first)
    sink = backend.open_sink("packs/p.pack")
    monkeypatch.undo()
    assert swept == ["packs/p.pack.tmp"]
    sink.write(b"bytes")
    sink.publish()
    assert backend.get("packs/p.pack") == b"bytes" and backend.temporaries("packs/") == []


def test_local_reads_see_replacements_made_through_the_backend(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    backend.put("k", b"old!")
    out = bytearray(4)
    backend.read_into("k", 0, memoryview(out))  # caches the descriptor
    backend.put("k", b"new!")
    backend.read_into("k", 0, memoryview(out))
    assert out == b"new!"


def test_local_directory_named_like_a_key_is_not_read(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    (tmp_path / "packs" / "dir.pack").mkdir(parents=True)
    assert list(backend.list("packs/", recursive=False)) == ["packs/dir.pack"]
    with pytest.raises(CorruptObjectError, match="not a regular file"):
        backend.size("packs/dir.pack")
