"""The prune log: which commits a retention policy released, by which policy, when.

``.ckvc/pruned.jsonl`` holds one JSON object per line:
``{"commit": "<64 hex>", "policy": "<description>", "time_ns": <int>}``. It is
append-only and fsynced; a torn last line (crash mid-append) is ignored. A
commit listed here keeps its commit object (history, metrics) while gc releases
its snapshot and chunks. Pruning is never undone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ckvc.ids import is_full_hex_id
from ckvc.storage.files import append_durable, file_lock

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

    def records(self) -> dict[str, PruneRecord]:
        """Pruned commit id -> its first prune record."""
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return {}
        out: dict[str, PruneRecord] = {}
        for line in lines:
            try:
                d = json.loads(line)
                record = PruneRecord(str(d["commit"]), str(d["policy"]), int(d["time_ns"]))
            except (ValueError, KeyError, TypeError):
                continue
            if is_full_hex_id(record.commit):
                out.setdefault(record.commit, record)
        return out

    def add(self, commits: Iterable[str], policy: str) -> int:
        """Record ``commits`` as pruned (those not pruned already). Returns how many."""
        with file_lock(self._lock):
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
