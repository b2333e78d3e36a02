"""Checkpoint files and folders in, exact files out: what ``ckvc commit PATH`` reads
and ``ckvc checkout -o`` / ``ckvc export`` write (docs/GUIDE.md, "Files and folders").

Every file is stored as it is. A .safetensors file or a torch.save file (read with
``weights_only=True`` plus the numpy types RNG states use, never unpickling code)
is split into its tensors, so they dedup and compress; its other bytes (the header,
the zip skeleton with its pickle program) are kept so that export rebuilds the file
byte for byte with no pickling. Anything else, including files that would need
pickle, is stored as bytes. Each file becomes a :class:`ckvc.state.StoredFile`
(ext 10, docs/FORMAT.md 10.7); ``load`` returns its content, so a directory commit
loads as ``{relative path: tensors | bytes | link target}``.

Entry points: :func:`read_checkpoint` (PATH -> state, metadata), :func:`export_commit`
(a revision -> files) and :func:`write_checkpoint` (a state -> files). Output is
atomic: a file is written under a hidden temporary name and renamed; a directory
is written as a hidden sibling and swapped in, and the leftovers of killed runs
are removed by the next run.

One module, over 600 lines, on purpose: each file kind's reader and writer
(torch.save zip, safetensors, folders and links) are a pair that must stay
byte-faithful to each other, and share the skeleton and path-safety helpers.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import itertools
import json
import mmap
import os
import re
import shutil
import stat
import struct
import uuid
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from ckvc.errors import CkvcError, InvalidInputError, UnsupportedTypeError
from ckvc.state import StoredFile, is_utf8

if TYPE_CHECKING:
    import torch

    from ckvc.objects import Commit
    from ckvc.read import ReadCore

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SAFETENSORS_SUFFIX = ".safetensors"
DCP_SUFFIX = ".distcp"  # torch.distributed.checkpoint's data files: torch.save archives back to back
DIRECTORY_SOURCE = "directory"
REPOSITORY_DIR = ".ckvc"
# Files up to this size are kept inline in the state tree; larger ones become a
# uint8 blob (chunked, deduplicated, compressed) that ``load`` returns as bytes.
INLINE_BYTES = 64 << 10
Format = Literal["pt", "safetensors", "dir"]
Progress = Callable[[int, int], None]
_DEFAULT_FILE_MODE = 0o644


class CommitSource(Protocol):
    """What export needs of a repository (ckvc.Repo): its core, and revisions
    resolved as every read resolves them."""

    @property
    def core(self) -> ReadCore: ...

    def readable_commit(self, rev: str, *, allow_pickle: bool = False) -> Commit: ...


_TMP_TAG = ".ckvc-tmp-"
# Temporary names of this module (".NAME.ckvc-tmp-HEX") and of older ckvc (".NAME.HEX.tmp").
_LEFTOVER = re.compile(r"^\.(?P<name>.+)(?:\.ckvc-tmp-[0-9a-f]{32}|\.[0-9a-f]{32}\.tmp)$")


class UnsupportedFileError(InvalidInputError):
    """A path to commit is not a regular file, directory or symlink (a FIFO, socket,
    device), or cannot be read; nothing was read from it and nothing was written."""

    exit_code = 31


class LinkOutsideTreeError(InvalidInputError):
    """A symlink in a committed directory points outside it (use follow_links / --follow-links)."""

    exit_code = 32


class OutputPathError(InvalidInputError):
    """An output path cannot be written: missing parent, wrong kind, unsafe name."""

    exit_code = 33


# --------------------------------------------------------------------------- reading


def read_checkpoint(
    path: Path | str, *, follow_links: bool = False, progress: Progress | None = None
) -> tuple[Any, dict[str, str]]:
    """(state, commit metadata describing the source) for a file or directory.

    A directory becomes ``{relative posix path: StoredFile}`` for every regular file,
    symlink and empty directory in it (dot-files included). A symlink that stays in
    the tree is stored as a link; one that leaves it raises LinkOutsideTreeError
    unless ``follow_links`` (then what it points to is stored). FIFOs, sockets and
    devices raise UnsupportedFileError before anything is read."""
    path = Path(path)
    try:
        st = os.stat(path)  # the path the user names is followed, as any tool does
    except FileNotFoundError:
        raise InvalidInputError(f"no such file or directory: {path}") from None
    except OSError as exc:
        raise UnsupportedFileError(f"cannot read {path}: {exc.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        try:
            entries = _walk(Path(os.path.realpath(path)), follow_links)
        except OSError as exc:  # the tree changed while it was read
            raise UnsupportedFileError(f"cannot read {exc.filename or path}: {exc.strerror or exc}") from None
        total = sum(e.size for e in entries.values())
        done = 0
        state: dict[str, StoredFile] = {}
        for rel, entry in entries.items():
            state[rel] = entry.read()
            done += entry.size
            if progress is not None:
                progress(done, total)
        return state, {"ckvc.source": DIRECTORY_SOURCE}
    if not stat.S_ISREG(st.st_mode):
        raise UnsupportedFileError(f"{path} is not a regular file or directory ({_kind_name(st.st_mode)})")
    if st.st_size == 0:
        raise InvalidInputError(f"{path} is empty (0 bytes): nothing to commit")
    stored = _read_file(path, st)
    if progress is not None:
        progress(st.st_size, st.st_size)
    return stored, {"ckvc.source": path.suffix.lstrip(".") or "file"}


@dataclass
class _Entry:
    kind: Literal["file", "link", "dir"]
    path: Path  # the file to read (a followed link's target), or the link / directory itself
    st: os.stat_result
    target: str = ""  # a link's target

    @property
    def size(self) -> int:
        return self.st.st_size if self.kind == "file" else 0

    def read(self) -> StoredFile:
        if self.kind == "link":
            return StoredFile(self.target, {"type": "link"})
        if self.kind == "dir":
            return StoredFile(None, {"type": "dir", "mode": stat.S_IMODE(self.st.st_mode)})
        return _read_file(self.path, self.st)


def _kind_name(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _walk(root: Path, follow_links: bool) -> dict[str, _Entry]:
    """Every entry under ``root`` by relative posix path, sorted; refuses what it
    cannot store before anything is read, and never skips a directory."""
    entries: dict[str, _Entry] = {}
    visited = {(os.stat(root).st_dev, os.stat(root).st_ino)}
    stack: list[tuple[Path, str]] = [(root, "")]
    while stack:
        directory, rel_dir = stack.pop()
        try:
            names = sorted(os.listdir(directory))
        except OSError as exc:
            raise UnsupportedFileError(f"cannot list {directory}: {exc.strerror}") from None
        if not names and rel_dir:
            entries[rel_dir] = _Entry("dir", directory, os.stat(directory))
        for name in names:
            path = directory / name
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if not is_utf8(name):  # stored names are UTF-8 (FORMAT.md 10.7)
                raise UnsupportedFileError(f"{os.fsencode(path)!r}: the file name is not valid UTF-8")
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(path)
                if _link_stays_inside(root, path, rel, target):
                    entries[rel] = _Entry("link", path, st, target)
                    continue
                if not follow_links:
                    raise LinkOutsideTreeError(
                        f"{path} is a symlink to {target}, outside {root}; "
                        "commit with --follow-links (follow_links=True) to store what it points to"
                    )
                try:
                    st = os.stat(path)
                except OSError:
                    raise LinkOutsideTreeError(f"{path} is a broken symlink to {target}, outside {root}") from None
                path = Path(os.path.realpath(path))
            if stat.S_ISDIR(st.st_mode) and name == REPOSITORY_DIR and (path / "config.json").is_file():
                continue  # a ckvc repository (`ckvc commit .`) is not part of the checkpoint, as git skips .git
            if stat.S_ISDIR(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if key in visited:
                    raise UnsupportedFileError(f"{directory / name} leads back to a directory already read (link loop)")
                visited.add(key)
                stack.append((path, rel))
            elif stat.S_ISREG(st.st_mode):
                entries[rel] = _Entry("file", path, st)
            else:
                what = _kind_name(st.st_mode)
                raise UnsupportedFileError(f"{directory / name} is {what}; only files can be committed")
    return dict(sorted(entries.items()))


def _link_stays_inside(root: Path, link: Path, rel: str, target: str) -> bool:
    """Whether the link's target is inside the tree both by name (relative, no
    climbing out) and, when it exists, once resolved."""
    if not target or os.path.isabs(target) or "\x00" in target:
        return False
    lexical = os.path.normpath(os.path.join(os.path.dirname(rel), target))
    if lexical == ".." or lexical.startswith("../") or os.path.isabs(lexical):
        return False
    resolved = os.path.realpath(link)
    root_real = os.path.realpath(root)
    return not os.path.lexists(resolved) or resolved == root_real or resolved.startswith(root_real + os.sep)


def _open_regular(path: Path) -> int:
    """A read-only fd of ``path``, which must still be a regular file: O_NONBLOCK
    so that a FIFO swapped in never blocks the open, and fstat before any read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise UnsupportedFileError(f"cannot read {path}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsupportedFileError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def _read_file(path: Path, st: os.stat_result) -> StoredFile:
    """A file as its tensors plus what rebuilds its exact bytes, or as bytes."""
    mode = stat.S_IMODE(st.st_mode)
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        data: Any = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as exc:
        raise UnsupportedFileError(f"cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    stored = None
    if size and path.suffix == SAFETENSORS_SUFFIX:
        stored = _read_safetensors(path, data, mode)
    elif size and path.suffix in TORCH_SUFFIXES:
        stored = _read_torch(path, data, mode)
    elif size and path.suffix == DCP_SUFFIX:
        stored = _read_distcp(data, mode)
    if stored is not None:
        return stored
    return _bytes_file(data, mode)


def _bytes_file(data: Any, mode: int) -> StoredFile:
    layout = {"type": "file", "format": "bytes", "mode": mode, "size": len(data)}
    if len(data) <= INLINE_BYTES:
        return StoredFile(bytes(data), layout)
    # A zero-copy view of the mapping; the array keeps it alive until the commit is written.
    return StoredFile(np.frombuffer(data, dtype=np.uint8), layout, as_bytes=True)


def _layout(fmt: str, mode: int, size: int, pieces: list[bytes | int], parts: list[Any]) -> dict[str, Any]:
    return {"type": "file", "format": fmt, "mode": mode, "size": size, "pieces": pieces, "parts": parts}


def _pieces(data: Any, spans: list[tuple[int, int]]) -> list[bytes | int]:
    """The file as literal bytes between ``spans`` (sorted, disjoint) and part
    indices in their place."""
    pieces: list[bytes | int] = []
    pos = 0
    for i, (begin, end) in enumerate(spans):
        if begin > pos:
            pieces.append(bytes(data[pos:begin]))
        pieces.append(i)
        pos = end
    if pos < len(data):
        pieces.append(bytes(data[pos:]))
    return pieces


def _read_safetensors(path: Path, data: Any, mode: int) -> StoredFile | None:
    """The tensors as safetensors loads them, plus the header verbatim; None when
    the file is not valid safetensors (it is then stored as bytes)."""
    import safetensors.torch

    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(bytes(data[8 : 8 + n]))
        tensors = safetensors.torch.load_file(str(path))
    except Exception:
        return None
    start = 8 + n
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        spans.append((start + begin, start + end, name))
    spans.sort()
    if any(a < b for (_, a, _), (b, _, _) in itertools.pairwise(spans)):
        return None  # overlapping tensors cannot be rebuilt from separate blobs
    parts = []
    for begin, end, name in spans:
        t = tensors.get(name)
        if t is None or t.numel() * t.element_size() != end - begin:
            return None
        parts.append(t)
    pieces = _pieces(data, [(a, b) for a, b, _ in spans])
    return StoredFile(tensors, _layout("safetensors", mode, len(data), pieces, parts))


@contextmanager
def _numpy_allowed() -> Iterator[None]:
    """torch.load's weights_only unpickler plus the numpy types of RNG states (as
    transformers' Trainer does): arrays rebuilt from dtype and bytes, no code."""
    import torch

    np_core = getattr(np, "_core", None) or np.core
    allow = [np_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    allow += [type(np.dtype(t)) for t in (np.float64, np.float32, np.int64, np.int32, np.uint8, np.bool_)]
    with torch.serialization.safe_globals(allow):
        yield


def _zip_data_spans(data: Any) -> dict[str, tuple[int, int]] | None:
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


def _read_torch(path: Path, data: Any, mode: int) -> StoredFile | None:
    """The object torch.load(weights_only=True) returns, plus the archive's bytes
    around its storages and the storages themselves (as full views of the loaded
    tensors' storages, so they share blobs with the content); None when the file
    needs pickle beyond the allowlist or is not a torch file."""
    import torch

    from ckvc.state import flatten

    spans = _zip_data_spans(data)
    try:
        with _numpy_allowed(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes about files that are not its own
            # mmap: every storage is a view of one mapping of the file, so its
            # address tells which archive entry it is, with no hashing.
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=spans is not None)
    except Exception:
        return None
    if spans is None:
        # Legacy (pre-zip) torch files: the content, and the file's bytes beside it.
        return StoredFile(obj, _layout("torch", mode, len(data), [0], [np.frombuffer(data, dtype=np.uint8)]))
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
        bytes(_raw_bytes(s, str(path))[:64]) != bytes(data[b : b + 64])[: s.untyped_storage().nbytes()]
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
    return StoredFile(obj, _layout("torch", mode, len(data), _pieces(data, by_begin), parts))


def _archive_end(data: Any, begin: int) -> int | None:
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


def _read_distcp(data: Any, mode: int) -> StoredFile | None:
    """A DCP data file, which holds one torch.save archive per item back to back (its
    .metadata, a pickle, is stored as bytes and never read): the content is each
    item as torch.load(weights_only=True) reads it, by its byte offset; the tensors'
    storages fill the rebuild. None when it is not laid out so."""
    import torch

    from ckvc.state import flatten

    content: dict[str, Any] = {}
    spans: list[tuple[int, int]] = []
    parts: list[Any] = []
    pos = 0
    while pos < len(data):
        end = _archive_end(data, pos) if data[pos : pos + 4] == b"PK\x03\x04" else None
        if end is None:
            return None
        archive = bytes(data[pos:end])
        entries = _zip_data_spans(archive)
        try:
            with _numpy_allowed(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                item = torch.load(io.BytesIO(archive), map_location="cpu", weights_only=True)
        except Exception:
            return None
        if entries is None:
            return None
        content[str(pos)] = item
        by_size: dict[int, list[torch.Tensor]] = {}
        for leaf in flatten(item).values():
            if isinstance(leaf, torch.Tensor):
                s = leaf.untyped_storage()
                full = torch.empty(0, dtype=leaf.dtype).set_(s)
                if all(t.untyped_storage().data_ptr() != s.data_ptr() for t in by_size.get(s.nbytes(), [])):
                    by_size.setdefault(s.nbytes(), []).append(full)
        for begin, stop in sorted(entries.values()):
            raw = archive[begin:stop]
            found = [t for t in by_size.get(stop - begin, []) if bytes(_raw_bytes(t, "distcp")) == raw]
            if found and (stop - begin) % found[0].element_size() == 0:
                parts.append(found[0])
            else:
                parts.append(np.frombuffer(raw, dtype=np.uint8).copy())
            spans.append((pos + begin, pos + stop))
        pos = end
    return StoredFile(content, _layout("dcp", mode, len(data), _pieces(data, spans), parts))


# --------------------------------------------------------------------------- writing


def export_commit(
    repo: CommitSource,
    rev: str,
    out: Path | str,
    *,
    format: Format | None = None,
    prefix: str | None = None,
    progress: Progress | None = None,
    allow_pickle: bool = False,
) -> list[Path]:
    """Write commit ``rev`` to ``out`` without moving HEAD; returns the files written.

    A commit made from files is written back byte for byte, with its modes and
    links (a directory commit as a directory). ``format`` converts instead: "pt"
    (torch.save), "safetensors" (tensors only) or "dir"; by default the commit's own
    kind, else the suffix of ``out``. ``prefix`` ("model."): only the leaves under
    it, with the prefix removed from their names, as one file. ``allow_pickle``: as
    for ``Repo.load`` (a commit holding pickled values is refused without it)."""
    from ckvc import read

    commit = repo.readable_commit(rev, allow_pickle=allow_pickle)
    if prefix is not None:
        flat = read.load_state(
            repo.core, commit, map_location="cpu", allow_pickle=allow_pickle, progress=progress, prefix=prefix
        )
        return write_checkpoint({k[len(prefix) :]: v for k, v in flat.items()}, out, format=format)
    state = read.load_state(
        repo.core, commit, map_location="cpu", allow_pickle=allow_pickle, progress=progress, files=True
    )
    return write_checkpoint(state, out, commit.metadata, format=format, progress=progress)


def write_checkpoint(
    state: Any,
    out: Path | str,
    metadata: Mapping[str, str] | None = None,
    *,
    format: Format | None = None,
    progress: Progress | None = None,
) -> list[Path]:
    """Write ``state`` to ``out``; returns the files written.

    ``state`` is what a commit holds: StoredFile nodes (from ``export_commit``) are
    written back byte for byte, a directory commit (``metadata["ckvc.source"] ==
    "directory"``, or a dict of StoredFile) as a directory. Anything else is
    written by ``format`` or the suffix of ``out`` (.pt/.pth/.bin/.ckpt:
    torch.save, deterministic; .safetensors: a flat dict of tensors). The output
    appears atomically; leftovers of killed runs next to ``out`` are removed."""
    out = Path(os.path.abspath(out))
    if format in ("pt", "safetensors") and _format_of(out) != format:
        # Tools pick the reader by suffix: safetensors bytes in a .bin would be misread.
        wanted = " or ".join(TORCH_SUFFIXES) if format == "pt" else SAFETENSORS_SUFFIX
        raise InvalidInputError(f"--format {format} writes a {wanted} file, not {out.name!r}")
    is_dir = (metadata or {}).get("ckvc.source") == DIRECTORY_SOURCE or (
        isinstance(state, dict) and bool(state) and all(isinstance(v, StoredFile) for v in state.values())
    )
    _check_parent(out)
    try:
        _remove_leftovers(out)
        if format == "dir" or (format is None and is_dir):
            if not isinstance(state, dict):
                raise OutputPathError(f"this commit is one file, not a directory; write it to a file, not {out}/")
            return _write_directory(state, out, progress)
        if out.is_dir():
            raise OutputPathError(f"{out} is a directory; this writes one file (use --format dir for a directory)")
        files = _plan_file(state, out, format)
        _write_files(out, [(out, files)], progress)
        return [out]
    except OSError as exc:  # disk full, I/O error, permissions: nothing half-written is left behind
        where = f" ({exc.filename})" if exc.filename else ""
        raise OutputPathError(f"cannot write {out}: {exc.strerror or exc}{where}") from None


@dataclass
class _Planned:
    """One output file: how to produce its bytes, and its mode."""

    mode: int | None  # None: the default for new files
    size: int
    write: Callable[[Any, Callable[[int], None]], None]  # (binary file, count bytes) -> None
    link: str | None = None


def _plan_file(state: Any, out: Path, format: Format | None) -> _Planned:
    fmt = format or _format_of(out)
    if isinstance(state, StoredFile):
        layout = state.layout
        own = {"torch": "pt", "safetensors": "safetensors"}.get(layout.get("format", ""))
        if fmt == own or layout.get("format") == "bytes" or layout.get("type") == "link":
            return _plan_stored(state, str(out))
        state = state.content
    if fmt is None:
        raise InvalidInputError(f"{out}: unknown output type (use .pt, .pth, .bin, .ckpt or .safetensors, or --format)")
    content = contents(state)
    if fmt == "safetensors":
        import safetensors.torch

        tensors = _flat_tensors(content)
        return _planned_bytes(safetensors.torch.save(tensors), None)
    import torch

    buffer = io.BytesIO()
    torch.save(content, buffer)  # to a file object: the archive is named "archive", not after a temp file
    return _planned_bytes(buffer.getvalue(), None)


def _planned_bytes(data: bytes | memoryview, mode: int | None) -> _Planned:
    def write(f: Any, count: Callable[[int], None]) -> None:
        f.write(data)
        count(len(data))

    return _Planned(mode, len(data), write)


def _format_of(out: Path) -> Format | None:
    if out.suffix == SAFETENSORS_SUFFIX:
        return "safetensors"
    if out.suffix in TORCH_SUFFIXES:
        return "pt"
    return None


def contents(state: Any) -> Any:
    """``state`` with each StoredFile replaced by its content (what ``load`` returns)."""
    if isinstance(state, StoredFile):
        return state.content
    if isinstance(state, dict) and any(isinstance(v, StoredFile) for v in state.values()):
        return {k: contents(v) for k, v in state.items()}
    return state


def _plan_stored(stored: StoredFile, name: str) -> _Planned:
    """The exact bytes of a stored file, from its layout."""
    layout = stored.layout
    kind = layout.get("type")
    if kind == "link":
        if not isinstance(stored.content, str):
            raise _corrupt(name, "link without a target")
        return _Planned(None, 0, lambda f, count: None, link=stored.content)
    mode = layout.get("mode")
    if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise _corrupt(name, f"bad mode {mode!r}")
    size = layout.get("size")
    pieces = layout.get("pieces")
    parts = layout.get("parts", [])
    if pieces is None:
        data = stored.content
        if isinstance(data, np.ndarray):
            data = data.data.cast("B")
        if not isinstance(data, (bytes, memoryview)):
            raise _corrupt(name, "file content is not bytes")
        if size is not None and len(data) != size:
            raise _corrupt(name, f"{len(data)} bytes where the layout says {size}")
        return _planned_bytes(data, mode)
    if not isinstance(pieces, list) or not isinstance(parts, list) or not isinstance(size, int):
        raise _corrupt(name, "malformed layout")
    views: list[memoryview] = []
    for piece in pieces:
        if isinstance(piece, bytes):
            views.append(memoryview(piece))
        elif isinstance(piece, int) and 0 <= piece < len(parts):
            views.append(_raw_bytes(parts[piece], name))
        else:
            raise _corrupt(name, f"bad piece {piece!r:.40}")
    if sum(len(v) for v in views) != size:
        raise _corrupt(name, f"its pieces do not add up to its {size} bytes")

    def write(f: Any, count: Callable[[int], None]) -> None:
        for v in views:
            f.write(v)
            count(len(v))

    return _Planned(mode, size, write)


def _raw_bytes(value: Any, name: str) -> memoryview:
    import torch

    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).reshape(-1).view(np.uint8).data.cast("B")
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        return (t.view(torch.uint8) if t.element_size() else t).numpy().data.cast("B")
    raise _corrupt(name, f"part is a {type(value).__name__}, not an array")


def _corrupt(name: str, why: str) -> CkvcError:
    from ckvc.errors import CorruptObjectError

    return CorruptObjectError(f"stored file {name!r}: {why}")


def _flat_tensors(state: Any) -> dict[str, torch.Tensor]:
    """A flat name -> tensor dict for safetensors, which refuses non-tensors and shared storage."""
    import torch

    from ckvc.state import flatten

    if not isinstance(state, dict):
        raise UnsupportedTypeError("", "a .safetensors file holds a dict of tensors; use .pt for this state")
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for path, leaf in flatten(state).items():
        if isinstance(leaf, np.ndarray):
            leaf = torch.from_numpy(np.ascontiguousarray(leaf))
        if not isinstance(leaf, torch.Tensor):
            raise UnsupportedTypeError(path, f"{type(leaf).__name__} cannot go in a .safetensors file; use .pt")
        t = leaf.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
        seen.add(ptr)
        out[path] = t
    return out


def safe_relative(key: Any) -> PurePosixPath:
    """A stored directory key as a relative path that stays inside the output:
    no absolute paths, '..', '.', empty parts or NUL (a crafted commit's keys)."""
    if not isinstance(key, str) or not key or "\x00" in key:
        raise OutputPathError(f"refusing to write the stored name {key!r:.80}: not a plain relative path")
    path = PurePosixPath(key)
    if path.is_absolute() or any(part in ("", ".", "..") for part in key.split("/")):
        raise OutputPathError(f"refusing to write the stored name {key!r:.80}: it would leave the output directory")
    return path


def _write_directory(state: dict[Any, Any], out: Path, progress: Progress | None) -> list[Path]:
    if out.exists() and not out.is_dir():
        raise OutputPathError(f"{out} exists and is not a directory (this commit is a directory)")
    if out.is_dir() and _holds_repository(out):
        raise OutputPathError(f"refusing to replace {out}: it holds a ckvc repository")
    plan: list[tuple[PurePosixPath, _Planned | None]] = []
    names: set[PurePosixPath] = set()
    for key, value in state.items():
        rel = safe_relative(key)
        names.add(rel)
        if isinstance(value, StoredFile) and value.layout.get("type") == "dir":
            plan.append((rel, None))
        elif isinstance(value, StoredFile):
            plan.append((rel, _plan_stored(value, key)))
        elif isinstance(value, bytes):  # a directory commit of older ckvc
            plan.append((rel, _planned_bytes(value, None)))
        else:
            plan.append((rel, _plan_file(value, Path(key), None)))
    for rel in names:
        if any(parent in names for parent in rel.parents if parent != PurePosixPath(".")):
            raise OutputPathError(f"refusing to write the stored name {str(rel)!r}: a parent of it is a file")
    tmp = out.parent / f".{out.name}{_TMP_TAG}{uuid.uuid4().hex}"
    written = [out / rel for rel, p in plan if p is not None]
    with _holding_tmp(tmp, directory=True):
        empty_dirs = [rel for rel, p in plan if p is None]
        for rel in empty_dirs:
            (tmp / rel).mkdir(parents=True, exist_ok=True)
        files = [(tmp / rel, p) for rel, p in plan if p is not None and p.link is None]
        links = [(tmp / rel, p.link) for rel, p in plan if p is not None and p.link is not None]
        _write_files(out, files, progress, in_tmp_dir=tmp)
        for path, target in links:  # last: nothing is ever written through a link
            _check_link(out, tmp, path, target)
            path.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(target, path)
        for rel in empty_dirs:
            mode = state[str(rel)].layout.get("mode")
            if isinstance(mode, int):
                os.chmod(tmp / rel, mode & 0o7777)
        _fsync_tree(tmp)
        if out.is_dir():
            os.chmod(tmp, stat.S_IMODE(os.stat(out).st_mode))
            _exchange(tmp, out)  # tmp now holds the old version, removed on leaving
        else:
            os.chmod(tmp, 0o777 & ~_umask())
            os.rename(tmp, out)
        _fsync_dir(out.parent)
    return written


def _check_link(out: Path, tmp: Path, path: Path, target: str) -> None:
    rel = os.path.relpath(path, tmp)
    lexical = os.path.normpath(os.path.join(os.path.dirname(rel), target))
    if not target or os.path.isabs(target) or "\x00" in target or lexical == ".." or lexical.startswith("../"):
        raise OutputPathError(f"refusing to write the stored link {rel!r} -> {target!r}: it points outside {out}")


def _holds_repository(path: Path) -> bool:
    """Whether replacing ``path`` would take a repository or the working directory with it."""
    cwd = Path.cwd().resolve()
    real = path.resolve()
    return (path / REPOSITORY_DIR).exists() or cwd == real or real in cwd.parents


def _write_files(
    out: Path, files: list[tuple[Path, _Planned]], progress: Progress | None, in_tmp_dir: Path | None = None
) -> None:
    """Write each planned file: inside a fresh temporary directory directly (it is
    swapped in whole), otherwise each as a hidden temporary file renamed into place."""
    total = sum(p.size for _, p in files)
    done = 0

    def count(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None and n:
            progress(done, total)

    for path, planned in files:
        if in_tmp_dir is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_one(path, planned, count)
            continue
        tmp = path.parent / f".{path.name}{_TMP_TAG}{uuid.uuid4().hex}"
        with _holding_tmp(tmp, directory=False):
            _write_one(tmp, planned, count)
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise OutputPathError(f"cannot write {path}: {exc.strerror}") from None
            _fsync_dir(path.parent)
    if progress is not None:
        progress(total, total)


def _write_one(path: Path, planned: _Planned, count: Callable[[int], None]) -> None:
    mode = planned.mode if planned.mode is not None else _DEFAULT_FILE_MODE
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise OutputPathError(f"cannot write {path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        planned.write(f, count)
        f.flush()
        os.fsync(f.fileno())
        # chmod, not the open mode: the umask must not change a committed mode. Set-id
        # bits are not restored (as git does not): a stored commit cannot make one.
        os.fchmod(f.fileno(), mode & 0o777 if planned.mode is not None else mode & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _check_parent(out: Path) -> None:
    parent = out.parent
    if not parent.is_dir():
        what = "does not exist" if not parent.exists() else "is not a directory"
        raise OutputPathError(f"cannot write {out}: {parent} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot write {out}: {parent} is not writable")
    if len(out.name.encode("utf-8", "surrogateescape")) > 200:
        raise OutputPathError(f"cannot write {out}: the name is too long")


@contextmanager
def _holding_tmp(tmp: Path, *, directory: bool) -> Iterator[None]:
    """Create ``tmp`` and hold an flock on it while in use (so that another run's
    leftover sweep leaves it alone); remove whatever remains of it on leaving."""
    try:
        if directory:
            tmp.mkdir(mode=0o700)
            fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        else:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise OutputPathError(f"cannot write in {tmp.parent}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        _remove(tmp)
        os.close(fd)


def _remove(path: Path) -> None:
    with suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _remove_leftovers(out: Path) -> None:
    """Remove the hidden temporary files and directories that killed runs writing
    ``out`` left next to it; one still in use (flocked) is left alone."""
    try:
        names = os.listdir(out.parent)
    except OSError:
        return
    for name in names:
        m = _LEFTOVER.match(name)
        if m is None or m.group("name") != out.name:
            continue
        path = out.parent / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live run's
        try:
            _remove(path)
        finally:
            os.close(fd)


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE): a reader sees the old
    directory or the new one, never neither. Where the kernel or filesystem lacks
    it, two renames, the old one first moved to a hidden name the next run removes."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        renameat2 = None
    if renameat2 is not None:
        at_fdcwd = -100
        if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OutputPathError(f"cannot replace {b}: {os.strerror(err)}")
    old = b.parent / f".{b.name}{_TMP_TAG}{uuid.uuid4().hex}"
    os.rename(b, old)
    os.rename(a, b)
    os.rename(old, a)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every directory under ``root`` (its files were fsynced as written)."""
    for directory, _dirs, _files in os.walk(root):
        _fsync_dir(Path(directory))
