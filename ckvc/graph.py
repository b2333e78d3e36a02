"""The commit graph over a Repository: revisions (ids, prefixes, refs, ``~n``,
``^n``), reachability (ref tips, walks), history (log, topological log, best and
rank by a metric), the checks every read makes (pruned, pickles), and moving
refs by name (branches, tags, HEAD)."""

from __future__ import annotations

import collections
import difflib
import heapq
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ckvc import notes, signing
from ckvc.core import Repository, check_utf8, default_author
from ckvc.errors import (
    CkvcError,
    CorruptObjectError,
    InvalidInputError,
    InvalidRevisionError,
    ObjectNotFoundError,
    PrunedCommitError,
    RefConflictError,
    RefNotFoundError,
    UnsafeContentError,
    storage_errors,
)
from ckvc.ids import ObjectType, is_full_hex_id
from ckvc.objects import Commit, Snapshot, Tag
from ckvc.refs import BRANCH_PREFIX, HEAD, TAG_PREFIX, ReflogEntry, branch_ref, check_ref_name, tag_ref

MIN_PREFIX = 4
_SUFFIX = re.compile(r"(~(\d*)|\^(\d*))")


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """ "; did you mean 'main'?" when a candidate is close to ``word``, else ""."""
    close = difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.6)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"


# ---- refs by name ---------------------------------------------------------------


def head(core: Repository) -> tuple[str | None, str | None]:
    """(current branch name or None when detached, commit id or None when unborn)."""
    target, commit_id = core.refs.head()
    short = target[len(BRANCH_PREFIX) :] if target and target.startswith(BRANCH_PREFIX) else target
    return short, commit_id


def branches(core: Repository) -> dict[str, str]:
    return {k[len(BRANCH_PREFIX) :]: v for k, v in core.refs.list_refs(BRANCH_PREFIX).items()}


def tags(core: Repository) -> dict[str, str]:
    """Tag name -> commit id (annotated tags peeled)."""
    return {k[len(TAG_PREFIX) :]: peel(core, v) for k, v in core.refs.list_refs(TAG_PREFIX).items()}


def branch_named(core: Repository, rev: str) -> str | None:
    """The full branch ref ``rev`` names exactly, if it is a branch name."""
    candidates = [rev] if rev.startswith(BRANCH_PREFIX) else [BRANCH_PREFIX + rev]
    for full in candidates:
        try:
            check_ref_name(full)
        except CkvcError:
            return None
        if core.refs.read(full) is not None:
            return full
    return None


def ref_hint(core: Repository, name: str, *, branches: bool = True, tags: bool = True) -> str:
    """A did-you-mean suffix for an unknown revision or ref, from branch and tag names."""
    try:
        names = [*(_branches(core) if branches else ()), *(_tags(core) if tags else ())]
    except CkvcError:
        return ""  # a damaged ref must not hide the original error
    return did_you_mean(name, names)


_branches, _tags = branches, tags  # ref_hint's keyword arguments shadow the names


# ---- revisions ------------------------------------------------------------------


def resolve(core: Repository, rev: str) -> str:
    """The full commit id ``rev`` names: an id or unique id prefix, a branch,
    a tag, HEAD, or any of those followed by ``~n``, ``^`` and ``^n``."""
    if not isinstance(rev, str) or not rev:
        raise InvalidRevisionError(f"invalid revision {rev!r}")
    match = re.search(r"[~^]", rev)
    base, suffix = (rev[: match.start()], rev[match.start() :]) if match else (rev, "")
    commit_id = _resolve_base(core, rev, base)
    pos = 0
    while pos < len(suffix):
        m = _SUFFIX.match(suffix, pos)
        if m is None:
            raise InvalidRevisionError(f"invalid revision {rev!r}: cannot parse {suffix[pos:]!r}")
        pos = m.end()
        if m.group(0).startswith("~"):
            for _ in range(int(m.group(2) or 1)):
                parents = core.read_commit(commit_id).parents
                if not parents:
                    raise InvalidRevisionError(f"revision {rev!r} goes past the root commit")
                commit_id = parents[0]
        else:
            n = int(m.group(3) or 1)
            if n == 0:
                continue
            parents = core.read_commit(commit_id).parents
            if n > len(parents):
                raise InvalidRevisionError(f"revision {rev!r}: commit {commit_id[:12]} has no parent {n}")
            commit_id = parents[n - 1]
    return commit_id


