"""push: send what the remote lacks, then move its refs by compare-and-swap (the
order of publication: ckvc.remote.common)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckvc import graph
from ckvc.codecs.codec_ids import WHOLE_CODECS
from ckvc.config import RepoConfig
from ckvc.core import Repository
from ckvc.errors import (
    CkvcError,
    InvalidInputError,
    NonFastForwardError,
    RefConflictError,
    RefNotFoundError,
)
from ckvc.graph import is_ancestor
from ckvc.pruned import hollow_snapshots, local_released, remote_released
from ckvc.refs import BRANCH_PREFIX, TAG_PREFIX, check_ref_name
from ckvc.remote.common import (
    Progress,
    PushResult,
    RefUpdate,
    TransferStats,
    copy_sidecars,
    counted,
    move_tracking,
    remotes_of,
)
from ckvc.remote.repository import CatalogStore, Remote, open_remote
from ckvc.remote.transfer import UploadedPack, split_groups, upload_packs
from ckvc.storage.records import Located, Verifier, locate_all

# ---- push ------------------------------------------------------------------------


def _push_refs(core: Repository, refs: Sequence[str] | None, tags: bool) -> list[tuple[str, str]]:
    """(full ref name, id) for each ref to push: the named ones (branch or tag,
    short or full), else HEAD's branch; with ``tags`` every tag too."""
    out: dict[str, str] = {}
    if refs:
        for name in refs:
            if name.startswith("refs/"):
                candidates = [name]
            else:
                candidates = [BRANCH_PREFIX + name, TAG_PREFIX + name]
            for full in candidates:
                check_ref_name(full)
                value = core.refs.read(full)
                if value is not None:
                    out[full] = value
                    break
            else:
                raise RefNotFoundError(f"no branch or tag {name!r} to push{graph.ref_hint(core, name)}")
    elif not tags:
        target, commit_id = core.refs.head()
        if target is None:
            raise InvalidInputError("HEAD is detached: name the branch to push")
        if commit_id is None:
            raise RefNotFoundError(f"branch {target[len(BRANCH_PREFIX) :]} has no commits to push")
        out[target] = commit_id
    if tags:
        out.update(core.refs.list_refs(TAG_PREFIX))
    return list(out.items())


@dataclass
class _PushPlan:
    waves: list[list[Located]]  # each wave's packs published before the next wave starts
    pruned: dict[str, list[str]]  # policy -> commits sent without their data


def _plan_push(local: Repository, remote: Remote, tips: list[str], max_pack: int) -> _PushPlan:
    """What the remote lacks of what ``tips`` reach, in publication waves. The walk
    stops at objects the remote has (the invariant makes their closure complete)."""
    # A mirror's source may be a remote, where a record covers what FORMAT 18.2 says
    from_remote = isinstance(local.store, CatalogStore)
    records = local.pruned()
    released = remote_released(records, local.store.has) if from_remote else local_released(records)
    remote_has = remote.core.store.has
    # A snapshot the remote's own retention released is there without its chunks
    # (FORMAT 17): a new commit of the same state must send them again.
    hollow = hollow_snapshots(remote.core.pruned())
    needed = graph.closure(
        graph.StoredObjects(local),
        tips,
        have=(lambda oid: oid not in hollow and remote_has(oid)) if hollow else remote_has,
        pruned=released,
    )
    # Parents before children, and a tag's target tag (found after it) before it.
    ordered = (needed.snapshots, parents_first(needed.commits, needed.parents), needed.tags[::-1])
    return _PushPlan(_waves(local, needed.chunks, ordered, max_pack), needed.pruned)


def _waves(
    local: Repository, chunks: dict[bytes, int], metadata: Sequence[list[bytes]], max_pack: int
) -> list[list[Located]]:
    """Publication waves for ``chunks`` (id -> delta depth: a base's wave comes
    before its deltas') then ``metadata`` (lists of ids, each after the one before)."""
    by_depth: dict[int, list[bytes]] = {}
    for chunk, depth in chunks.items():
        by_depth.setdefault(depth, []).append(chunk)
    chunk_items = [locate_all(local.store, by_depth[d]) for d in sorted(by_depth)]
    meta_items = [locate_all(local.store, ids, in_order=True) for ids in metadata if ids]
    waves: list[list[Located]] = []
    for items, in_order in ((chunk_items, False), (meta_items, True)):
        # One pack is published whole, so what fits in one needs no order inside it.
        flat = [item for group in items for item in group]
        if sum(item.entry.record_size for item in flat) <= max_pack:
            waves.append(flat)
        elif in_order:  # a pack at a time: a kill leaves a prefix, every parent before its child
            waves.extend(pack for group in items for pack in split_groups(group, max_pack))
        else:
            waves.extend(items)
    return [w for w in waves if w]


