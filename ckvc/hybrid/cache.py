"""The local chunk cache in front of a remote: a byte budget, eviction, pins and
hit-rate statistics (docs/DESIGN.md, "Hybrid cache"; docs/FORMAT.md section 19).

A repository with ``cache_size`` set, or a lazy clone, gets a :class:`Hybrid`
attached when it opens (``attach``): it installs the promisor
(:class:`ckvc.hybrid.promisor.RemotePromisor`) on the store, so reads fetch what is
absent, and it keeps the state file ``.ckvc/cache/state.json``: per local pack
its size, last access and aged access count, the pins, and the hit and miss
bytes of the reads so far.

Eviction works on whole local packs, which are immutable: a pack whose chunks
every one are held by a promisor remote (its catalog says so) is deleted; a pack
that also holds what must stay (metadata, chunks no remote holds, pinned
chunks, chunks of the read in progress) is rewritten with only those records,
or kept when nothing in it may go. Deletion is gc's protocol (the exclusive
lock, one index transaction, retire then purge), so a crash leaves every
object either indexed or gone as a whole pack. Never dropped: data no remote is
known to hold (unpushed commits), pinned commits' chunks and their delta bases,
and what the running read needs.

The eviction order was chosen by measurement (benchmarks/hybrid.py; figures in
docs/DESIGN.md, "Hybrid cache"): on the trace of resume-latest / evaluate-older /
branch-from-a-past-epoch, least recently used first ("lru") was not beaten by
"tip" (LRU, but the packs HEAD's commit needs last), "lru2" (LRU-2), "lfu" with
aging or "slru" (segmented LRU); "lru" is the default, the others stay selectable
(``Hybrid.set_policy``) for other access patterns and for the benchmark.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ckvc import gc as gc_mod
from ckvc import graph
from ckvc.codecs.codec_ids import WHOLE_CODECS
from ckvc.core import Repository
from ckvc.errors import CkvcError, CkvcWarning, CorruptObjectError, InvalidInputError, ObjectNotFoundError
from ckvc.hybrid.backup import AutoPush
from ckvc.hybrid.promisor import RemotePromisor, promisor_names
from ckvc.hybrid.settings import HybridSettings
from ckvc.ids import ObjectType
from ckvc.refs import BRANCH_PREFIX
from ckvc.retention_policy import parse_size
from ckvc.storage.index import IndexEntry
from ckvc.storage.packs import PackWriter, RecordInfo, parse_record

STATE_KEY = "cache/state.json"
STATE_VERSION = 1
POLICIES = ("lru", "tip", "lru2", "slru", "lfu")
DEFAULT_POLICY = "lru"  # measured best (benchmarks/hybrid.py; docs/DESIGN.md, "Hybrid cache")
# SLRU: the protected segment holds at most this share of the bytes cached.
PROTECTED_SHARE = 0.5
# LFU with aging: counts halve every this many accesses of the whole cache.
LFU_HALF_LIFE = 16
# SLRU: a pack read this many times since it arrived is in the protected segment.
PROTECT_AFTER = 2
EXCLUSIVE_TIMEOUT_S = 30.0
PACKS_PER_BUDGET = 32

# ---- state ----------------------------------------------------------------------


@dataclass
class PackState:
    size: int = 0
    first: int = 0  # tick it arrived (fetched or written)
    last: int = 0  # tick of its last read
    prev: int = 0  # tick of the read before that (0: read once): LRU-2's key
    reads: int = 0  # reads since it arrived
    freq: float = 0.0  # reads, halved every LFU_HALF_LIFE ticks (LFU with aging)


@dataclass
class CacheState:
    version: int = STATE_VERSION
    policy: str = DEFAULT_POLICY
    tick: int = 0
    hit_bytes: int = 0
    miss_bytes: int = 0
    reads: int = 0
    evicted_packs: int = 0
    evicted_bytes: int = 0
    packs: dict[str, PackState] = field(default_factory=dict)
    pins: dict[str, str] = field(default_factory=dict)  # commit id -> what was pinned (the rev)

    @property
    def hit_rate(self) -> float | None:
        total = self.hit_bytes + self.miss_bytes
        return None if total == 0 else self.hit_bytes / total

    @classmethod
    def decode(cls, data: bytes | None) -> CacheState:
        if data is None:
            return cls()
        try:
            raw = json.loads(data.decode("utf-8"))
            if raw.get("version") != STATE_VERSION:
                raise ValueError(f"unknown version {raw.get('version')!r}")
            packs = {str(k): PackState(**v) for k, v in raw.pop("packs", {}).items()}
            state = cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__ and k != "packs"})
            state.packs = packs
            return state
        except (ValueError, TypeError, AttributeError) as exc:
            # Statistics only: a damaged file costs the history, never data.
            warnings.warn(CkvcWarning(f"{STATE_KEY} is damaged ({exc}); cache statistics start over"), stacklevel=3)
            return cls()

    def encode(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode()


def eviction_order(state: CacheState, policy: str, hot: frozenset[str] = frozenset()) -> list[str]:
    """Pack names, the first to evict first. ``hot``: packs holding what HEAD's
    commit needs (the "tip" policy keeps them to the last)."""
    packs = state.packs
    if policy == "lru":
        return sorted(packs, key=lambda n: (packs[n].last, packs[n].first, n))
    if policy == "lfu":
        return sorted(packs, key=lambda n: (packs[n].freq, packs[n].last, packs[n].first, n))
    if policy == "tip":
        return sorted(packs, key=lambda n: (n in hot, packs[n].last, packs[n].first, n))
    if policy == "lru2":
        # LRU-2 (O'Neil et al.): by the second most recent read, packs read once first.
        return sorted(packs, key=lambda n: (packs[n].prev, packs[n].last, packs[n].first, n))
    if policy == "slru":
        # Packs read twice or more, the most recent first, up to PROTECTED_SHARE of
        # the bytes, are protected; the rest (probation) go first, each LRU.
        total = sum(p.size for p in packs.values())
        protected: set[str] = set()
        held = 0
        for name in sorted(packs, key=lambda n: -packs[n].last):
            if packs[name].reads >= PROTECT_AFTER and held + packs[name].size <= PROTECTED_SHARE * total:
                protected.add(name)
                held += packs[name].size
        return sorted(packs, key=lambda n: (n in protected, packs[n].last, n))
    raise InvalidInputError(f"unknown cache policy {policy!r}; known: {', '.join(POLICIES)}")


def record_access(state: CacheState, packs: Iterable[str]) -> None:
    """One read touching ``packs``: a tick, recency, counts (aged for LFU)."""
    state.tick += 1
    state.reads += 1
    if state.tick % LFU_HALF_LIFE == 0:
        for p in state.packs.values():
            p.freq /= 2
    for name in packs:
        p = state.packs.setdefault(name, PackState(first=state.tick))
        p.prev = p.last
        p.last = state.tick
        p.reads += 1
        p.freq += 1


# ---- results ----------------------------------------------------------------------


@dataclass
class CacheReport:
    """``ckvc cache``: usage against the budget, hit rate, pins, what cannot go."""

    budget: int | None
    used_bytes: int
    packs: int
    evictable_bytes: int
    unpushed_bytes: int
    hit_bytes: int
    miss_bytes: int
    reads: int
    evicted_packs: int
    evicted_bytes: int
    policy: str
    lazy: bool
    promisors: list[str]
    pins: dict[str, str]

    @property
    def hit_rate(self) -> float | None:
        total = self.hit_bytes + self.miss_bytes
        return None if total == 0 else self.hit_bytes / total

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}


@dataclass
class PruneReport:
    budget: int | None
    before_bytes: int
    after_bytes: int
    packs_deleted: int = 0
    packs_rewritten: int = 0
    bytes_freed: int = 0
    over_budget_bytes: int = 0  # what is left above the budget: data that must stay
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ---- the cache ----------------------------------------------------------------------


class Hybrid:
    """The cache and promisor of one open repository (``Repo.cache``)."""

    def __init__(self, core: Repository, settings: HybridSettings) -> None:
        self.core = core
        self.settings = settings
        self._lock = threading.RLock()
        self.state = CacheState.decode(core.refs.backend.get(STATE_KEY))
        self.promisor = RemotePromisor(
            core,
            promisor_names(core, settings),
            on_access=self._on_access,
            on_fetched=self._on_fetched,
            on_settle=self._settle,
        )
        self._read_packs: set[str] = set()  # packs the reads since the last settle used
        core.store.promisor = self.promisor
        self.set_unit()
        self.on_evict: Callable[[PruneReport], None] | None = None  # tests and benchmarks watch each pass
        self.backup: AutoPush | None = None
        self.start_backup()
        core.commit_observers.append(self.on_commit)  # every commit path, not only Repo.commit
        core.hybrid = self

    def start_backup(self) -> None:
        """The auto_push worker, when configured (it resumes a backlog left by an earlier process)."""
        if self.settings.auto_push is not None and self.backup is None and self.core.path is not None:
            self.backup = AutoPush(self.core.path, self.settings.auto_push)
        elif self.settings.auto_push is None and self.backup is not None:
            self.backup.close(wait_s=0.0)
            self.backup = None

    # -- settings --
    def set_unit(self) -> None:
        """Fetched data lands in packs of about 1/32 of the budget (1-64 MiB): the
        eviction unit is a pack, and a budget should hold many of them."""
        budget = self.settings.cache_size
        self.promisor.pack_bytes = None if budget is None else max(1 << 20, min(64 << 20, budget // PACKS_PER_BUDGET))

    @property
    def budget(self) -> int | None:
        return self.settings.cache_size

    @property
    def policy(self) -> str:
        return self.state.policy

    def set_policy(self, policy: str) -> None:
        """The eviction order (benchmarks compare them; the default is measured best)."""
        eviction_order(CacheState(), policy)  # checks the name
        with self._lock:
            self.state.policy = policy
            self._save()

    # -- bookkeeping --
    def _save(self) -> None:
        try:
            self.core.refs.backend.put(STATE_KEY, self.state.encode())
        except (OSError, CkvcError) as exc:  # statistics only: a read never fails for them
            warnings.warn(CkvcWarning(f"cache statistics not saved: {exc}"), stacklevel=3)

    def _on_fetched(self, packs: Sequence[str]) -> None:
        with self._lock:
            for name in packs:
                info = self.core.store.pack_info(name)
                state = self.state.packs.setdefault(name, PackState(first=self.state.tick + 1))
                state.size = 0 if info is None else info.size

    def _on_access(self, entries: Sequence[IndexEntry], hit_bytes: int, miss_bytes: int) -> None:
        with self._lock:
            self.state.hit_bytes += hit_bytes
            self.state.miss_bytes += miss_bytes
            packs = {e.pack for e in entries}
            record_access(self.state, packs)
            self._read_packs |= packs
            self._save()  # eviction waits for the read to return (_settle)

    def _settle(self) -> None:
        """No read in flight: back within the budget, the packs the reads just
        used kept (a read larger than the budget keeps what it read)."""
        with self._lock:
            protect, self._read_packs = self._read_packs, set()
            if self.budget is not None and self.used_bytes() > self.budget:
                self.prune(protect=protect)

    def on_commit(self, event: Any) -> None:
        """A commit observer (``write.Committed``)."""
        self.committed(event.commit)

    def committed(self, commit_id: str) -> None:
        """After a commit landed: its packs join the cache, the budget holds, and
        auto_push queues its branch (the commit never waits for the network)."""
        if self.backup is not None:
            target, value = self.core.refs.head()
            if target is not None and target.startswith(BRANCH_PREFIX) and value == commit_id:
                self.backup.enqueue(target, commit_id)
        self.note_written()

    def note_written(self) -> None:
        """New local packs join the cache (as read once), and the budget holds."""
        with self._lock:
            known = set(self.state.packs)
            new = [n for n in self.core.store.index.indexed_packs() if n not in known]
            self._on_fetched(new)
            record_access(self.state, new)
            over = self.budget is not None and self.used_bytes() > self.budget
            if not over:
                self._save()
                return
        # outside the cache's lock: the store's read lock is always taken first
        if not self.core.store.unless_reading(self.prune):
            with self._lock:
                self._save()  # a read is in flight: its settle prunes

    # -- usage --
    def _sizes(self) -> dict[str, int]:
        """Every local pack's size; the state learns packs it did not see arrive."""
        sizes: dict[str, int] = {}
        for name in self.core.store.index.indexed_packs():
            state = self.state.packs.get(name)
            if state is None or not state.size:
                info = self.core.store.pack_info(name)
                if info is None:
                    continue
                state = self.state.packs.setdefault(name, PackState(first=self.state.tick))
                state.size = info.size
            sizes[name] = state.size
        for gone in set(self.state.packs) - set(sizes):  # gc or another process removed it
            del self.state.packs[gone]
        return sizes

    def used_bytes(self) -> int:
        return sum(self._sizes().values())

    def _head_packs(self) -> frozenset[str]:
        """Local packs holding chunks HEAD's commit needs (what the next resume reads)."""
        try:
            _, head = self.core.refs.head()
        except CkvcError:
            return frozenset()
        if head is None:
            return frozenset()
        chunks = self._closure([head])
        return frozenset(e.pack for e in self.core.store.index.get_many(list(chunks)) if e is not None)

    def _pinned_chunks(self) -> set[bytes]:
        """Chunks of pinned commits, with the delta bases they decode through."""
        return self._closure(list(self.state.pins))

    def _closure(self, commits: list[str]) -> set[bytes]:
        """The local chunks ``commits`` need, with the delta bases they decode
        through (what is not here, or cannot be read, has nothing here to keep)."""
        store = self.core.store

        def absent(oid: bytes) -> bool:
            return not store.has(oid)

        source = graph.StoredObjects(self.core)
        found = graph.closure(source, commits, have=absent, history=False, on_error=graph.skip_unreadable)
        return set(found.chunks)

    def _delta_bases(self) -> dict[bytes, bytes]:
        """Local delta chunk -> the base it decodes against (one record head read each)."""
        bases: dict[bytes, bytes] = {}
        for oid, entry in self.core.store.index.iter_entries():
            if entry.kind == ObjectType.CHUNK and entry.codec not in WHOLE_CODECS:
                try:
                    base = self.core.store.base_info(oid).base
                except (ObjectNotFoundError, CorruptObjectError):
                    continue
                if base is not None:
                    bases[oid] = base
        return bases

    def report(self) -> CacheReport:
        with self._lock:
            sizes = self._sizes()
            store = self.core.store
            entries = list(store.index.iter_entries())
            chunks = [oid for oid, e in entries if e.kind == ObjectType.CHUNK]
            held = self.promisor.remote_held(chunks)
            unpushed = sum(e.record_size for oid, e in entries if e.kind == ObjectType.CHUNK and oid not in held)
            evictable = sum(e.record_size for oid, e in entries if e.kind == ObjectType.CHUNK and oid in held)
            return CacheReport(
                budget=self.budget, used_bytes=sum(sizes.values()), packs=len(sizes), evictable_bytes=evictable,
                unpushed_bytes=unpushed, hit_bytes=self.state.hit_bytes, miss_bytes=self.state.miss_bytes,
                reads=self.state.reads, evicted_packs=self.state.evicted_packs,
                evicted_bytes=self.state.evicted_bytes, policy=self.state.policy, lazy=self.settings.lazy,
                promisors=list(self.promisor.remotes), pins=dict(self.state.pins),
            )  # fmt: skip

    # -- pins --
    def pin(self, rev: str) -> str:
        commit_id = graph.peel(self.core, graph.resolve(self.core, rev))
        with self._lock:
            self.state.pins[commit_id] = rev
            self._save()
        return commit_id

    def unpin(self, rev: str) -> str:
        with self._lock:
            for commit_id, label in list(self.state.pins.items()):
                if label == rev or commit_id.startswith(rev):
                    del self.state.pins[commit_id]
                    self._save()
                    return commit_id
            try:
                commit_id = graph.peel(self.core, graph.resolve(self.core, rev))
            except CkvcError:
                commit_id = ""
            if commit_id in self.state.pins:
                del self.state.pins[commit_id]
                self._save()
                return commit_id
        raise InvalidInputError(f"{rev!r} is not pinned (pinned: {', '.join(self.state.pins.values()) or 'nothing'})")

    # -- eviction --
    def prune(self, *, budget: int | None = None, protect: set[str] | None = None) -> PruneReport:
        """Drop remote-held chunk data in eviction order until the local packs fit
        ``budget`` (default: the configured one; no budget: nothing to do)."""
        started = time.monotonic()
        with self._lock:
            limit = self.budget if budget is None else budget
            sizes = self._sizes()
            used = sum(sizes.values())
            result = PruneReport(limit, used, used)
            if limit is None or used <= limit:
                self._save()
                return result
            store = self.core.store
            pinned = self._pinned_chunks()
            protect = protect or set()
            hot = self._head_packs()
            order = [n for n in eviction_order(self.state, self.state.policy, hot) if n in sizes and n not in protect]
            bases = self._delta_bases()
            # Passes until nothing more goes: a keyframe kept for deltas in a later
            # pack may go once that pack went.
            progress = True
            while progress and used > limit:
                progress = False
                for name in order:
                    if used <= limit:
                        break
                    if name not in self.state.packs:
                        continue  # gone in an earlier pass
                    freed = self._evict_pack(name, pinned, bases, result)
                    used -= freed
                    progress = progress or freed > 0
                order = [n for n in eviction_order(self.state, self.state.policy, hot) if n not in protect]
            result.after_bytes = sum(self._sizes().values())
            result.over_budget_bytes = max(0, result.after_bytes - limit)
            self.state.evicted_bytes += result.bytes_freed
            self.state.evicted_packs += result.packs_deleted + result.packs_rewritten
            self._save()
            del store
        result.seconds = time.monotonic() - started
        if self.on_evict is not None:
            self.on_evict(result)
        return result

    def _evict_pack(self, name: str, pinned: set[bytes], bases: dict[bytes, bytes], result: PruneReport) -> int:
        """Drop what may go of pack ``name``; returns the bytes freed."""
        store = self.core.store
        try:
            records, _ = store.pack_entries(name)
        except CkvcError:
            return 0  # damaged: fsck's business, never the cache's
        indexed = store.index.get_many([r.oid for r in records])
        mine = [(r, e) for r, e in zip(records, indexed, strict=True) if e is not None and e.pack == name]
        held = self.promisor.remote_held([r.oid for r, _ in mine if r.kind == ObjectType.CHUNK])
        drop = {r.oid for r, _ in mine if r.kind == ObjectType.CHUNK and r.oid in held and r.oid not in pinned}
        if not drop:
            return 0
        # A delta that stays anywhere keeps its base here: its reads never need the network.
        drop -= {base for oid, base in bases.items() if oid not in drop and base in drop}
        if not drop:
            return 0
        for oid in drop:
            bases.pop(oid, None)
        keep = [r for r, _ in mine if r.oid not in drop]
        size = self.state.packs[name].size if name in self.state.packs else 0
        with store.exclusive(EXCLUSIVE_TIMEOUT_S):
            new: list[tuple[str, list[RecordInfo]]] = []
            if keep:
                new = [self._rewrite(name, keep)]
            store.index.swap_packs(new, [(name, records)])
            store.reader.forget(name)
            gc_mod.retire_packs(store, [name])
        gc_mod.purge_retired(store)
        self.state.packs.pop(name, None)
        freed = size
        if new:
            info = store.pack_info(new[0][0])
            kept_size = 0 if info is None else info.size
            self.state.packs[new[0][0]] = PackState(size=kept_size, first=self.state.tick, last=self.state.tick)
            freed -= kept_size
            result.packs_rewritten += 1
        else:
            result.packs_deleted += 1
        result.bytes_freed += freed
        return freed

    def _rewrite(self, name: str, keep: list[RecordInfo]) -> tuple[str, list[RecordInfo]]:
        """A new sealed pack holding ``keep``'s records of pack ``name``, copied as stored."""
        store = self.core.store
        writer = PackWriter(store.backend)
        try:
            for r in keep:
                record = parse_record(store.reader.read(name, r.offset, r.record_size), r.record_size)
                if record.oid != r.oid:
                    raise CorruptObjectError("record holds a different object than the pack's TOC says")
                writer.append(record.oid, record.kind, record.codec, record.raw_size, record.payload, record.base)
            writer.seal()
        except BaseException:
            writer.abort()
            raise
        return writer.name, writer.entries

    def close(self) -> None:
        if self.backup is not None:
            self.backup.close()
        with self._lock:
            self._save()
            self.promisor.close()
            self.core.store.promisor = None
        if self.on_commit in self.core.commit_observers:
            self.core.commit_observers.remove(self.on_commit)
        if self.core.hybrid is self:
            self.core.hybrid = None


