"""The LMDB index: object id -> (pack, offset, size, type, codec, raw size).

The index is a cache over the packs: every entry can be rebuilt from the packs
alone. It also remembers which packs it has indexed, so a pack written by a
process that died before indexing it is picked up on the next miss.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import lmdb

from ckvc.errors import DamagedIndexError, ReadOnlyRepositoryError, StorageFullError, StorageIOError, storage_error
from ckvc.ids import ObjectType
from ckvc.storage.durable import fsync_dir
from ckvc.storage.packs import RecordInfo

# pack number, offset, record size, type, codec, raw size
_ENTRY = struct.Struct("<IQQBBQ")
_PACKNO = struct.Struct("<I")
_NEXT_PACK_KEY = b"next_pack"
# Address space only; LMDB grows the file as it needs. 1 TiB covers ~10^10 entries.
_MAP_SIZE = 1 << 40
DATA_FILE = "data.mdb"
_KINDS = frozenset(int(t) for t in ObjectType)
REPAIR_HINT = "run `ckvc fsck --rebuild-index` to rebuild it from the packs"

# LMDB's meta pages (pages 0 and 1 of data.mdb, 64-bit builds): a 16-byte page
# header, then magic, version, ..., the free DB's md_pad holding the page size,
# and the last page used and the transaction id of that meta's commit.
_META_MAGIC = 0xBEEFC0DE
_META_VERSION = 1
_META_HEAD = struct.Struct("<II")  # at 16: mm_magic, mm_version
_META_PSIZE = struct.Struct("<I")  # at 40: mm_dbs[0].md_pad (the page size)
_META_TAIL = struct.Struct("<QQ")  # at 136: mm_last_pg, mm_txnid
_META_SIZE = 152
_META_ROOT = struct.Struct("<Q")  # at 80 and 128: the free and main databases' root pages
_NO_PAGE = (1 << 64) - 1  # P_INVALID: an empty database has no root


def check_data_file(path: Path, *, writable: bool) -> None:
    """DamagedIndexError unless ``path/data.mdb`` is absent, empty, or holds a
    valid LMDB meta page whose root pages lie inside the file. Checked before
    mapping it: LMDB trusts its meta, and a page past the end of a truncated file
    is a SIGBUS, not an error.

    A valid file can end before its meta's last page: pages a transaction
    allocated and freed again are never written (SIGKILLed gc runs leave such
    files). So a short file is not damage by itself. When it can be written it is
    extended to the meta's size (zero pages; fallocate never shrinks, so a live
    writer is safe): free pages are never read, and a truncated file's missing
    pages then read as zeros, which LMDB reports as corruption instead of a SIGBUS."""
    data_file = path / DATA_FILE
    try:
        with open(data_file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = f.read(_META_SIZE)
            if size == 0:
                return  # LMDB initialises an empty file
            if len(first) < _META_SIZE:
                raise DamagedIndexError(f"index {data_file} is truncated ({size} bytes); {REPAIR_HINT}")
            (psize,) = _META_PSIZE.unpack_from(first, 40)
            if not (512 <= psize <= 1 << 16 and psize & (psize - 1) == 0):
                raise DamagedIndexError(f"index {data_file} is not an LMDB file; {REPAIR_HINT}")
            f.seek(psize)
            second = f.read(_META_SIZE)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise DamagedIndexError(f"index {data_file} cannot be read: {exc.strerror}; {REPAIR_HINT}") from None
    metas = []
    for page in (first, second):
        if len(page) == _META_SIZE and _META_HEAD.unpack_from(page, 16) == (_META_MAGIC, _META_VERSION):
            last_page, txnid = _META_TAIL.unpack_from(page, 136)
            roots = (_META_ROOT.unpack_from(page, 80)[0], _META_ROOT.unpack_from(page, 128)[0])
            metas.append((txnid, last_page, roots))
    if not metas:
        raise DamagedIndexError(f"index {data_file} is not an LMDB file; {REPAIR_HINT}")
    _, last_page, roots = max(metas)  # LMDB uses the meta of the newest commit
    pages = size // psize
    if any(root != _NO_PAGE and root >= pages for root in roots) or pages < 2:
        raise DamagedIndexError(
            f"index {data_file} is truncated ({size} bytes, its meta page needs {(last_page + 1) * psize}); "
            f"{REPAIR_HINT}"
        )
    if (last_page + 1) * psize > size and writable:
        try:
            fd = os.open(data_file, os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, (last_page + 1) * psize)
            finally:
                os.close(fd)
        except OSError as exc:
            raise DamagedIndexError(
                f"index {data_file} is shorter than its meta page says and cannot be extended "
                f"({exc.strerror}); {REPAIR_HINT}"
            ) from None


def _translate(exc: BaseException, path: Path) -> Exception:
    """The typed ckvc error for an LMDB error (or a damaged entry) at ``path``."""
    if isinstance(exc, lmdb.MapFullError):
        return StorageFullError(f"index {path} is full (its map size is reached)", path=str(path))
    if isinstance(exc, lmdb.ReadonlyError):
        return ReadOnlyRepositoryError(f"index {path} is read-only", path=str(path))
    if isinstance(exc, _DAMAGE):
        return DamagedIndexError(f"index {path} is damaged ({exc}); {REPAIR_HINT}")
    # An OS error inside LMDB (only its text says which): the one OS-error mapping.
    return storage_error(exc, f"using the index {path}", "the index is unchanged")


@contextlib.contextmanager
def lmdb_errors(path: Path) -> Iterator[None]:
    """LMDB's (and a damaged entry's) errors as typed ckvc errors."""
    try:
        yield
    except _CAUGHT as exc:
        raise _translate(exc, path) from None


class _BadEntry(Exception):
    """An index value that cannot be what ckvc wrote."""


_DAMAGE = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.VersionMismatchError,
    lmdb.BadTxnError,
    lmdb.PageFullError,
    lmdb.BadValsizeError,
    lmdb.IncompatibleError,
    lmdb.NotFoundError,
    struct.error,
    UnicodeDecodeError,
    _BadEntry,
)
_CAUGHT = (lmdb.Error, struct.error, UnicodeDecodeError, _BadEntry)


class _Env:
    """One open LMDB environment, shared by the Index objects of one process,
    with its four named databases. They are opened once, here, before any other
    thread can hold the environment: py-lmdb's open_db waits for LMDB's write
    lock while holding the GIL, so two threads opening them at once (or one
    while another writes) deadlock the process."""

    def __init__(self, env: lmdb.Environment, key: tuple[Any, ...], readonly: bool) -> None:
        self.env = env
        self.key = key
        self.readonly = readonly
        self.users = 1
        create = not readonly
        self.objects = env.open_db(b"objects", create=create)
        self.packs = env.open_db(b"packs", create=create)  # pack name -> pack number
        self.packnames = env.open_db(b"packnames", create=create)  # pack number -> pack name
        self.meta = env.open_db(b"meta", create=create)


# One Environment per index file per process: LMDB forbids opening the same
# environment twice in one process, and an environment must not cross fork().
# Keyed by the data file's identity too, so an index rebuilt beside the old one
# and renamed into place is a new environment.
_ENVS: dict[tuple[Any, ...], _Env] = {}
_ENVS_LOCK = threading.Lock()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path / DATA_FILE)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _acquire_env(path: Path, readonly: bool) -> _Env:
    with _ENVS_LOCK:
        key = (str(path.resolve()), os.getpid(), _identity(path))
        shared = _ENVS.get(key)
        if shared is not None and key[2] is not None:
            shared.users += 1
            return shared
        check_data_file(path, writable=not readonly)
        with lmdb_errors(path):
            if readonly:
                env = lmdb.open(
                    str(path), map_size=_MAP_SIZE, max_dbs=4, subdir=True, readahead=False, readonly=True, lock=False
                )
            else:
                try:
                    path.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise ReadOnlyRepositoryError(
                        f"cannot create the index {path}: {exc.strerror}", path=str(path)
                    ) from None
                env = lmdb.open(str(path), map_size=_MAP_SIZE, max_dbs=4, subdir=True, readahead=False)
            try:
                shared = _Env(env, (key[0], key[1], _identity(path)), readonly)
            except BaseException:
                env.close()
                raise
        _ENVS[shared.key] = shared
        return shared


def _release_env(shared: _Env) -> None:
    with _ENVS_LOCK:
        shared.users -= 1
        if shared.users:
            return
        if _ENVS.get(shared.key) is shared:
            del _ENVS[shared.key]
        shared.env.close()


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
    """The index at ``path``. ``readonly``: open it without a lock file and
    refuse writes (ReadOnlyRepositoryError), for repositories on read-only
    mounts. A damaged index raises DamagedIndexError naming the repair, here or
    on first use; it is never mapped when its file is shorter than its meta
    page says (check_data_file)."""

    def __init__(self, path: Path, *, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        self._shared: _Env | None = None
        self._open()

    @classmethod
    def open(cls, path: Path, readonly: bool = False) -> Index:
        return cls(path, readonly=readonly)

    def _open(self) -> None:
        shared = _acquire_env(self.path, self.readonly)
        self._objects = shared.objects
        self._packs = shared.packs
        self._packnames = shared.packnames
        self._meta = shared.meta
        self._shared = shared
        self._env = shared.env

    def close(self) -> None:
        if self._shared is not None:
            _release_env(self._shared)
            self._shared = None
            self._env = None  # type: ignore[assignment]

    def reopen_if_replaced(self) -> bool:
        """Switch to the index file now at ``path`` if it is not the one open
        (another process rebuilt the index). True when it switched."""
        if self._shared is None or self._shared.key[2] == _identity(self.path):
            return False
        old = self._shared
        self._open()
        _release_env(old)
        return True

    @contextlib.contextmanager
    def _txn(self, *, write: bool = False, db: Any = None, buffers: bool = False) -> Iterator[Any]:
        if write:
            if self.readonly:
                raise ReadOnlyRepositoryError(f"index {self.path} is open read-only", path=str(self.path))
            self.reopen_if_replaced()  # never write into an index that was rebuilt meanwhile
        env: Any = self._env  # lmdb's stubs type begin() by the literal value of buffers
        with lmdb_errors(self.path), env.begin(write=write, db=db, buffers=buffers) as txn:
            yield txn

    def _pack_name(self, txn: lmdb.Transaction, number: int) -> str:
        # Not cached across transactions: another process may rebuild the index
        # and renumber the packs.
        raw = txn.get(_PACKNO.pack(number), db=self._packnames)
        if raw is None:
            raise _BadEntry(f"pack number {number} has no name")
        return bytes(raw).decode()

    def _entry(self, txn: lmdb.Transaction, raw: Any) -> IndexEntry:
        packno, offset, size, kind, codec, raw_size = _ENTRY.unpack(raw)
        if kind not in _KINDS:
            raise _BadEntry(f"an entry of unknown type {kind}")
        return IndexEntry(self._pack_name(txn, packno), offset, size, kind, codec, raw_size)

    # get, has and sizes are on the read path of every chunk: no context-manager wrappers.
    def get(self, oid: bytes) -> IndexEntry | None:
        try:
            with self._env.begin(db=self._objects, buffers=True) as txn:
                raw = txn.get(oid)
                return None if raw is None else self._entry(txn, raw)
        except _CAUGHT as exc:
            raise _translate(exc, self.path) from None

    def get_many(self, oids: Iterable[bytes]) -> list[IndexEntry | None]:
        """The entry of each id, None where it is not indexed; one transaction (the
        read engine orders a checkout's chunks by where they lie)."""
        try:
            with self._env.begin(db=self._objects, buffers=True) as txn:
                return [None if (raw := txn.get(oid)) is None else self._entry(txn, raw) for oid in oids]
        except _CAUGHT as exc:
            raise _translate(exc, self.path) from None

    def has(self, oid: bytes) -> bool:
        try:
            with self._env.begin(db=self._objects, buffers=True) as txn:
                return txn.get(oid) is not None
        except _CAUGHT as exc:
            raise _translate(exc, self.path) from None

    def sizes(self, oids: Iterable[bytes]) -> list[tuple[int, int] | None]:
        """(type, raw size) of each id, None where it is not indexed; one transaction."""
        out: list[tuple[int, int] | None] = []
        try:
            with self._env.begin(db=self._objects, buffers=True) as txn:
                for oid in oids:
                    raw = txn.get(oid)
                    if raw is None:
                        out.append(None)
                    else:
                        _, _, _, kind, _, raw_size = _ENTRY.unpack(raw)
                        out.append((kind, raw_size))
        except _CAUGHT as exc:
            raise _translate(exc, self.path) from None
        return out

    def indexed_packs(self) -> set[str]:
        with self._txn(db=self._packs) as txn:
            return {bytes(k).decode() for k in txn.cursor().iternext(keys=True, values=False)}

    def add_pack(self, name: str, entries: Iterable[RecordInfo]) -> None:
        """Register a pack and its records in one durable transaction. An id that
        is already indexed keeps its first location."""
        with self._txn(write=True) as txn:
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
        with self._txn(write=True) as txn:
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
        with self._txn(write=True) as txn:
            for db in (self._objects, self._packs, self._packnames, self._meta):
                txn.drop(db, delete=False)

    def iter_entries(self, prefix: bytes = b"") -> Iterator[tuple[bytes, IndexEntry]]:
        with self._txn(db=self._objects, buffers=True) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(prefix):
                return
            for key, raw in cursor:
                oid = bytes(key)
                if not oid.startswith(prefix):
                    return
                yield oid, self._entry(txn, raw)

    def count(self) -> int:
        with self._txn(db=self._objects) as txn:
            return int(txn.stat(self._objects)["entries"])


def rebuild_local_index(root: Path, index_dir: str, fill: Callable[[Index], None]) -> Index:
    """Build a new LMDB index with ``fill`` beside the one at ``root/index_dir``,
    which is never opened (it may be damaged: a truncated LMDB file is a SIGBUS
    when mapped), rename it into place and open it. The caller holds off writers."""
    target = root / index_dir
    fresh = root / f"{index_dir}.rebuild-{uuid.uuid4().hex}"
    aside = root / f"{index_dir}.old-{uuid.uuid4().hex}"
    try:
        new = Index(fresh)
        try:
            fill(new)
        finally:
            new.close()
        if target.exists():
            os.rename(target, aside)
        os.rename(fresh, target)
        fsync_dir(root)
    except OSError as exc:
        raise StorageIOError(f"cannot rebuild the index in {root}: {exc}", path=str(root)) from None
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)
    return Index(target)


