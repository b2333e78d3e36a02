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

The rename is the moment an update takes effect. An OS error before it leaves
the ref unchanged and is raised as a typed StorageError; one after it (the
directory fsync, the reflog append) does not undo the move, so the update is
reported as done with a DurabilityWarning, and ``repair-pending`` is created so
the next writable open re-syncs the directories and restores lost reflog
entries (``RefStore.repair``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ckvc.errors import (
    CkvcError,
    DamageWarning,
    InvalidRefNameError,
    RefConflictError,
    RefNotFoundError,
    after_landing,
    storage_errors,
)
from ckvc.ids import is_full_hex_id
from ckvc.storage.files import (
    append_durable,
    file_lock,
    fsync_dir,
    has_stale_temporaries,
    looks_torn,
    read_log_lines,
    remove_stale_temporaries,
    write_atomic,
)

HEAD = "HEAD"
BRANCH_PREFIX = "refs/heads/"
TAG_PREFIX = "refs/tags/"
_SYMREF_PREFIX = "ref: "
_FORBIDDEN_CHARS = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")
_HEX_ID = re.compile(rb"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
REPAIR_MARKER = "repair-pending"
NAME_MAX = 255  # bytes in one path component on common file systems


def check_ref_name(name: str) -> str:
    """Validate a full ref name ("refs/heads/x") by git's check-ref-format rules,
    plus ours: nothing that could leave the repository directory."""

    def bad(why: str) -> InvalidRefNameError:
        return InvalidRefNameError(f"invalid ref name {name!r}: {why}")

    if not isinstance(name, str) or not name:
        raise bad("empty")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        raise bad("not valid UTF-8") from None
    if len(encoded) > 1024:
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
        if len(part.encode("utf-8")) > NAME_MAX:
            raise bad(f"a component is longer than {NAME_MAX} bytes")
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


def _parse_reflog_line(line: bytes) -> ReflogEntry | None:
    try:
        d = json.loads(line.decode("utf-8"))
        entry = ReflogEntry(d["old"], d["new"], int(d["time_ns"]), str(d["message"]))
    except (ValueError, KeyError, TypeError):
        return None
    if not all(v is None or (isinstance(v, str) and is_full_hex_id(v)) for v in (entry.old, entry.new)):
        return None
    return entry


@dataclass(frozen=True)
class StrayRef:
    """A file under refs/ whose name is not a valid ref name (e.g. ``main.lock``).
    ``value``: the id it holds, if it holds one."""

    path: str
    value: str | None
    problem: str


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

    def _head_branch(self) -> str | None:
        """The branch HEAD points at, without reading it (None: detached or unreadable)."""
        try:
            value = self._read_file(HEAD)
        except RefNotFoundError:
            return None
        if value is not None and value.startswith(_SYMREF_PREFIX):
            return value[len(_SYMREF_PREFIX) :]
        return None

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
                        check_ref_name(full)
                    except InvalidRefNameError:
                        # Not a ref at all (an editor's or another tool's leftover): skipped,
                        # reported by fsck (stray_refs); gc still keeps the id it holds.
                        warnings.warn(DamageWarning(f"skipping stray file {full}: not a valid ref name"), stacklevel=2)
                        continue
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

    def stray_refs(self) -> list[StrayRef]:
        """Files under refs/ whose names are not valid ref names (a valid name with
        bad content is a damaged ref: ``list_refs(damaged=...)``). fsck reports
        them; gc keeps any id they hold."""
        out: list[StrayRef] = []
        base = self.root / "refs"
        if not base.is_dir():
            return out
        for dirpath, _dirs, files in os.walk(base):
            for fname in files:
                path = Path(dirpath, fname)
                full = path.relative_to(self.root).as_posix()
                try:
                    raw = path.read_bytes()[:4096]
                except OSError as exc:
                    out.append(StrayRef(full, None, f"unreadable: {exc.strerror}"))
                    continue
                text = raw.decode("utf-8", "replace").strip()
                try:
                    check_ref_name(full)
                except InvalidRefNameError as exc:
                    if not fname.startswith("."):  # dot files: our own temporary files
                        out.append(StrayRef(full, text if is_full_hex_id(text) else None, str(exc)))
        return sorted(out, key=lambda r: r.path)

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

    def set_if_equals(self, name: str, old: str | None, new: str, message: str) -> None:
        """Point ``name`` at ``new`` if it currently names ``old`` (None: must not
        exist). Raises RefConflictError otherwise, changing nothing. Logged in
        ``name``'s reflog and, when HEAD is on that branch, in HEAD's (as git does;
        repair on open expects both). An OS error
        before the move is a StorageError with the ref unchanged; after it, a
        DurabilityWarning (the move stands)."""
        check_ref_name(name)
        if not is_full_hex_id(new):
            raise ValueError(f"not a full id: {new!r}")
        with storage_errors(f"updating {name}", f"{name} is unchanged"), file_lock(self._lock_path):
            current = self.read(name)
            if current != old:
                raise RefConflictError(f"{name} moved: expected {old or '(no ref)'}, found {current or '(no ref)'}")
            if current is None:
                self._check_no_dir_file_conflict(name)
                self._clear_stale_logs(name)
            path = self._path(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            head_on_it = self._head_branch() == name
            remove_stale_temporaries(path)  # under the refs lock: any left is a failed writer's
            write_atomic(path, (new + "\n").encode(), sync_dir=False)
            with self._after_move(f"{name} now names {new[:12]}", new):
                fsync_dir(path.parent)
                self._log(name, old, new, message)
                if head_on_it:
                    self._log(HEAD, old, new, message)

    def delete_if_equals(self, name: str, old: str, message: str) -> None:
        check_ref_name(name)
        with storage_errors(f"deleting {name}", f"{name} is unchanged"), file_lock(self._lock_path):
            current = self.read(name)
            if current != old:
                raise RefConflictError(f"{name} moved: expected {old}, found {current or '(no ref)'}")
            path = self._path(name)
            path.unlink()
            with self._after_move(f"{name} was deleted", old):
                fsync_dir(path.parent)
                _remove_empty_parents(path, self.root / "refs")
                # Like git, a deleted ref's reflog goes with it; HEAD's reflog keeps the history.
                log = self.root / "logs" / name
                if log.is_file():
                    log.unlink()
                    _remove_empty_parents(log, self.root / "logs")

    def _after_move(self, done: str, result: str | None) -> contextlib.AbstractContextManager[None]:
        """The follow-up writes of an update that has taken effect: a failure is a
        warning plus a repair on the next open, never an error (a caller that
        retried would apply the update twice)."""
        return after_landing(
            f"{done} (its reflog entry or directory sync is repaired on the next open)",
            result=result,
            on_failure=self.note_incomplete,
        )

    def note_incomplete(self) -> None:
        """Ask the next writable open to run :meth:`repair` (best effort: an
        empty marker file needs no data blocks, so it usually fits on a full disk)."""
        with contextlib.suppress(OSError):
            os.close(os.open(self.root / REPAIR_MARKER, os.O_WRONLY | os.O_CREAT, 0o644))

    def repair_pending(self, exists: Callable[[str], bool] = lambda oid: True) -> bool:
        """Whether :meth:`repair` has work: the marker exists, or (should the
        marker itself have failed to be written) HEAD's branch or HEAD moved
        without its reflog entry to a commit that ``exists`` (a ref edited by hand
        to name nothing is damage for fsck, not an update to finish). Cheap:
        reads the tails of two logs."""
        if (self.root / REPAIR_MARKER).exists():
            return True
        try:
            target, head_id = self.head()
        except (RefNotFoundError, InvalidRefNameError, OSError):
            return False
        if head_id is None or not exists(head_id):
            return False
        return any(self._last_logged(name) != head_id for name in ((target,) if target else ()) + (HEAD,))

    def _last_logged(self, name: str) -> str | None:
        """The ``new`` id of the last parseable entry of ``name``'s reflog."""
        path = self.root / "logs" / name
        try:
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - 65536))
                tail = f.read()
        except OSError:
            return None
        for line in reversed(tail.split(b"\n")):
            entry = _parse_reflog_line(line) if line.strip() else None
            if entry is not None:
                return entry.new
        return None

    def repair(self) -> int:
        """Finish updates whose follow-up writes failed: fsync the ref and log
        directories and append a reflog entry wherever a ref's reflog does not
        end at the ref's current value. Returns the entries restored. Raises
        OSError if the repository still cannot be written (the marker stays)."""
        restored = 0
        with file_lock(self._lock_path):
            tips = self.list_refs()
            with contextlib.suppress(RefNotFoundError):
                _, head_id = self.head()
                if head_id is not None:
                    tips[HEAD] = head_id
            for name, value in tips.items():
                entries = self.reflog(name)
                last = entries[0].new if entries else None
                if last != value:
                    message = "repair: entry restored after a failed reflog write"
                    self._log(name, last, value, message)
                    restored += 1
            for dirpath, _dirs, _files in os.walk(self.root / "refs"):
                fsync_dir(Path(dirpath))
            for dirpath, _dirs, _files in os.walk(self.root / "logs"):
                fsync_dir(Path(dirpath))
            fsync_dir(self.root)
            (self.root / REPAIR_MARKER).unlink(missing_ok=True)
            fsync_dir(self.root)
        return restored

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
        if branch is not None:
            check_ref_name(branch)
        elif detached is None or not is_full_hex_id(detached):
            raise ValueError(f"not a full id: {detached!r}")
        content = f"{_SYMREF_PREFIX}{branch}" if branch is not None else str(detached)
        if self._read_file(HEAD) == content:
            # Already there: nothing to write (a read-only repository can check out
            # its HEAD), but what a killed move of HEAD left goes now.
            if has_stale_temporaries(self.root / HEAD):
                with contextlib.suppress(OSError, CkvcError), file_lock(self._lock_path):
                    remove_stale_temporaries(self.root / HEAD)
            return
        with storage_errors("updating HEAD", "HEAD is unchanged"), file_lock(self._lock_path):
            old_id = self._head_id_or_none()
            new_id = self.read(branch) if branch is not None else detached
            remove_stale_temporaries(self.root / HEAD)
            write_atomic(self.root / HEAD, f"{content}\n".encode(), sync_dir=False)
            with self._after_move(f"HEAD now points at {branch or detached}", new_id):
                fsync_dir(self.root)
                self._log(HEAD, old_id, new_id, message)

    def set_head_if_equals(self, old: str, new: str, message: str) -> None:
        """Move a detached HEAD from ``old`` to ``new`` (a commit on a detached HEAD)."""
        with storage_errors("updating HEAD", "HEAD is unchanged"), file_lock(self._lock_path):
            target, current = self.head()
            if target is not None or current != old:
                raise RefConflictError(f"HEAD moved: expected detached at {old}")
            remove_stale_temporaries(self.root / HEAD)
            write_atomic(self.root / HEAD, f"{new}\n".encode(), sync_dir=False)
            with self._after_move(f"HEAD now names {new[:12]}", new):
                fsync_dir(self.root)
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

    def reflog(self, name: str, *, damaged: list[str] | None = None) -> list[ReflogEntry]:
        """Moves of ``name``, newest first. A line that cannot be parsed (a torn
        last line after a crash, a bad byte) is skipped; skipped lines other than
        torn ones are warned about, or listed in ``damaged`` when given."""
        if name != HEAD:
            check_ref_name(name)
        entries, bad = self._read_reflog(self.root / "logs" / name)
        if bad:
            problems = [f"logs/{name} line {n}: not a reflog entry" for n, _ in bad]
            if damaged is not None:
                damaged.extend(problems)
            else:
                warnings.warn(DamageWarning(f"skipped {len(bad)} damaged line(s) in logs/{name}"), stacklevel=2)
        return entries[::-1]

    @staticmethod
    def _read_reflog(path: Path) -> tuple[list[ReflogEntry], list[tuple[int, bytes]]]:
        """(entries oldest first, [(line number, raw line)] that did not parse),
        lines torn by a crashed append excepted from the latter."""
        lines = read_log_lines(path)
        entries: list[ReflogEntry] = []
        bad: list[tuple[int, bytes]] = []
        for number, line in enumerate(lines, 1):
            entry = _parse_reflog_line(line)
            if entry is not None:
                entries.append(entry)
            elif not looks_torn(line):
                bad.append((number, line))
        return entries, bad

    def damaged_logs(self) -> list[str]:
        """Every reflog line that does not parse (torn last lines excepted), for fsck."""
        out: list[str] = []
        logs = self.root / "logs"
        for dirpath, _dirs, files in os.walk(logs):
            for fname in sorted(files):
                path = Path(dirpath, fname)
                _, bad = self._read_reflog(path)
                rel = path.relative_to(self.root).as_posix()
                out.extend(f"{rel} line {n}: not a reflog entry" for n, _ in bad)
        return sorted(out)

    def iter_reflog_ids(self, since_ns: int = 0) -> Iterator[str]:
        """Every id a reflog entry at or after ``since_ns`` mentions (gc keeps them).
        A line that does not parse cannot say how old it is, so every id-shaped
        string in it counts: damage never lets gc drop what the line protected."""
        logs = self.root / "logs"
        if not logs.is_dir():
            return
        for dirpath, _dirs, files in os.walk(logs):
            for fname in files:
                lines = read_log_lines(Path(dirpath, fname))
                for line in lines:
                    entry = _parse_reflog_line(line)
                    if entry is None:
                        for match in _HEX_ID.findall(line):
                            yield match.decode()
                        continue
                    if entry.time_ns < since_ns:
                        continue
                    for value in (entry.old, entry.new):
                        if value:
                            yield value
