"""Moving stored records between two object stores as they are: no decode and
re-encode on the way (the bytes pushed are the bytes stored), and on the
receiving side of a fetch every record verified against its id before it is
written (a delta through its base), so nothing wrong is ever indexed locally.

- :func:`records_in` reads records of one store coalesced per pack
  (``Backend.read_ranges``: a remote backend turns neighbouring ranges into few
  requests), each parsed and checked against its index entry;
- :func:`upload_packs` writes records into new packs on a backend, packs in
  parallel, returning what each pack holds;
- :class:`Verifier` decodes a record and checks its id, delta bases taken from
  records verified just before or from the local store.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ckvc.codecs import WHOLE_CODECS, decode_chunk_into
from ckvc.codecs.records import base_to_decode
from ckvc.errors import CorruptObjectError, ObjectNotFoundError
from ckvc.executor import Executor
from ckvc.ids import ObjectType, object_id
from ckvc.storage.backend import Backend
from ckvc.storage.index import IndexEntry
from ckvc.storage.object_store import ObjectStore
from ckvc.storage.packs import PACK_DIR, PackWriter, Record, RecordInfo, pack_key, parse_record

# One read_ranges call covers at most this many bytes of records (memory bound of a fetch batch).
BATCH_BYTES = 16 << 20
# Plain bytes of verified keyframes kept for the deltas that follow them.
PLAIN_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class Located:
    """A record to move: its id and where its store keeps it."""

    oid: bytes
    entry: IndexEntry


def locate_all(store: ObjectStore, oids: Iterable[bytes], *, in_order: bool = False) -> list[Located]:
    """Index entries of ``oids``, sorted by pack and offset (the order reads are
    cheapest in), or in the order given (``in_order``: an order of publication)."""
    found = [Located(oid, store.locate(oid)) for oid in oids]
    if not in_order:
        found.sort(key=lambda item: (item.entry.pack, item.entry.offset))
    return found


def check_record(oid: bytes, entry: IndexEntry, raw: memoryview) -> Record:
    """The record in ``raw``, which must be the one ``entry`` names (header CRC,
    id, type, codec, sizes); CorruptObjectError otherwise."""
    record = parse_record(raw, entry.record_size)
    if record.oid != oid:
        raise CorruptObjectError("record holds a different object than the index says", object_id=oid.hex())
    if (record.kind, record.codec, record.raw_size) != (entry.kind, entry.codec, entry.raw_size):
        raise CorruptObjectError("record header does not match its index entry", object_id=oid.hex())
    return record


def _batches(items: list[Located]) -> Iterator[list[Located]]:
    """Runs of one pack's records, at most BATCH_BYTES each."""
    batch: list[Located] = []
    size = 0
    for item in items:
        if batch and (item.entry.pack != batch[0].entry.pack or size + item.entry.record_size > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item.entry.record_size
    if batch:
        yield batch


def records_in(
    store: ObjectStore, items: list[Located], describe: Callable[[str], str]
) -> Iterator[tuple[Located, Record]]:
    """Each item's record, read with one ``read_ranges`` per batch of a pack. A
    record that is cut short or does not parse is a CorruptObjectError naming
    ``describe(key)`` (the remote and the pack's key) and the object."""
    for batch in _batches(items):
        name = batch[0].entry.pack
        key = pack_key(name, PACK_DIR)
        current = batch[0]
        try:
            for current in batch:
                store.reader.check_range(name, current.entry.offset, current.entry.record_size)
            ranges = [(item.entry.offset, item.entry.record_size) for item in batch]
            got = store.backend.read_ranges(key, ranges)
            for current, (offset, raw) in zip(batch, got, strict=True):
                if offset != current.entry.offset or len(raw) != current.entry.record_size:
                    raise CorruptObjectError("short read")
                record = check_record(current.oid, current.entry, raw)
                yield current, record
        except ObjectNotFoundError as exc:
            raise ObjectNotFoundError(f"{describe(key)}: {exc}", object_id=current.oid.hex()) from None
        except CorruptObjectError as exc:
            raise CorruptObjectError(f"{describe(key)}: {exc.reason}", object_id=current.oid.hex()) from None


@dataclass
class UploadedPack:
    name: str
    entries: list[RecordInfo]
    size: int  # bytes of the pack: header, records, TOC, footer


def upload_packs(
    source: ObjectStore,
    target: Backend,
    groups: list[list[Located]],
    executor: Executor,
    on_pack: Callable[[UploadedPack], None],
) -> None:
    """Write each group as one new pack on ``target`` (its records copied from
    ``source`` as they are), the packs in parallel; ``on_pack`` is called on this
    thread as each is published. A failure aborts the packs not yet published
    (a published pack holds only whole records and is harmless: the next push
    finds it in the catalog and does not send it again)."""

    def write(group: list[Located]) -> UploadedPack:
        pack = PackWriter(target)
        try:
            for item, record in records_in(source, group, lambda key: f"local {key}"):
                pack.append(item.oid, record.kind, record.codec, record.raw_size, record.payload, record.base)
            pack.seal()
        except BaseException:
            pack.abort()
            raise
        return UploadedPack(pack.name, pack.entries, pack.size)

    with executor.window(depth=max(1, executor.threads)) as window:
        for group in groups:
            window.submit(write, group, then=on_pack)


def split_groups(items: list[Located], max_bytes: int) -> list[list[Located]]:
    """Consecutive items in groups of at most ``max_bytes`` of records (a group
    holds at least one item, whatever its size)."""
    groups: list[list[Located]] = []
    size = 0
    for item in items:
        if not groups or (size + item.entry.record_size > max_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.entry.record_size
    return groups


class Verifier:
    """Decodes records and checks them against their ids. A delta's base comes
    from a keyframe verified shortly before (kept in a bounded cache) or from the
    ``local`` store, whose reads verify it; without either, :meth:`plain` says so
    (None) and the caller fetches the base first."""

    def __init__(self, local: ObjectStore) -> None:
        self.local = local
        self._cache: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self._cached = 0

    def _base(self, oid: bytes, size: int) -> np.ndarray | None:
        cached = self._cache.get(oid)
        if cached is not None:
            self._cache.move_to_end(oid)
            return cached if len(cached) == size else None
        if not self.local.has(oid):
            return None
        out = np.empty(size, dtype=np.uint8)
        self.local.read_into(oid, out.data)
        return out

    def needs(self, record: Record) -> bytes | None:
        """The base ``record`` decodes against, if it has one."""
        wanted = base_to_decode(record.codec, record.base, record.payload)
        return None if wanted is None else wanted[0]

    def plain(self, oid: bytes, record: Record) -> np.ndarray | None:
        """The record's plain bytes, verified; None when its base is not at hand."""
        base = None
        wanted = base_to_decode(record.codec, record.base, record.payload)
        if wanted is not None:
            base = self._base(wanted[0], record.raw_size)
            if base is None:
                return None
        out = np.empty(record.raw_size, dtype=np.uint8)
        decode_chunk_into(record.codec, record.payload, out, base)
        if object_id(ObjectType(record.kind), out.data) != oid:
            raise CorruptObjectError("content does not match its id", object_id=oid.hex())
        if record.kind == ObjectType.CHUNK and record.codec in WHOLE_CODECS:
            self._keep(oid, out)
        return out

    def _keep(self, oid: bytes, plain: np.ndarray) -> None:
        if len(plain) > PLAIN_CACHE_BYTES:
            return
        self._cache[oid] = plain
        self._cached += len(plain)
        while self._cached > PLAIN_CACHE_BYTES:
            _, dropped = self._cache.popitem(last=False)
            self._cached -= len(dropped)
