"""The record engine: stored records read as they are, checked, and decoded
against their delta bases and verified, for everything that moves or lands
records (push, fetch, the lazy promisor; ObjectStore's own reads parse and
check records with the same :func:`parse_checked`).

- :func:`records_in` reads located records coalesced per pack (a dense run as
  one stream, others with ``Backend.read_ranges``: a remote backend turns
  neighbouring ranges into few requests), each parsed and checked against its
  index entry; :func:`parallel_records` does it on an executor's workers;
- :class:`Verifier` decodes a record and checks its id, delta bases taken from
  records verified just before (one bounded cache) or from the local store.
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from ckvc.codecs import WHOLE_CODECS, decode_chunk_into
from ckvc.codecs.records import base_to_decode
from ckvc.errors import CorruptObjectError, ObjectNotFoundError
from ckvc.ids import ObjectType, object_id
from ckvc.storage.index import IndexEntry
from ckvc.storage.object_store import parse_checked
from ckvc.storage.packs import PACK_DIR, PACK_HEADER, Record, pack_key

if TYPE_CHECKING:
    from ckvc.storage.object_store import ObjectStore


class Workers(Protocol):
    """The part of an executor (ckvc.executor) that :func:`parallel_records` uses."""

    @property
    def threads(self) -> int: ...

    def submit(self, fn: Callable[[], None]) -> concurrent.futures.Future[None]: ...


# One read_ranges call covers at most this many bytes of records (memory bound of a fetch batch).
BATCH_BYTES = 16 << 20
# A run of one pack whose records fill at least this share of the bytes from its
# first to its last is read as one stream, gaps included: one request instead of
# one per batch (a server that copies the object per ranged GET, as moto does,
# copies it once), for at most as many bytes again as wanted.
DENSE_SHARE = 0.5
# Plain bytes of verified keyframes kept for the deltas that follow them.
PLAIN_CACHE_BYTES = 256 << 20

T = TypeVar("T")


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


def _runs(items: list[Located]) -> Iterator[list[Located]]:
    """Runs of consecutive items in one pack."""
    run: list[Located] = []
    for item in items:
        if run and item.entry.pack != run[0].entry.pack:
            yield run
            run = []
        run.append(item)
    if run:
        yield run


def _is_dense(run: list[Located]) -> bool:
    """Whether the run is best read as one stream from its first record to its
    last, the gaps included: ascending, apart, and filling DENSE_SHARE of that span."""
    end = run[0].entry.offset
    wanted = 0
    for item in run:
        if item.entry.offset < end:
            return False
        end = item.entry.offset + item.entry.record_size
        wanted += item.entry.record_size
    return wanted >= DENSE_SHARE * (end - run[0].entry.offset)


def _reads(items: list[Located]) -> Iterator[list[Located]]:
    """The requests that read ``items`` (in their order): a dense run of one pack
    as one stream, any other run in batches of at most BATCH_BYTES."""
    for run in _runs(items):
        if len(run) > 1 and _is_dense(run):
            yield run
            continue
        batch: list[Located] = []
        size = 0
        for item in run:
            if batch and size + item.entry.record_size > BATCH_BYTES:
                yield batch
                batch, size = [], 0
            batch.append(item)
            size += item.entry.record_size
        if batch:
            yield batch


def _streamed(
    store: ObjectStore, key: str, run: list[Located], *, with_header: bool = False
) -> Iterator[tuple[Located, memoryview]]:
    """The run's records cut out of one stream of its span: a record inside one
    piece is a view of it, one across pieces is copied together. ``with_header``:
    the run starts at the pack's first record and its header, still unchecked,
    is read by the same stream (from offset 0) and checked first."""
    start = 0 if with_header else run[0].entry.offset
    last = run[-1].entry
    pieces = store.backend.read_stream(key, start, last.offset + last.record_size - start)
    piece, piece_at = memoryview(b""), start
    if with_header:
        head = bytearray()
        while len(head) < PACK_HEADER.size:
            piece = next(pieces, memoryview(b""))
            if not piece:
                raise CorruptObjectError("short read")
            head += piece[: PACK_HEADER.size - len(head)]
            piece_at += len(piece)
        piece_at -= len(piece)
        store.reader.header_read(run[0].entry.pack, head)

    def next_piece() -> memoryview:
        got = next(pieces, None)
        if got is None:
            raise CorruptObjectError("short read")
        return got

    for item in run:
        offset, size = item.entry.offset, item.entry.record_size
        while piece_at + len(piece) <= offset:
            piece_at += len(piece)
            piece = next_piece()
        at = offset - piece_at
        if at + size <= len(piece):
            yield item, piece[at : at + size]
            continue
        joined = bytearray(size)
        filled = len(piece) - at
        joined[:filled] = piece[at:]
        while filled < size:
            piece_at += len(piece)
            piece = next_piece()
            n = min(size - filled, len(piece))
            joined[filled : filled + n] = piece[:n]
            filled += n
        yield item, memoryview(joined)


def _read(store: ObjectStore, read: list[Located], describe: Callable[[str], str]) -> Iterator[tuple[Located, Record]]:
    """The records of one request (a run of one pack, from :func:`_reads`), each
    parsed and checked against its index entry."""
    name = read[0].entry.pack
    key = pack_key(name, PACK_DIR)
    current = read[0]
    try:
        dense = len(read) > 1 and _is_dense(read)
        with_header = dense and read[0].entry.offset == PACK_HEADER.size and store.reader.header_pending(name)
        check = store.reader.check_bounds if with_header else store.reader.check_range
        for current in read:
            check(name, current.entry.offset, current.entry.record_size)
        got: Iterator[tuple[Located, memoryview]]
        if dense:
            got = _streamed(store, key, read, with_header=with_header)
        else:
            ranges = [(item.entry.offset, item.entry.record_size) for item in read]
            got = zip(read, (raw for _offset, raw in store.backend.read_ranges(key, ranges)), strict=True)
        for current, raw in got:
            if len(raw) != current.entry.record_size:
                raise CorruptObjectError("short read")
            yield current, parse_checked(raw, current.oid, current.entry)
    except ObjectNotFoundError as exc:
        raise ObjectNotFoundError(f"{describe(key)}: {exc}", object_id=current.oid.hex()) from None
    except CorruptObjectError as exc:
        raise CorruptObjectError(f"{describe(key)}: {exc.reason}", object_id=current.oid.hex()) from None


def records_in(
    store: ObjectStore, items: list[Located], describe: Callable[[str], str]
) -> Iterator[tuple[Located, Record]]:
    """Each item's record, in order: a dense run of one pack read as one stream,
    others with one ``read_ranges`` per batch. A record that is cut short or does
    not parse is a CorruptObjectError naming ``describe(key)`` (the remote and the
    pack's key) and the object."""
    for read in _reads(items):
        yield from _read(store, read, describe)


@dataclass
class _Failed:
    error: BaseException


_DONE = object()


def parallel_records(
    store: ObjectStore,
    items: list[Located],
    describe: Callable[[str], str],
    executor: Workers,
    work: Callable[[Located, Record], T],
) -> Iterator[tuple[Located, Record, T]]:
    """:func:`records_in` with the requests on ``executor``'s workers, several at
    once, and ``work(item, record)`` (a verification) done there too: the caller
    gets (item, record, result) as they arrive, in order within a request but
    not across them. Leaving the loop early stops the workers before it returns."""
    reads = list(_reads(items))
    workers = min(executor.threads, len(reads))
    # A serial executor runs a worker inline. One request still gets a worker: it
    # reads and verifies while this thread writes.
    if workers == 0 or executor.threads <= 1:
        for read in reads:
            for item, record in _read(store, read, describe):
                yield item, record, work(item, record)
        return
    results: queue.Queue[Any] = queue.Queue(maxsize=4 * workers)
    stop = threading.Event()
    todo = iter(reads)
    todo_lock = threading.Lock()

    def hand_over(out: Any) -> bool:
        while not stop.is_set():
            try:
                results.put(out, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def worker() -> None:
        try:
            while not stop.is_set():
                with todo_lock:
                    read = next(todo, None)
                if read is None:
                    break
                for item, record in _read(store, read, describe):
                    if not hand_over((item, record, work(item, record))):
                        return
        except BaseException as exc:
            hand_over(_Failed(exc))
            return
        hand_over(_DONE)

    futures = [executor.submit(worker) for _ in range(workers)]
    finished = 0
    try:
        while finished < workers:
            got = results.get()
            if got is _DONE:
                finished += 1
            elif isinstance(got, _Failed):
                raise got.error
            else:
                yield got
    finally:
        stop.set()
        concurrent.futures.wait(futures)


class LocalBaseCorruptError(CorruptObjectError):
    """A delta base read from the local store while verifying a transferred record
    is damaged: this repository's damage, not the other side's."""


class Verifier:
    """Decodes records and checks them against their ids, from several threads at
    once. A delta's base comes from a keyframe verified shortly before (kept in a
    bounded cache, from the start when ``keep_keyframes`` (a fetch of several
    commits) or else once a delta has been met, so that one commit's fetch copies
    nothing) or from the ``local`` store, whose reads verify it; without either,
    :meth:`plain` and :meth:`check` say so (None) and the caller fetches the base
    first.

    ``landing``: where a read waiting for these records wants their plain bytes
    (chunk id -> a buffer of its size). :meth:`check` decodes such a record
    there instead of into scratch, so a lazy read decodes and hashes each
    fetched chunk once; ``landed`` is what it verified in place."""

    def __init__(
        self, local: ObjectStore, *, keep_keyframes: bool = True, landing: Mapping[bytes, memoryview] | None = None
    ) -> None:
        self.local = local
        self._cache: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self._cached = 0
        self._keeping = keep_keyframes
        self._lock = threading.Lock()
        self._scratch = threading.local()
        self.landing: Mapping[bytes, memoryview] = landing or {}
        self.landed: set[bytes] = set()

    def _base(self, oid: bytes, size: int) -> np.ndarray | None:
        with self._lock:
            cached = self._cache.get(oid)
            if cached is not None:
                self._cache.move_to_end(oid)
                return cached if len(cached) == size else None
        if not self.local.has(oid):
            return None
        out = np.empty(size, dtype=np.uint8)
        try:
            self.local.read_into(oid, out.data)
        except CorruptObjectError as exc:
            raise LocalBaseCorruptError(
                f"the local delta base {oid.hex()} is damaged ({exc.reason}; ckvc fsck names it)", object_id=oid.hex()
            ) from None
        return out

    def needs(self, record: Record) -> bytes | None:
        """The base ``record`` decodes against, if it has one."""
        wanted = base_to_decode(record.codec, record.base, record.payload)
        return None if wanted is None else wanted[0]

    def _decoded(self, oid: bytes, record: Record, out: np.ndarray) -> bool:
        """Decode into ``out`` and check the id; False when the base is not at hand."""
        base = None
        wanted = base_to_decode(record.codec, record.base, record.payload)
        if wanted is not None:
            self._keeping = True  # deltas are coming: keep keyframes for them from now on
            base = self._base(wanted[0], record.raw_size)
            if base is None:
                return False
        decode_chunk_into(record.codec, record.payload, out, base)
        if object_id(ObjectType(record.kind), out.data) != oid:
            raise CorruptObjectError("content does not match its id", object_id=oid.hex())
        return True

    def plain(self, oid: bytes, record: Record) -> np.ndarray | None:
        """The record's plain bytes, verified; None when its base is not at hand."""
        out = np.empty(record.raw_size, dtype=np.uint8)
        if not self._decoded(oid, record, out):
            return None
        self._keep(oid, record, out)
        return out

    def check(self, oid: bytes, record: Record) -> bool | None:
        """:meth:`plain` for a caller that needs only the verdict: decoded into
        this thread's scratch buffer, reused (fresh memory costs a page fault per
        page), unless the keyframe is kept, or into its landing buffer. True, or
        None when the base is not at hand."""
        target = self.landing.get(oid)
        lands = target is not None and len(target) == record.raw_size
        if target is not None and lands:
            out = np.frombuffer(target, dtype=np.uint8)
        else:
            if self._keeping and self._keepable(record):
                return None if self.plain(oid, record) is None else True
            scratch: np.ndarray | None = getattr(self._scratch, "buffer", None)
            if scratch is None or len(scratch) < record.raw_size:
                scratch = self._scratch.buffer = np.empty(record.raw_size, dtype=np.uint8)
            out = scratch[: record.raw_size]
        if not self._decoded(oid, record, out):
            return None
        if self._keeping and self._keepable(record):  # a kept keyframe, or the first delta met while decoding
            self._keep(oid, record, out.copy())
        if lands:
            with self._lock:
                self.landed.add(oid)
        return True

    @staticmethod
    def _keepable(record: Record) -> bool:
        return record.kind == ObjectType.CHUNK and record.codec in WHOLE_CODECS and record.raw_size <= PLAIN_CACHE_BYTES

    def _keep(self, oid: bytes, record: Record, plain: np.ndarray) -> None:
        if not (self._keeping and self._keepable(record)):
            return
        with self._lock:
            if oid in self._cache:
                return
            self._cache[oid] = plain
            self._cached += len(plain)
            while self._cached > PLAIN_CACHE_BYTES:
                _, dropped = self._cache.popitem(last=False)
                self._cached -= len(dropped)
