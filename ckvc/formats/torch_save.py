"""torch.save files: read with ``weights_only=True`` plus the numpy types RNG
states use (never unpickling code), split into the loaded object and the zip
archive's bytes around its storages, so export rebuilds the file byte for byte."""

from __future__ import annotations

import io
import mmap
import struct
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ckvc.state import StoredFile

if TYPE_CHECKING:
    import torch


from ckvc.formats.layout import NotParsed, file_layout, first_line, pieces, raw_bytes


@contextmanager
def numpy_allowed() -> Iterator[None]:
    """torch.load's weights_only unpickler plus the numpy types of RNG states (as
    transformers' Trainer does): arrays rebuilt from dtype and bytes, no code."""
    import torch

    np_core = getattr(np, "_core", None) or np.core
    allow = [np_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    allow += [type(np.dtype(t)) for t in (np.float64, np.float32, np.int64, np.int32, np.uint8, np.bool_)]
    with torch.serialization.safe_globals(allow):
        yield


def zip_data_spans(data: Any) -> dict[str, tuple[int, int]] | None:
    """{storage key: (begin, end) of its bytes in the file} of a torch zip archive,
    or None when it is not one whose entries are stored uncompressed."""
    try:
        with zipfile.ZipFile(io.BytesIO(data) if isinstance(data, bytes) else _MmapReader(data)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None
    spans: dict[str, tuple[int, int]] = {}
    for info in infos:
        parts = info.filename.split("/")
        if len(parts) == 3 and parts[1] == "data":
            if info.compress_type != zipfile.ZIP_STORED:
                return None
            local = data[info.header_offset : info.header_offset + 30]
            if len(local) < 30 or local[:4] != b"PK\x03\x04":
                return None
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            begin = info.header_offset + 30 + name_len + extra_len
            spans[parts[2]] = (begin, begin + info.file_size)
    return spans


class _MmapReader(io.RawIOBase):
    """A seekable read-only file over a mapping, for zipfile."""

    def __init__(self, data: mmap.mmap) -> None:
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else len(self._data) + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        chunk = self._data[self._pos : self._pos + len(buffer)]
        buffer[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


def read_torch(path: Path, data: Any, mode: int) -> StoredFile | None:
    """The object torch.load(weights_only=True) returns, plus the archive's bytes
    around its storages and the storages themselves (as full views of the loaded
    tensors' storages, so they share blobs with the content); None when the file
    needs pickle beyond the allowlist or is not a torch file."""
    import torch

    from ckvc.state import flatten

    spans = zip_data_spans(data)
    if spans is None and bytes(data[:2]) == b"PK":
        raise NotParsed("a broken zip archive (cut short, or damaged)", malformed=True)
    if spans is None and bytes(data[:1]) != b"\x80":
        raise NotParsed("not a torch.save file (neither a zip archive nor a pickle)", malformed=True)
    try:
        with numpy_allowed(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes about files that are not its own
            # mmap: every storage is a view of one mapping of the file, so its
            # address tells which archive entry it is, with no hashing.
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=spans is not None)
    except Exception as exc:
        if "Weights only load failed" in str(exc):
            reason = "it needs pickle beyond torch's weights-only allowlist (never unpickled)"
            raise NotParsed(reason, malformed=False) from None
        raise NotParsed(f"unreadable by torch.load: {first_line(exc)}", malformed=True) from None
    if spans is None:
        # Legacy (pre-zip) torch files: the content, and the file's bytes beside it.
        return StoredFile(obj, file_layout("torch", mode, len(data), [0], [np.frombuffer(data, dtype=np.uint8)]))
    storages: dict[int, torch.Tensor] = {}
    for leaf in flatten(obj).values():
        if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().nbytes():
            s = leaf.untyped_storage()
            storages.setdefault(s.data_ptr(), torch.empty(0, dtype=leaf.dtype).set_(s))
    by_begin = sorted(spans.values())
    filled = [(b, e) for b, e in by_begin if e > b]
    ptrs = sorted(storages)
    base = ptrs[0] - filled[0][0] if ptrs and filled else 0
    located = {p - base: storages[p] for p in ptrs}
    sizes = dict(filled)
    if any(sizes.get(b) != b + s.untyped_storage().nbytes() for b, s in located.items()) or any(
        bytes(raw_bytes(s, str(path))[:64]) != bytes(data[b : b + 64])[: s.untyped_storage().nbytes()]
        for b, s in located.items()
    ):
        located = {}  # not laid out as expected: every entry keeps its own bytes
    parts: list[Any] = []
    for begin, end in by_begin:
        full = located.get(begin)
        if full is not None and full.untyped_storage().nbytes() == end - begin:
            itemsize = full.element_size()
            view = full if (end - begin) % itemsize == 0 else full.view(torch.uint8)
            parts.append(view.reshape(-1)[: (end - begin) // view.element_size()])
        else:  # not located (or empty): the entry's own bytes
            parts.append(np.frombuffer(data, dtype=np.uint8, count=end - begin, offset=begin).copy())
    return StoredFile(obj, file_layout("torch", mode, len(data), pieces(data, by_begin), parts))


def archive_end(data: Any, begin: int) -> int | None:
    """Where the zip archive starting at ``begin`` ends: at the first end-of-central-
    directory record (zip64 too) whose central directory ends right before it."""
    search = begin
    while True:
        e = data.find(b"PK\x05\x06", search)
        if e < 0 or e + 22 > len(data):
            return None
        _sig, _d, _cd, _n1, _n2, cd_size, cd_offset, comment = struct.unpack("<IHHHHIIH", data[e : e + 22])
        cd_end = e
        if e - 20 >= begin and data[e - 20 : e - 16] == b"PK\x06\x07":  # zip64: its record ends the directory
            (record,) = struct.unpack("<Q", data[e - 12 : e - 4])
            at = begin + record
            if data[at : at + 4] == b"PK\x06\x06":
                cd_size, cd_offset = struct.unpack("<QQ", data[at + 40 : at + 56])
                cd_end = at
        if begin + cd_offset + cd_size == cd_end and e + 22 + comment <= len(data):
            return e + 22 + comment
        search = e + 1
