"""fsck: verify every stored object against its id, the packs' integrity, the
refs, and that every commit a ref reaches has all its objects."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ckvc import graph, notes
from ckvc.chunking import chunk_spans
from ckvc.core import ProgressCallback, Repository
from ckvc.errors import (
    CkvcError,
    CorruptObjectError,
    InvalidInputError,
    MalformedObjectError,
    ObjectNotFoundError,
    UnsafeContentError,
)
from ckvc.ids import ObjectType
from ckvc.objects import Commit
from ckvc.storage.backend import BackendError
from ckvc.storage.object_store import ObjectStore, StoredObject
from ckvc.storage.packs import TMP_SUFFIX, RecordInfo, pack_key, parse_toc_copy, toc_copy_name

# Problem kinds. "error" severity makes fsck fail; "warning" does not.
MISSING_OBJECT = "missing-object"
BAD_CHECKSUM = "bad-checksum"
DANGLING_REF = "dangling-ref"
DAMAGED_REF = "damaged-ref"
STRAY_REF = "stray-ref"  # a file under refs/ that is no valid ref (e.g. main.lock)
DAMAGED_LOG = "damaged-log"  # a reflog or prune-log line that does not parse
UNFINISHED_PACK = "unfinished-pack"
UNREFERENCED = "unreferenced"
BAD_PACK = "bad-pack"
UNINDEXED_PACK = "unindexed-pack"
MISSING_PACK = "missing-pack"  # indexed, gone from the pack folder (its objects are reported missing)
BAD_TOC_COPY = "bad-toc-copy"  # a remote pack's TOC copy that is not its TOC
ORPHAN_TOC_COPY = "orphan-toc-copy"  # the TOC copy of a pack that is gone (gc deletes it)
# A commit whose state load refuses: its tree or blob table breaks the format's
# rules (state.parse_snapshot, the checks load makes), or a chunk's stored size
# differs from its span. One per commit, naming the path.
BAD_STATE = "bad-state"
BAD_NOTE = "bad-note"  # a note record that does not parse or is not what its name says (ckvc.notes)


@dataclass(frozen=True)
class Problem:
    kind: str
    severity: str  # "error" or "warning"
    object_id: str | None
    detail: str
    # What the damaged object breaks: commit id -> the tensor paths whose bytes
    # need it (itself or as a delta base; empty: the commit's snapshot or the
    # commit itself). Filled for what the graph walk reaches.
    breaks: dict[str, list[str]] = field(default_factory=dict)
    pack: str | None = None  # the pack a pack-level problem is about


@dataclass
class FsckReport:
    objects_checked: int = 0
    bytes_checked: int = 0
    packs_checked: int = 0
    commits_reachable: int = 0
    unreferenced_objects: int = 0
    unreferenced_bytes: int = 0
    # Chunks not held here that a promisor remote's catalog holds (a lazy clone,
    # or what the cache dropped): not damage; fsck --remote checks them there.
    remote_chunks: int = 0
    remote_bytes: int = 0
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


LEVELS = ("refs", "metadata", "full")


def _corruption_kind(exc: CorruptObjectError) -> str:
    """Bytes that match their id but do not parse are what load refuses (bad-state);
    a refetch of the same id cannot repair them, as it can a bad checksum."""
    return BAD_STATE if isinstance(exc, MalformedObjectError) else BAD_CHECKSUM


def _check_toc_copy(store: ObjectStore, name: str, entries: list[RecordInfo], add: Callable[..., None]) -> None:
    """A remote pack's TOC copy must be its TOC: a damaged one only costs readers
    the pack's own, but one that parses and differs would send their reads astray."""
    data = store.backend.get(pack_key(toc_copy_name(name)))
    if data is None:
        return  # deleted since the listing
    parsed = parse_toc_copy(data)
    if parsed is None:
        add(BAD_TOC_COPY, None, f"pack {name}: its TOC copy is damaged (readers use the pack's own TOC)", "warning")
    elif parsed[0] != entries or parsed[1] != store.reader.size(name):
        add(BAD_TOC_COPY, None, f"pack {name}: its TOC copy describes another pack (delete {toc_copy_name(name)})")


