"""The LMDB index: object id -> (pack, offset, size, type, codec, raw size).

The index is a cache over the packs: every entry can be rebuilt from the packs
alone. It also remembers which packs it has indexed, so a pack written by a
process that died before indexing it is picked up on the next miss.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import lmdb

from ckvc.storage.packs import RecordInfo

# pack number, offset, record size, type, codec, raw size
_ENTRY = struct.Struct("<IQQBBQ")
_PACKNO = struct.Struct("<I")
_NEXT_PACK_KEY = b"next_pack"
# Address space only; LMDB grows the file as it needs. 1 TiB covers ~10^10 entries.
_MAP_SIZE = 1 << 40

# One Environment per index path per process: LMDB forbids opening the same
# environment twice in one process, and an environment must not cross fork().
_ENVS: dict[tuple[str, int], tuple[lmdb.Environment, int]] = {}
_ENVS_LOCK = threading.Lock()


def _acquire_env(path: Path) -> lmdb.Environment:
    key = (str(path.resolve()), os.getpid())
    with _ENVS_LOCK:
        if key in _ENVS:
            env, refs = _ENVS[key]
            _ENVS[key] = (env, refs + 1)
            return env
        path.mkdir(parents=True, exist_ok=True)
        try:
            env = lmdb.open(str(path), map_size=_MAP_SIZE, max_dbs=4, subdir=True, readahead=False)
        except lmdb.Error:
            if os.access(path, os.W_OK) or not (path / "data.mdb").is_file():
                raise
            env = _open_read_only(path)
        _ENVS[key] = (env, 1)
        return env


def _open_read_only(path: Path) -> lmdb.Environment:
    """A repository that cannot be written (read-only mount, no write permission)
    stays readable. On a read-only mount LMDB skips its lock file by itself;
    where only permission is missing, it must be told to."""
    try:
        return lmdb.open(str(path), map_size=_MAP_SIZE, max_dbs=4, subdir=True, readahead=False, readonly=True)
    except lmdb.Error:
        return lmdb.open(
            str(path), map_size=_MAP_SIZE, max_dbs=4, subdir=True, readahead=False, readonly=True, lock=False
        )


def _release_env(path: Path) -> None:
    key = (str(path.resolve()), os.getpid())
    with _ENVS_LOCK:
        if key not in _ENVS:
            return
        env, refs = _ENVS[key]
        if refs > 1:
            _ENVS[key] = (env, refs - 1)
        else:
            del _ENVS[key]
            env.close()


class IndexEntry:
    __slots__ = ("codec", "kind", "offset", "pack", "raw_size", "record_size")

    def __init__(self, pack: str, offset: int, record_size: int, kind: int, codec: int, raw_size: int):
        self.pack = pack
        self.offset = offset
        self.record_size = record_size
        self.kind = kind
        self.codec = codec
        self.raw_size = raw_size


class Index:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._env = _acquire_env(path)
        self._objects = self._env.open_db(b"objects")
        self._packs = self._env.open_db(b"packs")  # pack name -> pack number
        self._packnames = self._env.open_db(b"packnames")  # pack number -> pack name
        self._meta = self._env.open_db(b"meta")

    def close(self) -> None:
        if self._env is not None:
            _release_env(self.path)
            self._env = None  # type: ignore[assignment]

    def _pack_name(self, txn: lmdb.Transaction, number: int) -> str:
        # Not cached across transactions: another process may rebuild the index
        # and renumber the packs.
        raw = txn.get(_PACKNO.pack(number), db=self._packnames)
        if raw is None:
            raise KeyError(number)
        return bytes(raw).decode()

    def get(self, oid: bytes) -> IndexEntry | None:
        with self._env.begin(db=self._objects, buffers=True) as txn:
            raw = txn.get(oid)
            if raw is None:
                return None
            packno, offset, size, kind, codec, raw_size = _ENTRY.unpack(raw)
            return IndexEntry(self._pack_name(txn, packno), offset, size, kind, codec, raw_size)

    def has(self, oid: bytes) -> bool:
        with self._env.begin(db=self._objects, buffers=True) as txn:
            return txn.get(oid) is not None

    def indexed_packs(self) -> set[str]:
        with self._env.begin(db=self._packs) as txn:
            return {bytes(k).decode() for k in txn.cursor().iternext(keys=True, values=False)}

    def add_pack(self, name: str, entries: Iterable[RecordInfo]) -> None:
        """Register a pack and its records in one durable transaction. An id that
        is already indexed keeps its first location."""
        with self._env.begin(write=True) as txn:
            if txn.get(name.encode(), db=self._packs) is not None:
                return
            raw_next = txn.get(_NEXT_PACK_KEY, db=self._meta)
            number = _PACKNO.unpack(raw_next)[0] if raw_next else 0
            txn.put(_NEXT_PACK_KEY, _PACKNO.pack(number + 1), db=self._meta)
            txn.put(name.encode(), _PACKNO.pack(number), db=self._packs)
            txn.put(_PACKNO.pack(number), name.encode(), db=self._packnames)
            for e in entries:
                value = _ENTRY.pack(number, e.offset, e.record_size, e.kind, e.codec, e.raw_size)
                txn.put(e.oid, value, db=self._objects, overwrite=False)

    def swap_packs(
        self, added: list[tuple[str, list[RecordInfo]]], removed: list[tuple[str, list[RecordInfo]]]
    ) -> None:
        """gc's one durable transaction: index the ``added`` packs (their entries
        become the canonical copies), then forget the ``removed`` packs and every
        entry still pointing into them."""
        with self._env.begin(write=True) as txn:
            for name, entries in added:
                raw_number = txn.get(name.encode(), db=self._packs)
                if raw_number is None:
                    raw_next = txn.get(_NEXT_PACK_KEY, db=self._meta)
                    number = _PACKNO.unpack(raw_next)[0] if raw_next else 0
                    txn.put(_NEXT_PACK_KEY, _PACKNO.pack(number + 1), db=self._meta)
                    txn.put(name.encode(), _PACKNO.pack(number), db=self._packs)
                    txn.put(_PACKNO.pack(number), name.encode(), db=self._packnames)
                else:
                    number = _PACKNO.unpack(raw_number)[0]
                for e in entries:
                    txn.put(
                        e.oid,
                        _ENTRY.pack(number, e.offset, e.record_size, e.kind, e.codec, e.raw_size),
                        db=self._objects,
                    )
            for name, entries in removed:
                raw_number = txn.get(name.encode(), db=self._packs)
                if raw_number is None:
                    continue  # never indexed (left by a writer that died)
                number = _PACKNO.unpack(raw_number)[0]
                for e in entries:
                    raw = txn.get(e.oid, db=self._objects)
                    if raw is not None and _ENTRY.unpack(raw)[0] == number:
                        txn.delete(e.oid, db=self._objects)
                txn.delete(name.encode(), db=self._packs)
                txn.delete(_PACKNO.pack(number), db=self._packnames)

    def location(self, oid: bytes) -> tuple[str, int] | None:
        """(pack, offset) of the canonical copy of ``oid``."""
        entry = self.get(oid)
        return None if entry is None else (entry.pack, entry.offset)

    def clear(self) -> None:
        with self._env.begin(write=True) as txn:
            for db in (self._objects, self._packs, self._packnames, self._meta):
                txn.drop(db, delete=False)

    def iter_entries(self, prefix: bytes = b"") -> Iterator[tuple[bytes, IndexEntry]]:
        with self._env.begin(db=self._objects, buffers=True) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(prefix):
                return
            for key, raw in cursor:
                oid = bytes(key)
                if not oid.startswith(prefix):
                    return
                packno, offset, size, kind, codec, raw_size = _ENTRY.unpack(raw)
                yield oid, IndexEntry(self._pack_name(txn, packno), offset, size, kind, codec, raw_size)

    def count(self) -> int:
        with self._env.begin(db=self._objects) as txn:
            return int(txn.stat(self._objects)["entries"])
