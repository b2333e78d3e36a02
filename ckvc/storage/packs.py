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

A pack is written through a backend's sink and published (locally: fsync and
rename into place) only once it is complete, so every ``*.pack`` key is whole.
Records are self-describing, so a pack whose table of contents is damaged can
still be read by scanning.

Pure format: this module moves bytes through the Backend interface and never
touches the file system itself.
"""

from __future__ import annotations

import struct
import threading
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from ckvc.errors import CorruptObjectError, UnsupportedFormatError
from ckvc.ids import ID_SIZE, Buffer, ObjectType
from ckvc.storage.backend import Backend, Sink, describe_key

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
# The bytes read from a pack's end to find its footer and TOC at once: a TOC of up
# to 66 entries (a metadata pack, a small pack of chunks); a larger one takes a
# second read. Small, because a lazy clone reads every pack's tail and no chunk.
TAIL_READ = 4 << 10
NO_BASE = bytes(ID_SIZE)
_KINDS = frozenset(int(t) for t in ObjectType)  # record types this reader knows
PACK_SUFFIX = ".pack"
TMP_SUFFIX = ".pack.tmp"  # a pack sink's temporary, locally
# A remote pack's TOC and footer, copied into a small key of their own beside it
# (``<pack>.toc``): a reader builds its catalog without a ranged read of each
# pack, which some servers answer by reading the whole object.
TOC_COPY_SUFFIX = ".toc"
PACK_DIR = "packs"  # the folder (key prefix) of packs in a repository's backend


def is_pack_name(name: str) -> bool:
    """A name that can be a pack of this repository: index entries are not
    trusted to stay inside the pack folder."""
    return name.endswith(PACK_SUFFIX) and "/" not in name and "\0" not in name and not name.startswith(".")


def pack_key(name: str, directory: str = PACK_DIR) -> str:
    return f"{directory}/{name}" if directory else name


def toc_copy_name(pack: str) -> str:
    """The name, beside pack ``pack``, of the copy of its TOC and footer."""
    return pack + TOC_COPY_SUFFIX


def copied_pack_name(name: str) -> str | None:
    """The pack a TOC copy's name belongs to, or None when ``name`` is no TOC copy."""
    pack = name.removesuffix(TOC_COPY_SUFFIX)
    return pack if pack != name and is_pack_name(pack) else None


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


# Records smaller than this are gathered into writes of about this size.
COALESCE_BYTES = 256 << 10


class PackWriter:
    """Appends records to a new pack in ``backend``'s ``directory``. Nothing is
    visible under the pack's key until :meth:`seal` has written the table of
    contents and published the sink."""

    def __init__(self, backend: Backend, directory: str = PACK_DIR) -> None:
        self.pack_uuid = uuid.uuid4()
        self.name = f"pack-{self.pack_uuid.hex}{PACK_SUFFIX}"
        self.key = pack_key(self.name, directory)
        # Locally the sink holds an flock on its temporary until publish or
        # abort: a temporary nobody holds is a dead writer's, which sweep removes.
        self.sink: Sink = backend.open_sink(self.key)
        self._done = False
        # Small records wait here and reach the sink together: one write call per
        # record cost more than encoding a few-KiB tensor (40,000-tensor states).
        self._coalesced = bytearray()
        self.entries: list[RecordInfo] = []
        self.tail = b""  # the TOC and footer, once sealed (what a TOC copy holds)
        try:
            self.sink.write(PACK_HEADER.pack(PACK_MAGIC, PACK_VERSION, 0, self.pack_uuid.bytes))
        except BaseException:
            self.abort()  # nobody holds this writer yet: leave no temporary pack behind
            raise

    @property
    def size(self) -> int:
        return self.sink.size + len(self._coalesced)

    def append(
        self, oid: bytes, kind: int, codec: int, raw_size: int, payload: Buffer, base: bytes | None = None
    ) -> RecordInfo:
        header = encode_record_header(oid, kind, codec, raw_size, len(payload), base)
        info = RecordInfo(oid, kind, codec, self.size, len(header) + len(payload), raw_size)
        if len(payload) < COALESCE_BYTES:
            self._coalesced += header
            self._coalesced += payload
            if len(self._coalesced) >= COALESCE_BYTES:
                self._flush()
        else:
            self._flush()
            self.sink.writev((header, payload))
        self.entries.append(info)
        return info

    def _flush(self) -> None:
        if self._coalesced:
            self.sink.write(self._coalesced)
            self._coalesced = bytearray()

    def seal(self) -> str:
        """Write the table of contents and footer and publish the pack (locally:
        fsync, rename into place, directory fsync). Returns the pack's name."""
        toc = bytearray(TOC_HEADER.pack(TOC_MAGIC, 0))
        for e in self.entries:
            toc += TOC_ENTRY.pack(e.oid, e.kind, e.codec, 0, e.offset, e.record_size, e.raw_size)
        toc_offset = self.size
        footer = FOOTER.pack(FOOTER_MAGIC, toc_offset, len(self.entries), zlib.crc32(toc), 0)
        self._flush()
        self.sink.writev((toc, footer))
        self.sink.publish()
        self._done = True
        self.tail = bytes(toc) + footer
        return self.name

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self.sink.abort()


