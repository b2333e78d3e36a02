"""Reading what ``ckvc commit PATH`` commits: a file by its format, or a folder
walked entry by entry (files, links that stay inside it, empty directories),
refusing what cannot be stored before anything is read."""

from __future__ import annotations

import mmap
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ckvc.errors import CkvcWarning, InvalidInputError
from ckvc.formats.distcp import read_distcp
from ckvc.formats.layout import (
    DCP_SUFFIX,
    DIRECTORY_SOURCE,
    REPOSITORY_DIR,
    SAFETENSORS_SUFFIX,
    TORCH_SUFFIXES,
    LinkOutsideTreeError,
    MalformedFileError,
    NotParsed,
    Progress,
    UnsupportedFileError,
    bytes_file,
)
from ckvc.formats.safetensors import read_safetensors
from ckvc.formats.torch_save import read_torch
from ckvc.state import StoredFile, is_utf8

# Commit metadata: {file name: why it is stored as bytes} for files that claim a format.
UNPARSED_KEY = "ckvc.stored_as_bytes"


def read_checkpoint(
    path: Path | str, *, follow_links: bool = False, progress: Progress | None = None, strict: bool = False
) -> tuple[Any, dict[str, str]]:
    """(state, commit metadata describing the source) for a file or directory.

    A directory becomes ``{relative posix path: StoredFile}`` for every regular file,
    symlink and empty directory in it (dot-files included). A symlink that stays in
    the tree is stored as a link; one that leaves it raises LinkOutsideTreeError
    unless ``follow_links`` (then what it points to is stored). FIFOs, sockets and
    devices raise UnsupportedFileError before anything is read.

    A file whose name claims a format (.pt, .safetensors) but that does not parse is
    stored byte for byte with a CkvcWarning naming it and what is wrong; ``strict``
    refuses it instead (MalformedFileError), so nothing is committed."""
    path = Path(path)
    unparsed: dict[str, str] = {}  # name -> why it is stored as bytes
    try:
        st = os.stat(path)  # the path the user names is followed, as any tool does
    except FileNotFoundError:
        raise InvalidInputError(f"no such file or directory: {path}") from None
    except OSError as exc:
        raise UnsupportedFileError(f"cannot read {path}: {exc.strerror}") from None
    _refuse_repository_internals(path)
    if stat.S_ISDIR(st.st_mode):
        try:
            entries = _walk(Path(os.path.realpath(path)), follow_links)
        except OSError as exc:  # the tree changed while it was read
            raise UnsupportedFileError(f"cannot read {exc.filename or path}: {exc.strerror or exc}") from None
        total = sum(e.size for e in entries.values())
        done = 0
        state: dict[str, StoredFile] = {}
        for rel, entry in entries.items():
            state[rel] = entry.read(strict, unparsed, rel)
            done += entry.size
            if progress is not None:
                progress(done, total)
        return state, {"ckvc.source": DIRECTORY_SOURCE, **_unparsed_meta(unparsed)}
    if not stat.S_ISREG(st.st_mode):
        raise UnsupportedFileError(f"{path} is not a regular file or directory ({_kind_name(st.st_mode)})")
    if st.st_size == 0:
        raise InvalidInputError(f"{path} is empty (0 bytes): nothing to commit")
    stored = _read_file(path, st, strict, unparsed, path.name)
    if progress is not None:
        progress(st.st_size, st.st_size)
    return stored, {"ckvc.source": path.suffix.lstrip(".") or "file", **_unparsed_meta(unparsed)}


@dataclass
class _Entry:
    kind: Literal["file", "link", "dir"]
    path: Path  # the file to read (a followed link's target), or the link / directory itself
    st: os.stat_result
    target: str = ""  # a link's target

    @property
    def size(self) -> int:
        return self.st.st_size if self.kind == "file" else 0

    def read(self, strict: bool = False, unparsed: dict[str, str] | None = None, name: str = "") -> StoredFile:
        if self.kind == "link":
            return StoredFile(self.target, {"type": "link"})
        if self.kind == "dir":
            return StoredFile(None, {"type": "dir", "mode": stat.S_IMODE(self.st.st_mode)})
        return _read_file(self.path, self.st, strict, unparsed, name)


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


def _refuse_repository_internals(path: Path) -> None:
    """A ckvc repository's own folder (or anything in it: packs, the open LMDB index,
    lock files) is never a checkpoint, as git refuses to add .git."""
    real = Path(os.path.realpath(path))
    for folder in (real, *real.parents):
        if folder.name == REPOSITORY_DIR and (folder / "config.json").is_file():
            where = "is" if folder == real else "is inside"
            raise InvalidInputError(
                f"{path} {where} the ckvc repository folder {folder}: its internals are not a checkpoint"
            )


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


def _unparsed_meta(unparsed: dict[str, str]) -> dict[str, Any]:
    """Commit metadata naming the files stored as bytes although their names claim a
    format, and why: ``show``, ``log`` and the web UI show it with the commit."""
    return {UNPARSED_KEY: dict(sorted(unparsed.items()))} if unparsed else {}


def _read_file(
    path: Path, st: os.stat_result, strict: bool = False, unparsed: dict[str, str] | None = None, name: str = ""
) -> StoredFile:
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
    try:
        if size and path.suffix == SAFETENSORS_SUFFIX:
            stored = read_safetensors(path, data, mode)
        elif size and path.suffix in TORCH_SUFFIXES:
            stored = read_torch(path, data, mode)
        elif size and path.suffix == DCP_SUFFIX:
            stored = read_distcp(data, mode)
    except NotParsed as why:
        # A valid file that needs pickle is stored as bytes by design (never unpickled):
        # no word, or every Trainer folder's training_args.bin would warn.
        if strict and why.malformed:
            raise MalformedFileError(
                f"{path} is {why.reason}; nothing was committed (without --strict it is stored as bytes)"
            ) from None
        if why.malformed:
            warnings.warn(CkvcWarning(f"{path} stored as bytes, byte for byte: {why.reason}"), stacklevel=4)
            if unparsed is not None:
                unparsed[name or path.name] = why.reason
    if stored is not None:
        return stored
    return bytes_file(data, mode)
