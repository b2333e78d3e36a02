"""fetch and pull: copy what the remote's refs reach, verified record by record,
then move the remote-tracking refs (the order of writes: ckvc.remote.common)."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ckvc import graph, signing
from ckvc.core import Repository
from ckvc.errors import (
    CkvcWarning,
    CorruptObjectError,
    InvalidInputError,
    NonFastForwardError,
    ObjectNotFoundError,
    RefNotFoundError,
)
from ckvc.graph import is_ancestor
from ckvc.ids import ObjectType
from ckvc.objects import Commit, Snapshot, Tag
from ckvc.pruned import PruneRecord, remote_released
from ckvc.refs import BRANCH_PREFIX, TAG_PREFIX
from ckvc.remote.common import (
    FetchResult,
    Progress,
    PullResult,
    RefUpdate,
    TransferStats,
    copy_sidecars,
    counted,
    move_tracking,
    remotes_of,
    tracking_ref,
)
from ckvc.remote.repository import Remote, forget_packs, open_remote
from ckvc.storage.packs import RECORD_HEADER_SIZE, Record
from ckvc.storage.records import (
    LocalBaseCorruptError,
    Located,
    Verifier,
    locate_all,
    parallel_records,
    records_in,
)

# ---- fetch -----------------------------------------------------------------------


class Fetch:
    """One fetch: the remote metadata walk, then the chunks in rounds (a delta
    whose base is neither local nor just verified waits for it), every record
    verified before it is written, metadata last."""

    def __init__(self, local: Repository, handle: Remote, stats: TransferStats, progress: Progress | None) -> None:
        self.local = local
        self.handle = handle
        self.stats = stats
        self.progress = progress
        self.verifier = Verifier(local.store)
        self.snapshots: list[tuple[bytes, Record]] = []
        self.commits: list[tuple[bytes, Record]] = []
        self.tags: list[tuple[bytes, Record]] = []
        self.pruned: dict[str, list[str]] = {}
        self.chunks: dict[bytes, None] = {}
        self.done = 0
        self.total = 0  # bytes known to be wanted so far (grows as the walk finds more)
        self.prefetched: dict[bytes, tuple[Located, Record]] = {}
        self.metadata_by_pack: dict[str, list[bytes]] | None = None
        self.landing: Mapping[bytes, memoryview] | None = None  # a lazy read's buffers (Verifier)

    def _stream(self, items: list[Located]) -> Iterator[tuple[Located, Record]]:
        """The items' records as they arrive (one pack batch in memory at a time)."""
        self.total += sum(item.entry.record_size for item in items)
        with self._distrusting_damaged_packs():
            for item, record in records_in(self.handle.core.store, items, self.handle.describe):
                self.stats.wire_bytes += item.entry.record_size
                self.done += item.entry.record_size
                if self.progress is not None:
                    self.progress(self.done, self.total)
                yield item, record

    @contextlib.contextmanager
    def _distrusting_damaged_packs(self) -> Iterator[None]:
        """A record that is not what the catalog says (a damaged pack, or TOC copies
        that are not their packs' TOCs, perhaps of more packs than this one): the
        catalog, a cache, forgets every pack, so that the next fetch reads the
        packs' indexes again rather than failing on what it cached."""
        try:
            yield
        except LocalBaseCorruptError:
            raise
        except CorruptObjectError:
            catalog = self.handle.core.store
            forget_packs(catalog, catalog.index.indexed_packs())
            raise

    def _checked(self, items: list[Located]) -> Iterator[tuple[Located, Record, bool]]:
        """The items' chunk records as they arrive, several packs at once, each
        verified on the worker that read it: (item, record, verified), False
        where the delta base is not at hand yet."""
        self.total += sum(item.entry.record_size for item in items)

        def check(item: Located, record: Record) -> bool:
            if record.kind != ObjectType.CHUNK:
                raise CorruptObjectError(f"{self.handle.describe('packs/' + item.entry.pack)}: not a chunk")
            return self._verified(item, record, keep=False) is not None

        executor = self.handle.core.executor
        with self._distrusting_damaged_packs():
            for item, record, verified in parallel_records(
                self.handle.core.store, items, self.handle.describe, executor, check
            ):
                self.stats.wire_bytes += item.entry.record_size
                self.done += item.entry.record_size
                if self.progress is not None:
                    self.progress(self.done, self.total)
                yield item, record, verified

    def _locate(self, oids: list[bytes]) -> list[Located]:
        try:
            return locate_all(self.handle.core.store, oids)
        except ObjectNotFoundError as exc:
            if self.handle.damaged:  # a truncated or damaged pack is the likely reason
                key = f"packs/{self.handle.damaged[0]}"
                raise CorruptObjectError(
                    f"{self.handle.describe(key)}: pack is damaged (its table of contents cannot be read) "
                    "and a needed object is in no readable pack",
                    object_id=exc.object_id,
                ) from None
            raise ObjectNotFoundError(
                f"{self.handle.describe('packs/')}: object {exc.object_id} is missing", object_id=exc.object_id
            ) from None

    def _verified(self, item: Located, record: Record, *, keep: bool = True) -> Any:
        """The record's plain bytes (``keep``), or only True, verified; None when
        its delta base is not at hand. A mismatch names the remote and the pack."""
        try:
            if not keep:
                return self.verifier.check(item.oid, record)
            return self.verifier.plain(item.oid, record)
        except LocalBaseCorruptError:
            raise  # this repository's damage: not the remote's to be named for
        except CorruptObjectError as exc:
            key = f"packs/{item.entry.pack}"
            raise CorruptObjectError(f"{self.handle.describe(key)}: {exc.reason}", object_id=item.oid.hex()) from None

    def _metadata(self, oid: bytes) -> tuple[Located, Record]:
        """The record of a metadata object. Reading one reads every metadata record
        of its pack that is not here yet, in one coalesced request: pushes put a
        history's commits, snapshots and tags in packs of their own, so a walk
        costs about one request per pack rather than one per object."""
        found = self.prefetched.pop(oid, None)
        if found is not None:
            return found
        (item,) = self._locate([oid])
        if self.metadata_by_pack is None:
            self.metadata_by_pack = {}
            for other, entry in self.handle.core.store.index.iter_entries():
                if entry.kind != ObjectType.CHUNK:
                    self.metadata_by_pack.setdefault(entry.pack, []).append(other)
        wanted = [m for m in self.metadata_by_pack.get(item.entry.pack, []) if m != oid and not self.local.store.has(m)]
        for got, record in self._stream(sorted([item, *self._locate(wanted)], key=lambda x: x.entry.offset)):
            self.prefetched[got.oid] = (got, record)
        self.metadata_by_pack.pop(item.entry.pack, None)  # read once
        return self.prefetched.pop(oid)

    # ---- the walk: graph.closure over the remote's records, each verified as read ----

    def walk(self, tips: list[str]) -> None:
        records = self.handle.core.pruned()
        released = remote_released(records, self.handle.core.store.has)
        found = graph.closure(self, tips, have=self.local.store.has, bases=False, pruned=released)
        self.pruned = found.pruned
        self.chunks = dict.fromkeys(found.chunks)
        self._released_behind(records)

    def _released_behind(self, records: Mapping[str, PruneRecord]) -> None:
        """A lazy clone or a bounded cache leaves chunks on the remote: where the
        remote's own retention released a commit this repository holds without all
        of its data, the record comes here too, so that loading it says it was
        pruned (the walk stops at commits this repository has and never sees them)."""
        store = self.local.store
        if store.promisor is None:
            return  # a whole repository holds its commits' data itself
        mine = self.local.pruned()
        for record in records.values():
            if record.remote_retention is None or record.commit in mine:
                continue
            oid = bytes.fromhex(record.commit)
            if not store.has(oid):
                continue
            tree = bytes.fromhex(record.remote_retention)
            try:
                snapshot = Snapshot.decode(store.read(tree, ObjectType.SNAPSHOT)) if store.has(tree) else None
            except (CorruptObjectError, ObjectNotFoundError):
                snapshot = None
            if snapshot is None or not all(store.has(c) for blob in snapshot.blobs for c in blob.chunks):
                self.pruned.setdefault(record.policy, []).append(record.commit)

    def kind(self, oid: bytes) -> ObjectType:
        item, record = self._metadata(oid)
        if record.kind not in (ObjectType.COMMIT, ObjectType.TAG):
            raise CorruptObjectError(
                f"{self.handle.describe('refs/')}: a ref or parent names a {ObjectType(record.kind).name.lower()}",
                object_id=oid.hex(),
            )
        self.prefetched[oid] = (item, record)  # read_commit or read_tag comes next
        return ObjectType(record.kind)

    def read_tag(self, oid: bytes) -> Tag:
        item, record = self._metadata(oid)
        tag = Tag.decode(self._verified(item, record).data, oid.hex())
        self.tags.append((oid, record))
        return tag

    def read_commit(self, oid: bytes) -> Commit:
        item, record = self._metadata(oid)
        commit = Commit.decode(self._verified(item, record).data, oid.hex())
        self.commits.append((oid, record))
        return commit

    def read_snapshot(self, oid: bytes) -> Snapshot:
        item, record = self._metadata(oid)
        if record.kind != ObjectType.SNAPSHOT:
            raise CorruptObjectError(f"{self.handle.describe('packs/' + item.entry.pack)}: not a snapshot")
        snapshot = Snapshot.decode(self._verified(item, record).data)
        self.snapshots.append((oid, record))
        return snapshot

    def delta_base(self, oid: bytes) -> bytes | None:
        return None  # learnt from each record as it arrives (fetch_chunks)

    def fetch_chunks(self) -> None:
        store = self.local.store
        # keyframes are worth keeping for the deltas after them only when several commits come
        self.verifier = Verifier(store, keep_keyframes=len(self.snapshots) > 1, landing=self.landing)
        writer = store.writer(self.local.codec, self.local.config.max_pack_size)
        want = list(self.chunks)
        asked: set[bytes] = set(want)
        waiting: dict[bytes, tuple[Located, Record]] = {}
        try:
            while want or waiting:
                for item, record, verified in self._checked(self._locate(want)) if want else ():
                    if not verified:
                        waiting[item.oid] = (item, record)
                    elif writer.add_encoded(
                        ObjectType(record.kind), item.oid, record.raw_size, record.codec, record.payload, record.base
                    ):
                        self.stats.objects += 1
                        self.stats.record_bytes += item.entry.record_size
                want = []
                self._retry(writer, waiting)
                if not waiting:
                    break
                self._commit(writer)  # what was verified becomes local: bases for the rest
                writer = store.writer(self.local.codec, self.local.config.max_pack_size)
                self._retry(writer, waiting)
                for _item, record in waiting.values():
                    base = self.verifier.needs(record)
                    if base is not None and base not in asked:
                        asked.add(base)
                        want.append(base)
                if waiting and not want:
                    oid = next(iter(waiting))
                    raise CorruptObjectError(
                        f"{self.handle.describe('packs/')}: the delta base chain of an object cannot be resolved",
                        object_id=oid.hex(),
                    )
            self._commit(writer)
        except BaseException:
            writer.abort()
            raise

    def _retry(self, writer: Any, waiting: dict[bytes, tuple[Located, Record]]) -> None:
        progress = True
        while waiting and progress:
            progress = False
            for oid, (item, record) in list(waiting.items()):
                if self._write(writer, item, record):
                    del waiting[oid]
                    progress = True

    def _write(self, writer: Any, item: Located, record: Record) -> bool:
        if self._verified(item, record, keep=False) is None:
            return False
        if writer.add_encoded(
            ObjectType(record.kind), item.oid, record.raw_size, record.codec, record.payload, record.base
        ):
            self.stats.objects += 1
            self.stats.record_bytes += item.entry.record_size
        return True

    def _commit(self, writer: Any) -> None:
        before = len(self.local.store.index.indexed_packs())
        writer.commit()
        self.stats.packs += len(self.local.store.index.indexed_packs()) - before

    def write_metadata(self) -> None:
        for policy, commits in self.pruned.items():  # before the commits, as on the remote
            self.local.prune_log.add(commits, policy)
        writer = self.local.store.writer(self.local.codec, self.local.config.max_pack_size)
        try:
            for oid, record in [*self.snapshots, *self.commits[::-1], *self.tags]:
                if writer.add_encoded(
                    ObjectType(record.kind), oid, record.raw_size, record.codec, record.payload, record.base
                ):
                    self.stats.objects += 1
                    self.stats.record_bytes += RECORD_HEADER_SIZE + len(record.payload)
            self._commit(writer)
        except BaseException:
            writer.abort()
            raise


