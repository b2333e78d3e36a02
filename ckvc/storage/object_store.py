"""The object store: put objects into packs on a Backend, find them through the
index, and verify every byte read against its id. Writes are in object_writer.py;
what stays here (a little over 600 lines) is the read path, whose single reads,
delta chains and coalesced reads share their checks."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ckvc.chunking import MAX_CHUNK_SIZE
from ckvc.codecs import registry
from ckvc.codecs.codec_ids import CODEC_NAMES, RAW, WHOLE_CODECS, ZSTD
from ckvc.codecs.frames import WHOLE_DECODERS
from ckvc.codecs.records import (
    BASE_HEAD_SIZE,
    WHOLE,
    BaseInfo,
    base_info,
    base_to_decode,
    check_base_link,
    is_keyframe_delta,
)
from ckvc.errors import CorruptObjectError, DamagedIndexError, ObjectNotFoundError, ReadOnlyRepositoryError
from ckvc.ids import Buffer, ObjectType, object_id
from ckvc.storage.backend import Backend, KeyInfo
from ckvc.storage.index import AnyIndex, Index, IndexEntry, MemoryIndex, rebuild_local_index
from ckvc.storage.local import LocalBackend
from ckvc.storage.locks import GC_INTENT_LOCK, GC_LOCK, PIN_TIMEOUT_S, StoreLocks
from ckvc.storage.object_writer import ObjectWriter
from ckvc.storage.packs import (
    PACK_DIR,
    RECORD_HEADER_SIZE,
    PackReader,
    Record,
    RecordInfo,
    copied_pack_name,
    is_pack_name,
    pack_key,
    parse_record,
    parse_record_header,
    toc_copy_name,
)

if TYPE_CHECKING:  # numpy and the codecs load with the first chunk: metadata reads need neither
    import numpy as np

    from ckvc.codecs import Codec

# Names other modules import from here.
__all__ = ["GC_INTENT_LOCK", "GC_LOCK", "PIN_TIMEOUT_S", "BaseInfo", "ObjectStore", "ObjectWriter", "StoredObject"]

DEFAULT_MAX_PACK_SIZE = 256 << 20
INDEX_DIR = "index"
# Decoded links of delta chains, so that consecutive checkouts (and chains that
# share links) decode each base once. Bounded per thread: part of the memory budget.
BASE_CACHE_BYTES = 32 << 20


def _raw_direct(entry: IndexEntry, size: int) -> bool:
    """A record stored raw whose payload is exactly the destination: read straight into it."""
    return entry.codec == RAW and entry.record_size == RECORD_HEADER_SIZE + size


def parse_checked(raw: memoryview, oid: bytes, entry: IndexEntry, kind: ObjectType | None = None) -> Record:
    """The record in ``raw``, which must be the object and the record its index entry names."""
    record = parse_record(raw, entry.record_size)
    check_identity(record.oid, record.kind, oid, kind)
    if (record.raw_size, record.codec, record.kind) != (entry.raw_size, entry.codec, entry.kind):
        raise CorruptObjectError("record header does not match its index entry")
    return record


def check_identity(record_oid: bytes, record_kind: int, oid: bytes, kind: ObjectType | None) -> None:
    """A record read at an index entry's place must be the object the index names."""
    if record_oid != oid:
        raise CorruptObjectError("record holds a different object than the index says")
    if kind is not None and record_kind != kind:
        raise CorruptObjectError(f"expected a {kind.name.lower()} object, found type {record_kind}")


# The most a zstd frame expands: an RLE block is 4 bytes for up to 128 KiB.
_ZSTD_MAX_RATIO = 1 << 15
_ZSTD_BLOCK = 128 << 10


def _check_sizes(oid: bytes, entry: IndexEntry) -> None:
    """An entry's type, codec and raw size must be possible for its record size,
    before a buffer of raw_size bytes is allocated: chunks are at most
    MAX_CHUNK_SIZE, a raw record holds exactly its payload, and metadata objects
    are raw or one zstd frame."""
    payload = entry.record_size - RECORD_HEADER_SIZE
    if entry.kind == ObjectType.CHUNK:
        ok = entry.raw_size <= MAX_CHUNK_SIZE and entry.codec in CODEC_NAMES
    elif entry.kind in (ObjectType.SNAPSHOT, ObjectType.COMMIT, ObjectType.TAG):
        ok = entry.codec == ZSTD and entry.raw_size <= _ZSTD_MAX_RATIO * payload + _ZSTD_BLOCK
    else:
        raise CorruptObjectError(f"unknown object type {entry.kind} in the index", object_id=oid.hex())
    if entry.codec == RAW:
        ok = entry.raw_size == payload
    if payload < 0 or not ok:
        raise CorruptObjectError(
            f"a {CODEC_NAMES.get(entry.codec, entry.codec)} record of {entry.record_size} bytes cannot hold "
            f"{entry.raw_size} bytes of type {entry.kind}",
            object_id=oid.hex(),
        )


