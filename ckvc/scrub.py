"""Scrub: verification that covers everything over time, a little at a time.

Each run re-reads and re-hashes the records of the packs this cycle has not yet
verified, those verified longest ago first, until its budget (bytes or seconds) is
spent; when every pack has been verified once, the cycle is complete and the next
run starts a new one (restic's ``check --read-data-subset``, ZFS's scrub). The
record of what was verified, when, and any damage found is a small JSON file
(``scrub.json`` in the repository directory, or ``remotes/<name>/scrub.json`` for a
remote's packs), saved after every pack, so a killed scrub loses at most the pack it
was reading. A scrub repairs nothing: damage is reported (exit 1, as fsck) and kept
in the record until a later cycle reads the pack clean (``ckvc fsck --repair``
restores from a remote).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckvc.errors import CorruptObjectError, InvalidInputError, ObjectNotFoundError
from ckvc.storage.backend import BackendError
from ckvc.storage.durable import write_atomic
from ckvc.storage.object_store import ObjectStore

SCRUB_FILE = "scrub.json"


@dataclass
class ScrubState:
    cycle: int = 1
    cycle_started_ns: int = 0
    verified: dict[str, int] = field(default_factory=dict)  # pack -> when this cycle verified it
    last_verified: dict[str, int] = field(default_factory=dict)  # pack -> when any cycle last verified it
    damage: dict[str, str] = field(default_factory=dict)  # pack -> what was wrong, until read clean
    last_complete: dict[str, Any] | None = None  # {"cycle", "started_ns", "finished_ns", "packs", "bytes"}
    cycle_bytes: int = 0

    @classmethod
    def load(cls, path: Path) -> ScrubState:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            raise InvalidInputError(f"{path} is not readable JSON ({exc}); delete it to start a new cycle") from None
        if not isinstance(data, dict) or set(data) - set(cls.__dataclass_fields__):
            raise InvalidInputError(f"{path} is not a scrub record; delete it to start a new cycle")
        state = cls(**data)
        maps = (state.verified, state.last_verified, state.damage)
        if (
            any(not isinstance(m, dict) for m in maps)
            or not all(isinstance(v, int) for m in maps[:2] for v in m.values())
            or not all(isinstance(v, str) for v in state.damage.values())
            or not isinstance(state.cycle, int) or not isinstance(state.cycle_started_ns, int)
            or not isinstance(state.cycle_bytes, int)
            or not (state.last_complete is None or isinstance(state.last_complete, dict))
        ):  # fmt: skip
            raise InvalidInputError(f"{path} is not a scrub record; delete it to start a new cycle")
        return state

    def save(self, path: Path) -> None:
        write_atomic(path, (json.dumps(asdict(self), sort_keys=True, indent=1) + "\n").encode())


@dataclass
class ScrubReport:
    cycle: int
    packs_verified: list[str] = field(default_factory=list)
    bytes_verified: int = 0
    objects_verified: int = 0
    damage: dict[str, str] = field(default_factory=dict)  # found by this run
    cycle_complete: bool = False  # this run finished its cycle
    coverage: float = 0.0  # of the current cycle's packs, verified (after this run)
    packs_total: int = 0
    seconds: float = 0.0
    last_complete: dict[str, Any] | None = None
    known_damage: dict[str, str] = field(default_factory=dict)  # every pack the record says is damaged

    @property
    def ok(self) -> bool:
        return not self.known_damage

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _verify_pack(store: ObjectStore, name: str) -> tuple[int, str | None]:
    """Re-read and re-hash every record of pack ``name`` the index places there:
    (objects verified, the first damage or None)."""
    try:
        entries, from_toc = store.pack_entries(name)
    except BackendError:
        raise
    except (CorruptObjectError, ObjectNotFoundError, ValueError) as exc:
        return 0, f"its table of contents cannot be read: {exc}"
    problem = None if from_toc else "table of contents damaged (records recovered by scanning)"
    count = 0
    for entry in entries:
        located = store.index.get(entry.oid)
        if located is None or located.pack != name:
            continue  # a copy another pack serves: verified with that pack
        try:
            store.verify(entry.oid)
        except (CorruptObjectError, ObjectNotFoundError) as exc:
            problem = problem or str(exc)
        count += 1
    return count, problem


def scrub(
    store: ObjectStore,
    state_path: Path,
    *,
    max_bytes: int | None = None,
    max_seconds: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    now_ns: Callable[[], int] = time.time_ns,
    progress: Callable[[int, int], None] | None = None,
) -> ScrubReport:
    """Verify the packs this cycle has not, longest unverified first, until ``max_bytes``
    (a pack that crosses it is finished) or ``max_seconds`` (checked between packs) is
    spent; neither: the rest of the cycle. The record is saved after every pack."""
    if max_bytes is not None and max_bytes <= 0:
        raise InvalidInputError(f"a scrub's byte budget must be positive, got {max_bytes}")
    if max_seconds is not None and max_seconds <= 0:
        raise InvalidInputError(f"a scrub's time budget must be positive, got {max_seconds}")
    started = clock()
    state = ScrubState.load(state_path)
    listing = store.pack_listing(sizes=True)
    sizes = listing.sizes
    live = set(listing.packs)
    for gone in [p for p in {*state.verified, *state.last_verified, *state.damage} if p not in live]:
        state.verified.pop(gone, None)  # gc deleted it: nothing left to verify
        state.last_verified.pop(gone, None)
        state.damage.pop(gone, None)
    if not state.cycle_started_ns:
        state.cycle_started_ns = now_ns()
    report = ScrubReport(cycle=state.cycle)
    pending = sorted((p for p in live if p not in state.verified), key=lambda p: (state.last_verified.get(p, 0), p))
    total = sum(sizes.get(p, 0) for p in pending)
    for name in pending:
        if max_bytes is not None and report.bytes_verified >= max_bytes:
            break
        if max_seconds is not None and clock() - started >= max_seconds:
            break
        with store.pin():  # a gc cannot delete the pack while it is read
            count, problem = _verify_pack(store, name)
            if problem is not None and store.pack_info(name) is None:
                continue  # gone before the pin: a gc took it, nothing was damaged
        when = now_ns()
        state.verified[name] = state.last_verified[name] = when
        size = sizes.get(name, 0)
        state.cycle_bytes += size
        if problem is None:
            state.damage.pop(name, None)
        else:
            state.damage[name] = report.damage[name] = problem
        report.packs_verified.append(name)
        report.bytes_verified += size
        report.objects_verified += count
        state.save(state_path)  # a kill loses at most the pack being read
        if progress is not None:
            progress(report.bytes_verified, total)
    if live and all(p in state.verified for p in live):
        report.cycle_complete = True
        state.last_complete = {
            "cycle": state.cycle,
            "started_ns": state.cycle_started_ns,
            "finished_ns": now_ns(),
            "packs": len(live),
            "bytes": state.cycle_bytes,
            "damaged_packs": sorted(state.damage),
        }
        state = ScrubState(
            cycle=state.cycle + 1, last_verified=state.last_verified, damage=state.damage,
            last_complete=state.last_complete,
        )  # fmt: skip
        state.save(state_path)
        report.coverage = 1.0
    else:
        report.coverage = len([p for p in live if p in state.verified]) / len(live) if live else 1.0
    report.packs_total = len(live)
    report.last_complete = state.last_complete
    report.known_damage = dict(state.damage)
    report.seconds = clock() - started
    return report


def scrub_status(state_path: Path, packs: int | None = None) -> dict[str, Any]:
    """What status, stats and the web UI show: the last complete cycle, the current
    one's coverage (of ``packs`` when known) and the damage on record."""
    state = ScrubState.load(state_path)
    verified = len(state.verified)
    return {
        "cycle": state.cycle,
        "verified_packs": verified,
        "coverage": (verified / packs if packs else None),
        "last_complete": state.last_complete,
        "damage": dict(state.damage),
    }