def fetch(
    local: Repository, remote: str = "origin", *, progress: Progress | None = None, chunks: bool | None = None
) -> FetchResult:
    """Copy what the remote's branches and tags reach and this repository lacks,
    every record verified against its id before it is written (CorruptObjectError
    naming the remote and the key otherwise, nothing stored); then move the
    remote-tracking refs ``refs/remotes/<remote>/*`` and create the remote's tags
    that do not exist here (an existing tag that differs is kept, with a warning).
    An interrupted fetch keeps the packs it sealed and the next one resumes.
    ``chunks=False``: commits, snapshots and tags only; the default (None) is
    that for a lazy clone (hybrid.json), whose chunks come on first read."""
    from ckvc.hybrid.settings import HybridSettings

    if chunks is None:
        chunks = not HybridSettings.load(local).lazy
    started = time.monotonic()
    spec = remotes_of(local).get(remote)
    handle = open_remote(local, spec)
    result = FetchResult(spec.name, spec.url)
    how = "fetch" if chunks else "fetch --lazy"
    with counted(handle, result.stats, started):
        refs = handle.core.refs.list_refs("refs/")  # one listing for branches and tags
        branches = {k: v for k, v in refs.items() if k.startswith(BRANCH_PREFIX)}
        tags = {k: v for k, v in refs.items() if k.startswith(TAG_PREFIX)}
        trust = signing.TrustSettings.load(local)
        if trust.require_signatures:  # before a byte is copied: the refs' targets must be signed
            remote_signatures = signing.SignatureStore(handle.backend)
            signing.check_ref_targets(refs, remote_signatures, trust.keys(), f"fetch from {spec.name}")
        local.upgrade_format(handle.core.config.format_version)
        local.store.refresh()  # packs an interrupted fetch sealed
        job = Fetch(local, handle, result.stats, progress)
        with local.store.pin():
            job.walk(list(dict.fromkeys([*branches.values(), *tags.values()])))
            if chunks:
                job.fetch_chunks()
            job.write_metadata()
            # signatures and notes before the refs that name what they describe
            copy_sidecars(handle.backend, local.refs.backend, local.object_exists)
            # the refs move under the pin too: a gc cannot take what they are about to name
            for full, new in branches.items():
                moved = move_tracking(local, spec.name, full[len(BRANCH_PREFIX) :], new, how)
                if moved is not None:
                    result.updated.append(moved)
            for full, new in tags.items():
                mine = local.refs.read(full)
                if mine is None:
                    local.refs.set_if_equals(full, None, new, f"fetch: tag from {spec.name}")
                    result.tags.append(RefUpdate(full, None, new))
                elif mine != new:
                    kept = f"kept local {full} ({mine[:12]}); {spec.name} has {new[:12]}"
                    warnings.warn(CkvcWarning(kept), stacklevel=2)
    return result