def attach(core: Repository) -> Hybrid | None:
    """The cache of a repository opened from a directory, when it has one (a lazy
    clone or a cache budget); None for a plain repository."""
    if core.dir is None or not (core.dir / "hybrid.json").is_file():
        return None
    settings = HybridSettings.load(core)
    return Hybrid(core, settings) if settings.active else None


def configure(core: Repository, current: Hybrid | None, **values: Any) -> Hybrid | None:
    """Set ``cache_size`` (bytes or None), ``auto_push`` (a remote or None) and/or
    ``promisors`` (the remotes asked for absent chunks) in ``.ckvc/hybrid.json``;
    returns the repository's cache as it now is."""
    from ckvc.remote.common import remotes_of

    core.require_writable("changing the config")
    settings = HybridSettings.load(core)
    if "cache_size" in values:
        size = values["cache_size"]
        if isinstance(size, str):
            size = parse_size(size)
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise InvalidInputError(f"cache_size must be a byte count or None, got {size!r}")
        if size is not None and not remotes_of(core).list():
            raise InvalidInputError("cache_size needs a remote to hold what the cache drops: add one first")
        settings.cache_size = size
    if "promisors" in values:
        names = values["promisors"]
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise InvalidInputError(f"promisors must be a list of remote names, got {names!r}")
        for name in names:
            remotes_of(core).get(name)  # UnknownRemoteError for a name not configured
        settings.promisors = list(dict.fromkeys(names))
    if "auto_push" in values:
        name = values["auto_push"]
        if name in ("", "none", "off"):
            name = None
        if name is not None:
            remotes_of(core).get(name)  # UnknownRemoteError for a name not configured
        settings.auto_push = name
    settings.save(core)
    if current is not None:
        current.settings = settings
        current.promisor.remotes = promisor_names(core, settings)
        current.set_unit()
        current.start_backup()
        if settings.cache_size is not None:
            current.prune()
        return current
    hybrid = attach(core)
    if hybrid is not None and settings.cache_size is not None:
        hybrid.prune()
    return hybrid