def parents_first(commits: list[bytes], parents_of: dict[bytes, tuple[bytes, ...]]) -> list[bytes]:
    """``commits`` ordered so that each comes after its parents among them."""
    order: list[bytes] = []
    done: set[bytes] = set()
    for start in commits:
        stack = [(start, False)]
        while stack:
            oid, parents_done = stack.pop()
            if oid in done:
                continue
            if parents_done:
                done.add(oid)
                order.append(oid)
                continue
            stack.append((oid, True))
            stack.extend((p, False) for p in parents_of.get(oid, ()) if p in parents_of and p not in done)
    return order


def push(
    local: Repository,
    remote: str = "origin",
    refs: Sequence[str] | None = None,
    *,
    force: bool = False,
    tags: bool = False,
    progress: Progress | None = None,
) -> PushResult:
    """Send what the remote lacks of ``refs`` (default: HEAD's branch; ``tags``: every
    tag too), then move the remote refs by compare-and-swap: a branch only
    forward (its remote commit must be an ancestor of ours) and an existing tag
    never, unless ``force`` (NonFastForwardError). A racing pusher that moved a
    ref first makes this one's swap fail (RefConflictError); what was uploaded
    stays and is not sent again."""
    started = time.monotonic()
    spec = remotes_of(local).get(remote)
    updates = _push_refs(local, refs, tags)
    handle = open_remote(local, spec, create_from=local.config)
    result = PushResult(spec.name, spec.url)
    with counted(handle, result.stats, started):
        plan: list[RefUpdate] = []
        for full, new in updates:
            old = handle.core.refs.read(full)
            if old == new:
                result.up_to_date.append(full)
                continue
            # a fast-forward: a branch whose remote commit is an ancestor of ours
            forward = old is None or (full.startswith(BRANCH_PREFIX) and is_ancestor(local, old, new))
            if not forward and not force:
                assert old is not None
                if full.startswith(TAG_PREFIX):
                    raise NonFastForwardError(f"tag {full} already exists on {spec.name}; use --force to move it")
                raise NonFastForwardError(
                    f"{full} on {spec.name} ({old[:12]}) is not an ancestor of {new[:12]}: "
                    "fetch and integrate first, or push --force"
                )
            plan.append(RefUpdate(full, old, new, forced=not forward))
        if plan:
            # The remote's writer pin from the walk to the last ref move, and the
            # catalog refreshed under it: a remote gc deletes nothing this push
            # counts on (docs/DESIGN.md, "Remote gc").
            with handle.core.store.pin():
                handle.core.store.refresh()
                _raise_format(handle, local.config)
                max_pack = min(local.config.max_pack_size, handle.core.config.max_pack_size)
                work = _plan_push(local, handle, [u.new for u in plan], max_pack)
                _upload(local, handle, work, max_pack, result.stats, progress)
                # signatures and notes of what the remote now holds, before the refs that name it
                copy_sidecars(local.refs.backend, handle.backend, handle.core.object_exists)
                for update in plan:
                    # a pin whose lease lapsed no longer holds a remote gc off what the ref will name
                    handle.backend.check_locks_held()
                    message = f"push: from {local.config.repo_id}"
                    try:
                        handle.core.refs.set_if_equals(update.ref, update.old, update.new, message)
                    except RefConflictError as exc:  # another pusher got there first: say where
                        raise RefConflictError(
                            f"{spec.name} ({spec.url}): {exc}; nothing was lost: fetch, then push again"
                        ) from None
                    result.updated.append(update)
                    if update.ref.startswith(BRANCH_PREFIX):
                        move_tracking(local, spec.name, update.ref[len(BRANCH_PREFIX) :], update.new, "push")
        else:
            # refs up to date; a signature or note added since the push still goes
            copy_sidecars(local.refs.backend, handle.backend, handle.core.object_exists)
            for full, new in updates:
                if full.startswith(BRANCH_PREFIX):
                    move_tracking(local, spec.name, full[len(BRANCH_PREFIX) :], new, "push")
    return result


def upload_objects(
    local: Repository,
    handle: Remote,
    chunks: Iterable[bytes] = (),
    metadata: Sequence[list[bytes]] = (),
    *,
    stats: TransferStats | None = None,
    progress: Progress | None = None,
) -> TransferStats:
    """Send what ``handle`` lacks of ``chunks`` (with the delta bases they need)
    and of ``metadata`` (lists of ids, each list published after the one before),
    verified as push verifies, moving no ref: the parts of a commit that
    several processes write (ckvc.remote.publish). Call it under the remote's
    pin, as push does, so a remote gc deletes nothing this upload counts on."""
    stats = stats if stats is not None else TransferStats()
    there = handle.core.store.has
    needed = graph.closure(graph.StoredObjects(local), chunks=chunks, have=there)
    wanted = [[oid for oid in ids if not there(oid)] for ids in metadata]
    max_pack = min(local.config.max_pack_size, handle.core.config.max_pack_size)
    _raise_format(handle, local.config)
    plan = _PushPlan(_waves(local, needed.chunks, wanted, max_pack), {})
    _upload(local, handle, plan, max_pack, stats, progress)
    return stats


