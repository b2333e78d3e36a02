"""Remote gc (ckvc.remote.gc; docs/DESIGN.md, "Remote gc"): exactly the packs
nothing live needs go, young packs stay, dry runs change nothing, and pushes
racing a gc, in the interleavings that matter (forced through hooks), lose
nothing a ref reaches. On a directory remote, a bucket-like memory remote and
(a few tests) the S3 server of tests/s3server.py."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import assert_state_equal

import ckvc
from ckvc.cli import cli
from ckvc.errors import RepositoryLockedError
from ckvc.remote import gc as remote_gc
from ckvc.remote import push as push_module
from ckvc.remote.gc import gc_remote
from ckvc.remote.location import forget_memory_remote, open_backend
from ckvc.remote.repository import open_remote
from ckvc.storage.backend import Backend

CHUNK = 16 << 10
HAS_S3 = all(importlib.util.find_spec(m) is not None for m in ("obstore", "moto"))


@dataclass
class Where:
    url: str
    endpoint: str | None = None


def local_where(kind: str, tmp_path: Path) -> Iterator[Where]:
    if kind == "dir":
        yield Where(str(tmp_path / "remote"))
        return
    name = f"memory://g{uuid.uuid4().hex[:12]}"
    yield Where(name)
    forget_memory_remote(name)


@pytest.fixture(params=["dir", "memory"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Where]:
    yield from local_where(request.param, tmp_path)


@pytest.fixture(params=["dir", "memory", "s3"])
def where_s3(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Where]:
    if request.param == "s3":
        if not HAS_S3:
            pytest.skip("the remote and test extras (obstore, moto) are not installed")
        server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        yield Where(f"s3://{bucket}/models", server.endpoint)
        return
    yield from local_where(request.param, tmp_path)


def state(step: int, base: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(base)
    return {"w": torch.randn(64, 64, generator=g) + 0.001 * step, "b": torch.full((30, 30), float(step + base))}


def packs(backend: Backend) -> dict[str, int]:
    """Published packs of a remote: key -> bytes."""
    out = {}
    for key in backend.list("packs/"):
        info = backend.stat(key) if key.endswith(".pack") else None
        if info is not None:
            out[key] = info.size
    return out


@dataclass
class Setup:
    a: ckvc.Repo  # pushed main (c0, c1) and side (s1), then deleted side on the remote
    b: ckvc.Repo  # a clone from before the deletion: it has s1
    where: Where
    backend: Backend
    main: list[str]
    s1: str
    dead: dict[str, int]  # the packs side's push sent: nothing live needs them


def setup(tmp_path: Path, where: Where) -> Setup:
    a = ckvc.Repo.init(tmp_path / "a", chunk_size=CHUNK)
    a.remotes.add("origin", where.url, endpoint=where.endpoint)
    main = [a.commit(state(0), message="c0"), a.commit(state(1), message="c1")]
    a.push()
    backend = open_backend(where.url, endpoint=where.endpoint)
    before = packs(backend)
    a.branch("side", main[0])
    a.switch("side")
    s1 = a.commit(state(5, base=3), message="s1")
    a.switch("main")
    a.push("origin", ["side"])
    dead = {k: v for k, v in packs(backend).items() if k not in before}
    assert len(dead) == 2  # its chunks, then its metadata
    b = ckvc.Repo.clone(where.url, tmp_path / "b", endpoint=where.endpoint)
    remote = open_remote(a.core, a.remotes.get("origin"))
    try:
        remote.core.refs.delete_if_equals("refs/heads/side", s1, "test: side deleted")
    finally:
        remote.close()
    return Setup(a, b, where, backend, main, s1, dead)


def remote_fsck_ok(repo: ckvc.Repo) -> bool:
    report = repo.fsck_remote()
    return bool(report.ok)


def check_clone(tmp_path: Path, s: Setup, commits: dict[str, ckvc.Repo]) -> None:
    """A fresh clone checks out each commit bit-exact against the repository that made it."""
    c = ckvc.Repo.clone(s.where.url, tmp_path / f"c{uuid.uuid4().hex[:6]}", endpoint=s.where.endpoint)
    try:
        c.fetch()
        for commit, maker in commits.items():
            assert_state_equal(c.load(commit), maker.load(commit))
        assert c.fsck().ok
    finally:
        c.close()


def close(s: Setup) -> None:
    s.a.close()
    s.b.close()


def test_gc_deletes_exactly_the_dead_packs(tmp_path: Path, where_s3: Where) -> None:
    s = setup(tmp_path, where_s3)
    listing = packs(s.backend)
    dry = s.a.gc_remote(dry_run=True, now=True)
    assert not dry.executed and packs(s.backend) == listing  # nothing deleted
    assert dry.count("delete") == 2 and dry.bytes_to_delete == sum(s.dead.values())
    done = s.a.gc_remote(now=True)
    assert done.executed and done.packs_deleted == 2 and done.bytes_freed == sum(s.dead.values())
    assert done.kept_revived == []
    assert packs(s.backend) == {k: v for k, v in listing.items() if k not in s.dead}
    assert not [k for k in s.backend.list("packs/") if "retired" in k or k.endswith(".trash")]
    # the TOC copies went with their packs: one beside each pack left, no other
    copies = {k.removesuffix(".toc") for k in s.backend.list("packs/") if k.endswith(".pack.toc")}
    assert copies == set(packs(s.backend))
    assert not list(s.backend.list("locks/"))  # every lease (pushes' pins, gc's locks) released
    assert remote_fsck_ok(s.a)
    check_clone(tmp_path, s, {c: s.a for c in s.main})
    again = s.a.gc_remote(now=True)
    assert again.packs_deleted == 0 and again.bytes_freed == 0
    assert json.loads(json.dumps(done.to_json()))["bytes_freed"] == sum(s.dead.values())
    close(s)


def test_young_packs_are_kept(tmp_path: Path, where: Where) -> None:
    s = setup(tmp_path, where)
    listing = packs(s.backend)
    kept = s.a.gc_remote(grace_s=3600)  # everything was just pushed
    assert kept.count("young") == len(listing) and kept.packs_deleted == 0
    assert packs(s.backend) == listing
    close(s)


def test_grace_is_per_pack_and_a_kept_pack_keeps_what_it_needs(tmp_path: Path) -> None:
    """A young dead pack stays, and so does an old one it needs (presence means
    closure): s1's metadata is young, its chunks old; a later push that stops at
    s1 on the remote then still names complete data."""
    s = setup(tmp_path, Where(str(tmp_path / "remote")))
    root = Path(s.where.url)
    old = time.time() - 7200
    meta = max(s.dead, key=lambda k: (root / k).stat().st_mtime_ns)  # published after the chunks
    for key in packs(s.backend):
        if key != meta:
            os.utime(root / key, (old, old))
    report = s.a.gc_remote(grace_s=3600)
    assert report.count("young") == 1 and report.packs_deleted == 0
    assert packs(s.backend).keys() >= s.dead.keys()
    # now all old: both go
    os.utime(root / meta, (old, old))
    gone = s.a.gc_remote(grace_s=3600)
    assert gone.packs_deleted == 2 and gone.bytes_freed == sum(s.dead.values())
    close(s)


def s2_on_s1(s: Setup) -> str:
    """b builds on s1, which the remote holds but nothing there reaches."""
    s.b.branch("side2", s.s1)
    s.b.switch("side2")
    return s.b.commit(state(7, base=4), message="s2")


def test_push_between_plan_and_delete_revives_what_it_needs(tmp_path: Path, where_s3: Where) -> None:
    s = setup(tmp_path, where_s3)
    s2 = s2_on_s1(s)
    pushed: list[Any] = []

    def hook(stage: str) -> None:
        if stage == "planned":  # gc found s1's packs dead; b pushes s2, stopping its walk at s1
            pushed.append(s.b.push("origin", ["side2"]))

    report = gc_remote(s.a.core, now=True, hook=hook)
    assert pushed[0].stats.objects > 0
    assert sorted(report.kept_revived) == sorted(k.rpartition("/")[2] for k in s.dead)
    assert report.packs_deleted == 0
    assert remote_fsck_ok(s.a)
    check_clone(tmp_path, s, {s2: s.b, s.s1: s.a, s.main[1]: s.a})
    close(s)


def test_push_in_flight_holds_off_the_delete(tmp_path: Path, where_s3: Where) -> None:
    """b has uploaded everything and not yet moved its ref when gc plans: gc
    waits for b's pin, then sees the ref and deletes nothing b needs."""
    s = setup(tmp_path, where_s3)
    s2 = s2_on_s1(s)
    planned = threading.Event()
    reports: list[Any] = []
    errors: list[BaseException] = []

    def hook(stage: str) -> None:
        if stage == "planned":
            planned.set()

    def run_gc() -> None:
        try:
            reports.append(gc_remote(s.a.core, now=True, hook=hook))
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)
            planned.set()

    worker = threading.Thread(target=run_gc)

    def progress(done: int, total: int) -> None:
        if done == total and total and not worker.is_alive() and not reports:
            worker.start()
            assert planned.wait(60)

    pushed = s.b.push("origin", ["side2"], progress=progress)
    worker.join(120)
    assert not errors and reports
    report = reports[0]
    # doomed at planning: s1's packs and b's uploads (no ref named them yet); all spared
    assert report.packs_deleted == 0 and len(report.kept_revived) == len(s.dead) + pushed.stats.packs
    assert remote_fsck_ok(s.a)
    check_clone(tmp_path, s, {s2: s.b, s.s1: s.a})
    close(s)


