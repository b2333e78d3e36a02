"""Writing files out (``ckvc checkout -o``, ``ckvc export``): a commit made from
files back byte for byte with its modes and links, or a state converted to
torch.save or safetensors. Output is atomic: a file is written under a hidden
temporary name and renamed; a directory is written as a hidden sibling and
swapped in, and the leftovers of killed runs are removed by the next run."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ckvc.errors import InvalidInputError
from ckvc.state import StoredFile

if TYPE_CHECKING:
    from ckvc.objects import Commit
    from ckvc.read import ReadCore
    from ckvc.signing import SigningKey

from ckvc.formats.layout import (
    DIRECTORY_SOURCE,
    REPOSITORY_DIR,
    SAFETENSORS_SUFFIX,
    TORCH_SUFFIXES,
    Format,
    OutputPathError,
    Progress,
    contents,
    corrupt,
    raw_bytes,
)
from ckvc.formats.safetensors import flat_tensors
from ckvc.formats.sigstore_bundle import IGNORED, SIGNATURE_NAME, Digests, check_key, make_bundle

_DEFAULT_FILE_MODE = 0o644


class CommitSource(Protocol):
    """What export needs of a repository (ckvc.Repo): its core, and revisions
    resolved as every read resolves them."""

    @property
    def core(self) -> ReadCore: ...

    def readable_commit(
        self, rev: str, *, allow_pickle: bool = False, verify_signatures: bool | None = None
    ) -> Commit: ...


_TMP_TAG = ".ckvc-tmp-"

# Temporary names of this module (".NAME.ckvc-tmp-HEX") and of older ckvc (".NAME.HEX.tmp").
_LEFTOVER = re.compile(r"^\.(?P<name>.+)(?:\.ckvc-tmp-[0-9a-f]{32}|\.[0-9a-f]{32}\.tmp)$")


def export_commit(
    repo: CommitSource,
    rev: str,
    out: Path | str,
    *,
    format: Format | None = None,
    prefix: str | None = None,
    progress: Progress | None = None,
    allow_pickle: bool = False,
    verify_signatures: bool | None = None,
    sign_key: SigningKey | None = None,
) -> list[Path]:
    """Write commit ``rev`` to ``out`` without moving HEAD; returns the files written.

    A commit made from files is written back byte for byte, with its modes and
    links (a directory commit as a directory). ``format`` converts instead: "pt"
    (torch.save), "safetensors" (tensors only) or "dir"; by default the commit's own
    kind, else the suffix of ``out``. ``prefix`` ("model."): only the leaves under
    it, with the prefix removed from their names, as one file. ``allow_pickle``: as
    for ``Repo.load`` (a commit holding pickled values is refused without it).
    ``sign_key`` (ECDSA P-256): also an OpenSSF model-signing bundle, ``out/model.sig``
    for a folder or ``out.sig`` for a file, over the bytes as they are written."""
    from ckvc import read

    if sign_key is not None:
        check_key(sign_key.algorithm)

    commit = repo.readable_commit(rev, allow_pickle=allow_pickle, verify_signatures=verify_signatures)
    if prefix is not None:
        flat = read.load_state(
            repo.core, commit, map_location="cpu", allow_pickle=allow_pickle, progress=progress, prefix=prefix
        )
        trimmed = {k[len(prefix) :]: v for k, v in flat.items()}
        return write_checkpoint(trimmed, out, format=format, sign_key=sign_key)
    state = read.load_state(
        repo.core, commit, map_location="cpu", allow_pickle=allow_pickle, progress=progress, files=True
    )
    return write_checkpoint(state, out, commit.metadata, format=format, progress=progress, sign_key=sign_key)


def write_checkpoint(
    state: Any,
    out: Path | str,
    metadata: Mapping[str, str] | None = None,
    *,
    format: Format | None = None,
    progress: Progress | None = None,
    sign_key: SigningKey | None = None,
) -> list[Path]:
    """Write ``state`` to ``out``; returns the files written (with ``sign_key``, the
    model-signing bundle last: ckvc.formats.sigstore_bundle).

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
            return _write_directory(state, out, progress, sign_key)
        if out.is_dir():
            raise OutputPathError(f"{out} is a directory; this writes one file (use --format dir for a directory)")
        files = _plan_file(state, out, format)
        if sign_key is None:
            _write_files(out, [(out, files)], progress)
            return [out]
        digests = Digests()
        try:
            _write_files(out, [(out, files)], progress, digests=digests, root=out)
            names = digests.result()
        finally:
            digests.close()
        bundle_path = out.with_name(out.name + ".sig")
        _write_files(
            bundle_path,
            [(bundle_path, _planned_bytes(make_bundle(out.name, names, sign_key, folder=False), None))],
            None,
        )
        return [out, bundle_path]
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

        tensors = flat_tensors(content)
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