def _raise_format(handle: Remote, config: RepoConfig) -> None:
    """A remote whose format version is below what we send is raised first, so an
    older ckvc refuses it instead of misreading new objects."""
    if handle.core.config.format_version < config.format_version:
        upgraded = RepoConfig.load(handle.backend)
        if upgraded.format_version < config.format_version:  # never lower what another pusher raised
            upgraded.format_version = config.format_version
            upgraded.save(handle.backend)
        handle.core.config = upgraded


def _upload(
    local: Repository, handle: Remote, plan: _PushPlan, max_pack: int, stats: TransferStats, progress: Progress | None
) -> None:
    total = sum(item.entry.record_size for wave in plan.waves for item in wave)
    done = 0

    def landed(pack: UploadedPack) -> None:
        nonlocal done
        handle.core.store.index.add_pack(pack.name, pack.entries)
        stats.packs += 1
        stats.objects += len(pack.entries)
        size = sum(e.record_size for e in pack.entries)
        stats.record_bytes += size
        stats.wire_bytes += pack.size + pack.copy_size
        done += size
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    if plan.pruned:  # before the commits: the remote never holds a pruned commit it calls whole
        for policy, commits in plan.pruned.items():
            handle.core.prune_log.add(commits, policy)
    # Every record is verified before it leaves: a backup must not take on damage
    # from this side. Keyframes are kept for the deltas of later waves, if any come.
    deltas = any(item.entry.codec not in WHOLE_CODECS for wave in plan.waves for item in wave)
    verifier = Verifier(local.store, keep_keyframes=deltas)
    for wave in plan.waves:
        groups = split_groups(wave, max_pack)
        upload_packs(local.store, handle.backend, groups, handle.core.executor, landed, verifier)


# ---- mirror ------------------------------------------------------------------------


@dataclass
class MirrorResult:
    """What ``mirror`` moved: the refs set, the refs deleted (``prune``), the objects."""

    source: str
    target: str
    updated: list[RefUpdate] = field(default_factory=list)
    deleted: dict[str, str] = field(default_factory=dict)  # ref -> what it named
    up_to_date: list[str] = field(default_factory=list)
    stats: TransferStats = field(default_factory=TransferStats)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "target": self.target,
            "updated": [u.to_json() for u in self.updated],
            "deleted": self.deleted,
            "up_to_date": self.up_to_date,
            **self.stats.to_json("bytes_sent"),
        }


def _descends(source: Repository, old: str, new: str) -> bool:
    try:
        return is_ancestor(source, old, new)
    except CkvcError:  # the target's commit is not in the source at all
        return False


def mirror_to(
    source: Repository, handle: Remote, *, prune: bool = False, progress: Progress | None = None, label: str = ""
) -> MirrorResult:
    """Make ``handle`` hold every branch and tag of ``source`` (a local repository or
    another remote's core): the objects it lacks sent as push sends them (stored
    records, each verified before it leaves, in packs published whole), signatures
    and notes, then every ref set to the source's by compare-and-swap, forced, as
    ``git push --mirror``; ``prune``: refs the source lacks are deleted. Nothing is
    staged locally (records stream from the source's packs into the new ones), and a
    killed mirror resumes: what was published is not sent again."""
    started = time.monotonic()
    result = MirrorResult(label or repr(source), handle.spec.url)
    wanted = {k: v for k, v in source.refs.list_refs("refs/").items() if k.startswith((BRANCH_PREFIX, TAG_PREFIX))}
    with counted(handle, result.stats, started), handle.core.store.pin():
        handle.core.store.refresh()
        _raise_format(handle, source.config)
        max_pack = min(source.config.max_pack_size, handle.core.config.max_pack_size)
        theirs = {k: v for k, v in handle.core.refs.list_refs("refs/").items()}
        work = _plan_push(source, handle, list(dict.fromkeys(wanted.values())), max_pack)
        _upload(source, handle, work, max_pack, result.stats, progress)
        copy_sidecars(source.refs.backend, handle.backend, handle.core.object_exists)
        for ref, new in sorted(wanted.items()):
            old = theirs.get(ref)
            if old == new:
                result.up_to_date.append(ref)
                continue
            handle.backend.check_locks_held()
            forced = old is not None and not (ref.startswith(BRANCH_PREFIX) and _descends(source, old, new))
            handle.core.refs.set_if_equals(ref, old, new, f"mirror: from {result.source}")
            result.updated.append(RefUpdate(ref, old, new, forced=forced))
        if prune:
            for ref, old in sorted(theirs.items()):
                if ref not in wanted and ref.startswith((BRANCH_PREFIX, TAG_PREFIX)):
                    handle.core.refs.delete_if_equals(ref, old, f"mirror --prune: not in {result.source}")
                    result.deleted[ref] = old
    return result
