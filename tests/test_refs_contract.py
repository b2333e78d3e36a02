"""The RefStore contract: one suite, run on every Backend.

RefStore(LocalBackend(tmp)) takes the flock + rename path, RefStore(MemoryBackend())
the same logic over the in-memory twin, and RefStore(MemoryBackend(object_store_semantics=True))
the object-store variant: compare_and_swap on the ref's key, tombstones for
deletions, one key per reflog and prune-log entry. The behaviour is the same
everywhere; only the keys underneath differ (docs/FORMAT.md, "Remote layout draft").
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from s3server import s3_backend

from ckvc.errors import DamageWarning, InvalidRefNameError, RefConflictError, RefNotFoundError, StorageError
from ckvc.ids import Buffer
from ckvc.pruned import PruneLog, PruneRecord
from ckvc.refs import HEAD, REPAIR_MARKER, RefStore
from ckvc.storage.backend import Backend, BackendError, Version
from ckvc.storage.local import LocalBackend
from ckvc.storage.memory import MemoryBackend

KINDS = ["local", "memory", "memory-object-store", "s3"]
A, B, C, D = ("a" * 64), ("b" * 64), ("c" * 64), ("d" * 64)
MAIN = "refs/heads/main"


@pytest.fixture(params=KINDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "local":
        root = tmp_path / "repo"
        root.mkdir()
        b: Backend = LocalBackend(root)
    elif request.param == "s3":  # the object-store variant on a real S3 server (tests/s3server.py)
        b = s3_backend(request.getfixturevalue("s3_server").endpoint, request.getfixturevalue("s3_bucket"))
    else:
        b = MemoryBackend(object_store_semantics=request.param == "memory-object-store")
    yield b
    b.close()


@pytest.fixture
def refs(backend: Backend) -> RefStore:
    store = RefStore(backend)
    store.init_head(MAIN)
    return store


def moves(store: RefStore, name: str) -> list[tuple[str | None, str | None, str]]:
    return [(e.old, e.new, e.message) for e in store.reflog(name)]


def test_create_update_delete_each_under_its_condition(refs: RefStore) -> None:
    refs.set_if_equals(MAIN, None, A, "create")
    with pytest.raises(RefConflictError, match=rf"^{MAIN} moved: expected \(no ref\), found {A}$"):
        refs.set_if_equals(MAIN, None, B, "create again")
    with pytest.raises(RefConflictError, match=rf"^{MAIN} moved: expected {C}, found {A}$"):
        refs.set_if_equals(MAIN, C, B, "wrong old")
    assert refs.read(MAIN) == A
    refs.set_if_equals(MAIN, A, B, "update")
    assert refs.read(MAIN) == B
    with pytest.raises(RefConflictError, match=rf"^{MAIN} moved: expected {A}, found {B}$"):
        refs.delete_if_equals(MAIN, A, "wrong delete")
    refs.delete_if_equals(MAIN, B, "delete")
    assert refs.read(MAIN) is None
    assert refs.list_refs() == {}
    assert refs.reflog(MAIN) == []  # a deleted ref's reflog goes with it
    with pytest.raises(RefConflictError, match=rf"^{MAIN} moved: expected {B}, found \(no ref\)$"):
        refs.delete_if_equals(MAIN, B, "delete twice")
    refs.set_if_equals(MAIN, None, C, "recreate")
    assert refs.read(MAIN) == C
    assert moves(refs, MAIN) == [(None, C, "recreate")]


def test_set_if_equals_refuses_a_partial_id(refs: RefStore) -> None:
    with pytest.raises(ValueError, match="not a full id"):
        refs.set_if_equals(MAIN, None, "abc", "short")
    assert refs.read(MAIN) is None


def test_reflog_order_content_and_heads_log(refs: RefStore) -> None:
    refs.set_if_equals(MAIN, None, A, "commit: one")
    refs.set_if_equals(MAIN, A, B, "commit: two")
    side = "refs/heads/side"
    refs.set_if_equals(side, None, C, "branch: created from c")  # HEAD is not on it
    assert moves(refs, MAIN) == [(A, B, "commit: two"), (None, A, "commit: one")]
    assert moves(refs, HEAD) == [(A, B, "commit: two"), (None, A, "commit: one")]
    assert moves(refs, side) == [(None, C, "branch: created from c")]
    refs.set_head(branch=side, message="checkout: moving to side")
    assert refs.head() == (side, C)
    assert moves(refs, HEAD)[0] == (B, C, "checkout: moving to side")
    entries = refs.reflog(MAIN)
    assert entries[0].time_ns >= entries[1].time_ns > 0
    assert sorted(refs.iter_reflog_ids()) == [A] * 4 + [B] * 3 + [C] * 2  # main, HEAD and side
    assert refs.damaged_logs() == []


def test_head_attached_and_detached(refs: RefStore) -> None:
    assert refs.head() == (MAIN, None)  # unborn
    refs.set_if_equals(MAIN, None, A, "one")
    assert refs.head() == (MAIN, A)
    refs.set_head(detached=B, message="checkout: moving to b")
    assert refs.head() == (None, B)
    refs.set_head_if_equals(B, C, "commit: on detached")
    assert refs.head() == (None, C)
    assert refs.read(MAIN) == A  # a detached commit moves HEAD only
    assert moves(refs, MAIN) == [(None, A, "one")]
    assert moves(refs, HEAD)[:2] == [(B, C, "commit: on detached"), (A, B, "checkout: moving to b")]
    with pytest.raises(RefConflictError, match=rf"^HEAD moved: expected detached at {B}$"):
        refs.set_head_if_equals(B, D, "stale")
    refs.set_head(branch=MAIN, message="checkout: moving to main")
    with pytest.raises(RefConflictError, match="HEAD moved: expected detached at"):
        refs.set_head_if_equals(A, D, "attached")
    assert refs.head() == (MAIN, A)
    with pytest.raises(ValueError, match="exactly one"):
        refs.set_head(message="neither")


def test_invalid_names_are_refused_and_nothing_escapes(backend: Backend, refs: RefStore, tmp_path: Path) -> None:
    before = sorted(backend.list(""))
    outside = sorted(p.name for p in tmp_path.iterdir())
    bad = [
        "refs/heads/../../escape",
        "/etc/passwd",
        "refs/heads/a.lock",
        "refs/heads/.hidden",
        "refs/heads/a b",
        "refs/heads/a//b",
        "refs/heads/x@{1}",
        "refs/heads/end.",
        "refs/heads/" + "x" * 256,
        "",
    ]
    attempts: list[Callable[[str], object]] = [
        lambda name: refs.set_if_equals(name, None, A, "bad"),
        lambda name: refs.delete_if_equals(name, A, "bad"),
        refs.read,
        refs.reflog,
        lambda name: refs.set_head(branch=name, message="bad"),
    ]
    for name in bad:
        for attempt in attempts:
            with pytest.raises(InvalidRefNameError, match="invalid ref name"):
                attempt(name)
    assert sorted(backend.list("")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == outside


def test_a_ref_cannot_be_both_a_file_and_a_folder(refs: RefStore) -> None:
    refs.set_if_equals("refs/heads/a", None, A, "a")
    with pytest.raises(RefConflictError, match=r"^cannot create refs/heads/a/b: refs/heads/a exists$"):
        refs.set_if_equals("refs/heads/a/b", None, B, "a/b")
    refs.delete_if_equals("refs/heads/a", A, "gone")
    refs.set_if_equals("refs/heads/a/b", None, B, "a/b")  # now fine, reflog and all
    with pytest.raises(RefConflictError, match=r"^cannot create refs/heads/a: refs exist below it$"):
        refs.set_if_equals("refs/heads/a", None, C, "a")
    refs.delete_if_equals("refs/heads/a/b", B, "gone")
    refs.set_if_equals("refs/heads/a", None, C, "a again")
    assert refs.list_refs() == {"refs/heads/a": C}
    assert moves(refs, "refs/heads/a") == [(None, C, "a again")]


def test_list_refs_is_sorted_and_filtered(refs: RefStore) -> None:
    for name, value in [("refs/tags/v1", A), ("refs/heads/z", B), ("refs/heads/a/b", C), (MAIN, D)]:
        refs.set_if_equals(name, None, value, "create")
    assert list(refs.list_refs()) == ["refs/heads/a/b", "refs/heads/main", "refs/heads/z", "refs/tags/v1"]
    assert refs.list_refs("refs/tags/") == {"refs/tags/v1": A}


def test_damaged_and_stray_refs(backend: Backend, refs: RefStore) -> None:
    refs.set_if_equals(MAIN, None, A, "one")
    backend.put("refs/heads/broken", b"not an id\n")
    backend.put("refs/heads/main.lock", (B + "\n").encode())
    with pytest.raises(RefNotFoundError, match=r"^ref refs/heads/broken is damaged: 'not an id'$"):
        refs.read("refs/heads/broken")
    damaged: list[str] = []
    with pytest.warns(DamageWarning, match=r"^skipping stray file refs/heads/main.lock: not a valid ref name$"):
        assert refs.list_refs(damaged=damaged) == {MAIN: A}
    assert damaged == ["ref refs/heads/broken is damaged: 'not an id'"]
    [stray] = refs.stray_refs()
    assert (stray.path, stray.value) == ("refs/heads/main.lock", B)
    assert stray.problem.endswith("a component ends with '.lock'")
    backend.put("HEAD", b"garbage\n")
    with pytest.raises(RefNotFoundError, match=r"^HEAD is damaged: 'garbage'$"):
        refs.head()


def test_a_damaged_reflog_line_costs_that_line(backend: Backend, refs: RefStore) -> None:
    refs.set_if_equals(MAIN, None, A, "one")
    refs.set_if_equals(MAIN, A, B, "two")
    keys = [k for k in backend.list(f"logs/{MAIN}") if k == f"logs/{MAIN}" or k.startswith(f"logs/{MAIN}/")]
    first = keys[0]
    data = backend.get(first)
    assert data is not None
    backend.put(first, data.replace(b'"message"', b'"mess\xffage"', 1))
    with pytest.warns(DamageWarning, match=rf"^skipped 1 damaged line\(s\) in logs/{MAIN}$"):
        assert moves(refs, MAIN) == [(A, B, "two")]
    assert refs.damaged_logs() == [f"logs/{MAIN} line 1: not a reflog entry"]
    assert A in set(refs.iter_reflog_ids(since_ns=1 << 62))  # its age is unknown: its ids still count


def test_repair_restores_a_lost_reflog_entry(backend: Backend, refs: RefStore) -> None:
    refs.set_if_equals(MAIN, None, A, "one")
    assert not refs.repair_pending()
    backend.put(MAIN, (B + "\n").encode())  # a move whose reflog writes were lost
    assert refs.repair_pending()
    assert not refs.repair_pending(exists=lambda oid: oid != B)  # a hand edit naming nothing is fsck's
    refs.note_incomplete()
    assert backend.stat(REPAIR_MARKER) is not None
    assert refs.repair() == 2  # main's reflog and HEAD's
    assert moves(refs, MAIN)[0] == (A, B, "repair: entry restored after a failed reflog write")
    assert moves(refs, HEAD)[0] == (A, B, "repair: entry restored after a failed reflog write")
    assert backend.stat(REPAIR_MARKER) is None
    assert not refs.repair_pending()
    assert refs.repair() == 0


def _race_once(refs: RefStore, name: str, old: str | None, news: list[str]) -> tuple[list[str], list[Exception]]:
    barrier = threading.Barrier(len(news))
    won: list[str] = []
    lost: list[Exception] = []

    def attempt(new: str) -> None:
        barrier.wait()
        try:
            refs.set_if_equals(name, old, new, f"race to {new[:4]}")
            won.append(new)
        except RefConflictError as exc:
            lost.append(exc)

    threads = [threading.Thread(target=attempt, args=(n,)) for n in news]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won, lost


def test_two_threads_racing_give_one_winner(refs: RefStore) -> None:
    refs.set_if_equals(MAIN, None, A, "base")
    old = A
    for i in range(20):
        news = [f"{i:02d}{'1' * 62}", f"{i:02d}{'2' * 62}"]
        won, lost = _race_once(refs, MAIN, old, news)
        assert len(won) == 1 and len(lost) == 1, (won, lost)
        assert refs.read(MAIN) == won[0]
        assert moves(refs, MAIN)[0] == (old, won[0], f"race to {won[0][:4]}")
        old = won[0]
    assert len(refs.reflog(MAIN)) == 21  # every winner logged once, no loser logged


def test_a_swap_lost_between_read_and_write_never_overwrites(backend: Backend, refs: RefStore) -> None:
    """The interleaving a lock forbids: another writer moves the ref after this
    one has read it. Without OS locks the compare-and-swap must catch it."""
    if backend.capabilities.file_locks:
        pytest.skip("under the refs lock no writer can move the ref between read and write")
    refs.set_if_equals(MAIN, None, A, "base")
    other = RefStore(backend)
    real = backend.get_versioned
    pending = [lambda: other.set_if_equals(MAIN, A, C, "the other writer")]

    def read_then_interfere(key: str) -> tuple[bytes, Version] | None:
        found = real(key)
        if key == MAIN and pending:
            pending.pop()()
        return found

    backend.get_versioned = read_then_interfere  # type: ignore[method-assign]
    with pytest.raises(RefConflictError, match=rf"^{MAIN} moved: expected {A}, found {C}$"):
        refs.set_if_equals(MAIN, A, B, "loses")
    assert refs.read(MAIN) == C
    pending.append(lambda: other.set_if_equals(MAIN, C, D, "moves again"))
    with pytest.raises(RefConflictError, match=rf"^{MAIN} moved: expected {C}, found {D}$"):
        refs.delete_if_equals(MAIN, C, "a delete loses")
    assert refs.read(MAIN) == D
    pending.append(lambda: other.delete_if_equals(MAIN, D, "deleted by the other"))
    with pytest.raises(RefConflictError, match=rf"^{MAIN} moved: expected {D}, found \(no ref\)$"):
        refs.set_if_equals(MAIN, D, A, "an update loses to a delete")
    assert refs.read(MAIN) is None
    pending.append(lambda: other.set_if_equals(MAIN, None, B, "created by the other"))
    with pytest.raises(RefConflictError, match=rf"^{MAIN} moved: expected \(no ref\), found {B}$"):
        refs.set_if_equals(MAIN, None, C, "a create loses")
    backend.get_versioned = real  # type: ignore[method-assign]
    assert refs.read(MAIN) == B
    assert moves(refs, MAIN) == [(None, B, "created by the other")]


@pytest.mark.parametrize("lands", [False, True])
def test_a_swap_whose_answer_is_lost_has_the_outcome_the_key_shows(lands: bool) -> None:
    """A remote compare-and-swap that times out may or may not have happened:
    the ref store reads the key back and reports what is there, never the error
    of an update that took effect."""
    backend = MemoryBackend(object_store_semantics=True)
    refs = RefStore(backend)
    refs.init_head(MAIN)
    refs.set_if_equals(MAIN, None, A, "base")
    real = backend.compare_and_swap

    def timeout(key: str, expected: Version | None, data: Buffer) -> Version:
        if lands:
            real(key, expected, data)
        raise BackendError(f"{key}: timed out", key=key, transient=True)

    backend.compare_and_swap = timeout  # type: ignore[method-assign]
    if lands:
        refs.set_if_equals(MAIN, A, B, "landed")
        assert refs.read(MAIN) == B
        assert moves(refs, MAIN)[0] == (A, B, "landed")
    else:
        with pytest.raises(StorageError, match=rf"^{MAIN}: timed out: {MAIN} is unchanged$"):
            refs.set_if_equals(MAIN, A, B, "lost")
        assert refs.read(MAIN) == A
        assert [m[2] for m in moves(refs, MAIN)] == ["base"]


def _race_process(root: str, rounds: int, mine: str, start: object, out: object) -> None:
    refs = RefStore(LocalBackend(Path(root)))
    start.wait()  # type: ignore[attr-defined]
    wins = 0
    for i in range(rounds):
        try:
            refs.set_if_equals(f"refs/heads/r{i}", None, mine, f"by {mine[:4]}")
            wins += 1
        except RefConflictError:
            pass
    out.put(wins)  # type: ignore[attr-defined]


def test_two_processes_racing_on_local_give_one_winner_per_ref(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    root.mkdir()
    RefStore(LocalBackend(root)).init_head(MAIN)
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    rounds = 40
    procs = [ctx.Process(target=_race_process, args=(str(root), rounds, v, start, out)) for v in (A, B)]
    for p in procs:
        p.start()
    start.set()
    wins = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sum(wins) == rounds
    refs = RefStore(LocalBackend(root))
    values = refs.list_refs()
    assert len(values) == rounds and set(values.values()) <= {A, B}
    for name, value in values.items():
        assert moves(refs, name) == [(None, value, f"by {value[:4]}")]
    assert sorted(os.listdir(root / "refs" / "heads")) == sorted(f"r{i}" for i in range(rounds))  # no temporaries


def test_prune_log_round_trip(backend: Backend) -> None:
    log = PruneLog(backend)
    assert log.records() == {}
    assert log.add([A, B, A], "keep_last=1") == 2
    assert log.add([B, C], "keep_best=loss:min:1") == 1
    records = log.records()
    assert set(records) == {A, B, C}
    assert (records[A].policy, records[B].policy, records[C].policy) == (
        "keep_last=1",
        "keep_last=1",
        "keep_best=loss:min:1",
    )
    assert records[A].time_ns == records[B].time_ns <= records[C].time_ns
    assert isinstance(records[A], PruneRecord)
    assert PruneLog(backend).records() == records  # what a second opener sees
    assert log.add([], "nothing") == 0


def test_the_local_layout_is_the_documented_one(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    root.mkdir()
    refs = RefStore.local(root)
    refs.init_head(MAIN)
    refs.set_if_equals(MAIN, None, A, "commit: one")
    refs.set_if_equals("refs/heads/x/y", None, B, "branch")
    refs.delete_if_equals("refs/heads/x/y", B, "branch: deleted")
    PruneLog.local(root).add([A], "p")
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
    assert files == [
        "HEAD", "logs", "logs/HEAD", "logs/refs", "logs/refs/heads", "logs/refs/heads/main", "pruned.jsonl",
        "pruned.lock", "refs", "refs.lock", "refs/heads", "refs/heads/main",
    ]  # fmt: skip
    assert (root / "HEAD").read_bytes() == b"ref: refs/heads/main\n"
    assert (root / MAIN).read_bytes() == (A + "\n").encode()
    line = (root / "logs" / MAIN).read_bytes()
    time_ns = json.loads(line)["time_ns"]
    assert line == f'{{"message": "commit: one", "new": "{A}", "old": null, "time_ns": {time_ns}}}\n'.encode()


def test_the_object_store_layout_is_keys_per_entry_and_tombstones() -> None:
    backend = MemoryBackend(object_store_semantics=True)
    refs = RefStore(backend)
    refs.init_head(MAIN)
    refs.set_if_equals(MAIN, None, A, "commit: one")
    refs.set_if_equals(MAIN, A, B, "commit: two")
    refs.set_if_equals("refs/tags/v1", None, A, "tag: v1")
    refs.delete_if_equals("refs/tags/v1", A, "tag: deleted")
    PruneLog(backend).add([A], "p")
    keys = list(backend.list(""))
    entries = [k for k in keys if k.startswith("logs/")]
    assert [k.rsplit("/", 1)[0] for k in entries] == ["logs/HEAD", "logs/HEAD", f"logs/{MAIN}", f"logs/{MAIN}"]
    assert all(k.rsplit("/", 1)[1].startswith("~") for k in entries)
    others = [k for k in keys if not k.startswith("logs/")]
    assert others[0] == "HEAD" and others[2:] == [MAIN, "refs/tags/v1"]
    assert others[1].startswith("pruned/~")
    assert backend.get("refs/tags/v1") == b""  # the tombstone: a deletion by compare-and-swap
    assert refs.read("refs/tags/v1") is None and refs.list_refs() == {MAIN: B}
    assert not any("lock" in k for k in keys)


def test_a_listed_ref_that_reads_as_absent_is_read_again_then_refused() -> None:
    """On an object store a ref key is never removed (deletion writes a tombstone): a
    key the listing shows but a GET does not find (a store catching up, a failed
    read) is read again, then a transient BackendError, never a branch silently
    missing from a fetch (the torture suite's 404-listed fault)."""
    backend = MemoryBackend(object_store_semantics=True)
    refs = RefStore(backend)
    refs.set_if_equals("refs/heads/main", None, "a" * 64, "test")
    misses = {"n": 0}
    original = backend.get_versioned

    def flaky(key: str) -> tuple[bytes, Version] | None:
        if key == "refs/heads/main" and misses["n"] > 0:
            misses["n"] -= 1
            return None
        return original(key)

    backend.get_versioned = flaky  # type: ignore[method-assign]
    misses["n"] = 1
    assert refs.list_refs() == {"refs/heads/main": "a" * 64}
    misses["n"] = 2
    with pytest.raises(BackendError, match="listed but reads as absent") as info:
        refs.list_refs()
    assert info.value.transient
    refs.delete_if_equals("refs/heads/main", "a" * 64, "test")
    assert refs.list_refs() == {}  # a tombstone: deleted, no error
