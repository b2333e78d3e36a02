"""auto_push: each commit pushed in the background once it is durable locally
(docs/DESIGN.md, "Hybrid cache"; the backlog file: docs/FORMAT.md section 19).

``commit`` never waits for the network: it appends the branch and commit to the
backlog (``.ckvc/backup.json``, replaced atomically) and wakes the worker thread,
which pushes the branch as it is then (``ckvc.remote.push``: data first, the
remote ref last by compare-and-swap, so the remote branch only ever names data
that is there). A failed push (remote unreachable, throttled) is retried with
exponential backoff; the backlog survives the process, ``ckvc status`` shows it,
a process closing with entries left says so (a warning), and the next process
that opens the repository resumes them.

The worker has its own :class:`ckvc.core.Repository` on the same directory, so a
push in flight never uses a store the caller has closed.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import warnings
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckvc.core import Repository, at_exit
from ckvc.errors import BackupIncompleteError, CkvcError, CkvcWarning, InvalidConfigError, NonFastForwardError
from ckvc.refs import BRANCH_PREFIX

BACKLOG_KEY = "backup.json"
BACKLOG_VERSION = 1
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 30.0
# How long close() lets a reachable remote drain the backlog before it warns and leaves.
CLOSE_WAIT_S = 3.0
# How long a process that ends without close() waits for a reachable remote to take
# what auto_push still holds ($CKVC_EXIT_WAIT seconds to change it); a remote that
# is failing gets no wait. CKVC_REQUIRE_BACKUP=1: exit with BackupIncompleteError's
# status when something is left.
EXIT_WAIT_S = 120.0
EXIT_WAIT_ENV = "CKVC_EXIT_WAIT"
REQUIRE_BACKUP_ENV = "CKVC_REQUIRE_BACKUP"


@dataclass
class Entry:
    ref: str  # refs/heads/<branch>
    commit: str
    time_ns: int


@dataclass
class Backlog:
    """What is not backed up yet, oldest first, and how the last attempt went."""

    version: int = BACKLOG_VERSION
    remote: str = "origin"
    entries: list[Entry] = field(default_factory=list)
    failures: int = 0  # consecutive failed attempts
    last_error: str | None = None
    last_attempt_ns: int | None = None

    @classmethod
    def load(cls, core: Repository, remote: str) -> Backlog:
        data = core.refs.backend.get(BACKLOG_KEY)
        if data is None:
            return cls(remote=remote)
        try:
            raw = json.loads(data.decode("utf-8"))
            if raw.get("version") != BACKLOG_VERSION:
                raise ValueError(f"unknown version {raw.get('version')!r}")
            entries = [Entry(str(e["ref"]), str(e["commit"]), int(e["time_ns"])) for e in raw["entries"]]
            return cls(
                remote=str(raw.get("remote", remote)),
                entries=entries,
                failures=int(raw.get("failures", 0)),
                last_error=raw.get("last_error"),
                last_attempt_ns=raw.get("last_attempt_ns"),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidConfigError(f"{BACKLOG_KEY} is damaged: {exc}") from None

    def save(self, core: Repository) -> None:
        core.refs.backend.put(BACKLOG_KEY, (json.dumps(asdict(self), indent=2) + "\n").encode())

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "pending": len(self.entries)}


class AutoPush:
    """The background pusher of one open repository."""

    def __init__(self, path: Path, remote: str) -> None:
        self.remote = remote
        self.core = Repository.open_local(path, threads=2)
        self._lock = threading.Condition()
        self.backlog = Backlog.load(self.core, remote)
        if self.backlog.remote != remote:  # the setting changed: what was queued goes to the new remote
            self.backlog.remote = remote
        self._stop = False
        self._busy = False
        self._rng = random.Random()
        # A push of this process has failed: the remote counts as down until one succeeds
        # (the backlog's failure count may be an earlier process's).
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="ckvc-auto-push", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # -- the caller's side --
    def enqueue(self, ref: str, commit: str) -> None:
        """Queue ``ref`` (now at ``commit``) for a push; returns at once."""
        with self._lock:
            self.backlog.entries.append(Entry(ref, commit, time.time_ns()))
            self._save()
            self._lock.notify_all()

    def status(self) -> Backlog:
        with self._lock:
            return Backlog(**{**asdict(self.backlog), "entries": [Entry(**asdict(e)) for e in self.backlog.entries]})

    def wait(self, timeout: float | None = None, *, while_reachable: bool = False) -> bool:
        """Wait until the backlog is empty (True) or ``timeout`` passed (False);
        ``while_reachable``: or an attempt failed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self.backlog.entries or self._busy:
                if while_reachable and self._failing:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left if left is None else min(left, 0.5))
            return True

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Stop after the backlog drained, or at once when the remote is failing;
        warn about what is left (the next open resumes it)."""
        left = self._stop_after(wait_s)
        if left:
            warnings.warn(CkvcWarning(left), stacklevel=3)

    def _stop_after(self, wait_s: float) -> str | None:
        """Wait up to ``wait_s`` for a reachable remote to take the backlog, then stop
        the worker; what is left, said in a line (None: nothing)."""
        self.wait(wait_s, while_reachable=True)
        with self._lock:
            self._stop = True
            left = list(self.backlog.entries)
            error = self.backlog.last_error
            self._lock.notify_all()
        _LIVE.discard(self)
        if not self._busy:
            self._thread.join(1.0)
            self.core.close()
        # else: a push is in flight; its thread holds its own repository and ends with the process
        if not left:
            return None
        tips = {e.ref.removeprefix(BRANCH_PREFIX): e.commit[:12] for e in left}  # the last queued per branch
        named = ", ".join(f"{branch} at {commit}" for branch, commit in tips.items())
        why = f" (last attempt: {error})" if error else ""
        return (
            f"{len(left)} commit(s) not yet backed up to {self.remote}: {named}{why}; "
            "they stay queued in .ckvc/backup.json and the next ckvc command resumes them"
        )

    def drain_at_exit(self, wait_s: float) -> str | None:
        """At exit: a progress line while a reachable remote takes the backlog (up to
        ``wait_s``), then what is left, said in a line."""
        with self._lock:
            pending, reachable = len(self.backlog.entries), not self._failing
        if pending and reachable and wait_s > 0:
            print(
                f"ckvc: pushing {pending} commit(s) to {self.remote} before exit (up to {wait_s:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        return self._stop_after(wait_s)

    # -- the worker --
    def _save(self) -> None:
        try:
            self.backlog.save(self.core)
        except (OSError, CkvcError) as exc:
            warnings.warn(CkvcWarning(f"auto_push backlog not saved: {exc}"), stacklevel=3)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self.backlog.entries:
                    self._lock.wait()
                if self._stop:
                    return
                batch = list(self.backlog.entries)
                self._busy = True
            ok = self._push(batch)
            with self._lock:
                self._busy = False
                self._failing = not ok
                if ok:
                    done = {(e.ref, e.commit, e.time_ns) for e in batch}
                    self.backlog.entries = [e for e in self.backlog.entries if (e.ref, e.commit, e.time_ns) not in done]
                    self.backlog.failures = 0
                    self.backlog.last_error = None
                self.backlog.last_attempt_ns = time.time_ns()
                self._save()
                self._lock.notify_all()
                if not ok:
                    pause = self._rng.uniform(
                        0.5, 1.0
                    ) * min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (self.backlog.failures - 1))  # fmt: skip
                    self._lock.wait_for(lambda: self._stop, timeout=pause)
                    if self._stop:
                        return

    def _on_remote(self, batch: list[Entry]) -> bool:
        from ckvc.graph import is_ancestor
        from ckvc.remote.clone import ls_remote

        try:
            refs = ls_remote(self.core, self.remote)
        except (CkvcError, OSError):
            return False
        return all(e.ref in refs and is_ancestor(self.core, e.commit, refs[e.ref]) for e in batch)

    def _push(self, batch: list[Entry]) -> bool:
        """Push each branch in the batch as it is now; False (and why, kept) on failure."""
        from ckvc.remote.push import push

        refs = list(dict.fromkeys(e.ref for e in batch if e.ref.startswith(BRANCH_PREFIX)))
        try:
            if refs:
                push(self.core, self.remote, refs)
            return True
        except NonFastForwardError as exc:
            # Another pusher (an earlier process resuming this backlog) got there first:
            # done if what it left contains every queued commit, else kept and retried.
            if self._on_remote(batch):
                return True
            with self._lock:
                self.backlog.failures += 1
                self.backlog.last_error = str(exc)
            return False
        except (CkvcError, OSError) as exc:
            with self._lock:
                self.backlog.failures += 1
                self.backlog.last_error = (str(exc).splitlines() or [type(exc).__name__])[0]
            return False


# The pushers of this process, drained at exit when their Repo was never closed.
_LIVE: weakref.WeakSet[AutoPush] = weakref.WeakSet()


def exit_wait_s() -> float:
    """EXIT_WAIT_S, or $CKVC_EXIT_WAIT seconds."""
    raw = os.environ.get(EXIT_WAIT_ENV)
    try:
        return max(0.0, float(raw)) if raw else EXIT_WAIT_S
    except ValueError:
        return EXIT_WAIT_S


def _drain_at_exit() -> int | None:
    """auto_push's backlog at exit: pushed within the wait, else a warning naming
    what is left; BackupIncompleteError's status when CKVC_REQUIRE_BACKUP=1 asked."""
    left = [line for pusher in list(_LIVE) if (line := pusher.drain_at_exit(exit_wait_s())) is not None]
    for line in left:
        print(f"ckvc: warning: {line}", file=sys.stderr, flush=True)
    if left and os.environ.get(REQUIRE_BACKUP_ENV) == "1":
        return BackupIncompleteError.exit_code
    return None


at_exit("auto_push", _drain_at_exit)