def run_fsck(
    repo: Repository,
    *,
    rebuild_index: bool = False,
    level: str = "full",
    sample: float | None = None,
    progress: ProgressCallback | None = None,
) -> FsckReport:
    """Check the repository. Levels, each including the one before:
    "refs" (refs, commit graph), "metadata" (snapshots and tags read and
    verified, every chunk present in the index), "full" (every stored object
    re-read and re-hashed). ``sample`` (0 < f <= 1) re-hashes that random
    fraction of the objects instead of all of them."""
    if level not in LEVELS:
        raise InvalidInputError(f"fsck level must be one of {LEVELS}, got {level!r}")
    if sample is not None and not 0 < sample <= 1:
        raise InvalidInputError(f"sample must be a fraction in (0, 1], got {sample!r}")
    check = _Fsck(repo)
    if rebuild_index:
        repo.store.rebuild_index()
        check.report.rebuilt_index = True
    else:
        repo.store.refresh()
    check.packs()
    if level == "full" or sample is not None:
        check.objects(sample, progress)
    check.graph(data=level != "refs")
    if level != "refs" and check.report.ok:  # only meaningful when the graph walk met no damage
        check.unreferenced()
    check.name_what_breaks()
    return check.report


class _Fsck:
    """One fsck run: its findings (each once) and what the graph walk reached."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self.store = repo.store
        self.report = FsckReport()
        self.seen: set[tuple[str, str | None]] = set()
        self.reachable: set[bytes] = set()
        self.damaged: set[bytes] = set()  # objects whose stored copy failed its read
        # chunk or delta base -> the first damaged or missing object of its delta
        # chain (itself included); absent when the chain is whole
        self.culprit: dict[bytes, bytes] = {}
        self.breaks: dict[str, dict[str, set[str]]] = {}

    def add(
        self, kind: str, object_id: str | None, detail: str, severity: str = "error", pack: str | None = None
    ) -> None:
        if (kind, object_id) in self.seen and object_id is not None:
            return
        self.seen.add((kind, object_id))
        if object_id is not None and severity == "error" and kind in (BAD_CHECKSUM, MISSING_OBJECT):
            self.damaged.add(bytes.fromhex(object_id))
        self.report.problems.append(Problem(kind, severity, object_id, detail, pack=pack))

    def broken(self, culprit: bytes | str, commit: str, path: str | None) -> None:
        name = culprit if isinstance(culprit, str) else culprit.hex()
        paths = self.breaks.setdefault(name, {}).setdefault(commit, set())
        if path is not None:
            paths.add(path)

    def name_what_breaks(self) -> None:
        self.report.problems = [
            replace(p, breaks={c: sorted(paths) for c, paths in sorted(self.breaks[p.object_id].items())})
            if p.object_id in self.breaks
            else p
            for p in self.report.problems
        ]

    def packs(self) -> None:
        """Packs: readable header and table of contents; every pack indexed."""
        store, add = self.store, self.add
        indexed = store.index.indexed_packs()
        listing = store.pack_listing()
        for name in listing.packs:
            self.report.packs_checked += 1
            try:
                toc, from_toc = store.pack_entries(name)
                if not from_toc:
                    detail = f"pack {name}: table of contents damaged (records recovered by scanning)"
                    add(BAD_PACK, None, detail, pack=name)
                elif name in listing.copied:
                    _check_toc_copy(store, name, toc, add)
            except BackendError:
                raise  # the store did not answer (denied, unreachable): an error, not damage
            except CkvcError as exc:
                add(BAD_PACK, None, f"pack {name}: {exc}", pack=name)
            if name not in indexed:
                add(UNINDEXED_PACK, None, f"pack {name} is not in the index", "warning")
        for name in sorted(indexed - set(listing.packs)):
            store.reader.forget(name)  # an open handle would still read a deleted file
            add(MISSING_PACK, None, f"pack {name} is in the index but gone from the pack folder", pack=name)
        for key in listing.orphan_copies:
            add(
                ORPHAN_TOC_COPY, None, f"{key}: the TOC copy of a pack that is gone (the next gc deletes it)", "warning"
            )
        for tmp in sorted(t.key.rpartition("/")[2] for t in store.temporaries() if t.key.endswith(TMP_SUFFIX)):
            add(UNFINISHED_PACK, None, f"{tmp}: being written, or left by a writer that died", "warning")

    def objects(self, sample: float | None, progress: ProgressCallback | None) -> None:
        """Stored objects: read, decode, re-hash (all, or a random sample)."""
        store, report = self.store, self.report
        entries = list(store.iter_stored())
        if sample is not None:
            entries = random.sample(entries, max(1, round(len(entries) * sample))) if entries else []
        total = sum(e.stored_size for e in entries)
        done = 0

        def check(oid: bytes) -> CorruptObjectError | ObjectNotFoundError | None:
            try:
                store.verify(oid)
            except (CorruptObjectError, ObjectNotFoundError) as exc:
                return exc
            return None

        def record(stored: StoredObject, err: CorruptObjectError | ObjectNotFoundError | None) -> None:
            nonlocal done
            report.objects_checked += 1
            report.bytes_checked += stored.stored_size
            done += stored.stored_size
            if err is not None:
                kind = MISSING_OBJECT if isinstance(err, ObjectNotFoundError) else _corruption_kind(err)
                self.add(kind, stored.oid.hex(), str(err))
            if progress is not None:
                progress(done, total)

        with self.repo.executor.window() as window:
            for stored in entries:
                window.submit(check, stored.oid, then=functools.partial(record, stored))

    def _promised(self, oid: bytes) -> bool:
        """Absent here but held by a promisor remote: counted, not a problem."""
        size = self.store.promised_size(oid)
        if size is None:
            return False
        self.report.remote_chunks += 1
        self.report.remote_bytes += size[1]
        return True

    def _chain(self, chunk: bytes, where: str) -> bytes | None:
        """Walk the delta chain below ``chunk`` (a delta or lossy residual needs its
        base: present, and reachable too) and return its first damaged or missing
        object, remembered for each object on the way."""
        walked = [chunk]
        culprit: bytes | None = None
        current = chunk
        while culprit is None:
            if current in self.damaged:
                culprit = current
                break
            try:
                base = self.store.base_info(current).base
            except (CorruptObjectError, ObjectNotFoundError) as exc:
                self.add(BAD_CHECKSUM, current.hex(), f"chunk of {where}: {exc}")
                culprit = current
                break
            if base is None:
                break
            if base in self.reachable:
                culprit = self.culprit.get(base)
                break
            self.reachable.add(base)
            if not self.store.has(base):
                if not self._promised(base):
                    self.add(MISSING_OBJECT, base.hex(), f"delta base of chunk {current.hex()} ({where}) is missing")
                    culprit = base
                break
            walked.append(base)
            current = base
        if culprit is not None:
            self.culprit.update(dict.fromkeys(walked, culprit))
        return culprit

    def graph(self, *, data: bool) -> None:
        """Refs and the commit graph; with ``data`` ("metadata" and "full"), each
        unpruned commit's snapshot and every chunk it needs, delta bases included."""
        repo, store, add = self.repo, self.store, self.add
        damaged_refs: list[str] = []
        tips = graph.ref_tips(repo, include_reflogs=False, damaged=damaged_refs)
        for detail in damaged_refs:
            add(DAMAGED_REF, None, detail)
        # Skipped by every other command with a warning; listed here (gc keeps what they name).
        for stray in repo.refs.stray_refs():
            add(STRAY_REF, stray.value, f"{stray.path}: {stray.problem}", "warning")
        log_damage: list[str] = []
        repo.prune_log.records(damaged=log_damage)
        for detail in [*repo.refs.damaged_logs(), *log_damage]:
            add(DAMAGED_LOG, None, detail, "warning")
        for detail in notes.damaged_notes(repo):  # readers skip them with a warning
            add(BAD_NOTE, None, detail)
        for label, oid in tips.items():
            if not store.has(bytes.fromhex(oid)):
                add(DANGLING_REF, oid, f"{label} points at missing object {oid}")
        pruned = repo.pruned()
        for reached in graph.walk(repo, tips.values()):
            oid = reached.oid
            if isinstance(reached.error, ObjectNotFoundError):
                add(MISSING_OBJECT, oid, f"commit {oid} is missing: {reached.error}")
                self.broken(oid, oid, None)
                continue
            self.reachable.add(bytes.fromhex(oid))
            if reached.error is not None:
                add(_corruption_kind(reached.error), oid, str(reached.error))
                self.broken(oid, oid, None)
                continue
            commit = reached.commit
            if commit is None:
                continue  # a tag object; the walk follows it to its commit
            self.report.commits_reachable += 1
            if data and oid not in pruned:  # a pruned commit keeps only its commit object
                self._snapshot(commit)

    def _snapshot(self, commit: Commit) -> None:
        add, oid = self.add, commit.id
        self.reachable.add(bytes.fromhex(commit.tree))
        try:
            snapshot = self.repo.read_snapshot(commit)
        except ObjectNotFoundError:
            add(MISSING_OBJECT, commit.tree, f"snapshot {commit.tree} of commit {oid} is missing")
            self.broken(commit.tree, oid, None)
            return
        except CorruptObjectError as exc:
            add(_corruption_kind(exc), commit.tree, str(exc))
            self.broken(commit.tree, oid, None)
            return
        try:
            # Never unpickles. A commit that does not declare pickles must hold none:
            # load refuses such a tree (UnsafeContentError), so fsck calls it damage.
            from ckvc import state as state_mod  # torch: only once there is a tree to parse

            state_mod.parse_snapshot(snapshot, oid, allow_pickle=None if commit.pickled else False)
        except CorruptObjectError as exc:
            add(BAD_STATE, oid, str(exc))
        except UnsafeContentError:
            add(BAD_STATE, oid, f"commit {oid} holds pickled values but does not declare them")
        for blob in snapshot.blobs:
            for chunk, (start, end) in zip(blob.chunks, chunk_spans(blob.nbytes, blob.chunk_size), strict=True):
                entry = self.store.index.get(chunk)
                if entry is not None and (entry.raw_size != end - start or entry.kind != ObjectType.CHUNK):
                    what = (
                        f"{entry.raw_size} bytes"
                        if entry.kind == ObjectType.CHUNK
                        else f"an object of type {entry.kind}"
                    )
                    add(
                        BAD_STATE,
                        oid,
                        f"chunk {chunk.hex()} at bytes {start}-{end} of tensor {blob.path!r} is {what} (commit {oid})",
                    )
                if chunk not in self.reachable:
                    self.reachable.add(chunk)
                    if entry is None and not self._promised(chunk):
                        add(MISSING_OBJECT, chunk.hex(), f"chunk of tensor {blob.path!r} in commit {oid} is missing")
                        self.culprit[chunk] = chunk
                    elif entry is not None:
                        self._chain(chunk, f"tensor {blob.path!r} in commit {oid}")
                culprit = self.culprit.get(chunk)
                if culprit is not None:
                    self.broken(culprit, oid, blob.path)

    def unreferenced(self) -> None:
        """Objects nothing reaches (released by retention, or left by crashes): gc reclaims them."""
        count, size = 0, 0
        for stored in self.store.iter_stored():
            if stored.oid not in self.reachable:
                count += 1
                size += stored.stored_size
        self.report.unreferenced_objects, self.report.unreferenced_bytes = count, size
        if count:
            self.add(
                UNREFERENCED,
                None,
                f"{count} objects ({size} bytes) are unreferenced (no branch, tag or HEAD reaches them); "
                "`ckvc gc` frees those no reflog entry names (entries live reflog_expiry) once their pack is "
                "older than gc_grace; `ckvc gc --now` skips the grace period",
                "warning",
            )
