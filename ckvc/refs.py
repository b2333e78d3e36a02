"""Branches, tags and HEAD as small files, with compare-and-swap updates and a reflog.

Layout under the repository directory:
    HEAD                    "ref: refs/heads/main\n" (symbolic) or "<64 hex>\n" (detached)
    refs/heads/<name>       "<64 hex>\n"  a commit id
    refs/tags/<name>        "<64 hex>\n"  a commit id (lightweight) or tag object id (annotated)
    logs/<ref>              one JSON line per move of that ref (the reflog)
    refs.lock               flock taken for every ref update

Every update happens under the flock: read, compare with the expected value,
write a temporary file, fsync, rename. The kernel releases the flock when a
process dies, so a crash never leaves a stale lock.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ckvc.errors import InvalidRefNameError, RefConflictError, RefNotFoundError
from ckvc.ids import is_full_hex_id
from ckvc.storage.files import append_durable, file_lock, fsync_dir, write_atomic

HEAD = "HEAD"
BRANCH_PREFIX = "refs/heads/"
TAG_PREFIX = "refs/tags/"
_SYMREF_PREFIX = "ref: "
_FORBIDDEN_CHARS = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")


def check_ref_name(name: str) -> str:
    """Validate a full ref name ("refs/heads/x") by git's check-ref-format rules,
    plus ours: nothing that could leave the repository directory."""

    def bad(why: str) -> InvalidRefNameError:
        return InvalidRefNameError(f"invalid ref name {name!r}: {why}")

    if not isinstance(name, str) or not name:
        raise bad("empty")
    if len(name.encode("utf-8", "surrogatepass")) > 1024:
        raise bad("too long")
    if _FORBIDDEN_CHARS.search(name):
        raise bad("contains a control character, space, or one of ~ ^ : ? * [ \\")
    if name.startswith("/") or name.endswith("/") or "//" in name:
        raise bad("empty path component or absolute path")
    if ".." in name:
        raise bad("contains '..'")
    if "@{" in name or name == "@":
        raise bad("contains '@{' or is '@'")
    if name.endswith("."):
        raise bad("ends with '.'")
    for part in name.split("/"):
        if part.startswith("."):
            raise bad("a component starts with '.'")
        if part.endswith(".lock"):
            raise bad("a component ends with '.lock'")
    return name


def branch_ref(short: str) -> str:
    return check_ref_name(BRANCH_PREFIX + _check_short(short, "branch"))


def tag_ref(short: str) -> str:
    return check_ref_name(TAG_PREFIX + _check_short(short, "tag"))


def _check_short(short: str, what: str) -> str:
    if not isinstance(short, str) or not short:
        raise InvalidRefNameError(f"invalid {what} name {short!r}: empty")
    if short in (HEAD, "@") or short.startswith("-") or is_full_hex_id(short):
        raise InvalidRefNameError(f"invalid {what} name {short!r}: reserved or looks like an option or an id")
    return short


def _remove_empty_parents(path: Path, stop: Path) -> None:
    """Remove directories left empty above ``path``, up to (not including) ``stop``
    and the refs/heads, refs/tags roots."""
    keep = {stop, stop / "heads", stop / "tags", stop / "refs", stop / "refs" / "heads", stop / "refs" / "tags"}
    parent = path.parent
    while parent not in keep and stop in parent.parents:
        try:
            parent.rmdir()
        except OSError:
            break
        parent = parent.parent


@dataclass(frozen=True)
class ReflogEntry:
    old: str | None
    new: str | None
    time_ns: int
    message: str


class RefStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock_path = root / "refs.lock"

    # ---- reading ------------------------------------------------------------
    def _path(self, name: str) -> Path:
        if name != HEAD:
            check_ref_name(name)
        return self.root / name

    def _read_file(self, name: str) -> str | None:
        try:
            text = self._path(name).read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except UnicodeDecodeError:
            raise RefNotFoundError(f"ref {name} is damaged: not UTF-8 text") from None
        return text.strip()

    def read(self, name: str) -> str | None:
        """The id a ref (not HEAD) names, or None if it does not exist."""
        value = self._read_file(name)
        if value is None:
            return None
        if not is_full_hex_id(value):
            raise RefNotFoundError(f"ref {name} is damaged: {value[:80]!r}")
        return value

    def head(self) -> tuple[str | None, str | None]:
        """(symbolic target, commit id). Target is None when HEAD is detached;
        id is None when the target branch has no commits yet."""
        value = self._read_file(HEAD)
        if value is None:
            raise RefNotFoundError("HEAD is missing")
        if value.startswith(_SYMREF_PREFIX):
            target = value[len(_SYMREF_PREFIX) :]
            return target, self.read(target)
        if not is_full_hex_id(value):
            raise RefNotFoundError(f"HEAD is damaged: {value[:80]!r}")
        return None, value

    def list_refs(self, prefix: str = "refs/", *, damaged: list[str] | None = None) -> dict[str, str]:
        """All refs under ``prefix`` (a directory prefix like "refs/heads/"), sorted.
        A damaged ref file raises RefNotFoundError, or, when ``damaged`` is given,
        is skipped and its name and error appended there."""
        out: dict[str, str] = {}
        base = self.root / "refs"
        if not base.is_dir():
            return out
        for dirpath, _dirs, files in os.walk(base):
            for fname in files:
                full = Path(dirpath, fname).relative_to(self.root).as_posix()
                if full.startswith(prefix) and not fname.startswith("."):
                    try:
                        value = self.read(full)
                    except RefNotFoundError as exc:
                        if damaged is None:
                            raise
                        damaged.append(str(exc))
                        continue
                    if value is not None:
                        out[full] = value
        return dict(sorted(out.items()))

    # ---- updating -----------------------------------------------------------
    def _check_no_dir_file_conflict(self, name: str) -> None:
        path = self.root / name
        if path.is_dir():
            raise RefConflictError(f"cannot create {name}: refs exist below it")
        parent = path.parent
        while parent != self.root:
            if parent.is_file():
                raise RefConflictError(f"cannot create {name}: {parent.relative_to(self.root).as_posix()} exists")
            parent = parent.parent

    def set_if_equals(self, name: str, old: str | None, new: str, message: str, *, also_log: str | None = None) -> None:
        """Point ``name`` at ``new`` if it currently names ``old`` (None: must not
        exist). Raises RefConflictError otherwise, changing nothing."""
        check_ref_name(name)
        if not is_full_hex_id(new):
            raise ValueError(f"not a full id: {new!r}")
        with file_lock(self._lock_path):
            current = self.read(name)
            if current != old:
                raise RefConflictError(f"{name} moved: expected {old or '(no ref)'}, found {current or '(no ref)'}")
            if current is None:
                self._check_no_dir_file_conflict(name)
                self._clear_stale_logs(name)
            path = self._path(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, (new + "\n").encode())
            self._log(name, old, new, message)
            if also_log:
                self._log(also_log, old, new, message)

    def delete_if_equals(self, name: str, old: str, message: str) -> None:
        check_ref_name(name)
        with file_lock(self._lock_path):
            current = self.read(name)
            if current != old:
                raise RefConflictError(f"{name} moved: expected {old}, found {current or '(no ref)'}")
            path = self._path(name)
            path.unlink()
            fsync_dir(path.parent)
            _remove_empty_parents(path, self.root / "refs")
            # Like git, a deleted ref's reflog goes with it; HEAD's reflog keeps the history.
            log = self.root / "logs" / name
            if log.is_file():
                log.unlink()
                _remove_empty_parents(log, self.root / "logs")

    def _clear_stale_logs(self, name: str) -> None:
        """Remove reflogs of deleted refs that would collide with ``name``'s
        (logs/refs/heads/a when creating a/b, or the reverse). The refs
        themselves were checked for such conflicts already."""
        logs = self.root / "logs"
        log = logs / name
        if log.is_dir():
            shutil.rmtree(log)
        parent = log.parent
        while parent != logs:
            if parent.is_file():
                parent.unlink()
            parent = parent.parent

    def set_head(self, *, branch: str | None = None, detached: str | None = None, message: str) -> None:
        """Point HEAD at a branch (symbolic) or at a commit (detached)."""
        if (branch is None) == (detached is None):
            raise ValueError("give exactly one of branch or detached")
        with file_lock(self._lock_path):
            old_id = self._head_id_or_none()
            if branch is not None:
                check_ref_name(branch)
                write_atomic(self.root / HEAD, f"{_SYMREF_PREFIX}{branch}\n".encode())
                new_id = self.read(branch)
            else:
                assert detached is not None
                if not is_full_hex_id(detached):
                    raise ValueError(f"not a full id: {detached!r}")
                write_atomic(self.root / HEAD, f"{detached}\n".encode())
                new_id = detached
            self._log(HEAD, old_id, new_id, message)

    def set_head_if_equals(self, old: str, new: str, message: str) -> None:
        """Move a detached HEAD from ``old`` to ``new`` (a commit on a detached HEAD)."""
        with file_lock(self._lock_path):
            target, current = self.head()
            if target is not None or current != old:
                raise RefConflictError(f"HEAD moved: expected detached at {old}")
            write_atomic(self.root / HEAD, f"{new}\n".encode())
            self._log(HEAD, old, new, message)

    def init_head(self, branch: str) -> None:
        write_atomic(self.root / HEAD, f"{_SYMREF_PREFIX}{check_ref_name(branch)}\n".encode())

    def _head_id_or_none(self) -> str | None:
        try:
            return self.head()[1]
        except RefNotFoundError:
            return None

    # ---- reflog -------------------------------------------------------------
    def _log(self, name: str, old: str | None, new: str | None, message: str) -> None:
        path = self.root / "logs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        line = {"old": old, "new": new, "time_ns": time.time_ns(), "message": message}
        append_durable(path, (json.dumps(line, sort_keys=True) + "\n").encode())

    def reflog(self, name: str) -> list[ReflogEntry]:
        """Moves of ``name``, newest first. A torn last line (crash mid-append) is skipped."""
        if name != HEAD:
            check_ref_name(name)
        path = self.root / "logs" / name
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                d = json.loads(line)
                out.append(ReflogEntry(d["old"], d["new"], int(d["time_ns"]), str(d["message"])))
            except (ValueError, KeyError, TypeError):
                continue
        return out[::-1]

    def iter_reflog_ids(self, since_ns: int = 0) -> Iterator[str]:
        """Every id a reflog entry at or after ``since_ns`` mentions (gc keeps them)."""
        logs = self.root / "logs"
        if not logs.is_dir():
            return
        for dirpath, _dirs, files in os.walk(logs):
            for fname in files:
                name = Path(dirpath, fname).relative_to(logs).as_posix()
                try:
                    entries = self.reflog(name)
                except Exception:
                    continue
                for e in entries:
                    if e.time_ns < since_ns:
                        continue
                    for value in (e.old, e.new):
                        if value:
                            yield value
