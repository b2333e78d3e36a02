"""Append-only line logs (reflogs, the prune log) over a Backend.

Two layouts, chosen from ``backend.capabilities.append``, never from the
backend's type:

- **appended**: the log is one key and every record batch is a durable append
  to it (the local ``logs/<ref>`` and ``pruned.jsonl`` files, docs/FORMAT.md
  sections 11.4 and 17);
- **one key per entry**: where a backend cannot append (object stores), each
  batch is its own immutable key ``<log>/~<time_ns, 20 digits>-<16 hex>``
  (docs/FORMAT.md section 18.3). ``~`` cannot occur in a ref name, so
  entry keys never collide with the logs of refs nested below a ref; the zero
  padded time makes the backend's sorted listing the log's order.

Either way a reader gets the log's lines oldest first and parses each on its
own, so one damaged line costs that line only.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator

from ckvc.storage.backend import Backend

ENTRY_MARK = "~"
_TAIL_BYTES = 65536


_clock = threading.Lock()
_last_ns = 0


def _entry_time() -> int:
    """Strictly increasing within this process, so that its entries keep their order."""
    global _last_ns
    with _clock:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        return _last_ns


def split_lines(data: bytes) -> list[bytes]:
    return [line for line in data.split(b"\n") if line.strip()]


class Journal:
    """The logs of one repository, in the layout its backend supports."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.appended = backend.capabilities.append

    # ---- reading ------------------------------------------------------------
    def entry_keys(self, log: str) -> list[str]:
        """The entry keys of ``log`` in order (one-key-per-entry layout only)."""
        prefix = f"{log}/{ENTRY_MARK}"
        return sorted(k for k in self.backend.list(f"{log}/") if k.startswith(prefix) and "/" not in k[len(prefix) :])

    def lines(self, log: str) -> list[bytes]:
        """Every non-empty line of ``log``, oldest first (none if it does not exist)."""
        if self.appended:
            return split_lines(self.backend.get(log) or b"")
        out: list[bytes] = []
        for key in self.entry_keys(log):
            out.extend(split_lines(self.backend.get(key) or b""))
        return out

    def tail(self, log: str) -> list[bytes]:
        """The last lines of ``log`` (at least its last whole line): the last
        entry, or the end of the appended key. The whole key is read (a ranged
        read would go through the backend's descriptor cache, which a short-lived
        store never closes); a reflog line is ~200 bytes, 5,000 commits a MiB."""
        if not self.appended:
            keys = self.entry_keys(log)
            return split_lines(self.backend.get(keys[-1]) or b"") if keys else []
        return split_lines((self.backend.get(log) or b"")[-_TAIL_BYTES:])

    def logs(self, prefix: str) -> Iterator[str]:
        """The names of the logs under ``prefix`` (a folder ending in '/')."""
        if self.appended:
            yield from self.backend.list(prefix)
            return
        seen: set[str] = set()
        for key in self.backend.list(prefix):
            log, _, last = key.rpartition("/")
            if last.startswith(ENTRY_MARK) and log not in seen:
                seen.add(log)
                yield log

    # ---- writing ------------------------------------------------------------
    def add(self, log: str, data: bytes) -> None:
        """Durably add ``data`` (whole lines) to ``log``: all of it or nothing."""
        if self.appended:
            self.backend.append(log, data)
            return
        key = self.new_entry_key(log)
        if not self.backend.put_if_absent(key, data):  # 64 random bits plus the time: not expected
            raise RuntimeError(f"entry key collision: {key}")

    @staticmethod
    def new_entry_key(log: str) -> str:
        return f"{log}/{ENTRY_MARK}{_entry_time():020d}-{uuid.uuid4().hex[:16]}"

    def remove(self, log: str, keep: str) -> None:
        """Delete ``log`` and its entries (a deleted ref's reflog goes with it),
        and the folders that leaves empty up to ``keep``."""
        keys = [log] if self.appended else self.entry_keys(log)
        for key in keys:
            try:
                self.backend.delete(key)
            except IsADirectoryError:  # the logs of refs below a deleted one: not this log
                return
            self.backend.prune_folders(key, keep)

    def drop(self, log: str, expired: Callable[[bytes], bool]) -> int:
        """Remove the lines of ``log`` for which ``expired`` says so; returns how
        many went. Appended: the key is rewritten whole (the caller holds the lock
        its appenders take). One key per entry: an entry goes only when all its
        lines have expired (entries are immutable; new ones never collide)."""
        if self.appended:
            lines = self.lines(log)
            kept = [line for line in lines if not expired(line)]
            if len(kept) != len(lines):
                self.backend.replace(log, b"".join(line + b"\n" for line in kept))
            return len(lines) - len(kept)
        dropped = 0
        for key in self.entry_keys(log):
            lines = split_lines(self.backend.get(key) or b"")
            if lines and all(expired(line) for line in lines):
                self.backend.delete(key)
                dropped += len(lines)
        return dropped
