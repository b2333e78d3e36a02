"""Remotes through the API, on a directory remote and on a bucket-like memory
remote (no rename, appends or locks): round trips bit-exact, exact byte counts,
fast-forward rules, a lost race, corrupt and unknown remotes, resumed fetches."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_state_equal

import ckvc
from ckvc.errors import (
    CorruptObjectError,
    NonFastForwardError,
    RefConflictError,
    UnknownRemoteError,
    UnsupportedFormatError,
)
from ckvc.fsck import run_fsck
from ckvc.gc import mark
from ckvc.remote import fetch as fetch_module
from ckvc.remote.common import pack_framing, toc_copy_size
from ckvc.remote.location import forget_memory_remote, open_backend
from ckvc.remote.repository import Remote, open_remote
from ckvc.storage import packs
from ckvc.storage.backend import Backend
from ckvc.storage.packs import RECORD_HEADER_SIZE, read_toc

CHUNK = 16 << 10


def state(step: int, base: int = 0) -> dict[str, Any]:
    """A state that drifts a little per step (deltas against keyframes) plus a fresh tensor."""
    g = torch.Generator().manual_seed(base)
    w = torch.randn(96, 96, generator=g)
    w += 0.001 * step
    return {"w": w, "b": torch.full((40, 40), float(step + base)), "step": step}


def history(repo: ckvc.Repo, n: int = 3) -> list[str]:
    ids = [repo.commit(state(i), message=f"epoch {i}", metrics={"loss": 1.0 / (i + 1)}) for i in range(n)]
    repo.tag("v1", ids[1])
    repo.tag("best", ids[-1], message="the best one")
    repo.branch("dev", ids[0])
    repo.switch("dev")
    ids.append(repo.commit(state(9, base=7), message="on dev"))
    repo.switch("main")
    return ids


def new_repo(tmp_path: Path, name: str) -> ckvc.Repo:
    return ckvc.Repo.init(tmp_path / name, chunk_size=CHUNK)


def opened(repo: ckvc.Repo, name: str = "origin") -> Remote:
    return open_remote(repo.core, repo.remotes.get(name))


def reachable(repo: ckvc.Repo) -> set[bytes]:
    live: set[bytes] = set()
    mark(repo.core, live, set(), reflog_expiry_s=0)
    return live


def stored_size(repo: ckvc.Repo, oids: set[bytes]) -> int:
    return sum(repo.store.stat(oid).stored_size for oid in oids)


def remote_pack_sizes(remote: Remote) -> dict[str, int]:
    return {name: remote.backend.size(f"packs/{name}") for name in remote.core.store.packs()}


def assert_same_history(a: ckvc.Repo, b: ckvc.Repo) -> None:
    commits_a = {c.id: c for c in a.iter_reachable_commits(a.ref_tips(include_reflogs=False))}
    commits_b = {c.id: c for c in b.iter_reachable_commits(b.ref_tips(include_reflogs=False))}
    assert commits_a.keys() == commits_b.keys()
    for oid, c in commits_a.items():
        assert commits_b[oid] == c  # message, metrics, parents, tree: the same object
        assert_state_equal(a.load(oid), b.load(oid))


def test_round_trip_push_clone_fetch_pull(tmp_path: Path, url: str) -> None:
    a = new_repo(tmp_path, "a")
    ids = history(a)
    a.remotes.add("origin", url)
    pushed = a.push("origin", ["main", "dev"], tags=True)
    assert {u.ref for u in pushed.updated} == {"refs/heads/main", "refs/heads/dev", "refs/tags/v1", "refs/tags/best"}
    assert a.remote_branches() == {"origin/main": ids[2], "origin/dev": ids[3]}
    b = ckvc.Repo.clone(url, tmp_path / "b")
    assert_same_history(a, b)
    assert b.branches() == {"main": ids[2]} and b.head() == ("main", ids[2])
    assert b.remote_branches() == {"origin/main": ids[2], "origin/dev": ids[3]}
    assert b.tags() == a.tags() and b.tag_object("best") == a.tag_object("best")
    assert b.resolve("origin/dev") == ids[3]
    assert [e.new for e in b.reflog("refs/remotes/origin/main")] == [ids[2]]
    # one more commit on each side of the round trip
    a.commit(state(5), message="epoch 5")
    a.push()
    pulled = b.pull()
    assert pulled.fast_forward and b.head() == a.head()
    assert_same_history(a, b)
    for repo in (a, b):
        assert repo.fsck().ok
    remote = opened(a)
    try:
        assert run_fsck(remote.core).ok
    finally:
        remote.close()
    a.close()
    b.close()


def test_push_sends_exactly_the_stored_records(tmp_path: Path, url: str) -> None:
    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", url)
    live = reachable(a)
    full = a.push("origin", ["main", "dev"], tags=True)
    remote = opened(a)
    try:
        sizes = remote_pack_sizes(remote)
        counts = {name: len(remote.core.store.pack_entries(name)[0]) for name in sizes}
    finally:
        remote.close()
    assert full.stats.objects == len(live)
    assert full.stats.record_bytes == stored_size(a, live)
    copies = sum(map(toc_copy_size, counts.values()))  # each pack's TOC copy, beside it
    assert full.bytes_sent - copies == sum(sizes.values())
    assert sum(sizes.values()) == full.stats.record_bytes + sum(map(pack_framing, counts.values()))
    # one more commit: only its new records
    a.commit(state(3), message="epoch 3")
    new = reachable(a) - live
    more = a.push()
    assert more.stats.objects == len(new) and more.stats.record_bytes == stored_size(a, new)
    new_chunks = sum(1 for oid in new if a.store.stat(oid).kind == 1)
    # two packs: the chunks, then the metadata (published after them)
    assert more.stats.packs == 2
    framing = sum(pack_framing(n) + toc_copy_size(n) for n in (new_chunks, len(new) - new_chunks))
    assert more.bytes_sent == more.stats.record_bytes + framing
    # unchanged: no pack at all
    again = a.push("origin", ["main", "dev"], tags=True)
    assert again.stats.packs == 0 and again.bytes_sent == 0 and not again.updated
    assert sorted(again.up_to_date) == ["refs/heads/dev", "refs/heads/main", "refs/tags/best", "refs/tags/v1"]
    a.close()


def test_fetch_receives_exactly_what_is_missing(tmp_path: Path, url: str) -> None:
    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", url)
    a.push("origin", ["main", "dev"], tags=True)
    b = ckvc.Repo.clone(url, tmp_path / "b")
    a.commit(state(4), message="epoch 4")
    new = reachable(a) - reachable(b)
    a.push()
    got = b.fetch()
    assert got.stats.objects == len(new) and got.bytes_received == stored_size(a, new) == stored_size(b, new)
    assert b.fetch().stats.objects == 0  # nothing new: nothing moves
    a.close()
    b.close()


def test_non_fast_forward_is_refused_and_force_moves(tmp_path: Path, url: str) -> None:
    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", url)
    a.push()
    b = ckvc.Repo.clone(url, tmp_path / "b")
    theirs = b.commit(state(7, base=3), message="b's work")
    b.push()
    mine = a.commit(state(8, base=4), message="a's work")
    with pytest.raises(NonFastForwardError, match="not an ancestor") as info:
        a.push()
    assert isinstance(info.value, RefConflictError) and info.value.exit_code == NonFastForwardError.exit_code
    assert a.ls_remote()["refs/heads/main"] == theirs
    forced = a.push(force=True)
    assert forced.updated[0].forced and a.ls_remote()["refs/heads/main"] == mine
    with pytest.raises(NonFastForwardError, match="diverged"):
        b.pull()
    assert b.head()[1] == theirs  # nothing moved
    a.push("origin", ["v1"])
    a.delete_tag("v1")
    a.tag("v1", mine)
    with pytest.raises(NonFastForwardError, match="already exists"):
        a.push("origin", ["v1"])
    assert a.push("origin", ["v1"], force=True).updated[0].new == mine
    a.close()
    b.close()


def test_racing_pushers_one_wins_nothing_lost(tmp_path: Path, url: str) -> None:
    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", url)
    a.push()
    b = ckvc.Repo.clone(url, tmp_path / "b")
    a_tip = a.commit(state(11, base=5), message="a")
    b_tip = b.commit(state(12, base=6), message="b")
    calls: list[int] = []

    def b_pushes_meanwhile(done: int, total: int) -> None:
        # a has uploaded its packs and read the ref; b moves it before a's swap
        if done == total and total and not calls:
            calls.append(1)
            b.push()

    with pytest.raises(RefConflictError) as info:
        a.push(progress=b_pushes_meanwhile)
    assert not isinstance(info.value, NonFastForwardError)  # the swap itself lost
    assert str(info.value).startswith(f"origin ({url}): refs/heads/main moved")  # names the remote
    assert str(info.value).endswith("nothing was lost: fetch, then push again")
    assert a.ls_remote()["refs/heads/main"] == b_tip
    assert a.head()[1] == a_tip and a.fsck().ok  # the loser keeps its commit
    # what a uploaded stays; a second attempt (on another branch) sends nothing more
    a.branch("a-work", a_tip)
    again = a.push("origin", ["a-work"])
    assert again.stats.objects == 0 and again.updated[0].new == a_tip
    c = ckvc.Repo.clone(url, tmp_path / "c")
    assert c.remote_branches() == {"origin/main": b_tip, "origin/a-work": a_tip}
    assert_state_equal(c.load(a_tip), a.load(a_tip))
    for repo in (a, b, c):
        repo.close()


def flip_byte_in_a_chunk(url: str, endpoint: str | None = None, among: set[bytes] | None = None) -> str:
    """Flip one payload byte of a chunk record (one of ``among``, if given) in a
    remote pack; returns the pack's key."""
    backend = open_backend(url, endpoint=endpoint)
    for key in backend.list("packs/"):
        if not key.endswith(".pack"):
            continue
        entries = read_toc(backend, key)
        assert entries is not None
        chunks = [
            e
            for e in entries
            if e.kind == 1 and e.record_size > RECORD_HEADER_SIZE + 64 and (among is None or e.oid in among)
        ]
        if chunks:
            data = bytearray(backend.get(key) or b"")
            data[chunks[0].offset + RECORD_HEADER_SIZE + 40] ^= 0x10
            backend.put(key, bytes(data))
            return key
    raise AssertionError("no chunk record found")