def _plan_stored(stored: StoredFile, name: str) -> _Planned:
    """The exact bytes of a stored file, from its layout."""
    layout = stored.layout
    kind = layout.get("type")
    if kind == "link":
        if not isinstance(stored.content, str):
            raise corrupt(name, "link without a target")
        return _Planned(None, 0, lambda f, count: None, link=stored.content)
    mode = layout.get("mode")
    if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise corrupt(name, f"bad mode {mode!r}")
    size = layout.get("size")
    pieces = layout.get("pieces")
    parts = layout.get("parts", [])
    if pieces is None:
        data = stored.content
        if isinstance(data, np.ndarray):
            data = data.data.cast("B")
        if not isinstance(data, (bytes, memoryview)):
            raise corrupt(name, "file content is not bytes")
        if size is not None and len(data) != size:
            raise corrupt(name, f"{len(data)} bytes where the layout says {size}")
        return _planned_bytes(data, mode)
    if not isinstance(pieces, list) or not isinstance(parts, list) or not isinstance(size, int):
        raise corrupt(name, "malformed layout")
    views: list[memoryview] = []
    for piece in pieces:
        if isinstance(piece, bytes):
            views.append(memoryview(piece))
        elif isinstance(piece, int) and 0 <= piece < len(parts):
            views.append(raw_bytes(parts[piece], name))
        else:
            raise corrupt(name, f"bad piece {piece!r:.40}")
    if sum(len(v) for v in views) != size:
        raise corrupt(name, f"its pieces do not add up to its {size} bytes")

    def write(f: Any, count: Callable[[int], None]) -> None:
        for v in views:
            f.write(v)
            count(len(v))

    return _Planned(mode, size, write)


def safe_relative(key: Any) -> PurePosixPath:
    """A stored directory key as a relative path that stays inside the output:
    no absolute paths, '..', '.', empty parts or NUL (a crafted commit's keys)."""
    if not isinstance(key, str) or not key or "\x00" in key:
        raise OutputPathError(f"refusing to write the stored name {key!r:.80}: not a plain relative path")
    path = PurePosixPath(key)
    if path.is_absolute() or any(part in ("", ".", "..") for part in key.split("/")):
        raise OutputPathError(f"refusing to write the stored name {key!r:.80}: it would leave the output directory")
    return path


def _write_directory(
    state: dict[Any, Any], out: Path, progress: Progress | None, sign_key: SigningKey | None = None
) -> list[Path]:
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
    if sign_key is not None:
        if any(p is not None and p.link is not None for _, p in plan):
            raise OutputPathError("a signed export holds no symlinks (the model-signing bundle allows none)")
        if PurePosixPath(SIGNATURE_NAME) in names:
            raise OutputPathError(f"this folder holds its own {SIGNATURE_NAME}; a signed export would replace it")
    tmp = out.parent / f".{out.name}{_TMP_TAG}{uuid.uuid4().hex}"
    written = [out / rel for rel, p in plan if p is not None]
    with _holding_tmp(tmp, directory=True):
        empty_dirs = [rel for rel, p in plan if p is None]
        for rel in empty_dirs:
            (tmp / rel).mkdir(parents=True, exist_ok=True)
        files = [(tmp / rel, p) for rel, p in plan if p is not None and p.link is None]
        links = [(tmp / rel, p.link) for rel, p in plan if p is not None and p.link is not None]
        if sign_key is None:
            _write_files(out, files, progress, in_tmp_dir=tmp)
        else:
            digests = Digests()
            try:
                _write_files(out, files, progress, in_tmp_dir=tmp, digests=digests, root=tmp)
                names_signed = {n: d for n, d in digests.result().items() if n.split("/")[0] not in IGNORED}
            finally:
                digests.close()
            bundle = make_bundle(out.name, names_signed, sign_key, folder=True)
            _write_files(out, [(tmp / SIGNATURE_NAME, _planned_bytes(bundle, None))], None, in_tmp_dir=tmp)
            written.append(out / SIGNATURE_NAME)
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
    out: Path,
    files: list[tuple[Path, _Planned]],
    progress: Progress | None,
    in_tmp_dir: Path | None = None,
    *,
    digests: Digests | None = None,
    root: Path | None = None,
) -> None:
    """Write each planned file: inside a fresh temporary directory directly (it is
    swapped in whole), otherwise each as a hidden temporary file renamed into place.
    ``digests``: each file's bytes hashed as written, named relative to ``root``
    (the file itself: ".")."""
    total = sum(p.size for _, p in files)
    done = 0

    def count(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None and n:
            progress(done, total)

    for path, planned in files:
        name = None
        if digests is not None:
            assert root is not None
            name = "." if path == root else path.relative_to(root).as_posix()
        if in_tmp_dir is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_one(path, planned, count, digests, name)
            continue
        tmp = path.parent / f".{path.name}{_TMP_TAG}{uuid.uuid4().hex}"
        with _holding_tmp(tmp, directory=False):
            _write_one(tmp, planned, count, digests, name)
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise OutputPathError(f"cannot write {path}: {exc.strerror}") from None
            _fsync_dir(path.parent)
    if progress is not None:
        progress(total, total)


def _write_one(
    path: Path,
    planned: _Planned,
    count: Callable[[int], None],
    digests: Digests | None = None,
    name: str | None = None,
) -> None:
    mode = planned.mode if planned.mode is not None else _DEFAULT_FILE_MODE
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise OutputPathError(f"cannot write {path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        planned.write(f if digests is None or name is None else digests.wrap(f, name), count)
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