def _resolve_base(core: Repository, rev: str, base: str) -> str:
    if base == HEAD:
        _, commit_id = core.refs.head()
        if commit_id is None:
            raise InvalidRevisionError(f"revision {rev!r}: HEAD has no commits yet")
        return commit_id
    if is_full_hex_id(base):
        return _peel_checked(core, rev, base)
    candidates = (
        [base]
        if base.startswith("refs/")
        else [BRANCH_PREFIX + base, TAG_PREFIX + base, "refs/" + base, "refs/remotes/" + base]  # origin/main
    )
    for full in candidates:
        try:
            check_ref_name(full)
        except CkvcError:
            continue
        value = core.refs.read(full)
        if value is not None:
            return _peel_checked(core, rev, value)
    if len(base) >= MIN_PREFIX and re.fullmatch(r"[0-9a-f]+", base):
        return _resolve_prefix(core, rev, base)
    raise InvalidRevisionError(f"unknown revision {rev!r}{ref_hint(core, base)}")


def _resolve_prefix(core: Repository, rev: str, prefix: str) -> str:
    key = bytes.fromhex(prefix[: len(prefix) // 2 * 2])
    matches: list[str] = []
    for attempt in range(2):
        matches = [
            s.oid.hex()
            for s in core.store.iter_stored(key)
            if s.oid.hex().startswith(prefix) and s.kind in (ObjectType.COMMIT, ObjectType.TAG)
        ]
        if matches or attempt or not core.store.refresh():
            break
    if not matches:
        raise InvalidRevisionError(f"unknown revision {rev!r}")
    commits = {peel(core, m) for m in matches}
    if len(commits) > 1:
        raise InvalidRevisionError(f"ambiguous revision {rev!r}: matches {len(commits)} commits")
    return commits.pop()


def peel(core: Repository, oid: str) -> str:
    """A tag object id -> its commit id; a commit id stays itself."""
    kind = core.store.stat(bytes.fromhex(oid)).kind
    if kind == ObjectType.TAG:
        return core.read_tag(oid).target
    return oid


def _peel_checked(core: Repository, rev: str, oid: str) -> str:
    try:
        kind = core.store.stat(bytes.fromhex(oid)).kind
    except ObjectNotFoundError:
        raise InvalidRevisionError(f"unknown revision {rev!r}") from None
    if kind == ObjectType.TAG:
        return core.read_tag(oid).target
    if kind != ObjectType.COMMIT:
        raise InvalidRevisionError(f"revision {rev!r} names a {kind.name.lower()}, not a commit")
    return oid


# ---- what a read refuses --------------------------------------------------------


def check_not_pruned(core: Repository, commit_id: str) -> None:
    record = core.pruned().get(commit_id)
    if record is not None:
        raise PrunedCommitError(commit_id, record.policy, record.time_ns)


def readable_commit(
    core: Repository, rev: str, *, allow_pickle: bool = False, verify_signatures: bool | None = None
) -> Commit:
    """The commit ``rev`` names, refused as every read refuses it: not signed by a
    trusted key under ``require_signatures`` (SignatureError; ``verify_signatures``
    True checks regardless, False skips with a warning), pruned
    (PrunedCommitError), or holding pickles unless allowed (UnsafeContentError)."""
    commit_id = resolve(core, rev)
    signing.require_signed(core, commit_id, verify_signatures=verify_signatures)
    commit = core.read_commit(commit_id)
    check_not_pruned(core, commit.id)
    if commit.pickled and not allow_pickle:
        raise UnsafeContentError(
            f"commit {commit.id[:12]} holds pickled values, which can run code; "
            "load with allow_pickle=True only if you trust it"
        )
    return commit


# ---- reachability ---------------------------------------------------------------


@dataclass(frozen=True)
class Reached:
    """An object met by ``walk``: a commit, a tag object (``commit`` None), or
    an object that could not be read (``error``)."""

    oid: str
    commit: Commit | None = None
    error: ObjectNotFoundError | CorruptObjectError | None = None


def ref_tips(core: Repository, *, include_reflogs: bool = True, damaged: list[str] | None = None) -> dict[str, str]:
    """Every commit a ref, HEAD or (optionally) a reflog names: label -> commit id.
    Damaged refs raise RefNotFoundError, or are listed in ``damaged`` when given."""
    tips: dict[str, str] = dict(core.refs.list_refs(damaged=damaged))
    try:
        _, head_id = core.refs.head()
        if head_id:
            tips[HEAD] = head_id
    except RefNotFoundError as exc:
        if damaged is None:
            raise
        damaged.append(str(exc))
    if include_reflogs:
        for i, oid in enumerate(dict.fromkeys(core.refs.iter_reflog_ids())):
            tips.setdefault(f"reflog:{i}", oid)
    return tips


def walk(core: Repository, tips: Iterable[str], visited: set[str] | None = None) -> Iterator[Reached]:
    """Every commit and tag object reachable from ``tips``, once each (tags
    peeled, all parents followed). An object that cannot be read is yielded
    with its error and not followed: the caller decides whether that is fatal
    (gc), a finding (fsck) or to be skipped. Ids in ``visited`` are not
    walked; every id met is added to it."""
    return _walk(StoredObjects(core), tips, visited)


def _walk(
    source: ObjectSource,
    tips: Iterable[str],
    visited: set[str] | None = None,
    *,
    have: Callable[[bytes], bool] = lambda oid: False,
    history: bool = True,
) -> Iterator[Reached]:
    """:func:`walk` over any source, stopping at what ``have`` holds; without
    ``history`` the commits themselves (tags still peeled), no parents."""
    visited = set() if visited is None else visited
    stack = list(tips)
    while stack:
        oid = stack.pop()
        if oid in visited:
            continue
        visited.add(oid)
        raw = bytes.fromhex(oid)
        if have(raw):
            continue
        try:
            if source.kind(raw) == ObjectType.TAG:
                stack.append(source.read_tag(raw).target)
                yield Reached(oid)
                continue
            commit = source.read_commit(raw)
        except (ObjectNotFoundError, CorruptObjectError) as exc:
            yield Reached(oid, error=exc)
            continue
        if history:
            stack.extend(commit.parents)
        yield Reached(oid, commit)


def iter_reachable_commits(core: Repository, tips: Mapping[str, str]) -> Iterator[Commit]:
    """Each readable commit reachable from ``tips`` once (tags peeled)."""
    for reached in walk(core, tips.values()):
        if reached.commit is not None:
            yield reached.commit


# ---- closure ---------------------------------------------------------------------


class ObjectSource(Protocol):
    """Where :func:`closure` reads objects: this repository's store
    (:class:`StoredObjects`), or a remote's records verified on the way (fetch)."""

    def kind(self, oid: bytes) -> ObjectType: ...

    def read_tag(self, oid: bytes) -> Tag: ...

    def read_commit(self, oid: bytes) -> Commit: ...

    def read_snapshot(self, oid: bytes) -> Snapshot: ...

    def delta_base(self, oid: bytes) -> bytes | None: ...


class StoredObjects:
    """A repository's own objects as an :class:`ObjectSource`."""

    def __init__(self, core: Repository) -> None:
        self.core = core

    def kind(self, oid: bytes) -> ObjectType:
        return ObjectType(self.core.store.stat(oid).kind)

    def read_tag(self, oid: bytes) -> Tag:
        return self.core.read_tag(oid.hex())

    def read_commit(self, oid: bytes) -> Commit:
        return self.core.read_commit(oid.hex())

    def read_snapshot(self, oid: bytes) -> Snapshot:
        return Snapshot.decode(self.core.store.read(oid, ObjectType.SNAPSHOT))

    def delta_base(self, oid: bytes) -> bytes | None:
        return self.core.store.delta_base(oid)  # a whole chunk: its index entry alone says so


@dataclass
class Closure:
    """What a set of wanted objects needs that the "have" side lacks, in the order
    the walk met it (a commit before its parents, a snapshot right after its commit)."""

    tags: list[bytes] = field(default_factory=list)
    commits: list[bytes] = field(default_factory=list)
    parents: dict[bytes, tuple[bytes, ...]] = field(default_factory=dict)
    snapshots: list[bytes] = field(default_factory=list)
    chunks: dict[bytes, int] = field(default_factory=dict)  # id -> delta links down to a whole record or one had
    pruned: dict[str, list[str]] = field(default_factory=dict)  # policy -> commits met without their data

    def ids(self) -> set[bytes]:
        return {*self.tags, *self.commits, *self.snapshots, *self.chunks}


OnUnreadable = Callable[[str, ObjectType, "ObjectNotFoundError | CorruptObjectError"], None]


def _raise(oid: str, role: ObjectType, exc: ObjectNotFoundError | CorruptObjectError) -> None:
    raise exc


def skip_unreadable(oid: str, role: ObjectType, exc: ObjectNotFoundError | CorruptObjectError) -> None:
    """An ``on_error`` for walks that leave damage to fsck (the remote gc, the cache's pins)."""


def closure(
    source: ObjectSource,
    commits: Iterable[str] = (),
    *,
    snapshots: Iterable[bytes] = (),
    chunks: Iterable[bytes] = (),
    have: Callable[[bytes], bool] = lambda oid: False,
    history: bool = True,
    bases: bool = True,
    pruned: Callable[[Commit], str | None] = lambda commit: None,
    on_error: OnUnreadable = _raise,
    visited: set[str] | None = None,
) -> Closure:
    """Everything ``commits`` (ids of commits or tag objects), ``snapshots`` and
    ``chunks`` need, minus what ``have`` holds: tags peeled, parents followed
    (``history``), the snapshot of each commit that ``pruned`` does not name a
    policy for, its chunks, and each chunk's delta bases (``bases``). The walk
    stops at an object ``have`` holds: a store that has an object has everything
    it needs (the invariant push, fetch and gc keep). This one walk serves push
    (have: the remote's store), fetch (source: the remote; have: this store), gc's
    mark and the remote gc's (have: what is marked live), and the hybrid cache's
    pins (no history).

    An object that cannot be read goes to ``on_error(id, role, error)`` (role:
    COMMIT where a commit or tag was wanted, SNAPSHOT, CHUNK), which raises (the
    default) or returns to skip it. ``visited``: commit and tag ids already
    walked (an incremental re-mark), grown by this walk."""
    found = Closure()
    met_snapshots: set[bytes] = set()

    def add_chunk(chunk: bytes) -> None:
        chain: list[bytes] = []
        below: bytes | None = chunk
        depth = -1
        while below is not None:
            if below in found.chunks:
                depth = found.chunks[below]
                break
            if have(below):
                break
            chain.append(below)
            if not bases:
                break
            try:
                below = source.delta_base(chain[-1])
            except (ObjectNotFoundError, CorruptObjectError) as exc:
                on_error(chain[-1].hex(), ObjectType.CHUNK, exc)
                break
        for oid in reversed(chain):
            depth += 1
            found.chunks[oid] = depth

    def add_snapshot(tree: bytes, commit: Commit | None = None) -> None:
        if tree in met_snapshots or have(tree):
            return
        met_snapshots.add(tree)
        found.snapshots.append(tree)
        try:
            snapshot = source.read_snapshot(tree)
        except (ObjectNotFoundError, CorruptObjectError) as exc:
            if isinstance(exc, CorruptObjectError) and commit is not None:
                exc = exc.with_context(commit=commit.id)
            on_error(tree.hex(), ObjectType.SNAPSHOT, exc)
            return
        for blob in snapshot.blobs:
            for chunk in blob.chunks:
                add_chunk(chunk)

    for reached in _walk(source, commits, visited, have=have, history=history):
        raw = bytes.fromhex(reached.oid)
        if reached.error is not None:
            on_error(reached.oid, ObjectType.COMMIT, reached.error)
            continue
        commit = reached.commit
        if commit is None:
            found.tags.append(raw)
            continue
        found.commits.append(raw)
        found.parents[raw] = tuple(bytes.fromhex(p) for p in commit.parents)
        policy = pruned(commit)
        if policy is not None:
            found.pruned.setdefault(policy, []).append(reached.oid)
            continue
        add_snapshot(bytes.fromhex(commit.tree), commit)
    for tree in snapshots:
        add_snapshot(tree)
    for chunk in chunks:
        add_chunk(chunk)
    return found


# ---- history --------------------------------------------------------------------


def log(
    core: Repository,
    rev: str | Sequence[str] = "HEAD",
    *,
    limit: int | None = None,
    first_parent: bool = False,
    all: bool = False,
) -> list[Commit]:
    """Commits reachable from ``rev`` (a revision or a list of them), newest
    first (by commit time); with ``first_parent``, the first-parent chain from
    ``rev`` down to the root. ``all``: from every branch, tag and HEAD; the order
    is then topological too (no commit before one of its children), as
    ``log --graph`` needs."""
    revs = [rev] if isinstance(rev, str) else list(rev)
    if all:
        revs = list(dict.fromkeys([*branches(core).values(), *tags(core).values(), *revs]))
        _, head_id = head(core)
        revs = [r for r in revs if r != "HEAD" or head_id is not None]
    starts = list(dict.fromkeys(resolve(core, r) for r in revs))
    if first_parent:  # the chain itself, whatever the commit times say
        chain = [core.read_commit(starts[0])]
        while chain[-1].parents and (limit is None or len(chain) < limit):
            chain.append(core.read_commit(chain[-1].parents[0]))
        return chain
    if all or len(starts) > 1:
        return topo_log(core, starts, limit)
    seen = set(starts)
    heap: list[tuple[int, int, Commit]] = []
    counter = 0
    for start in starts:
        first = core.read_commit(start)
        heapq.heappush(heap, (-first.time_ns, counter, first))
        counter += 1
    out: list[Commit] = []
    while heap and (limit is None or len(out) < limit):
        _, _, commit = heapq.heappop(heap)
        out.append(commit)
        for parent in commit.parents:
            if parent not in seen:
                seen.add(parent)
                pc = core.read_commit(parent)
                heapq.heappush(heap, (-pc.time_ns, counter, pc))
                counter += 1
    return out


def topo_log(core: Repository, starts: Sequence[str], limit: int | None) -> list[Commit]:
    """Every commit reachable from ``starts``, newest first, but never a parent
    before all of its children (equal commit times, clock skew)."""
    commits: dict[str, Commit] = {}
    stack = list(starts)
    while stack:
        oid = stack.pop()
        if oid not in commits:
            commits[oid] = core.read_commit(oid)
            stack.extend(commits[oid].parents)
    waiting = collections.Counter(p for c in commits.values() for p in set(c.parents))
    heap = [(-c.time_ns, i, c) for i, c in enumerate(commits.values()) if not waiting[c.id]]
    heapq.heapify(heap)
    order = {oid: i for i, oid in enumerate(commits)}
    out: list[Commit] = []
    while heap and (limit is None or len(out) < limit):
        _, _, commit = heapq.heappop(heap)
        out.append(commit)
        for parent in set(commit.parents):
            waiting[parent] -= 1
            if not waiting[parent]:
                pc = commits[parent]
                heapq.heappush(heap, (-pc.time_ns, order[parent], pc))
    return out


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def rank(
    core: Repository, metric: str, mode: Literal["min", "max"] = "min", rev: str = "HEAD", *, all: bool = False
) -> list[Commit]:
    """The commits reachable from ``rev`` that have ``metric`` (with their notes: the
    newest value, ckvc.notes), best first (``mode`` as for ``best``), newest first
    among equals."""
    history = log(core, rev, all=all)
    metrics = notes.noted_metrics(core, history)
    commits = [c for c in history if _finite(metrics[c.id].get(metric))]
    sign = 1 if mode == "min" else -1
    # log is newest first and sorted() is stable: the newest wins ties
    return sorted(commits, key=lambda c: sign * float(metrics[c.id][metric]))


def best(
    core: Repository, metric: str, mode: Literal["min", "max"] = "min", rev: str = "HEAD", *, all: bool = False
) -> Commit:
    """The commit reachable from ``rev`` (``all``: from any branch or tag) with the
    lowest (``mode="min"``) or highest (``"max"``) value of ``metric``; the newest
    among equals. Commits without the metric (or with NaN) are skipped;
    InvalidInputError when none has it, naming the metrics there are."""
    if mode not in ("min", "max"):
        raise InvalidInputError(f"mode must be 'min' or 'max', got {mode!r}")
    ranked = rank(core, metric, mode, rev, all=all)
    if not ranked:
        known = sorted({k for m in notes.noted_metrics(core, log(core, rev, all=all)).values() for k in m})
        hint = did_you_mean(metric, known) or (f"; metrics recorded: {', '.join(known)}" if known else "")
        where = "any branch or tag" if all else repr(rev)
        raise InvalidInputError(f"no commit reachable from {where} has metric {metric!r}{hint}")
    return ranked[0]


# ---- moving refs by name --------------------------------------------------------


def check_new_branch(core: Repository, name: str) -> str:
    """The full ref of a branch to be created; RefConflictError if it exists (the
    check a command makes before doing anything, and create_branch's own)."""
    full = branch_ref(name)
    if core.refs.read(full) is not None:
        raise RefConflictError(f"branch {name!r} already exists")
    return full


def create_branch(core: Repository, name: str, rev: str = "HEAD", *, force: bool = False) -> str:
    """Create branch ``name`` at ``rev``; RefConflictError if it exists. ``force``
    (git branch -f): an existing branch moves to ``rev`` instead, by
    compare-and-swap; not the branch HEAD is on (``reset`` moves that)."""
    full = branch_ref(name)
    with core.store.pin():  # the commit may be one gc is about to collect
        commit_id = resolve(core, rev)
        current = core.refs.read(full) if force else None
        if current is None:
            check_new_branch(core, name)
        elif core.refs.head()[0] == full:
            raise InvalidInputError(f"cannot force-move branch {name!r}: HEAD is on it (use reset {rev})")
        message = f"branch: reset to {rev}" if current is not None else f"branch: created from {rev}"
        try:
            core.refs.set_if_equals(full, current, commit_id, message)
        except RefConflictError:
            what = "moved meanwhile" if current is not None else "already exists"
            raise RefConflictError(f"branch {name!r} {what}") from None
    return commit_id


def is_ancestor(core: Repository, ancestor: str, descendant: str) -> bool:
    """Whether ``ancestor`` is ``descendant`` or one of its ancestors (tags peeled;
    False when either is not in ``core``)."""
    try:
        ancestor = peel(core, ancestor)
    except ObjectNotFoundError:
        return False
    return any(reached.oid == ancestor and reached.commit is not None for reached in walk(core, [descendant]))


def delete_branch(core: Repository, name: str, *, unmerged: bool = True) -> str:
    """Delete branch ``name`` (not the one HEAD is on); returns the commit it named.
    ``unmerged=False`` (git branch -d): refuse, changing nothing, unless HEAD or a
    remote-tracking branch of the same name already holds its commits."""
    full = branch_ref(name)
    current = core.refs.read(full)
    if current is None:
        raise RefNotFoundError(f"branch {name!r} not found{ref_hint(core, name, tags=False)}")
    target, head = core.refs.head()
    if target == full:
        raise InvalidInputError(f"cannot delete branch {name!r}: HEAD is on it")
    if not unmerged:
        holders = [head] if head is not None else []
        holders += [tip for ref, tip in core.refs.list_refs("refs/remotes/").items() if ref.endswith(f"/{name}")]
        if not any(is_ancestor(core, current, tip) for tip in holders):
            raise InvalidInputError(
                f"branch {name!r} is not fully merged: neither HEAD nor a remote-tracking branch holds "
                f"{current[:12]}; delete it anyway with `ckvc branch -D {name}`"
            )
    core.refs.delete_if_equals(full, current, "branch: deleted")
    return current


def reset(core: Repository, rev: str) -> str:
    """Move the branch HEAD is on to ``rev`` (git reset: HEAD stays on the branch),
    by compare-and-swap; a detached HEAD moves itself. Returns the commit id."""
    message = f"reset: moving to {rev}"
    with core.store.pin():  # the commit may be one gc is about to collect
        commit_id = resolve(core, rev)
        target, current = core.refs.head()
        if target is None:
            core.refs.set_head(detached=commit_id, message=message)
        else:
            try:
                core.refs.set_if_equals(target, current, commit_id, message)
            except RefConflictError:
                raise RefConflictError(f"{target.removeprefix(BRANCH_PREFIX)} moved meanwhile: nothing reset") from None
    return commit_id


def create_tag(
    core: Repository, name: str, rev: str = "HEAD", message: str | None = None, *, sign: bool = False
) -> str:
    """Create a tag: annotated (a tag object) when ``message`` is given,
    lightweight otherwise. Returns what the tag ref points at. ``sign``: an
    annotated tag signed with the configured key (``ckvc tag -s``; ckvc.signing)."""
    full = tag_ref(name)
    signer = signing.signer_for(core, True) if sign else None
    if signer is not None and message is None:
        raise InvalidInputError("a signed tag is an annotated tag: give it a message")
    with core.store.pin():
        commit_id = resolve(core, rev)
        target = commit_id
        if core.refs.read(full) is not None:
            raise RefConflictError(f"tag {name!r} already exists")
        if message is not None:
            tag = Tag(commit_id, name, default_author(), time.time_ns(), message)
            check_utf8("tag message", message)
            with storage_errors(f"writing tag {name}", "no tag was created"), core.store.writer(core.codec) as writer:
                target = writer.put(ObjectType.TAG, tag.encode()).hex()
                writer.commit()
            if signer is not None:
                signing.sign(core, target, "tag", signer)
        try:
            core.refs.set_if_equals(full, None, target, f"tag: {name}")
        except RefConflictError:
            raise RefConflictError(f"tag {name!r} already exists") from None
    return target


def delete_tag(core: Repository, name: str) -> str:
    """Delete tag ``name``; returns what it pointed at."""
    full = tag_ref(name)
    current = core.refs.read(full)
    if current is None:
        raise RefNotFoundError(f"tag {name!r} not found{ref_hint(core, name, branches=False)}")
    core.refs.delete_if_equals(full, current, "tag: deleted")
    return current


def tag_object(core: Repository, name: str) -> Tag | None:
    """The annotated tag ``name`` (its message, tagger, time); None for a
    lightweight tag. RefNotFoundError when there is no such tag."""
    oid = core.refs.read(tag_ref(name))
    if oid is None:
        raise RefNotFoundError(f"tag {name!r} not found{ref_hint(core, name, branches=False)}")
    if core.store.stat(bytes.fromhex(oid)).kind != ObjectType.TAG:
        return None
    return core.read_tag(oid)


def reflog(core: Repository, ref: str = "HEAD") -> list[ReflogEntry]:
    """The moves of ``ref`` (HEAD, a branch or tag name, or a full ref), oldest first."""
    full = ref if ref == HEAD or ref.startswith("refs/") else branch_named(core, ref) or TAG_PREFIX + ref
    entries = core.refs.reflog(full)
    if not entries and full != HEAD and core.refs.read(full) is None:
        raise RefNotFoundError(f"no branch or tag {ref!r}{ref_hint(core, ref)}")
    return entries


def expire_reflogs(core: Repository, older_than_s: float | None = None, refs: Sequence[str] | None = None) -> int:
    """Drop reflog entries older than ``older_than_s`` (default: the config's
    reflog_expiry; 0: all of them) of ``refs`` (HEAD, branch or tag names; default
    every reflog), so that gc may free what only they kept. Returns how many went."""
    core.require_writable("expiring reflogs")
    age = core.config.reflog_expiry_s if older_than_s is None else older_than_s
    if age < 0:
        raise InvalidInputError(f"an expiry age cannot be negative: {age}")
    names = None
    if refs is not None:
        names = [r if r == HEAD or r.startswith("refs/") else branch_named(core, r) or TAG_PREFIX + r for r in refs]
        for ref, name in zip(refs, names, strict=True):
            if name != HEAD and core.refs.read(name) is None and not core.refs.reflog(name):
                raise RefNotFoundError(f"no branch or tag {ref!r}{ref_hint(core, ref)}")
    before = time.time_ns() - int(age * 1e9) + (1 if age == 0 else 0)  # "now" takes this instant's entries too
    with storage_errors("expiring reflogs", "each reflog is expired or unchanged, never half"):
        return core.refs.expire_reflogs(before, names)


def move_head(core: Repository, rev: str, commit_id: str) -> None:
    """HEAD onto the branch ``rev`` names, or detached at ``commit_id``.
    ``HEAD`` itself leaves HEAD where it is (git checkout HEAD moves nothing)."""
    if rev == "HEAD":
        return
    full_branch = branch_named(core, rev)
    message = f"checkout: moving to {rev}"
    if full_branch is not None:
        core.refs.set_head(branch=full_branch, message=message)
    else:
        core.refs.set_head(detached=commit_id, message=message)


def switch(core: Repository, rev: str, *, new_branch: str | None = None) -> str:
    """Move HEAD to ``rev`` without loading it (see ``Repo.switch``). Returns the commit id."""
    with core.store.pin():  # HEAD may name a commit only a reflog keeps: gc must see the move
        commit_id = resolve(core, rev)
        check_not_pruned(core, commit_id)
        if new_branch is not None:
            create_branch(core, new_branch, commit_id)
            core.refs.set_head(branch=branch_ref(new_branch), message=f"checkout: moving to {new_branch}")
        else:
            move_head(core, rev, commit_id)
    return commit_id