# A run read in one request: at most this many records (two buffers each for
# preadv, whose limit is 1024) and this much scratch for the records that are
# not read straight into their destinations.
MAX_RUN_RECORDS = 500
MAX_RUN_SCRATCH = 64 << 20


def _runs(reads: list[tuple[IndexEntry, bytes, np.ndarray]]) -> Iterator[list[tuple[IndexEntry, bytes, np.ndarray]]]:
    """Split reads sorted by offset into runs of records that lie back to back."""
    run: list[tuple[IndexEntry, bytes, np.ndarray]] = []
    end = scratch = 0
    for read in reads:
        entry, _oid, out = read
        cost = RECORD_HEADER_SIZE if _raw_direct(entry, len(out)) else entry.record_size
        if run and (entry.offset != end or len(run) >= MAX_RUN_RECORDS or scratch + cost > MAX_RUN_SCRATCH):
            yield run
            run, scratch = [], 0
        run.append(read)
        end = entry.offset + entry.record_size
        scratch += cost
    if run:
        yield run


class _PlainCache:
    """Decoded delta bases, an LRU bounded by total size, one per thread: a base
    is only ever used by the thread that decoded it, so an evicted buffer can be
    handed out again at once, and decoding bases touches no fresh memory."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._local = threading.local()

    def _items(self) -> collections.OrderedDict[bytes, np.ndarray]:
        items: collections.OrderedDict[bytes, np.ndarray] | None = getattr(self._local, "items", None)
        if items is None:
            items = self._local.items = collections.OrderedDict()
            self._local.spare = []
        return items

    def get(self, oid: bytes) -> np.ndarray | None:
        items = self._items()
        item = items.get(oid)
        if item is not None:
            items.move_to_end(oid)
        return item

    def buffer(self, size: int) -> np.ndarray:
        """A buffer to decode a base into: a recycled one when there is one."""
        self._items()
        spare: list[np.ndarray] = self._local.spare
        for i, buf in enumerate(spare):
            if len(buf) == size:
                return spare.pop(i)
        import numpy as np

        return np.empty(size, dtype=np.uint8)

    def put(self, oid: bytes, plain: np.ndarray) -> None:
        items = self._items()
        spare: list[np.ndarray] = self._local.spare
        if len(plain) > self.max_bytes:
            spare[:] = [plain]
            return
        items[oid] = plain
        total = sum(len(v) for v in items.values())
        while total > self.max_bytes:
            _, dropped = items.popitem(last=False)
            total -= len(dropped)
            spare[:] = [dropped]  # keep one to recycle; the rest go back to the allocator


@dataclass(frozen=True, slots=True)
class StoredObject:
    """What the index knows about one object, plus its pack location."""

    oid: bytes
    kind: ObjectType
    codec: int
    raw_size: int
    stored_size: int
    pack: str


class Promisor(Protocol):
    """Where chunks this store lacks can be had (git's promisor remote): a lazy
    clone's remote, or the remote holding what the cache dropped. Installed on
    ``ObjectStore.promisor`` by ckvc.hybrid.cache; read paths ask :meth:`ObjectStore.ensure`
    before they read, and nothing else in the store fetches."""

    def entry(self, oid: bytes) -> IndexEntry | None:
        """The catalog entry of a chunk a promisor remote holds (no network); None if none does."""
        ...

    def fetch(self, oids: Sequence[bytes], landing: Mapping[bytes, memoryview] | None = None) -> set[bytes]:
        """Make ``oids`` (chunks) local, each verified against its id (delta bases
        too); RemoteUnavailableError when the remote cannot be reached, nothing written.
        ``landing``: buffers (of their sizes) the caller reads some of them into;
        returns those it filled with their verified plain bytes on the way."""
        ...

    def accessed(self, entries: Sequence[IndexEntry], hit_bytes: int, miss_bytes: int) -> None:
        """A read used these (now local) entries: ``hit_bytes`` of stored records
        were here, ``miss_bytes`` had to be fetched; the cache's hit-rate and
        recency bookkeeping."""
        ...

    def settle(self) -> None:
        """No read is in flight (:meth:`ObjectStore.reading`): the cache may evict
        to its budget now. Called with new reads held off until it returns."""
        ...


# Retired packs on a backend without rename (object stores): gc writes a record
# naming them before it deletes them, and pack enumeration skips every pack a
# record names, so a pack being deleted is never indexed again
# (docs/DESIGN.md, "Backends: local mechanisms on an object store").
RETIRED_PREFIX = "retired-"
RETIRED_SUFFIX = ".list"


@dataclass(frozen=True)
class PackListing:
    """One listing of a store's pack folder (:meth:`ObjectStore.pack_listing`)."""

    packs: list[str]  # sealed, not retired, sorted
    copied: set[str]  # those with a TOC copy beside them
    sizes: dict[str, int]  # pack -> bytes, when asked for
    orphan_copies: list[str]  # keys of TOC copies whose pack is gone (a gc deleted it): what gc deletes


class ObjectStore:
    """Objects in packs on a ``backend``, found through ``index`` (None: the LMDB
    index beside a LocalBackend's directory, a MemoryIndex otherwise).

    ``ObjectStore(path)`` (a ``.ckvc`` directory) is today's call: the same as
    :meth:`open_local`."""

    def __init__(self, backend: Backend | Path, index: AnyIndex | None = None, *, readonly: bool | None = None) -> None:
        if isinstance(backend, (str, os.PathLike)):
            backend, readonly = self._local(Path(backend), readonly)
        self.backend = backend
        self.readonly = backend.readonly if readonly is None else readonly
        self.local_root: Path | None = backend.root if isinstance(backend, LocalBackend) else None
        # A damaged index does not stop the repository from opening: every use
        # raises DamagedIndexError naming the repair, and rebuild_index() replaces
        # it without touching it.
        self._index: AnyIndex | None = index
        self._index_error: DamagedIndexError | None = None
        if index is None:
            if self.local_root is not None:
                try:
                    self._index = Index(self.local_root / INDEX_DIR, readonly=self.readonly)
                except DamagedIndexError as exc:
                    self._index_error = exc
            else:
                self._index = MemoryIndex()
        self.reader = PackReader(backend)
        self.locks = StoreLocks(backend)
        self._refresh_lock = threading.Lock()
        self._base_cache = _PlainCache(BASE_CACHE_BYTES)
        self.promisor: Promisor | None = None  # set on lazy clones and bounded caches
        self._reads = 0  # reads in flight (reading())
        self._reads_lock = threading.RLock()

    @staticmethod
    def _local(root: Path, readonly: bool | None) -> tuple[LocalBackend, bool]:
        index_dir = root / INDEX_DIR
        if readonly is None:
            readonly = not os.access(index_dir if index_dir.exists() else root, os.W_OK)
        return LocalBackend(root, readonly=readonly), readonly

    @classmethod
    def open_local(cls, root: Path, *, readonly: bool | None = None) -> ObjectStore:
        """The store of the ``.ckvc`` directory ``root``, its LMDB index beside it.
        ``readonly``: open the index read-only (None: when the index directory, or
        the repository if it has none yet, is not writable)."""
        backend, readonly = cls._local(root, readonly)
        return cls(backend, readonly=readonly)

    @property
    def root(self) -> Path:
        """The ``.ckvc`` directory of a local store."""
        if self.local_root is None:
            raise AttributeError("a store on a non-local backend has no directory")
        return self.local_root

    @property
    def pack_dir(self) -> Path:
        return self.root / PACK_DIR

    def pin(self, timeout: float = PIN_TIMEOUT_S) -> contextlib.AbstractContextManager[None]:
        """Shared lock held by writers: gc's sweep waits for them and they for it."""
        return self.locks.pin(timeout)

    def exclusive(self, timeout: float) -> contextlib.AbstractContextManager[None]:
        """gc's critical section: no writer is in flight while it is held."""
        return self.locks.exclusive(timeout)

    @property
    def index(self) -> AnyIndex:
        if self._index is None:
            assert self._index_error is not None
            raise self._index_error
        return self._index

    def close(self) -> None:
        self.reader.close()
        if self._index is not None:
            self._index.close()

    # ---- packs --------------------------------------------------------------
    def packs(self) -> list[str]:
        """Names of the sealed packs, sorted, without those a gc has retired."""
        return self.pack_listing().packs

    def pack_listing(self, *, sizes: bool = False) -> PackListing:
        """:meth:`packs`, the names of those packs that have a TOC copy beside them
        (``packs.toc_copy_name``; remotes only) and, with ``sizes``, each pack's
        size as the listing gives it (``Backend.list_sizes``), from one listing."""
        where = f"{PACK_DIR}/"
        keys = (
            self.backend.list_sizes(where, recursive=False)
            if sizes
            else dict.fromkeys(self.backend.list(where, recursive=False), 0)
        )
        by_name = {key.rpartition("/")[2]: size for key, size in keys.items()}
        listed = sorted(n for n in by_name if is_pack_name(n))
        copies = {n: pack for n in by_name if (pack := copied_pack_name(n)) is not None}
        orphans = sorted(pack_key(n) for n, pack in copies.items() if pack not in by_name)
        retired = self.retired_packs()
        packs = [n for n in listed if n not in retired] if retired else listed
        copied = set(copies.values())
        return PackListing(
            packs, {n for n in packs if n in copied}, {n: by_name[n] for n in packs} if sizes else {}, orphans
        )

    def know_pack_sizes(self, sizes: Mapping[str, int]) -> None:
        """Pack sizes from a listing (packs never change once sealed): no HEAD per
        pack at its first read."""
        for name, size in sizes.items():
            self.reader.know_size(name, size)

    def pack_entries_from_copy(self, name: str) -> list[RecordInfo] | None:
        """Pack ``name``'s entries from its TOC copy (one small GET rather than
        ranged reads of the pack); None when there is none or it is damaged."""
        data = self.backend.get(pack_key(toc_copy_name(name)))
        return None if data is None else self.reader.entries_from_copy(name, data)

    def retirement_records(self) -> list[str]:
        """Keys of gc's records of packs being deleted (object stores only)."""
        if self.backend.capabilities.atomic_rename:
            return []
        return list(self.backend.list(f"{PACK_DIR}/{RETIRED_PREFIX}", recursive=False))

    def retired_packs(self) -> set[str]:
        names: set[str] = set()
        for key in self.retirement_records():
            data = self.backend.get(key)
            if data is not None:
                names.update(n for n in data.decode(errors="replace").split("\n") if is_pack_name(n))
        return names

    def indexed_records(self, names: Iterable[str]) -> dict[str, list[RecordInfo]]:
        """Per pack of ``names``, the records the index names it for (the canonical
        copies it holds): what forgetting the pack takes out of the index."""
        found: dict[str, list[RecordInfo]] = {name: [] for name in names}
        for oid, e in self.index.iter_entries():
            if e.pack in found:
                found[e.pack].append(RecordInfo(oid, e.kind, e.codec, e.offset, e.record_size, e.raw_size))
        return found

    def pack_entries(self, name: str, *, header: bool = True) -> tuple[list[RecordInfo], bool]:
        """(entries, from_toc) of pack ``name``: its TOC, or what a scan recovers
        (``header``: PackReader.entries)."""
        return self.reader.entries(name, header=header)

    def pack_info(self, name: str) -> KeyInfo | None:
        """Size and modification time of pack ``name`` (None: it is gone)."""
        return self.backend.stat(pack_key(name))

    def temporaries(self) -> list[KeyInfo]:
        """Packs being written, or left by writers that died."""
        return self.backend.temporaries(f"{PACK_DIR}/")

    # ---- lookup -------------------------------------------------------------
    def has(self, oid: bytes) -> bool:
        return self.index.has(oid)

    def locate(self, oid: bytes) -> IndexEntry:
        """The index entry of ``oid``, checked for sizes a reader could be made to
        allocate (docs/FORMAT.md §7.5): CorruptObjectError rather than MemoryError."""
        entry = self.index.get(oid)
        if entry is None and self.refresh():
            entry = self.index.get(oid)
        if entry is None:
            raise ObjectNotFoundError(f"object {oid.hex()} not found", object_id=oid.hex())
        _check_sizes(oid, entry)
        return entry

    def promised_size(self, oid: bytes) -> tuple[int, int] | None:
        """(type, raw size) of an object this store lacks and its promisor can fetch."""
        entry = None if self.promisor is None else self.promisor.entry(oid)
        return None if entry is None else (entry.kind, entry.raw_size)

    def ensure(self, oids: Sequence[bytes], landing: Mapping[bytes, memoryview] | None = None) -> set[bytes]:
        """Before a read of chunks ``oids``: fetch through the promisor those not
        here, and the absent delta bases of those that are (a cache may have
        dropped a keyframe its deltas still need), in one batch. Without a
        promisor nothing happens and a read of an absent chunk raises as before.
        ``landing``: the read's buffers by chunk id; returns the chunks the fetch
        decoded and verified straight into them (the read need not read those again)."""
        if self.promisor is None or not oids:
            return set()
        wanted = list(dict.fromkeys(oids))
        entries = self.index.get_many(wanted)
        missing = [oid for oid, e in zip(wanted, entries, strict=True) if e is None]
        present = [(oid, e) for oid, e in zip(wanted, entries, strict=True) if e is not None]
        used = [e for _, e in present]
        for oid, e in present:
            below = None if e.codec in WHOLE_CODECS else self.base_info(oid).base
            while below is not None:
                entry = self.index.get(below)
                if entry is None:
                    missing.append(below)
                    break
                used.append(entry)
                below = None if entry.codec in WHOLE_CODECS else self.base_info(below).base
        hits = sum(e.record_size for _, e in present)
        fetched = 0
        landed: set[bytes] = set()
        if missing:
            missing = list(dict.fromkeys(missing))
            landed = self.promisor.fetch(missing, landing)
            fetched = sum(e.record_size for e in self.index.get_many(missing) if e is not None)
        if missing:
            used += [e for e in self.index.get_many([*wanted, *missing]) if e is not None]
        self.promisor.accessed(used, hits, fetched)
        return landed

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """One read of chunks (a checkout, a load_into): the cache evicts only
        when the last read in flight has returned (``Promisor.settle``), never
        under one, since eviction deletes and rewrites packs."""
        with self._reads_lock:
            self._reads += 1
        try:
            yield
        finally:
            with self._reads_lock:
                self._reads -= 1
                if self._reads == 0 and self.promisor is not None:
                    self.promisor.settle()

    def unless_reading(self, fn: Callable[[], object]) -> bool:
        """Run ``fn`` now if no read is in flight, holding new ones off until it
        returns; False (not run) otherwise: the last read's settle will."""
        with self._reads_lock:
            if self._reads:
                return False
            fn()
            return True

    def stat(self, oid: bytes) -> StoredObject:
        """What the index knows of ``oid``; for a chunk only a promisor remote holds
        (a lazy clone), what its catalog knows (``pack`` is then the remote's pack)."""
        try:
            e = self.locate(oid)
        except ObjectNotFoundError:
            promised = None if self.promisor is None else self.promisor.entry(oid)
            if promised is None:
                raise
            e = promised
        return StoredObject(oid, ObjectType(e.kind), e.codec, e.raw_size, e.record_size, e.pack)

    def refresh(self) -> int:
        """Index sealed packs that the index does not know yet (written by a
        process that died before indexing them, or after the index was lost).
        Returns how many packs were added."""
        with self._refresh_lock, self.pin():
            known = self.index.indexed_packs()
            added = 0
            for name in self.packs():
                if name in known:
                    continue
                try:
                    entries, _ = self.reader.entries(name)
                except (CorruptObjectError, ObjectNotFoundError):
                    continue  # damaged (fsck reports it) or removed by gc meanwhile
                self.index.add_pack(name, entries)
                added += 1
            return added

    def _fill(self, index: AnyIndex) -> None:
        for name in self.packs():
            try:
                entries, _ = self.reader.entries(name)
            except (CorruptObjectError, ObjectNotFoundError):
                continue  # damaged (fsck reports it)
            index.add_pack(name, entries)

    def rebuild_index(self) -> int:
        """Build a new index from the packs alone, beside the old one, which is
        never opened (it may be damaged: a truncated LMDB file is a SIGBUS when
        mapped), and put it in its place. Writers and gc are held off meanwhile;
        other processes switch to the new index on their next write. Returns the
        object count."""
        if self.readonly:
            raise ReadOnlyRepositoryError(f"cannot rebuild the index of a read-only repository {self.local_root}")
        with self.exclusive(PIN_TIMEOUT_S), self._refresh_lock:
            if self.local_root is None:
                fresh = MemoryIndex()
                self._fill(fresh)
                self._index = fresh
                return fresh.count()
            if self._index is not None:
                self._index.close()
                self._index = None
            self._index = rebuild_local_index(self.local_root, INDEX_DIR, self._fill)
            self._index_error = None
            return self._index.count()

    def iter_stored(self, prefix: bytes = b"") -> Iterator[StoredObject]:
        for oid, e in self.index.iter_entries(prefix):
            yield StoredObject(oid, ObjectType(e.kind), e.codec, e.raw_size, e.record_size, e.pack)

    # ---- reads --------------------------------------------------------------
    def read(self, oid: bytes, kind: ObjectType | None = None) -> Buffer:
        """The object's plain bytes, verified against ``oid``."""
        entry = self.locate(oid)
        try:
            return self._read_entry(oid, entry, kind)
        except ObjectNotFoundError:
            # gc may have repacked the object and removed the pack between our
            # index lookup and the read: look it up once more.
            self.reader.forget(entry.pack)
            self.index.reopen_if_replaced()  # or the index was rebuilt under us
            retry = self.locate(oid)
            if (retry.pack, retry.offset) == (entry.pack, entry.offset):
                raise
            return self._read_entry(oid, retry, kind)

    def _read_entry(self, oid: bytes, entry: IndexEntry, kind: ObjectType | None) -> Buffer:
        decode_whole = WHOLE_DECODERS.get(entry.codec)
        if decode_whole is not None:  # raw or one zstd frame, as every metadata object: no numpy
            with self._naming(oid, entry):
                record = self._record(oid, entry, kind)
                if record.base is None:
                    plain = bytes(decode_whole(record.payload, entry.raw_size))  # the record's buffer is reused
                    self._verify(oid, record.kind, plain, None)
                    return plain
        import numpy as np

        out = np.empty(entry.raw_size, dtype=np.uint8)
        self._decode_entry(oid, entry, kind, out)
        return out.data

    def _record(self, oid: bytes, entry: IndexEntry, kind: ObjectType | None, slot: int = 0) -> Record:
        """The parsed record, in this thread's read buffer ``slot`` (valid until the next read into it)."""
        return parse_checked(
            self.reader.read_reusing(entry.pack, entry.offset, entry.record_size, slot), oid, entry, kind
        )

    @contextlib.contextmanager
    def _naming(self, oid: bytes, entry: IndexEntry) -> Iterator[None]:
        """A decode's errors as CorruptObjectError naming the object and its pack."""
        hex_id = oid.hex()
        try:
            yield
        except CorruptObjectError as exc:
            if exc.object_id and exc.object_id != hex_id:
                raise  # a damaged base, already named
            raise CorruptObjectError(f"{exc.reason} in pack {entry.pack}", object_id=hex_id) from None
        except ValueError as exc:  # an unknown type byte
            raise CorruptObjectError(f"unreadable record in pack {entry.pack}: {exc}", object_id=hex_id) from None

    def _decode_entry(self, oid: bytes, entry: IndexEntry, kind: ObjectType | None, out: np.ndarray) -> None:
        """Decode the object into ``out`` and verify it against ``oid``."""
        with self._naming(oid, entry):
            if _raw_direct(entry, len(out)):
                self._verify(oid, self._read_raw_into(oid, entry, kind, out), out.data, None)
            else:
                self._decode_record(oid, entry, self._record(oid, entry, kind), out)

    def _decode_record(self, oid: bytes, entry: IndexEntry, record: Record, out: np.ndarray) -> None:
        """Decode a parsed record (through its base chain) into ``out`` and verify it."""
        if not self._decode_on_keyframe(record, out):
            base = self._base_plain(record, len(out))
            registry.decode_chunk_into(record.codec, record.payload, out, base)
        self._verify(oid, record.kind, out.data, record.base)

    def _verify(self, oid: bytes, record_kind: int, plain: Buffer, base_oid: bytes | None) -> None:
        if object_id(ObjectType(record_kind), plain) != oid:
            # A delta whose base chain is damaged decodes to wrong bytes: name the culprit.
            if base_oid is not None:
                self._verify_chain(base_oid)
            raise CorruptObjectError("content does not match its id")

    def _read_raw_into(self, oid: bytes, entry: IndexEntry, kind: ObjectType | None, out: np.ndarray) -> int:
        """A record stored raw: its payload read straight into ``out`` (no second copy),
        its header checked like :meth:`_record` does. Returns the record's type."""
        head = self.reader.read_head_into(entry.pack, entry.offset, entry.record_size, RECORD_HEADER_SIZE, out.data)
        return self._check_raw_head(head, oid, entry, kind, len(out))

    @staticmethod
    def _check_raw_head(head: memoryview, oid: bytes, entry: IndexEntry, kind: ObjectType | None, size: int) -> int:
        record_kind, codec, raw_size, payload_size, record_oid, base = parse_record_header(head)
        check_identity(record_oid, record_kind, oid, kind)
        if (
            codec != RAW
            or base is not None
            or raw_size != payload_size
            or payload_size != size
            or record_kind != entry.kind
        ):
            raise CorruptObjectError("record header does not match its index entry")
        return record_kind

    def _decode_on_keyframe(self, record: Record, out: np.ndarray) -> bool:
        """A delta one link from a whole chunk (all ckvc writes) whose base is not
        cached: the keyframe decodes straight into ``out`` and the residual is added
        in place, so a checkout touches no buffer besides its destination. False
        for every other record, left to the general path."""
        if not is_keyframe_delta(record.codec, record.base, record.payload):
            return False
        assert record.base is not None
        if self._base_cache.get(record.base) is not None:
            return False
        keyframe = self._base_record(record.base, len(out), slot=1)
        if keyframe.codec not in WHOLE_CODECS:  # depth 1: the base must be stored whole
            raise CorruptObjectError("delta chain depth 1 where its base is not whole", object_id=record.base.hex())
        from ckvc.codecs.delta import apply_delta

        registry.decode_chunk_into(keyframe.codec, keyframe.payload, out)
        apply_delta(record.payload, out, None)
        return True

    def _base_plain(self, record: Record, size: int) -> np.ndarray | None:
        """The plain bytes of a record's base (delta or lossy residual): decoded
        along its chain without verifying each link (the final id check covers
        the whole chain)."""
        wanted = base_to_decode(record.codec, record.base, record.payload)
        return None if wanted is None else self._plain_unverified(wanted[0], size, wanted[1])

    def _plain_unverified(self, oid: bytes, size: int, depth: int) -> np.ndarray:
        cached = self._base_cache.get(oid)
        if cached is not None:
            return cached
        record = self._base_record(oid, size, slot=1 + depth)
        below = check_base_link(oid, record.codec, record.base, record.payload, depth)
        base = None if below is None else self._plain_unverified(below, size, depth - 1)
        out = self._base_cache.buffer(size)
        registry.decode_chunk_into(record.codec, record.payload, out, base)
        self._base_cache.put(oid, out)
        return out

    def _base_record(self, oid: bytes, size: int, slot: int) -> Record:
        """The record of a delta's base, which must have the delta's size."""
        entry = self.locate(oid)
        if entry.raw_size != size:
            raise CorruptObjectError(f"delta base {oid.hex()[:12]} is {entry.raw_size} bytes, expected {size}")
        return self._record(oid, entry, ObjectType.CHUNK, slot=slot)

    def _verify_chain(self, oid: bytes) -> None:
        """Verify every link of a delta chain; raises naming the first damaged one."""
        self.read(oid, ObjectType.CHUNK)

    def base_info(self, oid: bytes) -> BaseInfo:
        """What a chunk is stored against, from its record's head alone."""
        entry = self.locate(oid)
        if entry.codec in WHOLE_CODECS:
            return WHOLE
        head = self.reader.read(entry.pack, entry.offset, RECORD_HEADER_SIZE + BASE_HEAD_SIZE)
        base = parse_record_header(head)[5]
        try:
            return base_info(entry.codec, base, memoryview(head)[RECORD_HEADER_SIZE:])
        except CorruptObjectError as exc:
            if exc.object_id:
                raise
            raise CorruptObjectError(exc.reason, object_id=oid.hex()) from None

    def delta_base(self, oid: bytes) -> bytes | None:
        """The id of the chunk ``oid`` is stored against, if any (what gc keeps alive with it)."""
        return self.base_info(oid).base

    def read_into(self, oid: bytes, out: memoryview) -> None:
        """Read a chunk straight into ``out``, which must be exactly its size."""
        import numpy as np

        target = np.frombuffer(out, dtype=np.uint8)
        entry = self.locate(oid)
        if entry.raw_size != len(target):
            raise CorruptObjectError(
                f"chunk is {entry.raw_size} bytes where {len(target)} were expected", object_id=oid.hex()
            )
        try:
            self._decode_entry(oid, entry, ObjectType.CHUNK, target)
        except ObjectNotFoundError:
            self.reader.forget(entry.pack)
            self.index.reopen_if_replaced()
            retry = self.locate(oid)
            if (retry.pack, retry.offset) == (entry.pack, entry.offset):
                raise
            self._decode_entry(oid, retry, ObjectType.CHUNK, target)

    def read_many_into(self, items: Sequence[tuple[bytes, memoryview]]) -> None:
        """Read many chunks into their destinations (each exactly its chunk's size)
        with few backend requests: located, ordered by pack and offset, and read
        by :meth:`read_located_into`. Every id is verified, deltas through their
        base as :meth:`read_into` does, and the errors are its errors
        (``object_id`` names the object). Thread-safe: callers run batches on an
        executor."""
        located = [(oid, self.locate(oid), out) for oid, out in items]
        located.sort(key=lambda item: (item[1].pack, item[1].offset))
        self.read_located_into(located)

    def read_located_into(self, items: Sequence[tuple[bytes, IndexEntry, memoryview]]) -> None:
        """:meth:`read_many_into` for chunks the caller located already (one index
        lookup per chunk in all), ordered by pack and offset as ``read.plan``
        orders them: each run of adjacent records read with one ``readv_into``
        whose buffers are the raw records' destinations themselves (no copy) and a
        scratch buffer for the rest, which are decoded from it. An entry gone stale
        (gc repacked meanwhile) is looked up again by the exact path."""
        import numpy as np

        reads: list[tuple[IndexEntry, bytes, np.ndarray]] = []
        for oid, entry, out in items:
            _check_sizes(oid, entry)
            target = np.frombuffer(out, dtype=np.uint8)
            if entry.raw_size != len(target):
                raise CorruptObjectError(
                    f"chunk is {entry.raw_size} bytes where {len(target)} were expected", object_id=oid.hex()
                )
            if reads and entry.pack != reads[0][0].pack:
                self._read_pack_runs(reads)
                reads = []
            reads.append((entry, oid, target))
        if reads:
            self._read_pack_runs(reads)

    def _read_pack_runs(self, reads: list[tuple[IndexEntry, bytes, np.ndarray]]) -> None:
        for run in _runs(reads):
            self._read_run(run[0][0].pack, run)

    def _read_run(self, pack: str, run: list[tuple[IndexEntry, bytes, np.ndarray]]) -> None:
        """One request for records that lie back to back in ``pack``, then decode each."""
        scratch_size = sum(RECORD_HEADER_SIZE if _raw_direct(e, len(out)) else e.record_size for e, _oid, out in run)
        scratch = self.reader.buffer(-2, scratch_size)
        buffers: list[memoryview] = []
        at = 0
        for entry, _oid, out in run:
            if _raw_direct(entry, len(out)):
                buffers += [scratch[at : at + RECORD_HEADER_SIZE], out.data.cast("B")]
                at += RECORD_HEADER_SIZE
            else:
                buffers.append(scratch[at : at + entry.record_size])
                at += entry.record_size
        first = run[0][0]
        try:
            self.reader.readv(pack, first.offset, buffers)
        except (CorruptObjectError, ObjectNotFoundError):
            # A pack gc removed meanwhile, or one cut short: one read per chunk
            # (retrying after gc, naming each damaged object) is the slow exact path.
            for _entry, oid, out in run:
                self.read_into(oid, out.data)
            return
        part = iter(buffers)
        for entry, oid, out in run:
            with self._naming(oid, entry):
                if _raw_direct(entry, len(out)):
                    head = next(part)
                    next(part)
                    self._verify(
                        oid, self._check_raw_head(head, oid, entry, ObjectType.CHUNK, len(out)), out.data, None
                    )
                else:
                    self._decode_record(oid, entry, parse_checked(next(part), oid, entry, ObjectType.CHUNK), out)

    def prefetch(self, oid: bytes, entry: IndexEntry | None = None) -> None:
        """Start reading a chunk's record from disk in the background (a hint:
        errors are left to the read that follows). ``entry``: its index entry,
        when the caller has it."""
        entry = entry or self.index.get(oid)
        if entry is not None:
            self.reader.prefetch(entry.pack, entry.offset, entry.record_size)

    def prefetch_span(self, pack: str, offset: int, size: int) -> None:
        """A read-ahead hint for ``size`` bytes of ``pack`` from ``offset`` (several
        neighbouring records at once)."""
        self.reader.prefetch(pack, offset, size)

    def verify(self, oid: bytes) -> None:
        """Read and verify one object; raises CorruptObjectError or ObjectNotFoundError."""
        self.read(oid)

    # ---- writes -------------------------------------------------------------
    def writer(self, codec: Codec, max_pack_size: int = DEFAULT_MAX_PACK_SIZE) -> ObjectWriter:
        self.backend.sweep(f"{PACK_DIR}/")  # what killed or failed writers left
        return ObjectWriter(self, codec, max_pack_size)
