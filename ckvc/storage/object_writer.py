"""One batch of new objects written into fresh packs (the write side of the object store)."""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from ckvc.ids import Buffer, ObjectType, object_id
from ckvc.storage.backend import Backend
from ckvc.storage.index import AnyIndex
from ckvc.storage.packs import PackWriter

if TYPE_CHECKING:  # the codecs (and numpy) load with the first write, not with the store
    from ckvc.codecs import ChunkLayout, Codec, DeltaBase


class WriteTarget(Protocol):
    """What a writer needs of its object store (ObjectStore is one), named here so
    this module does not import the store that imports it."""

    @property
    def backend(self) -> Backend: ...

    @property
    def index(self) -> AnyIndex: ...

    def has(self, oid: bytes) -> bool: ...


class ObjectWriter:
    """One batch of new objects. Records go to fresh packs; :meth:`commit` seals
    them (fsync) and indexes them. Until then nothing is visible to readers."""

    def __init__(self, store: WriteTarget, codec: Codec, max_pack_size: int) -> None:
        self.store = store
        self.codec = codec
        self.max_pack_size = max_pack_size
        self._pack: PackWriter | None = None
        # Full packs are sealed (TOC, fsync, rename) on a background thread so
        # the fsync overlaps encoding of the next chunks.
        self._sealer: ThreadPoolExecutor | None = None
        self._sealing: list[tuple[PackWriter, Future[str]]] = []
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
            from ckvc.codecs.base import encode_smallest

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
            self._pack = PackWriter(self.store.backend)
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
