"""The object store: put objects into packs, find them through the index, and
verify every byte read against its id."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import threading
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ckvc.chunking import MAX_CHUNK_SIZE
from ckvc.codecs import (
    CODEC_NAMES,
    DELTA,
    QUANT,
    RAW,
    WHOLE_CODECS,
    ZSTD,
    Buffer,
    ChunkLayout,
    Codec,
    DeltaBase,
    apply_delta,
    decode_chunk_into,
    delta_header,
    encode_smallest,
)
from ckvc.codecs.lossy import QUANT_HEAD_SIZE, quant_header
from ckvc.errors import (
    CorruptObjectError,
    DamagedIndexError,
    ObjectNotFoundError,
    ReadOnlyRepositoryError,
    StorageIOError,
    UnsupportedFormatError,
)
from ckvc.ids import ObjectType, object_id
from ckvc.storage.files import file_lock, fsync_dir
from ckvc.storage.index import Index, IndexEntry
from ckvc.storage.packs import (
    RECORD_HEADER_SIZE,
    PackReader,
    PackWriter,
    Record,
    list_packs,
    pack_entries,
    parse_record,
    parse_record_header,
    sweep_dead_temporaries,
)

DEFAULT_MAX_PACK_SIZE = 256 << 20
INDEX_DIR = "index"
# Decoded links of delta chains, so that consecutive checkouts (and chains that
# share links) decode each base once. Bounded per thread: part of the memory budget.
BASE_CACHE_BYTES = 32 << 20


def _check_identity(record_oid: bytes, record_kind: int, oid: bytes, kind: ObjectType | None) -> None:
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


class BaseInfo(NamedTuple):
    """A chunk's base (None: stored whole or lossy standalone), the age it records
    (commits since its base was written), and whether it decodes on its own
    without loss of meaning as a keyframe."""

    base: bytes | None
    age: int
    whole: bool


@dataclass(frozen=True, slots=True)
class StoredObject:
    """What the index knows about one object, plus its pack location."""

    oid: bytes
    kind: ObjectType
    codec: int
    raw_size: int
    stored_size: int
    pack: str


# Writers (commits, tags, index refreshes) hold a shared flock on this file while
# they work; gc takes it exclusively for its short critical section. So gc never
# removes an object that an in-flight writer deduplicated against, and a writer
# never sees an index entry that gc is about to drop.
GC_LOCK = "gc.lock"
GC_INTENT_LOCK = "gc-intent.lock"
PIN_TIMEOUT_S = 120.0


class ObjectStore:
    def __init__(self, root: Path, *, readonly: bool | None = None) -> None:
        """``readonly``: open the index read-only (None: when the index
        directory, or the repository if it has none yet, is not writable)."""
        self.root = root
        self.pack_dir = root / "packs"
        index_dir = root / INDEX_DIR
        if readonly is None:
            readonly = not os.access(index_dir if index_dir.exists() else root, os.W_OK)
        self.readonly = readonly
        # A damaged index does not stop the repository from opening: every use
        # raises DamagedIndexError naming the repair, and rebuild_index() replaces
        # it without touching it.
        self._index: Index | None = None
        self._index_error: DamagedIndexError | None = None
        try:
            self._index = Index(index_dir, readonly=readonly)
        except DamagedIndexError as exc:
            self._index_error = exc
        self.reader = PackReader(self.pack_dir)
        self._refresh_lock = threading.Lock()
        self._exclusive_held = False
        self._pins = threading.local()  # this thread's pin, if it holds one
        self._base_cache = _PlainCache(BASE_CACHE_BYTES)

    @contextlib.contextmanager
    def pin(self, timeout: float = PIN_TIMEOUT_S) -> Iterator[None]:
        """Shared lock held by writers: gc's sweep waits for them and they for it."""
        # Re-entrant: a pinned writer may pin again (an index refresh on a lookup
        # miss). Taking the intent lock again there would deadlock against a gc
        # waiting for this very pin.
        held: int = getattr(self._pins, "depth", 0)
        if self._exclusive_held or held:
            yield
            return
        # Passing through the intent lock first gives a waiting gc priority: flock
        # would otherwise let a stream of overlapping writers starve it.
        with file_lock(self.root / GC_INTENT_LOCK, shared=True, timeout=timeout):
            pass
        with file_lock(self.root / GC_LOCK, shared=True, timeout=timeout):
            self._pins.depth = 1
            try:
                yield
            finally:
                self._pins.depth = 0

    @contextlib.contextmanager
    def exclusive(self, timeout: float) -> Iterator[None]:
        """gc's critical section: no writer is in flight while it is held."""
        with (
            file_lock(self.root / GC_INTENT_LOCK, shared=False, timeout=timeout),
            file_lock(self.root / GC_LOCK, shared=False, timeout=timeout),
        ):
            self._exclusive_held = True
            try:
                yield
            finally:
                self._exclusive_held = False

    @property
    def index(self) -> Index:
        if self._index is None:
            assert self._index_error is not None
            raise self._index_error
        return self._index

    def close(self) -> None:
        self.reader.close()
        if self._index is not None:
            self._index.close()

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
            raise ObjectNotFoundError(f"object {oid.hex()} not found")
        _check_sizes(oid, entry)
        return entry

    def stat(self, oid: bytes) -> StoredObject:
        e = self.locate(oid)
        return StoredObject(oid, ObjectType(e.kind), e.codec, e.raw_size, e.record_size, e.pack)

    def refresh(self) -> int:
        """Index sealed packs that the index does not know yet (written by a
        process that died before indexing them, or after the index was lost).
        Returns how many packs were added."""
        with self._refresh_lock, self.pin():
            known = self.index.indexed_packs()
            added = 0
            for name in list_packs(self.pack_dir):
                if name in known:
                    continue
                try:
                    with self.reader.opened(name) as fd:
                        entries, _ = pack_entries(fd, name)
                except (CorruptObjectError, ObjectNotFoundError):
                    continue  # damaged (fsck reports it) or removed by gc meanwhile
                self.index.add_pack(name, entries)
                added += 1
            return added

    def rebuild_index(self) -> int:
        """Build a new index from the packs alone beside the old one, which is
        never opened (it may be damaged: a truncated LMDB file is a SIGBUS when
        mapped), and rename it into place. Writers and gc are held off meanwhile;
        other processes switch to the new index on their next write. Returns the
        object count."""
        if self.readonly:
            raise ReadOnlyRepositoryError(f"cannot rebuild the index of a read-only repository {self.root}")
        target = self.root / INDEX_DIR
        fresh = self.root / f"{INDEX_DIR}.rebuild-{uuid.uuid4().hex}"
        aside = self.root / f"{INDEX_DIR}.old-{uuid.uuid4().hex}"
        with self.exclusive(PIN_TIMEOUT_S), self._refresh_lock:
            try:
                new = Index(fresh)
                try:
                    for name in list_packs(self.pack_dir):
                        try:
                            with self.reader.opened(name) as fd:
                                entries, _ = pack_entries(fd, name)
                        except (CorruptObjectError, ObjectNotFoundError):
                            continue  # damaged (fsck reports it)
                        new.add_pack(name, entries)
                finally:
                    new.close()
                if self._index is not None:
                    self._index.close()
                    self._index = None
                if target.exists():
                    os.rename(target, aside)
                os.rename(fresh, target)
                fsync_dir(self.root)
            except OSError as exc:
                raise StorageIOError(f"cannot rebuild the index in {self.root}: {exc}", path=str(self.root)) from None
            finally:
                shutil.rmtree(fresh, ignore_errors=True)
                shutil.rmtree(aside, ignore_errors=True)
            self._index = Index(target)
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
        out = np.empty(entry.raw_size, dtype=np.uint8)
        self._decode_entry(oid, entry, kind, out)
        return out.data

    def _record(self, oid: bytes, entry: IndexEntry, kind: ObjectType | None, slot: int = 0) -> Record:
        """The parsed record, in this thread's read buffer ``slot`` (valid until the next read into it)."""
        raw = self.reader.read_reusing(entry.pack, entry.offset, entry.record_size, slot)
        record = parse_record(raw, entry.record_size)
        _check_identity(record.oid, record.kind, oid, kind)
        if (record.raw_size, record.codec, record.kind) != (entry.raw_size, entry.codec, entry.kind):
            raise CorruptObjectError("record header does not match its index entry")
        return record

    def _decode_entry(self, oid: bytes, entry: IndexEntry, kind: ObjectType | None, out: np.ndarray) -> None:
        """Decode the object into ``out`` and verify it against ``oid``."""
        hex_id = oid.hex()
        try:
            if entry.codec == RAW and entry.record_size == RECORD_HEADER_SIZE + len(out):
                record_kind = self._read_raw_into(oid, entry, kind, out)
                base_oid = None
            else:
                record = self._record(oid, entry, kind)
                if not self._decode_on_keyframe(record, out):
                    base = self._base_plain(record, len(out))
                    decode_chunk_into(record.codec, record.payload, out, base)
                record_kind, base_oid = record.kind, record.base
            if object_id(ObjectType(record_kind), out.data) != oid:
                # A delta whose base chain is damaged decodes to wrong bytes: name the culprit.
                if base_oid is not None:
                    self._verify_chain(base_oid)
                raise CorruptObjectError("content does not match its id")
        except CorruptObjectError as exc:
            if exc.object_id and exc.object_id != hex_id:
                raise  # a damaged base, already named
            raise CorruptObjectError(f"{exc.reason} in pack {entry.pack}", object_id=hex_id) from None
        except ValueError as exc:  # an unknown type byte
            raise CorruptObjectError(f"unreadable record in pack {entry.pack}: {exc}", object_id=hex_id) from None

    def _read_raw_into(self, oid: bytes, entry: IndexEntry, kind: ObjectType | None, out: np.ndarray) -> int:
        """A record stored raw: its payload read straight into ``out`` (no second copy),
        its header checked like :meth:`_record` does. Returns the record's type."""
        head = self.reader.read_head_into(entry.pack, entry.offset, entry.record_size, RECORD_HEADER_SIZE, out.data)
        record_kind, codec, raw_size, payload_size, record_oid, base = parse_record_header(head)
        _check_identity(record_oid, record_kind, oid, kind)
        if (
            codec != RAW
            or base is not None
            or raw_size != payload_size
            or payload_size != len(out)
            or record_kind != entry.kind
        ):
            raise CorruptObjectError("record header does not match its index entry")
        return record_kind

    def _decode_on_keyframe(self, record: Record, out: np.ndarray) -> bool:
        """A delta one link from a whole chunk (all ckvc writes) whose base is not
        cached: the keyframe decodes straight into ``out`` and the residual is added
        in place, so a checkout touches no buffer besides its destination. False
        for every other record, left to the general path."""
        if record.codec != DELTA or record.base is None or delta_header(record.payload).depth != 1:
            return False
        if self._base_cache.get(record.base) is not None:
            return False
        keyframe = self._base_record(record.base, len(out), slot=1)
        if keyframe.codec not in WHOLE_CODECS:  # depth 1: the base must be stored whole
            raise CorruptObjectError("delta chain depth 1 where its base is not whole", object_id=record.base.hex())
        decode_chunk_into(keyframe.codec, keyframe.payload, out)
        apply_delta(record.payload, out, None)
        return True

    def _base_plain(self, record: Record, size: int) -> np.ndarray | None:
        """The plain bytes of a record's base (delta or lossy residual): decoded
        along its chain without verifying each link (the final id check covers
        the whole chain)."""
        if record.codec == DELTA:
            if record.base is None:
                raise CorruptObjectError("delta record names no base")
            return self._plain_unverified(record.base, size, delta_header(record.payload).depth - 1)
        if record.codec == QUANT and record.base is not None:
            return self._plain_unverified(record.base, size, 0)  # residuals only ever sit on keyframes
        if record.base is not None:
            raise CorruptObjectError(f"a {CODEC_NAMES.get(record.codec, record.codec)} record names a base")
        return None

    def _plain_unverified(self, oid: bytes, size: int, depth: int) -> np.ndarray:
        cached = self._base_cache.get(oid)
        if cached is not None:
            return cached
        record = self._base_record(oid, size, slot=1 + depth)
        base: np.ndarray | None = None
        if record.codec not in WHOLE_CODECS and record.codec != DELTA:
            raise CorruptObjectError("a lossy chunk cannot be a base", object_id=oid.hex())
        if record.codec == DELTA:
            if record.base is None:
                raise CorruptObjectError("delta record names no base", object_id=oid.hex())
            own_depth = delta_header(record.payload).depth
            if own_depth != depth or depth < 1:  # depths strictly decrease, so a chain cannot loop
                raise CorruptObjectError(
                    f"delta chain depth {own_depth} where {depth} was expected", object_id=oid.hex()
                )
            base = self._plain_unverified(record.base, size, depth - 1)
        out = self._base_cache.buffer(size)
        decode_chunk_into(record.codec, record.payload, out, base)
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
            return BaseInfo(None, 0, True)
        head = self.reader.read(entry.pack, entry.offset, RECORD_HEADER_SIZE + QUANT_HEAD_SIZE)
        base = parse_record_header(head)[5]
        payload = memoryview(head)[RECORD_HEADER_SIZE:]
        if entry.codec == DELTA:
            if base is None:
                raise CorruptObjectError("delta record names no base", object_id=oid.hex())
            return BaseInfo(base, delta_header(payload).age, False)
        if entry.codec == QUANT:
            return BaseInfo(base, quant_header(payload).age, False)
        raise UnsupportedFormatError(f"unknown codec id {entry.codec}")

    def delta_base(self, oid: bytes) -> bytes | None:
        """The id of the chunk ``oid`` is stored against, if any (what gc keeps alive with it)."""
        return self.base_info(oid).base

    def read_into(self, oid: bytes, out: memoryview) -> None:
        """Read a chunk straight into ``out``, which must be exactly its size."""
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

    def prefetch(self, oid: bytes) -> None:
        """Start reading a chunk's record from disk in the background (a hint:
        errors are left to the read that follows)."""
        entry = self.index.get(oid)
        if entry is not None:
            self.reader.prefetch(entry.pack, entry.offset, entry.record_size)

    def verify(self, oid: bytes) -> None:
        """Read and verify one object; raises CorruptObjectError or ObjectNotFoundError."""
        self.read(oid)

    # ---- writes -------------------------------------------------------------
    def writer(self, codec: Codec, max_pack_size: int = DEFAULT_MAX_PACK_SIZE) -> ObjectWriter:
        sweep_dead_temporaries(self.pack_dir)  # what killed or failed writers left
        return ObjectWriter(self, codec, max_pack_size)

    def read_many_into(self, items: Sequence[tuple[bytes, memoryview]]) -> None:
        """Read several chunks, each straight into its buffer (exactly its size), as
        read_into does. Minimal version: one read per chunk (neighbouring records
        are not coalesced yet)."""
        for oid, out in items:
            self.read_into(oid, out)


