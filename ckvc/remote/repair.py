"""fsck --repair: objects fsck finds damaged or missing are fetched again from a
remote that holds them, each record verified against its id before it is
written; they go into new local packs, which the index then names as their
canonical copies. The packs that held the damage are rewritten without it
(their healthy records copied, verified) and dropped, as gc drops a pack.

Never lost: a damaged copy that something reaches and no remote holds stays
where it is (fsck keeps naming it); only damage nothing reaches (gc's to free)
goes with its pack.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckvc.core import ProgressCallback, Repository
from ckvc.errors import CorruptObjectError, after_landing, storage_errors
from ckvc.fsck import BAD_CHECKSUM, BAD_PACK, DANGLING_REF, MISSING_OBJECT, FsckReport, run_fsck
from ckvc.gc import CRITICAL_SECTION_TIMEOUT_S, copy_verified, purge_retired, retire_packs
from ckvc.inspect import fields_json
from ckvc.remote.common import remotes_of
from ckvc.remote.repository import Remote, open_remote
from ckvc.storage.packs import PackWriter, RecordInfo
from ckvc.storage.records import LocalBaseCorruptError, Verifier, locate_all, records_in

REPAIRABLE = (BAD_CHECKSUM, MISSING_OBJECT, DANGLING_REF)
MAX_ROUNDS = 64  # fsck passes: each finds what the objects restored by the last one lead to


@dataclass
class RepairReport:
    damaged: int = 0  # objects fsck found damaged or missing (all rounds)
    repaired: dict[str, int] = field(default_factory=dict)  # remote -> objects fetched from it
    repaired_bytes: int = 0  # stored bytes of the records fetched
    packs_written: int = 0
    packs_dropped: list[str] = field(default_factory=list)
    dropped_unreferenced: int = 0  # damaged objects nothing reaches, dropped with their pack
    unrepaired: list[str] = field(default_factory=list)  # still damaged: no remote holds them
    remotes_tried: list[str] = field(default_factory=list)
    after: FsckReport = field(default_factory=FsckReport)

    def to_json(self) -> dict[str, Any]:
        return {**fields_json(self, skip=("after",)), "after": self.after.to_json()}


class _Repair:
    def __init__(self, local: Repository, remotes: Sequence[str], report: RepairReport) -> None:
        self.local = local
        self.store = local.store
        self.remotes = list(remotes)
        self.report = report
        self.restored: set[bytes] = set()
        self.damaged: set[bytes] = set()  # what fsck found damaged or missing, all rounds

    def fetch(self, wanted: set[bytes]) -> None:
        """Fetch ``wanted`` from the remotes in turn (what one lacks, the next may hold)."""
        for name in self.remotes:
            if not wanted:
                return
            if name not in self.report.remotes_tried:
                self.report.remotes_tried.append(name)
            handle = open_remote(self.local, remotes_of(self.local).get(name))
            try:
                got = self._fetch_from(handle, {oid for oid in wanted if handle.core.store.has(oid)}, wanted)
            finally:
                handle.close()
            if got:
                self.report.repaired[name] = self.report.repaired.get(name, 0) + len(got)
            wanted -= got

    def _fetch_from(self, handle: Remote, held: set[bytes], damaged: set[bytes]) -> set[bytes]:
        """Rounds: a delta whose base is itself among the damaged waits until the
        base is restored (written and indexed), then verifies against it."""
        verifier = Verifier(self.store)
        got: set[bytes] = set()
        pending = set(held)
        while pending:
            writer = PackWriter(self.store.backend)
            written: set[bytes] = set()
            catalog = handle.core.store
            try:
                for item, record in records_in(catalog, locate_all(catalog, pending), handle.describe):
                    base = verifier.needs(record)
                    if base is not None and base in damaged and base not in got:
                        continue  # its base first
                    try:
                        if verifier.check(item.oid, record) is None:
                            continue  # its base is neither here nor damaged: fetched with it, or not at all
                    except LocalBaseCorruptError:
                        continue  # a base damaged here that fsck had not reached: the next round names it
                    except CorruptObjectError:
                        continue  # the remote's copy is damaged too: another remote may hold a good one
                    writer.append(record.oid, record.kind, record.codec, record.raw_size, record.payload, record.base)
                    written.add(item.oid)
                    self.report.repaired_bytes += item.entry.record_size
                if not written:
                    writer.abort()
                    break
                writer.seal()
            except BaseException:
                writer.abort()
                raise
            with self.store.exclusive(CRITICAL_SECTION_TIMEOUT_S):
                self.store.index.swap_packs([(writer.name, writer.entries)], [])  # the new copies are canonical
            self.report.packs_written += 1
            got |= written
            pending -= written
        self.restored |= got
        return got

    def drop_damaged_packs(self, packs: set[str], needed: set[bytes]) -> None:
        """Rewrite each pack that held damage without it, unless it still holds the
        only (damaged) copy of something a ref reaches (``needed``)."""
        store = self.store
        listed = set(store.packs())
        canonical = store.indexed_records(packs)
        doomed: list[tuple[str, list[RecordInfo]]] = []
        for name in sorted(packs):
            still_damaged = [e for e in canonical[name] if e.oid in needed]
            if still_damaged:
                continue
            doomed.append((name, canonical[name]))
        healthy = [
            (name, [e for e in entries if e.oid not in self.damaged]) for name, entries in doomed if name in listed
        ]
        before = "fsck --repair restored objects but dropped no pack"
        with storage_errors("rewriting damaged packs", before):
            copies, _, failed = copy_verified(store, healthy, self.local.config.max_pack_size)
        doomed = [(name, entries) for name, entries in doomed if name not in failed]
        if not doomed:
            return
        with store.exclusive(CRITICAL_SECTION_TIMEOUT_S):
            with storage_errors("rewriting damaged packs", before):
                store.index.swap_packs(copies, doomed)
            for name, _ in doomed:
                store.reader.forget(name)
            with after_landing("fsck --repair dropped damaged packs from the index; the next gc deletes their files"):
                retire_packs(store, [name for name, _ in doomed if name in listed])
        with after_landing("fsck --repair dropped damaged packs; the next gc deletes what is left of them"):
            purge_retired(store)
        self.report.packs_written += len(copies)
        self.report.packs_dropped.extend(name for name, _ in doomed)
        self.report.dropped_unreferenced += sum(1 for _, entries in doomed for e in entries if e.oid in self.damaged)


def repair(
    local: Repository,
    remotes: Sequence[str] | None = None,
    *,
    rebuild_index: bool = False,
    progress: ProgressCallback | None = None,
) -> RepairReport:
    """Find damage with fsck, fetch the damaged and missing objects again from
    ``remotes`` (default: every configured remote, in order), verified, and drop
    the damaged copies; returns what was done and a full fsck of the result."""
    names = list(remotes) if remotes is not None else [spec.name for spec in remotes_of(local).list()]
    for name in names:
        remotes_of(local).get(name)  # an unknown name: UnknownRemoteError before anything changes
    report = RepairReport()
    job = _Repair(local, names, report)
    fsck = run_fsck(local, rebuild_index=rebuild_index, level="full", progress=progress)
    needed: set[bytes] = set()
    affected: set[str] = set()
    for _ in range(MAX_ROUNDS):
        found = {bytes.fromhex(p.object_id) for p in fsck.problems if p.kind in REPAIRABLE and p.object_id}
        new = found - job.damaged
        if not new and not any(p.kind == BAD_PACK for p in fsck.problems):
            break
        job.damaged |= new
        needed |= {bytes.fromhex(p.object_id) for p in fsck.problems if p.breaks and p.object_id}
        for oid in new:
            entry = local.store.index.get(oid)
            if entry is not None:
                affected.add(entry.pack)
        affected |= {p.pack for p in fsck.problems if p.kind == BAD_PACK and p.pack}
        before = len(job.restored)
        job.fetch(new)
        if len(job.restored) == before:
            break
        # the restored commits and snapshots lead to objects the last pass could not reach
        fsck = run_fsck(local, level="metadata")
    job.drop_damaged_packs(affected, needed - job.restored)
    report.damaged = len(job.damaged)
    report.after = run_fsck(local, level="full", progress=progress)
    report.unrepaired = report.after.damaged_objects()
    return report
