"""Garbage collection: keep what refs, recent reflog entries and unpruned commits
reach; delete the rest; repack packs that are mostly garbage.

Plan and execute are separate. Execution has three steps:

1. (no lock) copy the live objects of mostly-dead packs into new packs, verified;
2. (exclusive gc lock: waits for in-flight writers, which hold it shared, and
   blocks new ones) re-mark from the refs as they are now, so anything a commit
   made or deduplicated against meanwhile stays; swap the index in one LMDB
   transaction; retire the removed packs: rename them to ``*.trash`` where the
   backend renames, else write one record naming them (object stores);
3. (no lock) delete the trash, or the packs the records name and then the records.

Every file operation goes through the store's Backend.

A crash anywhere leaves every reachable object readable: before the index
transaction the old packs are untouched; after it the new copies are indexed
and durable. Leftovers (unindexed copies, trash, temporary packs) are reclaimed
by the next gc.

The index transaction is also gc's point of no return for errors: an OS error
before it is a typed StorageError with nothing deleted; one after it (renaming
to trash, unlinking, fsync) is a DurabilityWarning, since the index already
dropped those packs and the next gc removes what is left.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckvc import graph
from ckvc.errors import CkvcError, CorruptObjectError, ObjectNotFoundError, after_landing, storage_errors
from ckvc.ids import ObjectType
from ckvc.inspect import fields_json
from ckvc.pruned import local_released, remote_released
from ckvc.storage.backend import Backend, KeyInfo
from ckvc.storage.object_store import RETIRED_PREFIX, RETIRED_SUFFIX, ObjectStore
from ckvc.storage.packs import PACK_DIR, TMP_SUFFIX, PackWriter, RecordInfo, pack_key, parse_record

if TYPE_CHECKING:
    from ckvc.core import Repository

TRASH_SUFFIX = ".trash"
CRITICAL_SECTION_TIMEOUT_S = 600.0


@dataclass
class PackPlan:
    name: str
    size: int
    live_bytes: int
    action: str  # "keep", "delete", "repack", "young" (inside the grace period), "unreadable"
    entries: list[RecordInfo] = field(repr=False)
    live: list[RecordInfo] = field(repr=False)


@dataclass
class GcPlan:
    grace_s: float
    repack_threshold: float
    live_objects: int = 0
    live_bytes: int = 0
    packs: list[PackPlan] = field(default_factory=list)
    # *.trash, stale *.pack.tmp and (object stores) retirement records an earlier gc left
    leftovers: list[str] = field(default_factory=list)
    leftover_bytes: int = 0
    live: set[bytes] = field(default_factory=set, repr=False)
    visited: set[str] = field(default_factory=set, repr=False)
    # What only reflog entries younger than reflog_expiry keep ("reflog expire" frees it)
    reflog_commits: int = 0
    reflog_bytes: int = 0

    @property
    def reclaimable_bytes(self) -> int:
        total = self.leftover_bytes
        for p in self.packs:
            if p.action == "delete":
                total += p.size
            elif p.action == "repack":
                total += p.size - p.live_bytes
        return total

    @property
    def grace_bytes(self) -> int:
        """Dead bytes in packs younger than the grace period (``gc --now`` takes them):
        a whole pack nothing needs, else its dead records."""
        young = [p for p in self.packs if p.action == "young"]
        return sum(p.size if not p.live_bytes else sum(e.record_size for e in p.entries) - p.live_bytes for p in young)

    def count(self, action: str) -> int:
        return sum(1 for p in self.packs if p.action == action)

    def to_json(self) -> dict[str, Any]:
        return {
            "live_objects": self.live_objects,
            "live_bytes": self.live_bytes,
            "reclaimable_bytes": self.reclaimable_bytes,
            "packs": len(self.packs),
            "packs_to_delete": self.count("delete"),
            "packs_to_repack": self.count("repack"),
            "packs_in_grace_period": self.count("young"),
            "grace_bytes": self.grace_bytes,
            "reflog_commits": self.reflog_commits,
            "reflog_bytes": self.reflog_bytes,
            "leftover_files": len(self.leftovers),
            "grace_s": self.grace_s,
            "repack_threshold": self.repack_threshold,
        }


@dataclass
class GcReport:
    plan: GcPlan
    executed: bool = False
    bytes_freed: int = 0
    packs_deleted: int = 0
    packs_repacked: int = 0
    packs_written: int = 0
    objects_copied: int = 0
    kept_revived: list[str] = field(default_factory=list)  # packs spared: a writer revived objects in them
    seconds: float = 0.0
    critical_section_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {**self.plan.to_json(), **fields_json(self, skip=("plan",))}


def _tips(repo: Repository, reflog_expiry_s: float) -> tuple[list[str], list[str]]:
    """(commits refs and HEAD name, commits recent reflog entries name)."""
    damaged: list[str] = []
    ref_tips = list(dict.fromkeys(graph.ref_tips(repo, include_reflogs=False, damaged=damaged).values()))
    if damaged:
        raise CorruptObjectError(f"gc refuses to run with damaged refs ({damaged[0]}); run `ckvc fsck`")
    # A stray file under refs/ (an invalid name such as main.lock) is no ref, but
    # the id it holds may be all that keeps a commit: keep it, where it exists.
    ref_tips += [s.value for s in repo.refs.stray_refs() if s.value and repo.store.has(bytes.fromhex(s.value))]
    since = time.time_ns() - int(reflog_expiry_s * 1e9)
    return ref_tips, list(dict.fromkeys(repo.refs.iter_reflog_ids(since_ns=since)))


def mark(
    repo: Repository, live: set[bytes], visited: set[str], *, reflog_expiry_s: float, remote: bool = False,
    reflog_only: set[bytes] | None = None,
) -> set[bytes]:  # fmt: skip
    """Add to ``live`` every object reachable from the refs and recent reflog
    entries: commit and tag objects always, snapshots and chunks of unpruned
    commits, a delta chunk with its whole base chain. Commits in ``visited`` are
    not walked again (incremental re-mark). Returns the ids newly added. Refuses
    to go on past a missing or corrupt reachable object: its ancestors would look
    dead. ``remote``: a prune record covers only a commit whose snapshot is absent
    (FORMAT 18.2: on a remote, a present snapshot came with a whole push of that
    commit, after the record). ``reflog_only`` gets the ids only reflog entries
    keep (what ``reflog expire`` would let gc free)."""
    pruned = repo.pruned()
    store = repo.store

    def have(oid: bytes) -> bool:
        # marked already, or a chunk a promisor remote holds: nothing local to keep
        if oid in live:
            return True
        promised = None if store.has(oid) else store.promised_size(oid)
        return promised is not None and promised[0] == ObjectType.CHUNK

    released = remote_released(pruned, store.has) if remote else local_released(pruned)

    def refuse(oid: str, role: ObjectType, exc: ObjectNotFoundError | CorruptObjectError) -> None:
        raise CorruptObjectError(
            f"gc refuses to run: reachable object {oid} is unreadable ({exc}); run `ckvc fsck`"
        ) from None

    def skip_removed(oid: str, role: ObjectType, exc: ObjectNotFoundError | CorruptObjectError) -> None:
        if role != ObjectType.COMMIT or store.has(bytes.fromhex(oid)):
            refuse(oid, role, exc)

    ref_tips, reflog_tips = _tips(repo, reflog_expiry_s)
    added: set[bytes] = set()
    # Refs first, strictly; then what only reflogs reach, where a commit an
    # earlier gc removed (its entry had expired then) is simply gone.
    for tips, on_error in ((ref_tips, refuse), (reflog_tips, skip_removed)):
        found = graph.closure(
            graph.StoredObjects(repo), tips, have=have, pruned=released, on_error=on_error, visited=visited
        ).ids()
        live |= found
        added |= found
        if reflog_only is not None and tips is reflog_tips:
            reflog_only |= found
    return added


def collect_garbage(
    repo: Repository, *, dry_run: bool = False, now: bool = False, grace_s: float | None = None
) -> GcReport:
    """Delete what nothing reachable needs and repack mostly-dead packs (``Repo.gc``).
    ``now`` skips the grace period (only when nothing else is writing)."""
    if not dry_run:
        repo.require_writable("running gc")
    grace = 0.0 if now else (repo.config.gc_grace_s if grace_s is None else grace_s)
    expiry = repo.config.reflog_expiry_s
    # One gc at a time (store.locks.one_gc). OS errors up to gc's index swap
    # delete nothing (execute_gc says what happened after it).
    with (
        storage_errors("running gc", "gc deleted nothing; the repository is unchanged"),
        repo.store.locks.one_gc(),
    ):
        plan = plan_gc(repo, grace_s=grace, repack_threshold=repo.config.repack_threshold, reflog_expiry_s=expiry)
        return GcReport(plan) if dry_run else execute_gc(repo, plan, reflog_expiry_s=expiry)


def plan_gc(repo: Repository, *, grace_s: float, repack_threshold: float, reflog_expiry_s: float) -> GcPlan:
    """Decide what to delete and repack. Writes nothing."""
    store = repo.store
    store.refresh()  # every sealed pack indexed: a live object always has an index entry
    plan = GcPlan(grace_s=grace_s, repack_threshold=repack_threshold)
    reflog_only: set[bytes] = set()
    mark(repo, plan.live, plan.visited, reflog_expiry_s=reflog_expiry_s, reflog_only=reflog_only)
    plan.live_objects = len(plan.live)
    for oid in reflog_only:
        entry = store.index.get(oid)
        if entry is not None:  # absent: a chunk a promisor remote holds, nothing local
            plan.reflog_commits += entry.kind == ObjectType.COMMIT
            plan.reflog_bytes += entry.record_size
    now = time.time()
    for name in store.packs():
        try:
            info, entries, _ = pack_contents(store, name)
        except (CkvcError, OSError):
            plan.packs.append(PackPlan(name, 0, 0, "unreadable", [], []))
            continue
        live = [e for e in entries if e.oid in plan.live and store.index.location(e.oid) == (name, e.offset)]
        live_bytes = sum(e.record_size for e in live)
        record_bytes = sum(e.record_size for e in entries)  # the live share ignores header, TOC and footer
        plan.live_bytes += live_bytes
        if now - info.mtime < grace_s:
            action = "young"
        elif not live:
            action = "delete"
        elif live_bytes < repack_threshold * record_bytes:
            action = "repack"
        else:
            action = "keep"
        plan.packs.append(PackPlan(name, info.size, live_bytes, action, entries, live))
    for tmp in store.temporaries():
        if now - tmp.mtime >= grace_s:
            plan.leftovers.append(tmp.key.rpartition("/")[2])
            plan.leftover_bytes += tmp.size
    for key, size in retired_leftovers(store):
        plan.leftovers.append(key.rpartition("/")[2])
        plan.leftover_bytes += size
    return plan


def pack_contents(store: ObjectStore, name: str) -> tuple[KeyInfo, list[RecordInfo], bool]:
    """(size and mtime, entries, from_toc) of pack ``name``, as both gcs plan by;
    ObjectNotFoundError when it is gone."""
    info = store.pack_info(name)
    if info is None:
        raise ObjectNotFoundError(f"pack {name} is missing")
    return (info, *store.pack_entries(name))


def retired_leftovers(store: ObjectStore) -> list[tuple[str, int]]:
    """(key, bytes it still holds) of what earlier gc runs retired and did not
    finish deleting: trash files, or retirement records with the packs they name."""
    backend = store.backend
    if backend.capabilities.atomic_rename:
        found = []
        for key in backend.list(f"{PACK_DIR}/", recursive=False):
            info = backend.stat(key) if key.endswith(TRASH_SUFFIX) else None
            if info is not None:
                found.append((key, info.size))
        return found
    named = store.retired_packs()
    held = sum(info.size for info in (store.pack_info(n) for n in named) if info is not None)
    records = store.retirement_records()
    return [(key, held if i == 0 else 0) for i, key in enumerate(records)]


def retire_packs(store: ObjectStore, names: list[str]) -> None:
    """Take removed packs out of the listing at once, for deletion after the
    critical section: a rename to trash, or on a backend that cannot rename, one
    record naming them (pack enumeration skips what a record names); made durable."""
    backend = store.backend
    if backend.capabilities.atomic_rename:
        for name in names:
            backend.rename(pack_key(name), pack_key(name + TRASH_SUFFIX))
    elif names:
        backend.put(pack_key(f"{RETIRED_PREFIX}{uuid.uuid4().hex}{RETIRED_SUFFIX}"), "\n".join(names).encode())
    backend.sync(f"{PACK_DIR}/")  # the renames (or the record) durable before anything is deleted


def purge_retired(store: ObjectStore) -> None:
    """Delete what retirement left: the trash, or the packs each record names and
    then the record; then the TOC copies of packs that are gone."""
    backend = store.backend
    if backend.capabilities.atomic_rename:
        for key in list(backend.list(f"{PACK_DIR}/", recursive=False)):
            if key.endswith(TRASH_SUFFIX):
                _unlink(backend, key)
    else:
        for record in store.retirement_records():
            data = backend.get(record) or b""
            for name in data.decode(errors="replace").split("\n"):
                if name:
                    _unlink(backend, pack_key(name))
            _unlink(backend, record)
    for key in store.pack_listing().orphan_copies:  # a remote's, once its pack is gone (listed after the deletes)
        _unlink(backend, key)
    backend.sync(f"{PACK_DIR}/")


def copy_verified(
    store: ObjectStore, packs: list[tuple[str, list[RecordInfo]]], max_pack_size: int
) -> tuple[list[tuple[str, list[RecordInfo]]], set[bytes], set[str]]:
    """Copy the given records of packs into new sealed packs, verifying each
    (gc's repack, fsck --repair's rewrite of damaged packs). Returns (new packs,
    copied ids, packs a record of which failed its check)."""
    new_packs: list[tuple[str, list[RecordInfo]]] = []
    copied: set[bytes] = set()
    failed: set[str] = set()
    writer: PackWriter | None = None
    try:
        for name, records in packs:
            for e in records:
                try:
                    record = parse_record(store.reader.read(name, e.offset, e.record_size), e.record_size)
                    if record.oid != e.oid:
                        raise CorruptObjectError("record holds a different object than the index says")
                    store.verify(e.oid)  # decodes through any delta chain and checks the id
                except (CkvcError, ValueError):
                    failed.add(name)  # never drop the only copy of a damaged object
                    continue
                if writer is None:
                    writer = PackWriter(store.backend)
                writer.append(record.oid, record.kind, record.codec, record.raw_size, record.payload, record.base)
                copied.add(e.oid)
                if writer.size >= max_pack_size:
                    writer.seal()
                    new_packs.append((writer.name, writer.entries))
                    writer = None
        if writer is not None:
            writer.seal()
            new_packs.append((writer.name, writer.entries))
            writer = None
    except BaseException:
        if writer is not None:
            writer.abort()  # sealed copies stay: unindexed, the next gc deletes them
        raise
    return new_packs, copied, failed


def execute_gc(repo: Repository, plan: GcPlan, *, reflog_expiry_s: float) -> GcReport:
    started = time.perf_counter()
    store = repo.store
    report = GcReport(plan)
    before = "gc deleted nothing; the repository is unchanged"
    with storage_errors("running gc", before):
        repacked = [(p.name, p.live) for p in plan.packs if p.action == "repack"]
        new_packs, copied, failed = copy_verified(store, repacked, repo.config.max_pack_size)
    report.packs_written = len(new_packs)
    report.objects_copied = len(copied)
    doomed = [p for p in plan.packs if p.action in ("delete", "repack") and p.name not in failed]
    with store.exclusive(CRITICAL_SECTION_TIMEOUT_S):
        entered = time.perf_counter()
        with storage_errors("running gc", before):
            # Writers that finished while we planned may reference objects we saw as
            # dead (deduplicated against them, or a branch now names an old commit).
            revived = mark(repo, set(plan.live), set(plan.visited), reflog_expiry_s=reflog_expiry_s)
            removed = []
            for pack in doomed:
                if any(e.oid in revived and e.oid not in copied for e in pack.entries):
                    report.kept_revived.append(pack.name)
                else:
                    removed.append(pack)
            store.index.swap_packs(new_packs, [(p.name, p.entries) for p in removed])
        report.executed = True
        for pack in removed:
            store.reader.forget(pack.name)
            report.bytes_freed += pack.size
            if pack.action == "delete":
                report.packs_deleted += 1
            else:
                report.packs_repacked += 1
        done = f"gc removed {len(removed)} packs from the index; the next gc deletes any file left behind"
        with after_landing(done):
            retire_packs(store, [pack.name for pack in removed])
            # No writer is in flight now, so temporary packs past the grace period are orphans.
            for name in plan.leftovers:
                if name.endswith(TMP_SUFFIX):
                    store.backend.delete_temporary(pack_key(name))
            store.backend.sync(f"{PACK_DIR}/")
        report.critical_section_s = time.perf_counter() - entered
    with after_landing(done):
        for name, _ in new_packs:
            info = store.pack_info(name)
            report.bytes_freed -= info.size if info is not None else 0
        report.bytes_freed += plan.leftover_bytes
        purge_retired(store)
    report.seconds = time.perf_counter() - started
    return report


def _unlink(backend: Backend, key: str) -> None:
    backend.delete(key)