def test_push_whose_catalog_predates_the_gc_resends_what_gc_deleted(
    tmp_path: Path, where: Where, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b opens the remote (its catalog lists s1's packs), then a whole gc runs and
    deletes them, then b pins: it must refresh and send s1 again."""
    s = setup(tmp_path, where)
    s2 = s2_on_s1(s)
    real_open = push_module.open_remote
    freed: list[int] = []

    def open_then_gc(*args: Any, **kwargs: Any) -> Any:
        handle = real_open(*args, **kwargs)
        if not freed:
            freed.append(s.a.gc_remote(now=True).packs_deleted)
        return handle

    monkeypatch.setattr(push_module, "open_remote", open_then_gc)
    pushed = s.b.push("origin", ["side2"])
    assert freed == [2]
    assert pushed.stats.objects > 0
    assert remote_fsck_ok(s.a)
    check_clone(tmp_path, s, {s2: s.b, s.s1: s.a, s.main[0]: s.a})
    close(s)


def test_two_gcs_at_once_the_second_is_refused(tmp_path: Path, where_s3: Where) -> None:
    s = setup(tmp_path, where_s3)
    listing = packs(s.backend)
    refused: list[BaseException] = []

    def hook(stage: str) -> None:
        if stage == "planned":
            with pytest.raises(RepositoryLockedError) as info:
                s.b.gc_remote(now=True)
            refused.append(info.value)
            assert packs(s.backend) == listing  # the refused one deleted nothing

    report = gc_remote(s.a.core, now=True, hook=hook)
    assert refused and report.packs_deleted == 2
    assert remote_fsck_ok(s.a)
    close(s)


def test_cli_gc_remote(tmp_path: Path, where: Where) -> None:
    s = setup(tmp_path, where)
    listing = packs(s.backend)
    runner = CliRunner()
    args = ["-C", str(tmp_path / "a"), "gc", "--remote", "origin", "--now"]
    dry = runner.invoke(cli, [*args, "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    body = json.loads(dry.output)
    assert body["packs_to_delete"] == 2 and body["bytes_to_delete"] == sum(s.dead.values())
    assert not body["executed"] and packs(s.backend) == listing
    young = runner.invoke(cli, ["-C", str(tmp_path / "a"), "gc", "--remote", "origin", "--grace", "1h", "--json"])
    assert young.exit_code == 0, young.output
    assert json.loads(young.output)["packs_in_grace_period"] == len(listing) and packs(s.backend) == listing
    done = runner.invoke(cli, args)
    assert done.exit_code == 0, done.output
    assert "2 packs deleted" in done.output
    missing = runner.invoke(cli, ["-C", str(tmp_path / "a"), "gc", "--remote", "nowhere"])
    assert missing.exit_code != 0 and "nowhere" in missing.output
    close(s)


def test_a_gc_killed_before_deleting_is_finished_by_the_next(
    tmp_path: Path, where: Where, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after retiring (record or trash written, packs not deleted): the
    remote is whole meanwhile and the next gc deletes what the first retired."""
    s = setup(tmp_path, where)
    listing = packs(s.backend)
    with monkeypatch.context() as m:
        m.setattr(remote_gc, "purge_retired", lambda store: None)
        first = gc_remote(s.a.core, now=True)
    assert first.packs_deleted == 2
    assert remote_fsck_ok(s.a)
    check_clone(tmp_path, s, {c: s.a for c in s.main})
    dry = gc_remote(s.a.core, now=True, dry_run=True)
    assert dry.count("delete") == 0 and dry.bytes_to_delete == dry.leftover_bytes == sum(s.dead.values())
    second = gc_remote(s.a.core, now=True)
    assert second.packs_deleted == 0 and second.bytes_freed == sum(s.dead.values())  # the leftovers
    assert packs(s.backend) == {k: v for k, v in listing.items() if k not in s.dead}
    assert not [k for k in s.backend.list("packs/") if "retired" in k or k.endswith(".trash")]
    # the TOC copies went with their packs: one beside each pack left, no other
    copies = {k.removesuffix(".toc") for k in s.backend.list("packs/") if k.endswith(".pack.toc")}
    assert copies == set(packs(s.backend))
    close(s)


def test_an_interrupted_push_keeps_what_its_young_packs_need(tmp_path: Path) -> None:
    """b's push of s2 (on the dead s1) dies after uploading, before its ref: its
    packs are young, s1's old. gc keeps s1's packs for them, so b's retry, whose
    walk stops at s2 already on the remote, moves a ref to complete data."""
    s = setup(tmp_path, Where(str(tmp_path / "remote")))
    s2 = s2_on_s1(s)
    old = time.time() - 7200
    for key in packs(s.backend):
        os.utime(Path(s.where.url) / key, (old, old))

    def die(done: int, total: int) -> None:
        if done == total and total:
            raise KeyboardInterrupt  # killed between the uploads and the ref move

    with pytest.raises(KeyboardInterrupt):
        s.b.push("origin", ["side2"], progress=die)
    report = s.a.gc_remote(grace_s=3600)
    assert report.packs_deleted == 0 and report.count("young") == 2
    retry = s.b.push("origin", ["side2"])
    assert retry.stats.objects == 0  # all of s2 was there, and what it needs too
    assert remote_fsck_ok(s.a)
    check_clone(tmp_path, s, {s2: s.b, s.s1: s.a})
    close(s)


@pytest.mark.skipif(not HAS_S3, reason="the remote and test extras (obstore, moto) are not installed")
def test_a_lapsed_lease_stops_gc_and_push_before_anything_changes(
    tmp_path: Path, s3_server: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder whose lease may have expired (its renewals failed) cannot know that
    no one else took the lock: gc retires nothing and push moves no ref."""
    from ckvc.storage import leases

    s = setup(tmp_path, Where(f"s3://{s3_bucket}/models", s3_server.endpoint))
    before = packs(s.backend)
    with monkeypatch.context() as patched:
        patched.setattr(leases._Renewer, "_valid_from", lambda self, written: written - 1.0)
        with pytest.raises(RepositoryLockedError, match="lapsed while held"):
            s.a.gc_remote("origin", now=True)
        assert packs(s.backend) == before  # nothing retired, nothing deleted
        tip = s.a.commit(state(9), message="c2")
        with pytest.raises(RepositoryLockedError, match="lapsed while held"):
            s.a.push()
        assert s.a.ls_remote()["refs/heads/main"] == s.main[-1]  # the ref did not move
    assert s.a.push().updated[0].new == tip  # with the lease standing, both go through
    assert s.a.gc_remote("origin", now=True).packs_deleted == len(s.dead)
    assert remote_fsck_ok(s.a)


def test_gc_refusing_over_damage_names_the_remote(tmp_path: Path, url: str) -> None:
    """torture remote: gc --remote over a deleted pack refused without saying which
    remote; it names it and points at fsck --remote."""
    from ckvc.errors import CorruptObjectError
    from ckvc.remote.repository import open_remote

    repo = ckvc.Repo.init(tmp_path / "a")
    repo.commit({"w": torch.zeros(100)}, message="one")
    repo.remotes.add("origin", url)
    repo.push()
    handle = open_remote(repo.core, repo.remotes.get("origin"))
    try:
        for pack in [k for k in handle.backend.list("packs/") if k.endswith(".pack")]:
            handle.backend.delete(pack)
    finally:
        handle.close()
    with pytest.raises(CorruptObjectError) as info:
        repo.gc_remote("origin", now=True)
    assert str(info.value).startswith(f"origin ({url}): gc refuses to run")
    assert str(info.value).endswith("run `ckvc fsck --remote origin`")
    repo.close()
