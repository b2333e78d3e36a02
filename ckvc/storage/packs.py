"""Pack files: append-only containers of object records with a table of contents.

Byte layout (all integers little-endian; see docs/FORMAT.md):

    pack   := header record* toc footer
    header := "CKVCPACK" u32 version u32 flags(0) u8[16] pack uuid            (32 bytes)
    record := "CKR1" u8 type u8 codec u16 reserved(0) u64 raw_size
              u64 payload_size u8[32] id u8[32] base_id u32 crc32(bytes 0..88)
              payload                                                       (92 + payload)
    toc    := "CKTC" u32 reserved(0) entry*                                  (8 + 60 * n)
    entry  := u8[32] id u8 type u8 codec u16 reserved(0) u64 offset u64 record_size u64 raw_size
    footer := "CKVCTOC1" u64 toc_offset u64 entry_count u32 crc32(toc) u32 reserved(0)  (32 bytes)

A pack is written under a temporary name and renamed into place only once it is
complete and fsynced, so every ``*.pack`` file is whole. Records are
self-describing, so a pack whose table of contents is damaged can still be
read by scanning.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import stat
import struct
import threading
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ckvc.codecs import Buffer
from ckvc.errors import CkvcError, CorruptObjectError, ObjectNotFoundError, UnsupportedFormatError, storage_error
from ckvc.ids import ID_SIZE, ObjectType
from ckvc.storage.files import fsync_dir

PACK_MAGIC = b"CKVCPACK"
PACK_VERSION = 1
PACK_HEADER = struct.Struct("<8sII16s")
RECORD_MAGIC = b"CKR1"
RECORD_HEADER = struct.Struct("<4sBBHQQ32s32s")  # followed by u32 crc32 of these 88 bytes
RECORD_CRC = struct.Struct("<I")
RECORD_HEADER_SIZE = RECORD_HEADER.size + RECORD_CRC.size  # 92
TOC_MAGIC = b"CKTC"
TOC_HEADER = struct.Struct("<4sI")
TOC_ENTRY = struct.Struct("<32sBBHQQQ")
FOOTER_MAGIC = b"CKVCTOC1"
FOOTER = struct.Struct("<8sQQII")
NO_BASE = bytes(ID_SIZE)
_KINDS = frozenset(int(t) for t in ObjectType)  # record types this reader knows
PACK_SUFFIX = ".pack"
TMP_SUFFIX = ".pack.tmp"


@dataclass(frozen=True, slots=True)
class RecordInfo:
    """Where one object record lives inside a pack, and what it holds."""

    oid: bytes
    kind: int
    codec: int
    offset: int
    record_size: int
    raw_size: int


@dataclass(frozen=True, slots=True)
class Record:
    oid: bytes
    kind: int
    codec: int
    raw_size: int
    base: bytes | None
    payload: memoryview


def encode_record_header(
    oid: bytes, kind: int, codec: int, raw_size: int, payload_size: int, base: bytes | None
) -> bytes:
    head = RECORD_HEADER.pack(RECORD_MAGIC, kind, codec, 0, raw_size, payload_size, oid, base or NO_BASE)
    return head + RECORD_CRC.pack(zlib.crc32(head))


def parse_record_header(head: Buffer) -> tuple[int, int, int, int, bytes, bytes | None]:
    """(kind, codec, raw_size, payload_size, id, base id) from a record's first 92 bytes."""
    view = memoryview(head)
    if len(view) < RECORD_HEADER_SIZE:
        raise CorruptObjectError("record truncated before its header ends")
    fixed = view[: RECORD_HEADER.size]
    (crc,) = RECORD_CRC.unpack_from(view, RECORD_HEADER.size)
    if zlib.crc32(fixed) != crc:
        raise CorruptObjectError("record header checksum mismatch")
    magic, kind, codec, _reserved, raw_size, payload_size, oid, base = RECORD_HEADER.unpack(fixed)
    if magic != RECORD_MAGIC:
        raise CorruptObjectError("bad record magic")
    return kind, codec, raw_size, payload_size, oid, None if base == NO_BASE else base