def parse_pack_header(head: Buffer, name: str) -> None:
    """CorruptObjectError or UnsupportedFormatError unless ``head`` is a pack header this reader knows."""
    if len(head) < PACK_HEADER.size:
        raise CorruptObjectError(f"pack {name} is shorter than its header")
    magic, version, _flags, _uuid = PACK_HEADER.unpack_from(head)
    if magic != PACK_MAGIC:
        raise CorruptObjectError(f"pack {name} has a bad magic number")
    if version != PACK_VERSION:
        raise UnsupportedFormatError(f"pack {name} has format version {version}; this ckvc reads {PACK_VERSION}")


def parse_footer(footer: Buffer, size: int) -> tuple[int, int, int] | None:
    """(toc offset, entry count, TOC crc) from a pack's last 32 bytes, or None
    when the footer does not describe a TOC that ends where the footer starts."""
    if size < PACK_HEADER.size + TOC_HEADER.size + FOOTER.size:
        return None
    magic, toc_offset, count, crc, _ = FOOTER.unpack(footer)
    if magic != FOOTER_MAGIC or toc_offset + TOC_HEADER.size + count * TOC_ENTRY.size + FOOTER.size != size:
        return None
    return toc_offset, count, crc


def parse_toc(toc: Buffer, toc_offset: int, count: int, crc: int) -> list[RecordInfo] | None:
    """The entries of a table of contents read at ``toc_offset``, or None when it is damaged."""
    if zlib.crc32(toc) != crc or bytes(toc[:4]) != TOC_MAGIC:
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


def parse_toc_copy(data: Buffer) -> tuple[list[RecordInfo], int] | None:
    """(entries, the pack's size) from a TOC copy (a pack's TOC and footer, as its
    last bytes), or None when it is damaged. Nothing here proves the copy matches
    its pack: a reader still checks each record it reads against its entry and
    every read against the pack's real size."""
    view = memoryview(data)
    if len(view) < TOC_HEADER.size + FOOTER.size:
        return None
    magic, toc_offset, count, crc, _ = FOOTER.unpack(view[-FOOTER.size :])
    if magic != FOOTER_MAGIC or TOC_HEADER.size + count * TOC_ENTRY.size + FOOTER.size != len(view):
        return None
    if toc_offset < PACK_HEADER.size:
        return None
    entries = parse_toc(view[: -FOOTER.size], toc_offset, count, crc)
    return None if entries is None else (entries, toc_offset + len(view))


def _read(backend: Backend, key: str, offset: int, size: int) -> bytearray:
    buf = bytearray(size)
    backend.read_into(key, offset, memoryview(buf))
    return buf


def read_toc(backend: Backend, key: str) -> list[RecordInfo] | None:
    """The pack's table of contents, or None when footer or TOC are damaged."""
    return _toc_in(backend, key, *backend.read_tail(key, TAIL_READ))


