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

On a remote a record covers a commit only while the remote lacks its snapshot
(FORMAT 18.2), unless the remote's own retention wrote it (``retain --remote``:
``"remote_retention": "<the commit's snapshot id>"``), which covers the commit
whatever the remote holds and wins over a plain record for the same commit
(:func:`remote_released`). Its snapshot is *hollow* on that remote: present, but
its chunks may be gone, so a pusher does not take it as whole (:func:`hollow_snapshots`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckvc.errors import DamageWarning, storage_errors
from ckvc.ids import is_full_hex_id
from ckvc.journal import Journal
from ckvc.storage.backend import Backend
from ckvc.storage.durable import looks_torn
from ckvc.storage.local import backend_at

PRUNE_LOG = "pruned.jsonl"
PRUNE_ENTRIES = "pruned"  # the log's name where each add is its own key
PRUNE_LOCK = "pruned.lock"

if TYPE_CHECKING:
    from ckvc.objects import Commit


@dataclass(frozen=True)
class PruneRecord:
    commit: str
    policy: str
    time_ns: int
    # Written by a remote's own retention: the commit's snapshot id (hex); such a
    # record covers the commit whatever the remote holds.
    remote_retention: str | None = None


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
            first = out.setdefault(record.commit, record)
            if record.remote_retention is not None and first.remote_retention is None:
                out[record.commit] = record  # the remote's own retention decides over a pusher's record
        if bad:
            if damaged is not None:
                damaged.extend(bad)
            else:
                warnings.warn(DamageWarning(f"skipped {len(bad)} damaged line(s) in {self.name}"), stacklevel=2)
        return out

    def add(self, commits: Iterable[str], policy: str, *, snapshots: Mapping[str, str] | None = None) -> int:
        """Record ``commits`` as pruned (those not pruned already). Returns how many.
        ``snapshots`` (commit -> its snapshot id): the records are a remote's own
        retention's (``retain --remote``), written for a commit whose only record
        is a pusher's too."""
        lock = self.backend.lock(PRUNE_LOCK) if self.backend.capabilities.file_locks else contextlib.nullcontext()
        with storage_errors("writing the prune log", "no commit was marked as pruned"), lock:
            known = self.records()
            now = time.time_ns()
            lines = []
            for commit in dict.fromkeys(commits):
                record: dict[str, object] = {"commit": commit, "policy": policy, "time_ns": now}
                if snapshots is not None:
                    record["remote_retention"] = snapshots[commit]
                if commit not in known or (snapshots is not None and known[commit].remote_retention is None):
                    lines.append(json.dumps(record, sort_keys=True) + "\n")
            if lines:
                self.journal.add(self.name, "".join(lines).encode())
            return len(lines)


def _parse(line: bytes) -> PruneRecord | None:
    try:
        d = json.loads(line.decode("utf-8"))
        snapshot = d.get("remote_retention")
        if "remote_retention" in d and not (type(snapshot) is str and is_full_hex_id(snapshot)):
            return None
        record = PruneRecord(str(d["commit"]), str(d["policy"]), int(d["time_ns"]), snapshot)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return record if is_full_hex_id(record.commit) else None


def local_released(records: Mapping[str, PruneRecord]) -> Callable[[Commit], str | None]:
    """graph.closure's ``pruned`` in a local repository: a commit's policy when it has a record."""

    def released(commit: Commit) -> str | None:
        record = records.get(commit.id)
        return None if record is None else record.policy

    return released


def remote_released(records: Mapping[str, PruneRecord], has: Callable[[bytes], bool]) -> Callable[[Commit], str | None]:
    """graph.closure's ``pruned`` on a remote (FORMAT 18.2): a commit's policy when
    its record covers it there: a remote retention record always, a pusher's
    record only while the remote lacks the commit's snapshot (present, it came
    with a whole push of that commit, after the record) or holds it hollow (its
    chunks may be gone). ``has``: the remote store's."""
    hollow = hollow_snapshots(records)

    def released(commit: Commit) -> str | None:
        record = records.get(commit.id)
        if record is None:
            return None
        if record.remote_retention is None:
            tree = bytes.fromhex(commit.tree)
            if tree not in hollow and has(tree):
                return None
        return record.policy

    return released


def hollow_snapshots(records: Mapping[str, PruneRecord]) -> set[bytes]:
    """The snapshots a remote's own retention released (FORMAT 17): present on the
    remote, but their chunks may be gone. A pusher MUST NOT stop its walk at one;
    a remote gc does not keep chunks for one by its presence alone."""
    return {bytes.fromhex(r.remote_retention) for r in records.values() if r.remote_retention is not None}
