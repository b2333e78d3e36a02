"""Lazy clones: metadata now, chunks on first read (git's partial clone with a
promisor remote; docs/DESIGN.md, "Hybrid cache").

- A lazy clone's fetch (ckvc.remote.fetch, reading hybrid.json) copies refs and
  metadata objects (commits, snapshots, tags) and no chunk: ``log``, ``show``,
  ``diff`` of metadata and ``du`` work at once.
- :class:`RemotePromisor` is what a read asks for the chunks this repository
  lacks (``ObjectStore.promisor``, ``ObjectStore.ensure``): it knows from the
  remotes' catalogs (local LMDB caches, no network) which remote holds a chunk
  and its size, and fetches what a read needs in one batch: coalesced range
  reads per pack, split over a few parallel streams for large reads, every
  record verified against its id (a delta through its base, which is fetched
  too when absent) before it lands in a local pack.
- :class:`ckvc.hybrid.settings.HybridSettings` is the small local file
  (``.ckvc/hybrid.json``) saying a repository is lazy, its promisor remotes, its
  cache budget and its auto_push remote.

Module level imports nothing that loads numpy: ``ckvc log`` on a lazy clone
stays a metadata command.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ckvc.core import Repository
from ckvc.errors import (
    CkvcError,
    ObjectNotFoundError,
    RemoteUnavailableError,
    StorageError,
    UnknownRemoteError,
)
from ckvc.hybrid.settings import HybridSettings
from ckvc.ids import ObjectType
from ckvc.remote.common import (
    TransferStats,
    remotes_of,
)
from ckvc.remote.location import RemoteSpec
from ckvc.remote.repository import CATALOG_DIR, Remote, catalog_dir, open_remote
from ckvc.storage.index import Index, IndexEntry

if TYPE_CHECKING:
    from ckvc.remote.fetch import Fetch

# A read needing more than this, split into a cache's eviction units, fetches
# several units at once.
PARALLEL_FETCH_BYTES = 32 << 20
MAX_STREAMS = 4


def promisor_names(core: Repository, settings: HybridSettings) -> list[str]:
    """The promisor remotes: those named, else every configured one, origin first."""
    if settings.promisors:
        return list(settings.promisors)
    names = [spec.name for spec in remotes_of(core).list()]
    return sorted(names, key=lambda n: (n != "origin", n))


# ---- metadata-only fetch ----------------------------------------------------------


# ---- the promisor -----------------------------------------------------------------


@dataclass
class FetchTotals:
    """What the promisor fetched in this process (benchmarks and ``ckvc cache``)."""

    fetches: int = 0
    objects: int = 0
    record_bytes: int = 0
    wire_bytes: int = 0
    requests: int = 0
    seconds: float = 0.0


class RemotePromisor:
    """Fetches on demand the chunks a read needs from the first promisor remote
    whose catalog holds them. ``on_access(entries, hit_bytes, miss_bytes)``,
    ``on_fetched(pack names)`` and ``on_settle()`` (no read in flight) let the
    cache keep its statistics and budget."""

    def __init__(
        self,
        local: Repository,
        remotes: Sequence[str],
        *,
        on_access: Callable[[Sequence[IndexEntry], int, int], None] | None = None,
        on_fetched: Callable[[Sequence[str]], None] | None = None,
        on_settle: Callable[[], None] | None = None,
    ) -> None:
        self.local = local
        self.remotes = list(remotes)
        self.on_access = on_access
        self.on_fetched = on_fetched
        self.on_settle = on_settle
        self.totals = FetchTotals()
        self._catalogs: dict[str, Index | None] = {}
        self._handles: dict[str, Remote] = {}
        self._lock = threading.RLock()
        self._unreported = 0  # bytes fetched since the last access was reported
        self.pack_bytes: int | None = None  # the cache's eviction unit (None: one pack per stream)

    # -- the catalogs: what each remote holds, known without the network --
    def _catalog(self, name: str) -> Index | None:
        if self._catalogs.get(name) is None:  # a catalog made after the first look is found at the next
            where = catalog_dir(self.local, name)
            path = None if where is None else where / CATALOG_DIR
            self._catalogs[name] = Index(path) if path is not None and path.is_dir() else None
        return self._catalogs[name]

    def holder(self, oid: bytes) -> tuple[str, IndexEntry] | None:
        """The first promisor remote whose catalog holds chunk ``oid``, with its entry there."""
        for name in self.remotes:
            catalog = self._catalog(name)
            entry = None if catalog is None else catalog.get(oid)
            if entry is not None and entry.kind == ObjectType.CHUNK:
                return name, entry
        return None

    def entry(self, oid: bytes) -> IndexEntry | None:
        found = self.holder(oid)
        return None if found is None else found[1]

    def remote_held(self, oids: Sequence[bytes]) -> set[bytes]:
        """Those of ``oids`` some promisor remote's catalog holds."""
        held: set[bytes] = set()
        for name in self.remotes:
            catalog = self._catalog(name)
            if catalog is None:
                continue
            for oid, entry in zip(oids, catalog.get_many(oids), strict=True):
                if entry is not None:
                    held.add(oid)
        return held

    def accessed(self, entries: Sequence[IndexEntry], hit_bytes: int, miss_bytes: int) -> None:
        # Misses are what came over the wire (delta bases a fetch needed included).
        with self._lock:
            fetched, self._unreported = self._unreported, 0
        if self.on_access is not None:
            self.on_access(entries, hit_bytes, max(miss_bytes, fetched))

    def settle(self) -> None:
        if self.on_settle is not None:
            self.on_settle()

    # -- fetching --
    def fetch(self, oids: Sequence[bytes], landing: Mapping[bytes, memoryview] | None = None) -> set[bytes]:
        by_remote: dict[str, list[tuple[bytes, IndexEntry]]] = {}
        for oid in oids:
            found = self.holder(oid)
            if found is not None:  # held by no remote: the read raises ObjectNotFoundError as before
                by_remote.setdefault(found[0], []).append((oid, found[1]))
        landed: set[bytes] = set()
        with self._lock:
            for name, items in by_remote.items():
                landed |= self._fetch_from(name, items, landing)
        return landed

    def _open(self, name: str, missing: int, count: int) -> Remote:
        handle = self._handles.get(name)
        if handle is not None:
            return handle
        spec: RemoteSpec | None = None
        try:
            spec = remotes_of(self.local).get(name)
            handle = open_remote(self.local, spec)
        except (StorageError, OSError, UnknownRemoteError) as exc:  # unknown: an unmounted directory
            if isinstance(exc, UnknownRemoteError) and spec is None:
                raise  # no such remote configured: a setup error, not the network
            raise unavailable(name, spec, missing, count, exc) from None
        self._handles[name] = handle
        return handle

    def _fetch_from(
        self, name: str, items: list[tuple[bytes, IndexEntry]], landing: Mapping[bytes, memoryview] | None
    ) -> set[bytes]:
        missing = sum(entry.record_size for _, entry in items)
        started = time.monotonic()
        for attempt in (0, 1):
            handle = self._open(name, missing, len(items))
            try:
                packs, landed = self._run(handle, [oid for oid, _ in items], missing, landing)
                break
            except ObjectNotFoundError:
                # The catalog was older than the remote (a remote gc repacked): refresh once.
                self._drop(name)
                if attempt:
                    raise
            except (StorageError, OSError) as exc:
                self._drop(name)
                raise unavailable(name, handle.spec, missing, len(items), exc) from None
        self.totals.fetches += 1
        self.totals.seconds += time.monotonic() - started
        if self.on_fetched is not None and packs:
            self.on_fetched(packs)
        return landed

    def _run(
        self, handle: Remote, oids: list[bytes], missing: int, landing: Mapping[bytes, memoryview] | None
    ) -> tuple[list[str], set[bytes]]:
        """Fetch ``oids`` (one Fetch per stream), returning the new local packs and
        the chunks verified straight into ``landing``."""
        from ckvc.remote.fetch import Fetch
        from ckvc.storage.records import locate_all

        local = self.local
        before = local.store.index.indexed_packs()
        streams = 1 if missing < PARALLEL_FETCH_BYTES else max(1, min(MAX_STREAMS, local.threads))
        located = locate_all(handle.core.store, oids)  # by remote pack and offset
        # One Fetch reads every pack at once and verifies on its workers (parallel_records);
        # splitting a pack's run between Fetch jobs would only add requests.
        groups = [[item.oid for item in located]]
        if self.pack_bytes is not None:
            # A cache's eviction unit is a local pack: packs of at most pack_bytes, so
            # that the budget holds many and a hot keyframe is not evicted with cold data.
            groups, size = [[]], 0
            for item in located:
                if groups[-1] and size + item.entry.record_size > self.pack_bytes:
                    groups.append([])
                    size = 0
                groups[-1].append(item.oid)
                size += item.entry.record_size
        jobs: list[tuple[Fetch, TransferStats]] = []
        for group in groups:
            if group:
                stats = TransferStats()
                job = Fetch(local, handle, stats, None)
                job.chunks = dict.fromkeys(group)
                job.landing = landing
                jobs.append((job, stats))
        requests_before = handle.backend.requests
        with local.store.pin():
            if len(jobs) == 1 or streams == 1:
                for job, _ in jobs:
                    job.fetch_chunks()
            else:
                import concurrent.futures

                with concurrent.futures.ThreadPoolExecutor(streams, thread_name_prefix="ckvc-lazy-fetch") as pool:
                    for done in [pool.submit(job.fetch_chunks) for job, _ in jobs]:
                        done.result()  # the first error, re-raised here
        for _, stats in jobs:
            self._unreported += stats.wire_bytes
            self.totals.objects += stats.objects
            self.totals.record_bytes += stats.record_bytes
            self.totals.wire_bytes += stats.wire_bytes
        self.totals.requests += handle.backend.requests - requests_before
        landed: set[bytes] = set()
        for job, _ in jobs:
            landed |= job.verifier.landed
        return sorted(local.store.index.indexed_packs() - before), landed

    def _drop(self, name: str) -> None:
        handle = self._handles.pop(name, None)
        if handle is not None:
            handle.close()

    def close(self) -> None:
        with self._lock:
            for name in list(self._handles):
                self._drop(name)
            for catalog in self._catalogs.values():
                if catalog is not None:
                    catalog.close()
            self._catalogs.clear()


def unavailable(name: str, spec: RemoteSpec | None, missing: int, count: int, exc: BaseException) -> CkvcError:
    where = f"remote {name}" + (f" ({spec.url})" if spec is not None else "")
    why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return RemoteUnavailableError(
        f"{where} cannot be reached ({why}): {count} chunks, {missing} bytes this read needs are not cached "
        "locally; nothing was changed (retry when the network is back)",
        remote=name,
        missing_bytes=missing,
    )


def settings_json(settings: HybridSettings) -> dict[str, Any]:
    return asdict(settings)