def _toc_in(backend: Backend, key: str, size: int, tail: memoryview) -> list[RecordInfo] | None:
    """The TOC of a pack of ``size`` bytes whose last bytes are ``tail``: footer
    and TOC come from that one read unless the TOC is larger (then a second)."""
    if len(tail) < FOOTER.size:
        return None
    where = parse_footer(tail[-FOOTER.size :], size)
    if where is None:
        return None
    toc_offset, count, crc = where
    toc_size = TOC_HEADER.size + count * TOC_ENTRY.size
    start = size - len(tail)
    if toc_offset >= start:
        toc: Buffer = tail[toc_offset - start : toc_offset - start + toc_size]
    else:
        toc = _read(backend, key, toc_offset, toc_size)
    return parse_toc(toc, toc_offset, count, crc)


def scan_records(backend: Backend, key: str) -> Iterator[RecordInfo]:
    """Walk records from the start of the pack, stopping at the first header that
    does not parse (the table of contents, or damage)."""
    size = backend.size(key)
    offset = PACK_HEADER.size
    head = memoryview(bytearray(RECORD_HEADER_SIZE))
    while offset + RECORD_HEADER_SIZE <= size:
        backend.read_into(key, offset, head)
        try:
            kind, codec, raw_size, payload_size, oid, _base = parse_record_header(head)
        except CorruptObjectError:
            return
        record_size = RECORD_HEADER_SIZE + payload_size
        if offset + record_size > size or kind not in _KINDS:
            return
        yield RecordInfo(oid, kind, codec, offset, record_size, raw_size)
        offset += record_size


@dataclass(frozen=True)
class PackIndex:
    entries: list[RecordInfo]
    from_toc: bool  # the TOC was intact (else the entries are what a scan recovered)
    size: int
    header_pending: bool  # the header was not read (``header=False`` on a large pack)


def read_pack_index(backend: Backend, key: str, *, header: bool = True) -> PackIndex:
    """The pack's entries: its TOC when intact, else what a scan recovers; its
    header checked first (unless ``header`` is False and it is not in the tail).
    One read of the tail gives footer, TOC and size, and the whole of a pack no
    larger than TAIL_READ."""
    size, tail = backend.read_tail(key, TAIL_READ)
    name = describe_key(key).removeprefix("pack ")
    if len(tail) == size:
        parse_pack_header(tail[: PACK_HEADER.size], name)
    elif header:
        parse_pack_header(_read(backend, key, 0, PACK_HEADER.size), name)
    pending = len(tail) < size and not header
    toc = _toc_in(backend, key, size, tail)
    if toc is not None:
        return PackIndex(toc, True, size, pending)
    return PackIndex(list(scan_records(backend, key)), False, size, pending)


def pack_entries(backend: Backend, key: str) -> tuple[list[RecordInfo], bool]:
    """(entries, from_toc) of the pack at ``key``, its header checked first."""
    found = read_pack_index(backend, key)
    return found.entries, found.from_toc


