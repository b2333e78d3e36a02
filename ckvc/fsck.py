"""fsck: verify every stored object against its id, the packs' integrity, the
refs, and that every commit a ref reaches has all its objects."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ckvc.errors import CkvcError, CorruptObjectError, ObjectNotFoundError
from ckvc.ids import ObjectType
from ckvc.objects import Commit
from ckvc.storage.packs import TMP_SUFFIX, list_packs, pack_entries

if TYPE_CHECKING:
    from ckvc.repo import ProgressCallback, Repo

# Problem kinds. "error" severity makes fsck fail; "warning" does not.
MISSING_OBJECT = "missing-object"
BAD_CHECKSUM = "bad-checksum"
DANGLING_REF = "dangling-ref"
DAMAGED_REF = "damaged-ref"
UNFINISHED_PACK = "unfinished-pack"
BAD_PACK = "bad-pack"
UNINDEXED_PACK = "unindexed-pack"


@dataclass(frozen=True)
class Problem:
    kind: str
    severity: str  # "error" or "warning"
    object_id: str | None
    detail: str


@dataclass
class FsckReport:
    objects_checked: int = 0
    bytes_checked: int = 0
    packs_checked: int = 0
    commits_reachable: int = 0
    rebuilt_index: bool = False
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    def damaged_objects(self) -> list[str]:
        return sorted({p.object_id for p in self.problems if p.object_id and p.severity == "error"})

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def run_fsck(repo: Repo, *, rebuild_index: bool = False, progress: ProgressCallback | None = None) -> FsckReport:
    report = FsckReport()
    store = repo.store
    if rebuild_index:
        store.rebuild_index()
        report.rebuilt_index = True
    else:
        store.refresh()
    seen: set[tuple[str, str | None]] = set()

    def add(kind: str, object_id: str | None, detail: str, severity: str = "error") -> None:
        if (kind, object_id) in seen and object_id is not None:
            return
        seen.add((kind, object_id))
        report.problems.append(Problem(kind, severity, object_id, detail))

    # 1. Packs: readable header and table of contents; every pack indexed.
    indexed = store.index.indexed_packs()
    for name in list_packs(store.pack_dir):
        report.packs_checked += 1
        try:
            _, from_toc = pack_entries(store.reader.fd(name), name)
            if not from_toc:
                add(BAD_PACK, None, f"pack {name}: table of contents damaged (records recovered by scanning)")
        except CkvcError as exc:
            add(BAD_PACK, None, f"pack {name}: {exc}")
        if name not in indexed:
            add(UNINDEXED_PACK, None, f"pack {name} is not in the index", "warning")
    for tmp in sorted(p.name for p in store.pack_dir.iterdir() if p.name.endswith(TMP_SUFFIX)):
        add(UNFINISHED_PACK, None, f"{tmp}: being written, or left by a writer that died", "warning")

    # 2. Every indexed object: read, decode, re-hash.
    entries = list(store.iter_stored())
    total = sum(e.stored_size for e in entries)
    done = 0

    def check(oid: bytes) -> str | None:
        try:
            store.verify(oid)
        except (CorruptObjectError, ObjectNotFoundError) as exc:
            return str(exc)
        return None

    workers = repo.pool
    window = 4 * (os.cpu_count() or 2)
    for i in range(0, len(entries), window):
        batch = entries[i : i + window]
        for stored, err in zip(batch, workers.map(lambda s: check(s.oid), batch), strict=True):
            report.objects_checked += 1
            report.bytes_checked += stored.stored_size
            done += stored.stored_size
            if err is not None:
                kind = MISSING_OBJECT if "missing" in err or "not found" in err else BAD_CHECKSUM
                add(kind, stored.oid.hex(), err)
        if progress is not None:
            progress(done, total)

    # 3. Refs and connectivity: every reachable commit, snapshot and chunk exists.
    damaged_refs: list[str] = []
    tips = repo.ref_tips(include_reflogs=False, damaged=damaged_refs)
    for detail in damaged_refs:
        add(DAMAGED_REF, None, detail)
    stack = list(dict.fromkeys(tips.values()))
    for label, oid in tips.items():
        if not store.has(bytes.fromhex(oid)):
            add(DANGLING_REF, oid, f"{label} points at missing object {oid}")
    visited: set[str] = set()
    while stack:
        oid = stack.pop()
        if oid in visited:
            continue
        visited.add(oid)
        raw_id = bytes.fromhex(oid)
        if not store.has(raw_id):
            add(MISSING_OBJECT, oid, f"commit {oid} is missing")
            continue
        try:
            if store.stat(raw_id).kind == ObjectType.TAG:
                stack.append(repo.read_tag(oid).target)
                continue
            commit: Commit = repo.read_commit(oid)
        except ObjectNotFoundError as exc:
            add(MISSING_OBJECT, oid, str(exc))
            continue
        except CorruptObjectError as exc:
            add(BAD_CHECKSUM, oid, str(exc))
            continue
        report.commits_reachable += 1
        stack.extend(commit.parents)
        try:
            snapshot = repo.read_snapshot(commit)
        except ObjectNotFoundError:
            add(MISSING_OBJECT, commit.tree, f"snapshot {commit.tree} of commit {oid} is missing")
            continue
        except CorruptObjectError as exc:
            add(BAD_CHECKSUM, commit.tree, str(exc))
            continue
        for blob in snapshot.blobs:
            for chunk in blob.chunks:
                if not store.has(chunk):
                    add(MISSING_OBJECT, chunk.hex(), f"chunk of tensor {blob.path!r} in commit {oid} is missing")
    return report
