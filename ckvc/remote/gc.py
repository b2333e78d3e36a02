"""Remote gc: delete the packs of a remote that nothing live needs, safe against
concurrent pushes (docs/DESIGN.md, "Remote gc").

A remote is a bare repository (``core.Repository`` over its Backend, its index
the local catalog), so marking, the lock protocol, retirement and deletion are
ckvc.gc's; what differs is what counts as live:

- **Presence means closure** (FORMAT 18.2): a pusher stops its walk at the first
  object the remote holds. So every object gc keeps must keep what it needs,
  not only what the refs reach: a dead commit in a pack gc keeps (it shares the
  pack with live objects, or is young) keeps its history and data. Live is the
  fixpoint of "reachable from the refs and recent reflogs, or needed by an
  object in a pack gc keeps".
- **Liveness is per id**, not per copy: another client's catalog may name any
  copy of a duplicated object, so a pack goes only when none of its ids is live.
- **Whole packs only**: a repack would download and upload live data; a pack
  with any live object stays.

Concurrent pushes: a pusher holds the remote's writer pin (gc.lock shared,
leases on an object store) from its catalog refresh until its refs have moved.
gc plans without a lock, then takes the lock exclusively (no push between its
walk and its ref move), refreshes its catalog, re-marks from the refs as they
are now and from every pack it keeps (packs pushed meanwhile included), spares
any doomed pack that became live, and retires the rest in one record (or
renames them to trash) before releasing the lock: a push that pins afterwards
refreshes its catalog, no longer sees them, and sends their objects again. The
retired packs are deleted after the lock. Packs younger than the grace period
are never touched (writers that do not follow the protocol).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ckvc import graph, retention
from ckvc.core import Repository
from ckvc.errors import CorruptObjectError, InvalidInputError, ObjectNotFoundError, after_landing, storage_errors
from ckvc.gc import CRITICAL_SECTION_TIMEOUT_S, mark, pack_contents, purge_retired, retire_packs, retired_leftovers
from ckvc.ids import ObjectType
from ckvc.inspect import fields_json
from ckvc.pruned import hollow_snapshots, remote_released
from ckvc.remote.common import remotes_of
from ckvc.remote.repository import Remote, open_remote
from ckvc.retention_policy import RetentionPolicy
from ckvc.storage.packs import RecordInfo

# Stages a test hook sees: "planned" (plan made, no lock held), "retired" (the
# exclusive section is over, the retired packs not yet deleted).
Hook = Callable[[str], None]


@dataclass
class RemotePack:
    name: str
    size: int
    # "delete", "keep", "young" (inside the grace period), "unreadable", "new" (pushed
    # while gc planned: kept, and what it needs is live)
    action: str
    entries: list[RecordInfo] = field(repr=False)

    @property
    def oids(self) -> list[bytes]:
        return [e.oid for e in self.entries]


@dataclass
class RemoteGcReport:
    remote: str
    url: str
    grace_s: float
    dry_run: bool
    live_objects: int = 0
    packs: list[RemotePack] = field(default_factory=list)
    leftover_bytes: int = 0  # what an earlier gc retired and did not finish deleting
    executed: bool = False
    packs_deleted: int = 0
    bytes_freed: int = 0
    kept_revived: list[str] = field(default_factory=list)  # doomed at planning, needed by the time of deleting
    seconds: float = 0.0
    critical_section_s: float = 0.0
    requests: int = 0

    def count(self, action: str) -> int:
        return sum(1 for p in self.packs if p.action == action)

    @property
    def bytes_to_delete(self) -> int:
        return self.leftover_bytes + sum(p.size for p in self.packs if p.action == "delete")

    def to_json(self) -> dict[str, Any]:
        return {
            **fields_json(self, skip=("packs",)),
            "packs": len(self.packs),
            "packs_to_delete": self.count("delete"),
            "bytes_to_delete": self.bytes_to_delete,
            "packs_in_grace_period": self.count("young"),
            "packs_unreadable": self.count("unreadable"),
        }


def mark_needed(core: Repository, roots: Iterable[bytes], live: set[bytes], visited: set[str]) -> set[bytes]:
    """Add to ``live`` what the objects ``roots`` need for "presence means closure":
    a commit its history (and the data of unpruned commits), a tag its target, a
    snapshot its chunks, a chunk its delta bases. Returns the ids added. What
    cannot be read is skipped: these objects are dead, and damage is fsck's."""
    pruned = core.pruned()
    store = core.store
    commits: list[str] = []
    snapshots: list[bytes] = []
    chunks: list[bytes] = []
    for oid in roots:
        try:
            kind = store.stat(oid).kind
        except (ObjectNotFoundError, CorruptObjectError):
            continue
        if kind in (ObjectType.COMMIT, ObjectType.TAG):
            commits.append(oid.hex())
        elif kind == ObjectType.SNAPSHOT:
            snapshots.append(oid)
        else:
            chunks.append(oid)

    hollow = hollow_snapshots(pruned)  # needed through an unreleased commit only, never by presence
    found = graph.closure(
        graph.StoredObjects(core),
        commits,
        snapshots=[oid for oid in snapshots if oid not in hollow],
        chunks=chunks,
        have=live.__contains__,
        pruned=remote_released(pruned, store.has),
        on_error=graph.skip_unreadable,
        visited=visited,
    ).ids()
    live |= found
    return found