class PackReader:
    """Positional reads from sealed packs through a backend. Thread-safe.

    Pack sizes are cached (packs never change once sealed), so a read is checked
    against its pack's end before a buffer of its size is allocated."""

    def __init__(self, backend: Backend, directory: str = PACK_DIR) -> None:
        self.backend = backend
        self.directory = directory
        self._sizes: dict[str, int] = {}
        self._headers_pending: set[str] = set()  # packs whose header waits for their first read
        self._local = threading.local()  # per-thread read buffers (read_reusing)

    def key(self, name: str) -> str:
        if not is_pack_name(name):  # index entries are not trusted to stay in packs/
            raise CorruptObjectError(f"the index names a pack {name!r:.80} that cannot exist")
        return pack_key(name, self.directory)

    def size(self, name: str) -> int:
        size = self._sizes.get(name)
        if size is None:
            size = self._sizes[name] = self.backend.size(self.key(name))
        return size

    def entries(self, name: str, *, header: bool = True) -> tuple[list[RecordInfo], bool]:
        """:func:`pack_entries` of pack ``name``, its size kept for range checks.
        ``header=False``: the header of a pack larger than TAIL_READ is checked by
        the first read of its records instead (a remote's catalog: one request a pack)."""
        found = read_pack_index(self.backend, self.key(name), header=header)
        self._sizes[name] = found.size
        if found.header_pending:
            self._headers_pending.add(name)
        return found.entries, found.from_toc

    def know_size(self, name: str, size: int) -> None:
        """Pack ``name``'s size, from a listing (packs never change once sealed)."""
        self._sizes[name] = size

    def entries_from_copy(self, name: str, data: Buffer) -> list[RecordInfo] | None:
        """The entries of pack ``name`` from its TOC copy (None: damaged, read the
        pack's own). The pack is not read: its header waits for its first read, and
        its size is learnt by the first range check, not taken from the copy."""
        parsed = parse_toc_copy(data)
        if parsed is None:
            return None
        self._headers_pending.add(name)
        return parsed[0]

    def header_pending(self, name: str) -> bool:
        """Whether the pack's header is left for its first read."""
        return name in self._headers_pending

    def header_read(self, name: str, head: Buffer) -> None:
        """Check ``head``, the first bytes of pack ``name``, as its header."""
        parse_pack_header(head, name)
        self._headers_pending.discard(name)

    def _check_pending_header(self, name: str) -> None:
        if name in self._headers_pending:
            self.header_read(name, _read(self.backend, self.key(name), 0, min(PACK_HEADER.size, self.size(name))))

    def check_range(self, name: str, offset: int, size: int) -> None:
        """CorruptObjectError unless [offset, offset + size) lies inside the pack:
        checked before any buffer of ``size`` bytes is allocated for a read (and
        the pack's header checked, if that was left for its first read)."""
        self._check_pending_header(name)
        self.check_bounds(name, offset, size)

    def check_bounds(self, name: str, offset: int, size: int) -> None:
        """:meth:`check_range` for a caller that checks a pending header itself."""
        pack_size = self.size(name)
        if offset < 0 or size < 0 or offset + size > pack_size:
            raise CorruptObjectError(
                f"pack {name}: {size} bytes at offset {offset} run past its end ({pack_size} bytes)"
            )

    def read(self, name: str, offset: int, size: int) -> bytes:
        self.check_range(name, offset, size)
        buf = bytearray(size)
        self.backend.read_into(self.key(name), offset, memoryview(buf))
        return bytes(buf)

    def read_reusing(self, name: str, offset: int, size: int, slot: int = 0) -> memoryview:
        """Like :meth:`read`, into a buffer this thread reuses per ``slot``: valid
        only until this thread's next read into the same slot. Fresh pages cost a
        fault per 4 KiB in these VMs, more than decoding what lands in them."""
        self.check_range(name, offset, size)
        view = self.buffer(slot, size)
        self.backend.read_into(self.key(name), offset, view)
        return view

    def buffer(self, slot: int, size: int) -> memoryview:
        """This thread's reusable buffer ``slot``, at least ``size`` bytes (its first ``size`` returned)."""
        bufs: dict[int, bytearray] = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(slot)
        if buf is None or len(buf) < size:
            buf = bufs[slot] = bytearray(max(size, 1 << 20))
        return memoryview(buf)[:size]

    def readv(self, name: str, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` in order from ``offset`` with one backend request."""
        self.check_range(name, offset, sum(len(b) for b in buffers))
        self.backend.readv_into(self.key(name), offset, buffers)

    def prefetch(self, name: str, offset: int, size: int) -> None:
        """Ask the backend to start reading a range now (locally POSIX_FADV_WILLNEED).
        A hint only; a missing pack is reported by the read itself."""
        if is_pack_name(name):
            self.backend.prefetch(pack_key(name, self.directory), offset, size)

    def read_head_into(self, name: str, offset: int, size: int, head_size: int, out: memoryview) -> memoryview:
        """Read ``size`` bytes at ``offset``: the first ``head_size`` into this thread's
        buffer (returned, valid until its next read), the rest straight into ``out``
        (a raw chunk's destination: no second copy)."""
        if len(out) != size - head_size:
            raise ValueError("destination does not match the record's payload size")
        self.check_range(name, offset, size)
        head = self.buffer(-1, head_size)
        self.backend.readv_into(self.key(name), offset, (head, out))
        return head

    def forget(self, name: str) -> None:
        """Drop what is cached of a pack (gc removed it)."""
        self._sizes.pop(name, None)
        self._headers_pending.discard(name)
        if is_pack_name(name):
            self.backend.forget(pack_key(name, self.directory))

    def close(self) -> None:
        self._sizes.clear()
        self._headers_pending.clear()
        self.backend.close()
