"""The prune log: which commits a retention policy released, by which policy, when.

``.ckvc/pruned.jsonl`` holds one JSON object per line:
``{"commit": "<64 hex>", "policy": "<description>", "time_ns": <int>}``. It is
append-only and fsynced; a torn last line (crash mid-append) is ignored, and a
damaged line is skipped with a warning (fsck lists it). A
commit listed here keeps its commit object (history, metrics) while gc releases
its snapshot and chunks. Pruning is never undone.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ckvc.errors import DamageWarning, storage_errors
from ckvc.ids import is_full_hex_id
from ckvc.storage.files import append_durable, file_lock, looks_torn, read_log_lines

PRUNE_LOG = "pruned.jsonl"


@dataclass(frozen=True)
class PruneRecord:
    commit: str
    policy: str
    time_ns: int


class PruneLog:
    def __init__(self, root: Path) -> None:
        self.path = root / PRUNE_LOG
        self._lock = root / "pruned.lock"

    def records(self, *, damaged: list[str] | None = None) -> dict[str, PruneRecord]:
        """Pruned commit id -> its first prune record. Lines that do not parse are
        skipped (torn ones silently; others with a warning, or listed in
        ``damaged`` when given). Skipping is the safe direction: a commit whose
        record is lost counts as not pruned, so gc keeps its data."""
        lines = read_log_lines(self.path)
        out: dict[str, PruneRecord] = {}
        bad: list[str] = []
        for number, line in enumerate(lines, 1):
            record = _parse(line)
            if record is None:
                if not looks_torn(line):
                    bad.append(f"{PRUNE_LOG} line {number}: not a prune record")
                continue
            out.setdefault(record.commit, record)
        if bad:
            if damaged is not None:
                damaged.extend(bad)
            else:
                warnings.warn(DamageWarning(f"skipped {len(bad)} damaged line(s) in {PRUNE_LOG}"), stacklevel=2)
        return out

    def add(self, commits: Iterable[str], policy: str) -> int:
        """Record ``commits`` as pruned (those not pruned already). Returns how many."""
        with storage_errors("writing the prune log", "no commit was marked as pruned"), file_lock(self._lock):
            known = self.records()
            now = time.time_ns()
            lines = [
                json.dumps({"commit": c, "policy": policy, "time_ns": now}, sort_keys=True) + "\n"
                for c in dict.fromkeys(commits)
                if c not in known
            ]
            if lines:
                append_durable(self.path, "".join(lines).encode())
            return len(lines)


def _parse(line: bytes) -> PruneRecord | None:
    try:
        d = json.loads(line.decode("utf-8"))
        record = PruneRecord(str(d["commit"]), str(d["policy"]), int(d["time_ns"]))
    except (ValueError, KeyError, TypeError):
        return None
    return record if is_full_hex_id(record.commit) else None