def test_corrupt_remote_object_is_named_and_nothing_is_stored(tmp_path: Path, url: str) -> None:
    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", url)
    a.push()
    key = flip_byte_in_a_chunk(url)
    with pytest.raises(CorruptObjectError) as info:
        ckvc.Repo.clone(url, tmp_path / "b")
    assert "remote origin" in str(info.value) and key in str(info.value) and info.value.object_id
    assert not (tmp_path / "b").exists()  # a failed clone leaves nothing
    c = new_repo(tmp_path, "c")
    c.remotes.add("origin", url)
    with pytest.raises(CorruptObjectError, match="content does not match"):
        c.fetch()
    bad = bytes.fromhex(str(info.value.object_id))
    assert not c.store.has(bad) and c.remote_branches() == {} and c.fsck().ok
    assert not any(c.store.has(oid) for oid in reachable(a) if a.store.stat(oid).kind != 1)  # no metadata
    a.close()
    c.close()


def test_truncated_remote_pack_is_named(tmp_path: Path, url: str) -> None:
    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", url)
    a.push()
    backend = open_backend(url)
    key = next(k for k in backend.list("packs/") if k.endswith(".pack"))
    data = backend.get(key) or b""
    backend.put(key, data[: len(data) // 2])
    c = new_repo(tmp_path, "c")
    c.remotes.add("origin", url)
    with pytest.raises(CorruptObjectError) as info:
        c.fetch()
    assert "remote origin" in str(info.value) and key in str(info.value)
    assert c.remote_branches() == {} and c.fsck().ok
    a.close()
    c.close()


def test_unknown_remote_format_version_is_refused(tmp_path: Path, url: str) -> None:
    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", url)
    a.push()
    backend = open_backend(url)
    config = json.loads(backend.get("config.json") or b"")
    config["format_version"] = 99
    backend.put("config.json", json.dumps(config).encode())
    before = a.refs.list_refs()
    with pytest.raises(UnsupportedFormatError, match="99"):
        ckvc.Repo.clone(url, tmp_path / "b")
    with pytest.raises(UnsupportedFormatError, match="99"):
        a.fetch()
    a.commit(state(6), message="more")
    with pytest.raises(UnsupportedFormatError, match="99"):
        a.push()
    with pytest.raises(UnsupportedFormatError, match="99"):
        a.ls_remote()
    assert not (tmp_path / "b").exists() and a.refs.list_refs("refs/remotes/") == {
        k: v for k, v in before.items() if k.startswith("refs/remotes/")
    }
    a.close()


def test_interrupted_fetch_keeps_what_it_verified(tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", url)
    a.push("origin", ["main", "dev"], tags=True)
    b = new_repo(tmp_path, "b")
    b.remotes.add("origin", url)

    def killed(self: Any) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(fetch_module.Fetch, "write_metadata", killed)
        with pytest.raises(KeyboardInterrupt):
            b.fetch()
    chunks = {oid for oid in reachable(a) if a.store.stat(oid).kind == 1}
    assert all(b.store.has(oid) for oid in chunks) and b.remote_branches() == {}
    resumed = b.fetch()
    metadata = reachable(a) - chunks
    assert resumed.stats.objects == len(metadata) and resumed.bytes_received == stored_size(a, metadata)
    assert_same_history(a, b)
    a.close()
    b.close()


def test_unknown_remote_and_missing_repository(tmp_path: Path) -> None:
    a = new_repo(tmp_path, "a")
    history(a)
    with pytest.raises(UnknownRemoteError, match="no remote named 'nope'"):
        a.push("nope")
    a.remotes.add("empty", str(tmp_path / "nothing"))
    with pytest.raises(UnknownRemoteError, match="holds no ckvc repository"):
        a.fetch("empty")
    assert not (tmp_path / "nothing").exists()
    a.remotes.remove("empty")
    assert a.remotes.list() == []
    a.close()


def test_remove_remote_drops_tracking_refs_and_catalog(tmp_path: Path, url: str) -> None:
    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", url)
    a.push()
    assert a.remote_branches() and (a.dir / "remotes" / "origin").is_dir()
    a.remotes.remove("origin")
    assert a.remote_branches() == {} and not (a.dir / "remotes" / "origin").exists()
    a.close()


def test_pruned_commits_travel_as_history_without_data(tmp_path: Path, url: str) -> None:
    from ckvc.errors import PrunedCommitError
    from ckvc.retention_policy import RetentionPolicy

    a = new_repo(tmp_path, "a")
    ids = [a.commit(state(i, base=i), message=f"epoch {i}") for i in range(3)]
    a.retain(RetentionPolicy(keep_last=1))
    a.gc(now=True)
    assert set(a.pruned()) == set(ids[:2])
    a.remotes.add("origin", url)
    pushed = a.push()
    assert pushed.stats.objects == len(reachable(a))  # pruned commits: the commit objects alone
    b = ckvc.Repo.clone(url, tmp_path / "b")
    assert [c.id for c in b.log()] == ids[::-1] and set(b.pruned()) == set(ids[:2])
    with pytest.raises(PrunedCommitError):
        b.load(ids[0])
    assert_state_equal(b.load(ids[2]), a.load(ids[2]))
    remote = opened(a)
    try:
        assert set(remote.core.pruned()) == set(ids[:2]) and run_fsck(remote.core).ok
    finally:
        remote.close()
    assert b.fsck().ok
    a.close()
    b.close()


def test_a_prune_record_left_by_an_interrupted_push_does_not_hide_a_later_whole_push(tmp_path: Path, url: str) -> None:
    """A push killed after writing a commit's prune record but before the commit
    leaves the record behind. When the same commit later arrives whole (pushed by
    a repository that kept its data), the record no longer covers it: clones fetch
    its data and remote gc keeps it, so nothing acknowledged is lost."""
    a = new_repo(tmp_path, "a")
    ids = [a.commit(state(i, base=i), message=f"epoch {i}") for i in range(2)]
    a.remotes.add("origin", url)
    a.push()
    a.commit(state(2, base=2), message="epoch 2")
    tip = a.head()[1]
    assert tip is not None
    remote = opened(a)
    try:  # what the interrupted push of a repository that pruned ``tip`` left: its record alone
        remote.core.prune_log.add([tip], "keep_last=1")
    finally:
        remote.close()
    a.push()  # the whole commit, from a repository that kept its data
    b = ckvc.Repo.clone(url, tmp_path / "b")
    assert tip not in b.pruned()
    assert_state_equal(b.load(tip), a.load(tip))
    done = a.gc_remote(now=True)
    assert done.executed
    c = ckvc.Repo.clone(url, tmp_path / "c")
    for commit in [*ids, tip]:
        assert_state_equal(c.load(commit), a.load(commit))
    assert c.fsck().ok and a.fsck_remote().ok
    for repo in (a, b, c):
        repo.close()


def test_fetch_requests_do_not_grow_with_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A history pushed at once is one chunk pack and one metadata pack: fetching it
    costs the same requests for 2 commits as for 8 (coalesced reads per pack)."""
    # every pack larger than the tail read: header, tail and TOC are three reads for both
    monkeypatch.setattr(packs, "TAIL_READ", 64)
    requests = []
    for n in (2, 8):
        url = f"memory://hist{n}-{uuid.uuid4().hex[:8]}"
        a = new_repo(tmp_path, f"a{n}")
        for i in range(n):
            a.commit(state(i, base=i), message=f"epoch {i}")
        a.remotes.add("origin", url)
        assert a.push().stats.packs == 2
        b = new_repo(tmp_path, f"b{n}")
        b.remotes.add("origin", url)
        got = b.fetch()
        assert got.stats.objects == len(reachable(a))
        requests.append(got.stats.requests)
        a.close()
        b.close()
        forget_memory_remote(url)
    assert requests[0] == requests[1]


def test_two_threads_pushing_one_ref(tmp_path: Path, url: str) -> None:
    import threading

    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", url)
    a.push()
    b = ckvc.Repo.clone(url, tmp_path / "b")
    tips = {"a": a.commit(state(21, base=8), message="a"), "b": b.commit(state(22, base=9), message="b")}
    barrier = threading.Barrier(2)
    errors: dict[str, BaseException] = {}

    def pusher(name: str, repo: ckvc.Repo) -> None:
        barrier.wait()
        try:
            repo.push()
        except BaseException as exc:
            errors[name] = exc

    threads = [threading.Thread(target=pusher, args=item) for item in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (loser,) = errors
    winner = "b" if loser == "a" else "a"
    assert isinstance(errors[loser], RefConflictError)
    assert a.ls_remote()["refs/heads/main"] == tips[winner]
    assert (a if loser == "a" else b).head()[1] == tips[loser]  # the loser's commit stays
    remote = opened(a)
    try:
        assert run_fsck(remote.core).ok
    finally:
        remote.close()
    a.close()
    b.close()


def test_metadata_over_several_packs_goes_up_parents_first(
    tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the metadata does not fit in one pack, its packs go up one at a time, a
    commit after its parents (with a merge among them) and a tag after the tag it
    names, so a push killed between two packs leaves only complete history."""
    from ckvc.remote import push as push_module

    a = new_repo(tmp_path, "a")
    ids = history(a)
    merged = a.commit(state(5), message="merge", merge=[ids[-1]])
    a.tag("again", "best", message="a tag of a tag")
    a.remotes.add("origin", url)
    a.push("origin", ["dev"])  # makes the remote (with a real pack size) and sends dev's first commit
    a.core.config.max_pack_size = 1  # then every record its own pack (in memory only, never saved)
    calls: list[list[bytes]] = []
    real = push_module.upload_packs

    def recording(source: Any, target: Any, groups: list[Any], *args: Any) -> None:
        calls.append([item.oid for group in groups for item in group])
        real(source, target, groups, *args)

    monkeypatch.setattr(push_module, "upload_packs", recording)
    a.push("origin", ["main", "dev"], tags=True)
    position = {oid: i for i, call in enumerate(calls) for oid in call}
    sent = [oid for oid in (bytes.fromhex(c) for c in [*ids, merged]) if oid in position]
    assert len(sent) == 3  # epochs 1 and 2 and the merge: dev (epoch 0 and "on dev") went first
    for oid in sent:
        commit = a.read_commit(oid.hex())
        assert len(calls[position[oid]]) == 1  # alone in its publication step
        assert position[bytes.fromhex(commit.tree)] < position[oid]
        # each parent went up before it, or was on the remote already
        assert all(position.get(bytes.fromhex(p), -1) < position[oid] for p in commit.parents)
    outer = bytes.fromhex(a.refs.read("refs/tags/again") or "")
    inner = bytes.fromhex(a.read_tag(outer.hex()).target)
    assert position[inner] < position[outer]
    a.close()


def test_two_first_pushes_agree_on_one_repository_id(tmp_path: Path, url: str) -> None:
    """Creating the remote twice (two first pushes racing) keeps the first config:
    one repository id, which both catalogs then use."""
    from ckvc.config import RepoConfig
    from ckvc.remote.repository import create_layout

    a, b = new_repo(tmp_path, "a"), new_repo(tmp_path, "b")
    backend = open_backend(url)
    try:
        create_layout(backend, a.core.config)
        first = RepoConfig.load(backend).repo_id
        create_layout(backend, b.core.config)  # the loser of the race
        assert RepoConfig.load(backend).repo_id == first
        a.commit(state(0), message="a0")
        a.remotes.add("origin", url)
        a.push()  # onto the layout made in the race
        assert RepoConfig.load(backend).repo_id == first
    finally:
        backend.close()
        a.close()
        b.close()


@pytest.mark.parametrize("damage", ["magic", "version"])
def test_a_bad_pack_header_is_caught_by_the_first_read(
    tmp_path: Path, url: str, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The catalog leaves a large pack's header for the first read of its records
    (a clone streams them from offset 0): a damaged or unknown header is still
    refused there, naming the remote and the key, and nothing is stored."""
    from ckvc.errors import UnsupportedFormatError

    monkeypatch.setattr(packs, "TAIL_READ", 64)  # every pack "large": headers left for the reads
    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", url)
    a.push()
    backend = open_backend(url)
    key = max((k for k in backend.list("packs/") if k.endswith(".pack")), key=lambda k: len(backend.get(k) or b""))
    data = bytearray(backend.get(key) or b"")
    if damage == "magic":
        data[0] ^= 0xFF
    else:
        data[8:12] = (packs.PACK_VERSION + 1).to_bytes(4, "little")
    backend.put(key, bytes(data))
    c = new_repo(tmp_path, "c")
    c.remotes.add("origin", url)
    expected = CorruptObjectError if damage == "magic" else UnsupportedFormatError
    with pytest.raises(expected) as info:
        c.fetch()
    assert key.removeprefix("packs/").removesuffix(".pack") in str(info.value)
    assert c.remote_branches() == {} and c.fsck().ok
    assert not any(c.store.has(oid) for oid in reachable(a))
    a.close()
    c.close()


def pushed_history(tmp_path: Path, url: str) -> tuple[ckvc.Repo, list[str], Backend]:
    """``history`` in a new repository, every branch and tag pushed to ``url``:
    (the repository, its commits, the remote's backend)."""
    a = new_repo(tmp_path, "a")
    ids = history(a)
    a.remotes.add("origin", url)
    a.push("origin", ["main", "dev"], tags=True)
    return a, ids, open_backend(url)


def test_toc_copies_build_the_catalog_without_reading_the_packs(
    tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each pushed pack has its TOC copy beside it (FORMAT.md 18.1.1), and a clone
    builds its catalog from the copies alone: no pack is read for its TOC."""
    a, ids, backend = pushed_history(tmp_path, url)
    pack_keys = sorted(k for k in backend.list("packs/") if k.endswith(".pack"))
    for key in pack_keys:
        pack, copy = backend.get(key) or b"", backend.get(key + ".toc") or b""
        assert copy and pack.endswith(copy) and packs.parse_toc_copy(copy) == (read_toc(backend, key), len(pack))
    read_from_packs: list[str] = []
    original = packs.read_pack_index

    def reading(backend: Backend, key: str, **kwargs: Any) -> packs.PackIndex:
        read_from_packs.append(key)
        return original(backend, key, **kwargs)

    monkeypatch.setattr(packs, "read_pack_index", reading)
    b = ckvc.Repo.clone(url, tmp_path / "b")
    assert read_from_packs == []
    assert_same_history(a, b)
    for commit in ids:
        assert_state_equal(b.load(commit), a.load(commit))
    assert b.fsck().ok and b.fsck_remote().ok
    a.close()
    b.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "missing"])
def test_a_damaged_or_missing_toc_copy_costs_only_a_read_of_the_pack(tmp_path: Path, url: str, damage: str) -> None:
    a, ids, backend = pushed_history(tmp_path, url)
    copies = sorted(k for k in backend.list("packs/") if k.endswith(".pack.toc"))
    for key in copies:
        copy = backend.get(key) or b""
        if damage == "garbage":
            backend.put(key, bytes(len(copy)))
        elif damage == "truncated":
            backend.put(key, copy[:-7])
        else:
            backend.delete(key)
    b = ckvc.Repo.clone(url, tmp_path / "b")
    for commit in ids:
        assert_state_equal(b.load(commit), a.load(commit))
    report = b.fsck_remote()
    assert report.ok  # a copy that does not parse is ignored: a warning, no error
    kinds = {p.kind for p in report.problems}
    assert kinds == (set() if damage == "missing" else {"bad-toc-copy"})
    a.close()
    b.close()


def test_a_toc_copy_of_another_pack_is_refused_and_named(tmp_path: Path, url: str) -> None:
    """A copy that parses but describes another pack sends reads astray: the fetch
    fails with CorruptObjectError naming the remote and the pack, nothing stored,
    and fsck of the remote names the copy."""
    a, _, backend = pushed_history(tmp_path, url)
    first, second = sorted(k for k in backend.list("packs/") if k.endswith(".pack.toc"))[:2]
    one, other = backend.get(first) or b"", backend.get(second) or b""
    backend.put(first, other)
    backend.put(second, one)
    c = new_repo(tmp_path, "c")
    c.remotes.add("origin", url)
    with pytest.raises(CorruptObjectError) as info:
        c.fetch()
    assert "remote origin" in str(info.value) and "packs/" in str(info.value)
    assert c.remote_branches() == {} and c.fsck().ok
    assert not any(c.store.has(oid) for oid in reachable(a))
    report = a.fsck_remote()
    assert not report.ok and {p.kind for p in report.problems if p.severity == "error"} == {"bad-toc-copy"}
    # The catalog did not keep what the bad copy said: with the copies deleted (what
    # fsck says to do), the same repository's next fetch reads the packs' own TOCs.
    backend.delete(first)
    backend.delete(second)
    c.fetch()
    assert c.remote_branches() == a.remote_branches() and c.fsck().ok
    a.close()
    c.close()


def test_push_verifies_what_it_sends_and_sends_no_local_damage(tmp_path: Path, url: str) -> None:
    """A chunk damaged in a local pack (bit rot) is caught before it leaves: push
    raises CorruptObjectError naming the local pack and the object, and no remote
    ref moves, so the backup never names damaged data."""
    import os

    a = new_repo(tmp_path, "a")
    history(a)
    a.remotes.add("origin", url)
    name = next(n for n in a.store.packs() if any(e.kind == 1 for e in a.store.pack_entries(n)[0]))
    victim = max((e for e in a.store.pack_entries(name)[0] if e.kind == 1), key=lambda e: e.record_size)
    path = a.dir / "packs" / name
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[victim.offset + RECORD_HEADER_SIZE + 5] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptObjectError) as info:
        a.push("origin", ["main", "dev"], tags=True)
    assert f"local packs/{name}" in str(info.value) and info.value.object_id == victim.oid.hex()
    assert not any(k.startswith("refs/") for k in a.ls_remote("origin"))
    assert a.remote_branches() == {}
    a.close()


def test_a_damaged_local_delta_base_is_named_as_local_not_as_the_remotes(tmp_path: Path, url: str) -> None:
    """Fetching deltas whose bases are here reads those bases from the local store;
    a damaged one is this repository's damage: the error says so (not the remote,
    whose data is fine), and nothing new is stored."""
    import os

    from ckvc.codecs.codec_ids import WHOLE_CODECS

    a = ckvc.Repo.init(tmp_path / "a")  # default chunks: large enough for deltas
    first = {"w": torch.randn(256, 256, generator=torch.Generator().manual_seed(5))}
    a.commit(first, message="epoch 0")
    a.remotes.add("origin", url)
    a.push()
    b = ckvc.Repo.clone(url, tmp_path / "b")
    first["w"][0, :8] += 1.0  # a few values: the new chunk is a delta against the one b holds
    a.commit(first, message="a few weights moved")
    assert any(e.codec not in WHOLE_CODECS for _, e in a.store.index.iter_entries() if e.kind == 1)
    a.push()
    for name in b.store.packs():  # every whole chunk here damaged: whichever base the fetch reads
        path = b.dir / "packs" / name
        os.chmod(path, 0o644)
        data = bytearray(path.read_bytes())
        for e in b.store.pack_entries(name)[0]:
            if e.kind == 1 and e.codec in WHOLE_CODECS and e.record_size > RECORD_HEADER_SIZE + 8:
                data[e.offset + RECORD_HEADER_SIZE + 3] ^= 0x10
        path.write_bytes(bytes(data))
    before = b.remote_branches()
    with pytest.raises(CorruptObjectError) as info:
        b.fetch()
    assert "local delta base" in str(info.value) and "remote origin" not in str(info.value)
    assert b.remote_branches() == before
    a.close()
    b.close()