def fetch_history(local: Repository, remote: str, tips: Sequence[str]) -> TransferStats:
    """The commits, snapshots and tags ``tips`` reach on ``remote`` that this
    repository lacks, verified (no chunks; no ref moves): what a commit made on top
    of another writer's needs for its history to be walked here."""
    started = time.monotonic()
    stats = TransferStats()
    handle = open_remote(local, remotes_of(local).get(remote))
    with counted(handle, stats, started):
        job = Fetch(local, handle, stats, None)
        with local.store.pin():
            job.walk(list(tips))
            job.write_metadata()
    return stats


def pull(
    local: Repository,
    remote: str = "origin",
    *,
    progress: Progress | None = None,
) -> PullResult:
    """fetch (metadata only on a lazy clone), then fast-forward HEAD's branch to
    its remote-tracking branch (an unborn branch is set to it). A branch with
    commits the remote lacks and the remote with commits it lacks:
    NonFastForwardError, nothing moved."""
    target, _ = local.refs.head()
    if target is None or not target.startswith(BRANCH_PREFIX):
        raise InvalidInputError("HEAD is detached: pull needs a branch")
    branch = target[len(BRANCH_PREFIX) :]
    fetched = fetch(local, remote, progress=progress)
    theirs = local.refs.read(tracking_ref(remote, branch))
    if theirs is None:
        raise RefNotFoundError(f"remote {remote} has no branch {branch!r}")
    ours = local.refs.read(target)
    if ours == theirs or (ours is not None and is_ancestor(local, theirs, ours)):
        return PullResult(fetched, branch, ours, ours, fast_forward=False)
    if ours is not None and not is_ancestor(local, ours, theirs):
        raise NonFastForwardError(
            f"{branch} ({ours[:12]}) and {remote}/{branch} ({theirs[:12]}) have diverged; ckvc does not merge: "
            f"take theirs with `ckvc reset {remote}/{branch}` (yours stay in the reflog; `ckvc branch mine "
            f"{ours[:12]}` keeps them on a branch), or keep yours with `ckvc push --force {remote}`"
        )
    local.refs.set_if_equals(target, ours, theirs, f"pull: fast-forward to {remote}/{branch}")
    return PullResult(fetched, branch, ours, theirs, fast_forward=True)
