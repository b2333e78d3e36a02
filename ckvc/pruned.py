"""The prune log: which commits a retention policy released, by which policy, when.

``.ckvc/pruned.jsonl`` (a Backend key) holds one JSON object per line:
``{"commit": "<64 hex>", "policy": "<description>", "time_ns": <int>}``. It is
append-only and fsynced; a torn last line (crash mid-append) is ignored, and a
damaged line is skipped with a warning (fsck lists it). A
commit listed here keeps its commit object (history, metrics) while gc releases
its snapshot and chunks. Pruning is never undone.

Where the backend cannot append, each ``add`` is one entry key under
``pruned/`` (ckvc.journal); without OS locks two writers may both record a
commit, which is harmless: the first record wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ckvc.errors import DamageWarning, storage_errors
from ckvc.ids import is_full_hex_id
from ckvc.journal import Journal
from ckvc.storage.backend import Backend
from ckvc.storage.durable import looks_torn
from ckvc.storage.local import backend_at

PRUNE_LOG = "pruned.jsonl"
PRUNE_ENTRIES = "pruned"  # the log's name where each add is its own key
PRUNE_LOCK = "pruned.lock"


@dataclass(frozen=True)
class PruneRecord:
    commit: str
    policy: str
    time_ns: int


class PruneLog:
    def __init__(self, backend: Backend | str | os.PathLike[str]) -> None:
        self.backend = backend = backend_at(backend)  # a .ckvc path: the local directory, as before
        self.journal = Journal(backend)
        self.name = PRUNE_LOG if self.journal.appended else PRUNE_ENTRIES

    @classmethod
    def local(cls, dot_ckvc: Path) -> PruneLog:
        return cls(dot_ckvc)

    def records(self, *, damaged: list[str] | None = None) -> dict[str, PruneRecord]:
        """Pruned commit id -> its first prune record. Lines that do not parse are
        skipped (torn ones silently; others with a warning, or listed in
        ``damaged`` when given). Skipping is the safe direction: a commit whose
        record is lost counts as not pruned, so gc keeps its data."""
        lines = self.journal.lines(self.name)
        out: dict[str, PruneRecord] = {}
        bad: list[str] = []
        for number, line in enumerate(lines, 1):
            record = _parse(line)
            if record is None:
                if not looks_torn(line):
                    bad.append(f"{self.name} line {number}: not a prune record")
                continue
            out.setdefault(record.commit, record)
        if bad:
            if damaged is not None:
                damaged.extend(bad)
            else:
                warnings.warn(DamageWarning(f"skipped {len(bad)} damaged line(s) in {self.name}"), stacklevel=2)
        return out

    def add(self, commits: Iterable[str], policy: str) -> int:
        """Record ``commits`` as pruned (those not pruned already). Returns how many."""
        lock = self.backend.lock(PRUNE_LOCK) if self.backend.capabilities.file_locks else contextlib.nullcontext()
        with storage_errors("writing the prune log", "no commit was marked as pruned"), lock:
            known = self.records()
            now = time.time_ns()
            lines = [
                json.dumps({"commit": c, "policy": policy, "time_ns": now}, sort_keys=True) + "\n"
                for c in dict.fromkeys(commits)
                if c not in known
            ]
            if lines:
                self.journal.add(self.name, "".join(lines).encode())
            return len(lines)


def _parse(line: bytes) -> PruneRecord | None:
    try:
        d = json.loads(line.decode("utf-8"))
        record = PruneRecord(str(d["commit"]), str(d["policy"]), int(d["time_ns"]))
    except (ValueError, KeyError, TypeError):
        return None
    return record if is_full_hex_id(record.commit) else None