def _classify(packs: list[RemotePack], live: set[bytes]) -> None:
    for pack in packs:
        if pack.action in ("delete", "keep"):
            pack.action = "keep" if any(oid in live for oid in pack.oids) else "delete"


def _settle(core: Repository, packs: list[RemotePack], live: set[bytes], visited: set[str]) -> None:
    """Grow ``live`` until every object of every pack kept has what it needs."""
    rooted: set[str] = set()
    while True:
        _classify(packs, live)
        kept = [p for p in packs if p.action in ("keep", "young", "new") and p.name not in rooted]
        if not kept:
            return
        rooted.update(p.name for p in kept)
        mark_needed(core, (oid for p in kept for oid in p.oids if oid not in live), live, visited)


def _read_pack(remote: Remote, name: str, now: float, grace_s: float) -> RemotePack:
    store = remote.core.store
    if name in remote.damaged:
        return RemotePack(name, 0, "unreadable", [])
    try:
        info, entries, from_toc = pack_contents(store, name)
    except (CorruptObjectError, ObjectNotFoundError):
        return RemotePack(name, 0, "unreadable", [])
    # Anything else (a BackendError once the retries are spent, an OSError) aborts
    # the gc: a pack read as empty would keep nothing of what it needs alive.
    if not from_toc:  # published packs have their TOC: never delete what gc cannot read whole
        return RemotePack(name, info.size, "unreadable", [])
    action = "young" if now - info.mtime < grace_s else "delete"
    return RemotePack(name, info.size, action, entries)


@dataclass
class GcMarks:
    live: set[bytes] = field(default_factory=set)
    visited: set[str] = field(default_factory=set)  # commits walked


def plan_remote_gc(remote: Remote, *, grace_s: float, reflog_expiry_s: float) -> tuple[RemoteGcReport, GcMarks]:
    """The packs of ``remote`` and what gc would do with each. Writes nothing."""
    core = remote.core
    core.store.refresh()
    report = RemoteGcReport(remote.spec.name, remote.spec.url, grace_s, dry_run=True)
    marks = GcMarks()
    mark(core, marks.live, marks.visited, reflog_expiry_s=reflog_expiry_s, remote=True)
    now = time.time()
    report.packs = [_read_pack(remote, name, now, grace_s) for name in core.store.packs()]
    _settle(core, report.packs, marks.live, marks.visited)
    report.live_objects = len(marks.live)
    report.leftover_bytes = sum(size for _, size in retired_leftovers(core.store))
    return report, marks


