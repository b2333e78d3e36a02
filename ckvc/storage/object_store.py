"""The object store: put objects into packs, find them through the index, and
verify every byte read against its id."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ckvc.codecs import Buffer, Codec, decoder_for, encode_smallest
from ckvc.errors import CorruptObjectError, ObjectNotFoundError
from ckvc.ids import ObjectType, object_id
from ckvc.storage.files import file_lock
from ckvc.storage.index import Index, IndexEntry
from ckvc.storage.packs import (
    PackReader,
    PackWriter,
    list_packs,
    pack_entries,
    parse_record,
)

DEFAULT_MAX_PACK_SIZE = 256 << 20


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
    def __init__(self, root: Path) -> None:
        self.root = root
        self.pack_dir = root / "packs"
        self.index = Index(root / "index")
        self.reader = PackReader(self.pack_dir)
        self._refresh_lock = threading.Lock()
        self._exclusive_held = False
        self._pins = threading.local()  # this thread's pin, if it holds one

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

    def close(self) -> None:
        self.reader.close()
        self.index.close()

    # ---- lookup -------------------------------------------------------------
    def has(self, oid: bytes) -> bool:
        return self.index.has(oid)

    def locate(self, oid: bytes) -> IndexEntry:
        entry = self.index.get(oid)
        if entry is None and self.refresh():
            entry = self.index.get(oid)
        if entry is None:
            raise ObjectNotFoundError(f"object {oid.hex()} not found")
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
        """Drop the index and rebuild it from the packs alone. Returns the object count."""
        self.index.clear()
        self.refresh()
        return self.index.count()

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
            retry = self.locate(oid)
            if (retry.pack, retry.offset) == (entry.pack, entry.offset):
                raise
            return self._read_entry(oid, retry, kind)

    def _read_entry(self, oid: bytes, entry: IndexEntry, kind: ObjectType | None) -> Buffer:
        hex_id = oid.hex()
        try:
            raw = self.reader.read(entry.pack, entry.offset, entry.record_size)
            record = parse_record(raw, entry.record_size)
            if record.oid != oid:
                raise CorruptObjectError("record holds a different object than the index says")
            if kind is not None and record.kind != kind:
                raise CorruptObjectError(f"expected a {kind.name.lower()} object, found type {record.kind}")
            plain = decoder_for(record.codec).decode(record.payload, record.raw_size)
            if object_id(ObjectType(record.kind), plain) != oid:
                raise CorruptObjectError("content does not match its id")
        except CorruptObjectError as exc:
            raise CorruptObjectError(f"{exc.reason} in pack {entry.pack}", object_id=hex_id) from None
        except ValueError as exc:  # an unknown type byte
            raise CorruptObjectError(f"unreadable record in pack {entry.pack}: {exc}", object_id=hex_id) from None
        return plain

    def read_into(self, oid: bytes, out: memoryview) -> None:
        """Read a chunk straight into ``out``, which must be exactly its size."""
        plain = self.read(oid, ObjectType.CHUNK)
        if len(plain) != len(out):
            raise CorruptObjectError(f"chunk is {len(plain)} bytes where {len(out)} were expected", object_id=oid.hex())
        out[:] = plain

    def verify(self, oid: bytes) -> None:
        """Read and verify one object; raises CorruptObjectError or ObjectNotFoundError."""
        self.read(oid)

    # ---- writes -------------------------------------------------------------
    def writer(self, codec: Codec, max_pack_size: int = DEFAULT_MAX_PACK_SIZE) -> ObjectWriter:
        return ObjectWriter(self, codec, max_pack_size)


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

    def encode(self, data: Buffer) -> tuple[int, Buffer]:
        """(codec id, payload) for ``data``: thread-safe, to run on a pool."""
        return encode_smallest(self.codec, data)

    def add_encoded(self, kind: ObjectType, oid: bytes, raw_size: int, codec_id: int, payload: Buffer) -> bool:
        """Append an already-encoded object. Returns False if it was already stored."""
        if oid in self._written:
            return False
        if self._pack is None:
            self._pack = PackWriter(self.store.pack_dir)
        info = self._pack.append(oid, int(kind), codec_id, raw_size, payload)
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