class MemoryIndex:
    """The index of a backend without local files (the memory twin, later a
    remote without a cache directory): a dict with Index's interface."""

    def __init__(self) -> None:
        self.path = None
        self.readonly = False
        self._lock = threading.Lock()
        self._objects: dict[bytes, IndexEntry] = {}
        self._packs: dict[str, list[RecordInfo]] = {}

    def close(self) -> None:
        pass

    def reopen_if_replaced(self) -> bool:
        return False

    def get(self, oid: bytes) -> IndexEntry | None:
        return self._objects.get(oid)

    def get_many(self, oids: Iterable[bytes]) -> list[IndexEntry | None]:
        return [self._objects.get(oid) for oid in oids]

    def has(self, oid: bytes) -> bool:
        return oid in self._objects

    def sizes(self, oids: Iterable[bytes]) -> list[tuple[int, int] | None]:
        out: list[tuple[int, int] | None] = []
        for oid in oids:
            e = self._objects.get(oid)
            out.append(None if e is None else (e.kind, e.raw_size))
        return out

    def indexed_packs(self) -> set[str]:
        with self._lock:
            return set(self._packs)

    def _put(self, name: str, e: RecordInfo) -> IndexEntry:
        return IndexEntry(name, e.offset, e.record_size, e.kind, e.codec, e.raw_size)

    def add_pack(self, name: str, entries: Iterable[RecordInfo]) -> None:
        with self._lock:
            if name in self._packs:
                return
            self._packs[name] = list(entries)
            for e in self._packs[name]:
                self._objects.setdefault(e.oid, self._put(name, e))

    def swap_packs(
        self, added: list[tuple[str, list[RecordInfo]]], removed: list[tuple[str, list[RecordInfo]]]
    ) -> None:
        with self._lock:
            for name, entries in added:
                self._packs.setdefault(name, list(entries))
                for e in entries:
                    self._objects[e.oid] = self._put(name, e)
            for name, entries in removed:
                if self._packs.pop(name, None) is None:
                    continue
                for e in entries:
                    current = self._objects.get(e.oid)
                    if current is not None and current.pack == name:
                        del self._objects[e.oid]

    def location(self, oid: bytes) -> tuple[str, int] | None:
        entry = self.get(oid)
        return None if entry is None else (entry.pack, entry.offset)

    def clear(self) -> None:
        with self._lock:
            self._objects.clear()
            self._packs.clear()

    def iter_entries(self, prefix: bytes = b"") -> Iterator[tuple[bytes, IndexEntry]]:
        with self._lock:
            items = sorted(((oid, e) for oid, e in self._objects.items() if oid.startswith(prefix)), key=lambda i: i[0])
        yield from items

    def count(self) -> int:
        return len(self._objects)


AnyIndex = Index | MemoryIndex