def parse_record(buf: Buffer, expected_size: int | None = None) -> Record:
    """Parse one whole record from ``buf``; checks the header CRC and the length."""
    view = memoryview(buf)
    kind, codec, raw_size, payload_size, oid, base = parse_record_header(view)
    end = RECORD_HEADER_SIZE + payload_size
    if len(view) < end or (expected_size is not None and end != expected_size):
        raise CorruptObjectError("record payload size does not match its location")
    return Record(oid, kind, codec, raw_size, base, view[RECORD_HEADER_SIZE:end])


class PackWriter:
    """Appends records to a new pack. Nothing is visible under the final name
    until :meth:`seal` has written the table of contents, fsynced and renamed."""

    def __init__(self, pack_dir: Path) -> None:
        self.pack_dir = pack_dir
        self.pack_uuid = uuid.uuid4()
        self.name = f"pack-{self.pack_uuid.hex}{PACK_SUFFIX}"
        self._tmp_path = pack_dir / f"pack-{self.pack_uuid.hex}{TMP_SUFFIX}"
        self._fd = os.open(self._tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.entries: list[RecordInfo] = []
        self.size = 0
        try:
            # Held until seal or abort: a temporary pack nobody holds is a dead
            # writer's, which sweep_dead_temporaries may remove.
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._write(PACK_HEADER.pack(PACK_MAGIC, PACK_VERSION, 0, self.pack_uuid.bytes))
        except BaseException:
            self.abort()  # nobody holds this writer yet: leave no temporary pack behind
            raise

    def _write(self, *parts: Buffer) -> None:
        total = sum(len(p) for p in parts)
        written = os.writev(self._fd, parts)
        if written != total:  # short write: finish it the slow way
            rest = b"".join(bytes(p) for p in parts)[written:]
            while rest:
                rest = rest[os.write(self._fd, rest) :]
        self.size += total

    def append(
        self, oid: bytes, kind: int, codec: int, raw_size: int, payload: Buffer, base: bytes | None = None
    ) -> RecordInfo:
        header = encode_record_header(oid, kind, codec, raw_size, len(payload), base)
        info = RecordInfo(oid, kind, codec, self.size, len(header) + len(payload), raw_size)
        self._write(header, payload)
        self.entries.append(info)
        return info

    def seal(self) -> Path:
        """Write the table of contents and footer, fsync, and rename into place."""
        toc = bytearray(TOC_HEADER.pack(TOC_MAGIC, 0))
        for e in self.entries:
            toc += TOC_ENTRY.pack(e.oid, e.kind, e.codec, 0, e.offset, e.record_size, e.raw_size)
        toc_offset = self.size
        footer = FOOTER.pack(FOOTER_MAGIC, toc_offset, len(self.entries), zlib.crc32(toc), 0)
        self._write(toc, footer)
        os.fsync(self._fd)
        final = self.pack_dir / self.name
        os.rename(self._tmp_path, final)  # still locked: no sweep can take it first
        os.close(self._fd)
        self._fd = -1
        fsync_dir(self.pack_dir)
        return final

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(OSError):
            os.unlink(self._tmp_path)


def sweep_dead_temporaries(pack_dir: Path) -> list[str]:
    """Remove temporary packs whose writer is gone (killed, or its cleanup failed
    too): their lock is free and they hold at least a header (a live writer locks
    its file before it writes the header). Returns the names removed."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(pack_dir) if n.endswith(TMP_SUFFIX)]
    except OSError:
        return removed
    for name in names:
        path = pack_dir / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_size >= PACK_HEADER.size:
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass  # held by a live writer, or not ours to remove
        finally:
            os.close(fd)
    return removed


def read_pack_header(fd: int, name: str) -> None:
    head = os.pread(fd, PACK_HEADER.size, 0)
    if len(head) < PACK_HEADER.size:
        raise CorruptObjectError(f"pack {name} is shorter than its header")
    magic, version, _flags, _uuid = PACK_HEADER.unpack(head)
    if magic != PACK_MAGIC:
        raise CorruptObjectError(f"pack {name} has a bad magic number")
    if version != PACK_VERSION:
        raise UnsupportedFormatError(f"pack {name} has format version {version}; this ckvc reads {PACK_VERSION}")


def read_toc(fd: int, name: str) -> list[RecordInfo] | None:
    """The pack's table of contents, or None when footer or TOC are damaged."""
    size = os.fstat(fd).st_size
    if size < PACK_HEADER.size + TOC_HEADER.size + FOOTER.size:
        return None
    magic, toc_offset, count, crc, _ = FOOTER.unpack(os.pread(fd, FOOTER.size, size - FOOTER.size))
    toc_size = TOC_HEADER.size + count * TOC_ENTRY.size
    if magic != FOOTER_MAGIC or toc_offset + toc_size + FOOTER.size != size:
        return None
    toc = os.pread(fd, toc_size, toc_offset)
    if zlib.crc32(toc) != crc or toc[:4] != TOC_MAGIC:
        return None
    entries = []
    for i in range(count):
        oid, kind, codec, _r, offset, record_size, raw_size = TOC_ENTRY.unpack_from(
            toc, TOC_HEADER.size + i * TOC_ENTRY.size
        )
        # A checksum is no proof (anyone can compute one): an entry must lie
        # between the header and the TOC, or the TOC counts as damaged.
        if (
            offset < PACK_HEADER.size
            or record_size < RECORD_HEADER_SIZE
            or offset + record_size > toc_offset
            or kind not in _KINDS
        ):
            return None
        entries.append(RecordInfo(oid, kind, codec, offset, record_size, raw_size))
    return entries


def scan_records(fd: int) -> Iterator[RecordInfo]:
    """Walk records from the start of the pack, stopping at the first header that
    does not parse (the table of contents, or damage)."""
    size = os.fstat(fd).st_size
    offset = PACK_HEADER.size
    while offset + RECORD_HEADER_SIZE <= size:
        try:
            kind, codec, raw_size, payload_size, oid, _base = parse_record_header(
                os.pread(fd, RECORD_HEADER_SIZE, offset)
            )
        except CorruptObjectError:
            return
        record_size = RECORD_HEADER_SIZE + payload_size
        if offset + record_size > size or kind not in _KINDS:
            return
        yield RecordInfo(oid, kind, codec, offset, record_size, raw_size)
        offset += record_size


def pack_entries(fd: int, name: str) -> tuple[list[RecordInfo], bool]:
    """(entries, from_toc): the TOC when intact, else what a scan recovers."""
    read_pack_header(fd, name)
    toc = read_toc(fd, name)
    if toc is not None:
        return toc, True
    return list(scan_records(fd)), False


MAX_OPEN_PACKS = 64


class PackReader:
    """Positional reads from sealed packs. Thread-safe: pread needs no seek.

    Open files are cached, least recently used first out, at most
    ``max_open`` of them idle: a repository has a pack per commit, far more than
    a process may keep open. A file in use by a read is never closed under it.
    """

    def __init__(self, pack_dir: Path, max_open: int = MAX_OPEN_PACKS) -> None:
        self.pack_dir = pack_dir
        self.max_open = max_open
        self._fds: collections.OrderedDict[str, list[int]] = collections.OrderedDict()  # name -> [fd, users]
        self._sizes: dict[str, int] = {}  # file sizes: packs never change once sealed
        self._retired: dict[int, int] = {}  # fd -> users, for files dropped from the cache while in use
        self._lock = threading.Lock()
        self._local = threading.local()  # per-thread read buffers (read_reusing)

    @contextlib.contextmanager
    def opened(self, name: str) -> Iterator[int]:
        """An open file descriptor for pack ``name`` for the duration of the block."""
        with self._lock:
            entry = self._fds.get(name)
            if entry is not None:
                self._fds.move_to_end(name)
                entry[1] += 1
            else:
                if not _is_pack_name(name):  # index entries are not trusted to stay in packs/
                    raise CorruptObjectError(f"the index names a pack {name!r:.80} that cannot exist")
                try:
                    fd = os.open(self.pack_dir / name, os.O_RDONLY)
                except FileNotFoundError:
                    raise ObjectNotFoundError(f"pack {name} is missing") from None
                except OSError as exc:
                    raise storage_error(exc, f"opening pack {name}", "nothing was read from it") from None
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    os.close(fd)
                    raise CorruptObjectError(f"pack {name} is not a regular file")
                self._sizes[name] = st.st_size
                entry = [fd, 1]
                self._fds[name] = entry
                self._evict_idle()
            fd = entry[0]
        try:
            yield fd
        except OSError as exc:  # EIO and the like from a read of this pack
            raise storage_error(exc, f"reading pack {name}", "nothing was read from it") from None
        finally:
            with self._lock:
                if self._fds.get(name) is entry:
                    entry[1] -= 1
                    self._evict_idle()
                else:  # dropped from the cache while we used it
                    self._retired[fd] -= 1
                    if not self._retired[fd]:
                        del self._retired[fd]
                        os.close(fd)

    def _evict_idle(self) -> None:
        """Close least recently used idle files beyond the cap (lock held)."""
        excess = len(self._fds) - self.max_open
        for name in list(self._fds):
            if excess <= 0:
                break
            fd, users = self._fds[name]
            if users == 0:
                del self._fds[name]
                os.close(fd)
                excess -= 1

    def check_range(self, name: str, offset: int, size: int) -> None:
        """CorruptObjectError unless [offset, offset + size) lies inside the pack:
        checked before any buffer of ``size`` bytes is allocated for a read."""
        pack_size = self._sizes.get(name)
        if pack_size is None:
            with self.opened(name):
                pack_size = self._sizes[name]
        if offset < 0 or size < 0 or offset + size > pack_size:
            raise CorruptObjectError(
                f"pack {name}: {size} bytes at offset {offset} run past its end ({pack_size} bytes)"
            )

    def read(self, name: str, offset: int, size: int) -> bytes:
        self.check_range(name, offset, size)
        with self.opened(name) as fd:
            data = os.pread(fd, size, offset)
        if len(data) != size:
            raise CorruptObjectError(f"pack {name} is truncated at offset {offset}")
        return data

    def read_reusing(self, name: str, offset: int, size: int, slot: int = 0) -> memoryview:
        """Like :meth:`read`, into a buffer this thread reuses per ``slot``: valid
        only until this thread's next read into the same slot. Fresh pages cost a
        fault per 4 KiB in these VMs, more than decoding what lands in them."""
        self.check_range(name, offset, size)
        view = self._buffer(slot, size)
        self._read_exact(name, offset, [view])
        return view

    def _buffer(self, slot: int, size: int) -> memoryview:
        bufs: dict[int, bytearray] = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(slot)
        if buf is None or len(buf) < size:
            buf = bufs[slot] = bytearray(max(size, 1 << 20))
        return memoryview(buf)[:size]

    def _read_exact(self, name: str, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` in order from ``offset``; a short read means a truncated pack."""
        with self.opened(name) as fd:
            got = os.preadv(fd, buffers, offset)
        if got != sum(len(b) for b in buffers):
            raise CorruptObjectError(f"pack {name} is truncated at offset {offset}")

    def prefetch(self, name: str, offset: int, size: int) -> None:
        """Ask the kernel to start reading a range now (POSIX_FADV_WILLNEED): the
        read that follows finds it in the page cache instead of waiting on the
        disk. A hint only; a missing pack is reported by the read itself."""
        if not hasattr(os, "posix_fadvise"):
            return
        try:
            with self.opened(name) as fd:
                os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)
        except (CkvcError, OSError):
            pass

    def read_head_into(self, name: str, offset: int, size: int, head_size: int, out: memoryview) -> memoryview:
        """Read ``size`` bytes at ``offset``: the first ``head_size`` into this thread's
        buffer (returned, valid until its next read), the rest straight into ``out``
        (a raw chunk's destination: no second copy)."""
        if len(out) != size - head_size:
            raise ValueError("destination does not match the record's payload size")
        self.check_range(name, offset, size)
        head = self._buffer(-1, head_size)
        self._read_exact(name, offset, [head, out])
        return head

    def forget(self, name: str) -> None:
        """Drop a pack's cached file (gc removed the pack)."""
        with self._lock:
            self._sizes.pop(name, None)
            entry = self._fds.pop(name, None)
            if entry is not None:
                if entry[1]:
                    self._retired[entry[0]] = entry[1]
                else:
                    os.close(entry[0])

    def close(self) -> None:
        with self._lock:
            entries, self._fds = list(self._fds.values()), collections.OrderedDict()
        for fd, _users in entries:
            os.close(fd)


def _is_pack_name(name: str) -> bool:
    return name.endswith(PACK_SUFFIX) and "/" not in name and "\0" not in name and not name.startswith(".")


def list_packs(pack_dir: Path) -> list[str]:
    return sorted(p.name for p in pack_dir.iterdir() if _is_pack_name(p.name))