class ObjectWriter:
    """One batch of new objects. Records go to fresh packs; :meth:`commit` seals
    them (fsync) and indexes them. Until then nothing is visible to readers."""

    def __init__(self, store: ObjectStore, codec: Codec, max_pack_size: int) -> None:
        self.store = store
        self.codec = codec
        self.max_pack_size = max_pack_size
        self._pack: PackWriter | None = None
        # Full packs are sealed (TOC, fsync, rename) on a background thread so
        # the fsync overlaps encoding of the next chunks.
        self._sealer: ThreadPoolExecutor | None = None
        self._sealing: list[tuple[PackWriter, Future[Path]]] = []
        self._written: set[bytes] = set()
        self.bytes_written = 0  # stored bytes of new records

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abort()

    def wants(self, oid: bytes) -> bool:
        """False when the object is already stored or written in this batch."""
        return oid not in self._written and not self.store.has(oid)

    def encode(
        self, data: Buffer, layout: ChunkLayout | None = None, base: DeltaBase | None = None
    ) -> tuple[int, Buffer]:
        """(codec id, payload) for ``data``: thread-safe, to run on a pool. Without a
        layout (metadata objects) only codecs 0 and 1 are used (docs/FORMAT.md §6)."""
        if layout is None:
            return encode_smallest(self.codec, data)
        return self.codec.encode_chunk(data, layout, base)

    def add_encoded(
        self, kind: ObjectType, oid: bytes, raw_size: int, codec_id: int, payload: Buffer, base: bytes | None = None
    ) -> bool:
        """Append an already-encoded object (``base``: a delta's base id).
        Returns False if it was already stored."""
        if oid in self._written:
            return False
        if self._pack is None:
            self._pack = PackWriter(self.store.pack_dir)
        info = self._pack.append(oid, int(kind), codec_id, raw_size, payload, base)
        self._written.add(oid)
        self.bytes_written += info.record_size
        if self._pack.size >= self.max_pack_size:
            self._seal_current()
        return True

    def put(self, kind: ObjectType, data: Buffer) -> bytes:
        """Hash, encode and append ``data`` unless stored already. Returns its id."""
        oid = object_id(kind, data)
        if self.wants(oid):
            codec_id, payload = self.encode(data)
            self.add_encoded(kind, oid, len(data), codec_id, payload)
        return oid

    def _seal_current(self) -> None:
        if self._pack is not None:
            pack, self._pack = self._pack, None
            if self._sealer is None:
                self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckvc-seal")
            try:
                future = self._sealer.submit(pack.seal)
            except RuntimeError:  # interpreter shutting down (a background commit finishing at exit)
                future = Future()
                future.set_result(pack.seal())
            self._sealing.append((pack, future))

    def _wait_for_seals(self) -> list[PackWriter]:
        """Wait for every pack being sealed; returns the sealed ones, raises the first error."""
        sealed, error = [], None
        for pack, fut in self._sealing:
            try:
                fut.result()
                sealed.append(pack)
            except BaseException as exc:
                pack.abort()
                error = error or exc
        self._sealing.clear()
        if self._sealer is not None:
            self._sealer.shutdown()
            self._sealer = None
        if error is not None:
            raise error
        return sealed

    def commit(self) -> None:
        """Make every object of this batch durable and indexed."""
        self._seal_current()
        for pack in self._wait_for_seals():
            self.store.index.add_pack(pack.name, pack.entries)

    def abort(self) -> None:
        if self._pack is not None:
            self._pack.abort()
            self._pack = None
        # Sealed but unindexed packs hold only unreferenced objects; index them
        # anyway so the bytes are not written twice, gc reclaims them if unused.
        with contextlib.suppress(BaseException):
            for pack in self._wait_for_seals():
                self.store.index.add_pack(pack.name, pack.entries)
