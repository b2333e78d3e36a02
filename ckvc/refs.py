"""Branches, tags and HEAD as small keys on a Backend, with compare-and-swap
updates and a reflog.

Layout (docs/FORMAT.md section 11; keys relative to the repository directory):
    HEAD                    "ref: refs/heads/main\n" (symbolic) or "<64 hex>\n" (detached)
    refs/heads/<name>       "<64 hex>\n"  a commit id
    refs/tags/<name>        "<64 hex>\n"  a commit id (lightweight) or tag object id (annotated)
    logs/<ref>              one JSON line per move of that ref (the reflog)
    refs.lock               the lock taken for every ref update (where the backend has OS locks)

The mechanism follows ``backend.capabilities``, never the backend's type:

- with ``file_locks`` (the local directory) every update happens under the
  refs.lock flock: read, compare with the expected value, write a temporary,
  fsync, rename (``Backend.replace``). The kernel releases the flock when a
  process dies, so a crash never leaves a stale lock;
- without them (object stores) the update is ``compare_and_swap`` on the ref's
  key, which alone decides a race; a deletion swaps in an empty tombstone, so
  it is conditional too (docs/DESIGN.md, "Refs and logs on an object store").

Reflogs are appended where the backend can append, else one key per entry
(ckvc.journal).

The publication is the moment an update takes effect. An OS error before it
leaves the ref unchanged and is raised as a typed StorageError; one after it (the
directory fsync, the reflog append) does not undo the move, so the update is
reported as done with a DurabilityWarning, and ``repair-pending`` is created so
the next writable open re-syncs the directories and restores lost reflog
entries (``RefStore.repair``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ckvc.errors import (
    CkvcError,
    DamageWarning,
    InvalidRefNameError,
    RefConflictError,
    RefNotFoundError,
    StorageError,
    after_landing,
    storage_errors,
)
from ckvc.ids import is_full_hex_id
from ckvc.journal import Journal
from ckvc.storage.backend import Backend, BackendError, Version
from ckvc.storage.durable import looks_torn
from ckvc.storage.local import backend_at

HEAD = "HEAD"
BRANCH_PREFIX = "refs/heads/"
TAG_PREFIX = "refs/tags/"
_SYMREF_PREFIX = "ref: "
_FORBIDDEN_CHARS = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")
_HEX_ID = re.compile(rb"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
REPAIR_MARKER = "repair-pending"
REFS_LOCK = "refs.lock"
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
        if part.endswith(".tmp"):  # the storage layer's temporaries (storage.backend.TEMP_SUFFIX)
            raise bad("a component ends with '.tmp'")
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


@dataclass(frozen=True)
class ReflogEntry:
    old: str | None
    new: str | None
    time_ns: int
    message: str


def _expired(line: bytes, *, before_ns: int, keep: bytes) -> bool:
    """A reflog line made before ``before_ns`` (not ``keep``; a line that does not
    parse never: its age is unknown)."""
    entry = _parse_reflog_line(line)
    return entry is not None and entry.time_ns < before_ns and line.strip() != keep


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


def kept_folder(key: str) -> str:
    """The folder above ``key`` that stays when refs or logs below it are deleted
    (the repository's own folders; docs/FORMAT.md section 2)."""
    for base in ("logs/refs/heads", "logs/refs/tags", "logs/refs", "logs", "refs/heads", "refs/tags", "refs"):
        if key.startswith(base + "/"):
            return base
    return ""


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


class RefStore:
    """Refs, HEAD and reflogs over ``backend`` (a ``.ckvc`` path still works: the
    local directory, as before)."""

    def __init__(self, backend: Backend | str | os.PathLike[str]) -> None:
        self.backend = backend = backend_at(backend)
        # With OS locks an update is read-compare-write under refs.lock; without
        # them compare_and_swap on the ref's key is the whole protocol, and a
        # deleted ref is an empty tombstone so that deleting is conditional too.
        self.locked = backend.capabilities.file_locks
        self.journal = Journal(backend)

    @classmethod
    def local(cls, dot_ckvc: Path) -> RefStore:
        """The ref store of the repository directory ``dot_ckvc``."""
        return cls(dot_ckvc)

    def _update_lock(self) -> contextlib.AbstractContextManager[None]:
        return self.backend.lock(REFS_LOCK) if self.locked else contextlib.nullcontext()

    # ---- reading ------------------------------------------------------------
    @staticmethod
    def _key(name: str) -> str:
        if name != HEAD:
            check_ref_name(name)
        return name

    def _get(self, name: str) -> tuple[bytes, Version | None] | None:
        try:
            if self.locked:  # no version needed: the lock orders the writers
                data = self.backend.get(self._key(name))
                return None if data is None else (data, None)
            return self.backend.get_versioned(self._key(name))
        except (NotADirectoryError, IsADirectoryError):
            return None

    def _text(self, name: str, data: bytes) -> str | None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise RefNotFoundError(f"ref {name} is damaged: not UTF-8 text") from None
        text = text.strip()
        return None if not text and not self.locked else text  # an empty key is a tombstone

    def _read_file(self, name: str) -> str | None:
        found = self._get(name)
        return None if found is None else self._text(name, found[0])

    def _read_versioned(self, name: str) -> tuple[str | None, Version | None]:
        """(the id ``name`` names or None, the version a compare_and_swap expects)."""
        found = self._get(name)
        if found is None:
            return None, None
        return self._checked(name, self._text(name, found[0])), found[1]

    @staticmethod
    def _checked(name: str, value: str | None) -> str | None:
        if value is not None and not is_full_hex_id(value):
            raise RefNotFoundError(f"ref {name} is damaged: {value[:80]!r}")
        return value

    def read(self, name: str) -> str | None:
        """The id a ref (not HEAD) names, or None if it does not exist."""
        return self._checked(name, self._read_file(name))

    @staticmethod
    def _parse_head(value: str | None) -> tuple[str | None, str | None]:
        """(symbolic target, detached id) of HEAD's content."""
        if value is None:
            raise RefNotFoundError("HEAD is missing")
        if value.startswith(_SYMREF_PREFIX):
            return value[len(_SYMREF_PREFIX) :], None
        if not is_full_hex_id(value):
            raise RefNotFoundError(f"HEAD is damaged: {value[:80]!r}")
        return None, value

    def head(self) -> tuple[str | None, str | None]:
        """(symbolic target, commit id). Target is None when HEAD is detached;
        id is None when the target branch has no commits yet."""
        target, detached = self._parse_head(self._read_file(HEAD))
        return (target, self.read(target)) if target is not None else (None, detached)

    def head_branch(self) -> str | None:
        """The branch (full ref name) HEAD points at, without reading it (None:
        detached or unreadable): one read where :meth:`head` makes two."""
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
        for full in self.backend.list("refs/"):
            if full.startswith(prefix) and not full.rpartition("/")[2].startswith("."):
                try:
                    check_ref_name(full)
                except InvalidRefNameError:
                    # Not a ref at all (an editor's or another tool's leftover): skipped,
                    # reported by fsck (stray_refs); gc still keeps the id it holds.
                    warnings.warn(DamageWarning(f"skipping stray file {full}: not a valid ref name"), stacklevel=2)
                    continue
                try:
                    value = self._listed(full)
                except RefNotFoundError as exc:
                    if damaged is None:
                        raise
                    damaged.append(str(exc))
                    continue
                if value is not None:
                    out[full] = value
        return dict(sorted(out.items()))

    def _listed(self, name: str) -> str | None:
        """The id a listed ref names. Without OS locks a ref key is never removed (a
        deletion writes a tombstone), so a listed key that reads as absent is a store
        that has not caught up, or a failed read: read once more, then a transient
        BackendError, never a branch silently missing from a listing."""
        found = self._get(name)
        if found is None and not self.locked:
            found = self._get(name)
            if found is None:
                raise BackendError(
                    f"{name} is listed but reads as absent (the store has not caught up?): try again",
                    key=name, transient=True,
                )  # fmt: skip
        return None if found is None else self._checked(name, self._text(name, found[0]))

    def stray_refs(self) -> list[StrayRef]:
        """Files under refs/ whose names are not valid ref names (a valid name with
        bad content is a damaged ref: ``list_refs(damaged=...)``). fsck reports
        them; gc keeps any id they hold."""
        out: list[StrayRef] = []
        for full in self.backend.list("refs/"):
            try:
                raw = (self.backend.get(full) or b"")[:4096]
            except (OSError, StorageError) as exc:
                out.append(StrayRef(full, None, f"unreadable: {_reason(exc)}"))
                continue
            text = raw.decode("utf-8", "replace").strip()
            try:
                check_ref_name(full)
            except InvalidRefNameError as exc:
                if not full.rpartition("/")[2].startswith("."):  # dot files: our own temporary files
                    out.append(StrayRef(full, text if is_full_hex_id(text) else None, str(exc)))
        return sorted(out, key=lambda r: r.path)

    # ---- updating -----------------------------------------------------------
    def _occupied(self, key: str) -> bool:
        """Whether ``key`` holds something (a local folder does not; nor does a tombstone)."""
        try:
            data = self.backend.get(key)
        except IsADirectoryError:
            return False
        return data is not None and (self.locked or bool(data.strip()))

    def _check_no_dir_file_conflict(self, name: str) -> None:
        if any(self._occupied(key) for key in self.backend.list(name + "/")):
            raise RefConflictError(f"cannot create {name}: refs exist below it")
        parent = name.rpartition("/")[0]
        while parent:
            if self._occupied(parent):
                raise RefConflictError(f"cannot create {name}: {parent} exists")
            parent = parent.rpartition("/")[0]

    def _publish(self, name: str, version: Version | None, data: bytes, conflict: Callable[[], str]) -> None:
        """The moment the update takes effect. Under the lock: a replace (the
        temporaries of killed writers go first; any left is one's, as every writer
        holds the lock). Without it: compare_and_swap against ``version``, whose
        loss is a RefConflictError with ``conflict()``'s message; a swap that
        failed otherwise but left the key holding ``data`` has landed."""
        if self.locked:
            # Every writer of refs, HEAD and the config holds this lock, so any
            # temporary of theirs left now is a failed or killed writer's, even
            # one of a ref (a tag) no later command writes again.
            self.backend.remove_stale_puts_in("refs/", recursive=True)
            self.backend.remove_stale_puts_in("")
            self.backend.replace(name, data)
            return
        try:
            self.backend.compare_and_swap(name, version, data)
        except RefConflictError:
            raise RefConflictError(conflict()) from None
        except Exception:
            # A remote swap whose answer was lost may have happened: the key says.
            if not self._holds(name, data):
                raise

    def _holds(self, name: str, data: bytes) -> bool:
        try:
            return self.backend.get(name) == data
        except Exception:
            return False

    def _found(self, name: str) -> str:
        try:
            value = self._read_file(name)
        except RefNotFoundError as exc:
            return str(exc)
        return value or "(no ref)"

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

        def moved() -> str:
            return f"{name} moved: expected {old or '(no ref)'}, found {self._found(name)}"

        with storage_errors(f"updating {name}", f"{name} is unchanged"), self._update_lock():
            current, version = self._read_versioned(name)
            if current != old:
                raise RefConflictError(f"{name} moved: expected {old or '(no ref)'}, found {current or '(no ref)'}")
            if current is None:
                self._check_no_dir_file_conflict(name)
                self._clear_stale_logs(name)
            head_on_it = self.head_branch() == name
            self._publish(name, version, (new + "\n").encode(), moved)
            with self._after_move(f"{name} now names {new[:12]}", new):
                self.backend.sync(name)
                self._log(name, old, new, message)
                if head_on_it:
                    self._log(HEAD, old, new, message)

    def delete_if_equals(self, name: str, old: str, message: str) -> None:
        check_ref_name(name)
        with storage_errors(f"deleting {name}", f"{name} is unchanged"), self._update_lock():
            current, version = self._read_versioned(name)
            if current != old:
                raise RefConflictError(f"{name} moved: expected {old}, found {current or '(no ref)'}")
            if self.locked:
                self.backend.delete(name)
            else:
                self._publish(name, version, b"", lambda: f"{name} moved: expected {old}, found {self._found(name)}")
            with self._after_move(f"{name} was deleted", old):
                self.backend.sync(name)
                self.backend.prune_folders(name, kept_folder(name))
                # Like git, a deleted ref's reflog goes with it; HEAD's reflog keeps the history.
                log = f"logs/{name}"
                self.journal.remove(log, kept_folder(log))

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
        empty marker needs no data blocks, so it usually fits on a full disk)."""
        with contextlib.suppress(OSError, CkvcError):
            self.backend.put(REPAIR_MARKER, b"")

    def repair_pending(self, exists: Callable[[str], bool] = lambda oid: True) -> bool:
        """Whether :meth:`repair` has work: the marker exists, or (should the
        marker itself have failed to be written) HEAD's branch or HEAD moved
        without its reflog entry to a commit that ``exists`` (a ref edited by hand
        to name nothing is damage for fsck, not an update to finish). Cheap:
        reads the tails of two logs."""
        if self.backend.stat(REPAIR_MARKER) is not None:
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
        try:
            tail = self.journal.tail(f"logs/{name}")
        except (OSError, CkvcError):  # a folder, unreadable: nothing logged that counts
            return None
        for line in reversed(tail):
            entry = _parse_reflog_line(line)
            if entry is not None:
                return entry.new
        return None

    def repair(self) -> int:
        """Finish updates whose follow-up writes failed: sync the ref and log
        directories and append a reflog entry wherever a ref's reflog does not
        end at the ref's current value. Returns the entries restored. Raises
        OSError if the repository still cannot be written (the marker stays).
        Without the refs lock a writer between its swap and its reflog entry may
        get a repair entry as well: a duplicate line, never a lost one."""
        restored = 0
        with self._update_lock():
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
            folders = {key.rpartition("/")[0] for top in ("refs/", "logs/") for key in self.backend.list(top)}
            for folder in sorted(folders | {"refs", "logs"}):
                self.backend.sync(folder + "/")
            self.backend.sync(HEAD)
            self.backend.delete(REPAIR_MARKER)
            self.backend.sync(REPAIR_MARKER)
        return restored

    def _clear_stale_logs(self, name: str) -> None:
        """Remove reflogs of deleted refs that would collide with ``name``'s
        (logs/refs/heads/a when creating a/b, or the reverse). The refs
        themselves were checked for such conflicts already. Entry-per-key logs
        cannot collide."""
        if not self.journal.appended:
            return
        log = f"logs/{name}"
        for key in list(self.backend.list(log + "/")):
            self.backend.delete(key)
            self.backend.prune_folders(key, log.rpartition("/")[0])
        parent = log.rpartition("/")[0]
        while parent != "logs":
            if self._occupied(parent):
                self.backend.delete(parent)
            parent = parent.rpartition("/")[0]

    def set_head(self, *, branch: str | None = None, detached: str | None = None, message: str) -> None:
        """Point HEAD at a branch (symbolic) or at a commit (detached)."""
        if (branch is None) == (detached is None):
            raise ValueError("give exactly one of branch or detached")
        if branch is not None:
            check_ref_name(branch)
        elif detached is None or not is_full_hex_id(detached):
            raise ValueError(f"not a full id: {detached!r}")
        content = f"{_SYMREF_PREFIX}{branch}" if branch is not None else str(detached)
        found = self._get(HEAD)
        if found is not None and self._text(HEAD, found[0]) == content:
            # Already there: nothing to write (a read-only repository can check out
            # its HEAD), but what a killed move of HEAD left goes now.
            if self.backend.has_stale_puts(HEAD):
                with contextlib.suppress(OSError, CkvcError), self._update_lock():
                    self.backend.remove_stale_puts(HEAD)
            return
        with storage_errors("updating HEAD", "HEAD is unchanged"), self._update_lock():
            if self.locked:
                found = self._get(HEAD)
            old_id = self._head_id_or_none()
            new_id = self.read(branch) if branch is not None else detached
            version = found[1] if found is not None else None
            self._publish(HEAD, version, f"{content}\n".encode(), lambda: "HEAD moved while it was being updated")
            with self._after_move(f"HEAD now points at {branch or detached}", new_id):
                self.backend.sync(HEAD)
                self._log(HEAD, old_id, new_id, message)

    def set_head_if_equals(self, old: str, new: str, message: str) -> None:
        """Move a detached HEAD from ``old`` to ``new`` (a commit on a detached HEAD)."""
        with storage_errors("updating HEAD", "HEAD is unchanged"), self._update_lock():
            found = self._get(HEAD)
            target, current = self._parse_head(None if found is None else self._text(HEAD, found[0]))
            if target is not None or current != old:
                raise RefConflictError(f"HEAD moved: expected detached at {old}")
            version = found[1] if found is not None else None
            self._publish(HEAD, version, f"{new}\n".encode(), lambda: f"HEAD moved: expected detached at {old}")
            with self._after_move(f"HEAD now names {new[:12]}", new):
                self.backend.sync(HEAD)
                self._log(HEAD, old, new, message)

    def init_head(self, branch: str) -> None:
        self.backend.put(HEAD, f"{_SYMREF_PREFIX}{check_ref_name(branch)}\n".encode())

    def _head_id_or_none(self) -> str | None:
        try:
            return self.head()[1]
        except RefNotFoundError:
            return None

    # ---- reflog -------------------------------------------------------------
    def _log(self, name: str, old: str | None, new: str | None, message: str) -> bytes:
        """Append one entry to ``name``'s reflog; returns its line."""
        line = json.dumps({"old": old, "new": new, "time_ns": time.time_ns(), "message": message}, sort_keys=True)
        self.journal.add(f"logs/{name}", (line + "\n").encode())
        return line.encode()

    def reflog(self, name: str, *, damaged: list[str] | None = None) -> list[ReflogEntry]:
        """Moves of ``name``, newest first. A line that cannot be parsed (a torn
        last line after a crash, a bad byte) is skipped; skipped lines other than
        torn ones are warned about, or listed in ``damaged`` when given."""
        if name != HEAD:
            check_ref_name(name)
        entries, bad = self._read_reflog(f"logs/{name}")
        if bad:
            problems = [f"logs/{name} line {n}: not a reflog entry" for n, _ in bad]
            if damaged is not None:
                damaged.extend(problems)
            else:
                warnings.warn(DamageWarning(f"skipped {len(bad)} damaged line(s) in logs/{name}"), stacklevel=2)
        return entries[::-1]

    def _read_reflog(self, log: str) -> tuple[list[ReflogEntry], list[tuple[int, bytes]]]:
        """(entries oldest first, [(line number, raw line)] that did not parse),
        lines torn by a crashed append excepted from the latter."""
        entries: list[ReflogEntry] = []
        bad: list[tuple[int, bytes]] = []
        for number, line in enumerate(self.journal.lines(log), 1):
            entry = _parse_reflog_line(line)
            if entry is not None:
                entries.append(entry)
            elif not looks_torn(line):
                bad.append((number, line))
        return entries, bad

    def expire_reflogs(self, before_ns: int, names: Iterable[str] | None = None) -> int:
        """Drop the reflog entries made before ``before_ns`` (git reflog expire): of
        ``names`` (HEAD or full ref names), default every reflog. A log left empty
        gets one entry naming the ref's value (and no old value). A line that does
        not parse stays, its age unknown. Returns how many entries went."""
        logs = [f"logs/{n}" for n in names] if names is not None else list(self.journal.logs("logs/"))
        dropped = 0
        with self._update_lock():  # appenders write under it: no entry is lost to the rewrite
            for log in logs:
                name = log.removeprefix("logs/")
                entries = [e for e in map(_parse_reflog_line, self.journal.lines(log)) if e is not None]
                current = self.head()[1] if name == HEAD else self.read(name)
                marker = b""
                if entries and entries[-1].time_ns < before_ns and current is not None:
                    # Every entry goes: one new entry records the ref's value (open's repair
                    # checks the last entry against it), with no old value to keep alive.
                    marker = self._log(name, None, current, "reflog: older entries expired")
                dropped += self.journal.drop(log, functools.partial(_expired, before_ns=before_ns, keep=marker))
        return dropped

    def damaged_logs(self) -> list[str]:
        """Every reflog line that does not parse (torn last lines excepted), for fsck."""
        out: list[str] = []
        for log in self.journal.logs("logs/"):
            _, bad = self._read_reflog(log)
            out.extend(f"{log} line {n}: not a reflog entry" for n, _ in bad)
        return sorted(out)

    def iter_reflog_ids(self, since_ns: int = 0) -> Iterator[str]:
        """Every id a reflog entry at or after ``since_ns`` mentions (gc keeps them).
        A line that does not parse cannot say how old it is, so every id-shaped
        string in it counts: damage never lets gc drop what the line protected."""
        for log in self.journal.logs("logs/"):
            for line in self.journal.lines(log):
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