def _execute(remote: Remote, report: RemoteGcReport, marks: GcMarks, reflog_expiry_s: float, hook: Hook | None) -> None:
    core = remote.core
    store = core.store
    live, visited = marks.live, marks.visited
    doomed = {p.name for p in report.packs if p.action == "delete"}
    before = "gc deleted nothing; the remote is unchanged"
    with store.exclusive(CRITICAL_SECTION_TIMEOUT_S):
        entered = time.perf_counter()
        with storage_errors("running gc on the remote", before):
            # Pushes that finished while we planned moved refs or published packs:
            # their packs are kept and their needs live (presence means closure).
            store.refresh()
            known = {p.name for p in report.packs}
            now = time.time()
            for name in store.packs():
                if name not in known:
                    pack = _read_pack(remote, name, now, report.grace_s)
                    if pack.action != "unreadable":
                        pack.action = "new"
                    report.packs.append(pack)
            mark(core, live, visited, reflog_expiry_s=reflog_expiry_s, remote=True)
            _settle(core, report.packs, live, visited)
            removed = [p for p in report.packs if p.action == "delete"]
            report.kept_revived = sorted(doomed - {p.name for p in removed})
            # the exclusive lease must still stand, or a push may have pinned and counted on these packs
            remote.backend.check_locks_held()
            store.index.swap_packs([], [(p.name, p.entries) for p in removed])
        report.executed = True
        done = f"gc retired {len(removed)} packs of {remote.spec.name}; the next gc deletes any left behind"
        with after_landing(done):
            retire_packs(store, [p.name for p in removed])
        report.critical_section_s = time.perf_counter() - entered
    report.packs_deleted = len(removed)
    if hook is not None:
        hook("retired")
    with after_landing(done):
        purge_retired(store)
    report.bytes_freed = report.leftover_bytes + sum(p.size for p in removed)


def gc_remote(
    local: Repository,
    remote: str = "origin",
    *,
    dry_run: bool = False,
    now: bool = False,
    grace_s: float | None = None,
    hook: Hook | None = None,
) -> RemoteGcReport:
    """Delete the packs of ``remote`` that nothing live needs (``Repo.gc_remote``).
    ``grace_s``: packs younger than this are kept (default: the remote's
    ``gc_grace_s``); ``now``: no grace period. One gc at a time per remote
    (RepositoryLockedError at once for a second one)."""
    started = time.perf_counter()
    spec = remotes_of(local).get(remote)
    handle = open_remote(local, spec)
    try:
        config = handle.core.config
        grace = 0.0 if now else (config.gc_grace_s if grace_s is None else grace_s)
        with (
            storage_errors("running gc on the remote", "gc deleted nothing; the remote is unchanged"),
            handle.core.store.locks.one_gc(),
        ):
            report, marks = plan_remote_gc(handle, grace_s=grace, reflog_expiry_s=config.reflog_expiry_s)
            report.dry_run = dry_run
            if hook is not None:
                hook("planned")
            if not dry_run:
                _execute(handle, report, marks, config.reflog_expiry_s, hook)
        report.requests = handle.backend.requests
    except CorruptObjectError as exc:  # damage gc will not run over: say where, and how to look
        said = str(exc).replace("run `ckvc fsck`", f"run `ckvc fsck --remote {spec.name}`")
        raise CorruptObjectError(f"{spec.name} ({spec.url}): {said}") from None
    finally:
        handle.close()
    report.seconds = time.perf_counter() - started
    return report


def retain_remote(
    local: Repository, remote: str = "origin", policy: RetentionPolicy | None = None, *, dry_run: bool = False
) -> retention.RetentionPlan:
    """Retention on a remote (``ckvc retain --remote``): ``policy`` (default: the local
    repository's stored one) over the remote's own branches, tags and HEAD, the
    released commits recorded in its prune log as its own retention's (FORMAT 17),
    so that ``gc --remote`` frees their data whatever pushed it. History stays."""
    policy = policy or retention.stored_policy(local)
    if policy is None:
        raise InvalidInputError("no retention policy given or stored (ckvc retain --remote NAME --keep-last N ...)")
    spec = remotes_of(local).get(remote)
    handle = open_remote(local, spec)
    try:
        with storage_errors(f"applying retention on {spec.name} ({spec.url})", "no commit was marked as pruned"):
            return retention.retain(handle.core, policy, dry_run=dry_run, remote=True)
    finally:
        handle.close()
