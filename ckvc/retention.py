"""Retention policies: which commits keep their data. History is never rewritten:
a released commit keeps its commit object and is recorded in the prune log; gc
then frees its snapshot and chunks.

Rules combine as a union, evaluated on each branch's first-parent history:
keep-last N, keep-best METRIC:min|max:N, keep-every K (position from the root,
root = 0), keep-within DURATION, max-size BYTES (the newest commits beyond the
other rules whose data fits in the budget). Tags, branch heads and HEAD are always kept, and
so is everything reachable from a branch the policy does not cover.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckvc import graph, notes
from ckvc.core import Repository
from ckvc.errors import CkvcError, DurabilityWarning, InterruptedOperationError, InvalidInputError
from ckvc.objects import Commit
from ckvc.pruned import local_released, remote_released
from ckvc.retention_policy import KeepBest, RetentionPolicy, format_duration, format_size, parse_duration

__all__ = [  # the policy types stay importable from here
    "KeepBest", "RetentionPlan", "RetentionPolicy", "apply_retention", "format_duration", "parse_duration",
    "plan_retention", "retain", "retain_after_commit", "store_policy", "stored_policy",
]  # fmt: skip


@dataclass
class RetentionPlan:
    policy: RetentionPolicy
    kept: dict[str, list[str]] = field(default_factory=dict)  # commit -> the rules that keep it
    released: list[str] = field(default_factory=list)  # commits this plan prunes, newest first
    already_pruned: list[str] = field(default_factory=list)
    # With max-size: the stored bytes the kept commits' data takes, each released
    # commit's share of what gc then frees (an object counted once, by the newest
    # released commit that needs it), and why the budget cannot be met.
    kept_bytes: int | None = None
    frees: dict[str, int] = field(default_factory=dict)
    over_budget: str | None = None
    summaries: dict[str, str] = field(default_factory=dict)  # commit -> its message's first line, for reports

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy.describe(),
            "kept": self.kept,
            "released": self.released,
            "already_pruned": self.already_pruned,
            "kept_bytes": self.kept_bytes,
            "frees": self.frees,
            "frees_total": sum(self.frees.values()),
            "over_budget": self.over_budget,
        }


def plan_retention(
    repo: Repository, policy: RetentionPolicy, *, now_ns: int | None = None, remote: bool = False
) -> RetentionPlan:
    """Decide which commits to keep and which to release. Reads only commit objects.
    ``remote``: ``repo`` is a remote, where a pusher's prune record of a commit
    whose snapshot is there covers nothing (FORMAT 18.2): such a commit is decided again."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    plan = RetentionPlan(policy)
    branches = graph.branches(repo)
    covered = list(branches) if policy.branches is None else list(policy.branches)
    for name in covered:
        if name not in branches:
            raise InvalidInputError(f"retention policy names branch {name!r}, which does not exist")

    def keep(commit_id: str, reason: str) -> None:
        if commit_id not in plan.summaries:  # a tag's or HEAD's commit off the covered histories
            plan.summaries[commit_id] = repo.read_commit(commit_id).message.split("\n", 1)[0]
        reasons = plan.kept.setdefault(commit_id, [])
        if reason not in reasons:
            reasons.append(reason)

    candidates: dict[str, Commit] = {}
    noted = notes.all_notes(repo) if policy.keep_best else {}  # a metric added later by a note counts
    for name in covered:
        history = graph.log(repo, name, first_parent=True)  # tip first, root last
        for commit in history:
            candidates.setdefault(commit.id, commit)
            plan.summaries.setdefault(commit.id, commit.message.split("\n", 1)[0])
        if policy.keep_last:
            for commit in history[: policy.keep_last]:
                keep(commit.id, f"keep-last {policy.keep_last} on {name}")
        if policy.keep_every:
            for index, commit in enumerate(history):
                if (len(history) - 1 - index) % policy.keep_every == 0:
                    keep(commit.id, f"keep-every {policy.keep_every} on {name}")
        for best in policy.keep_best:
            values = {c.id: notes.metrics_with_notes(c, noted.get(c.id, ())).get(best.metric) for c in history}
            scored = [c for c in history if values[c.id] is not None and not math.isnan(float(values[c.id] or 0))]
            scored.sort(key=lambda c: float(values[c.id] or 0), reverse=best.mode == "max")
            for commit in scored[: best.count]:
                keep(commit.id, f"keep-best {best} on {name}")
        if policy.keep_within_s:
            horizon = now_ns - int(policy.keep_within_s * 1e9)
            for commit in history:
                if commit.time_ns >= horizon:
                    keep(commit.id, f"keep-within {format_duration(policy.keep_within_s)}")

    # Always kept: branch heads, tags, HEAD, and whatever branches outside the policy reach.
    for name, commit_id in branches.items():
        keep(commit_id, f"head of branch {name}")
    for name, commit_id in graph.tags(repo).items():
        keep(commit_id, f"tag {name}")
    _, head_id = graph.head(repo)
    if head_id:
        keep(head_id, "HEAD")
    uncovered = {name: branches[name] for name in set(branches) - set(covered)}
    if uncovered:
        for commit in graph.iter_reachable_commits(repo, uncovered):
            if commit.id in candidates:
                keep(commit.id, "reachable from a branch the policy does not cover")

    records = repo.pruned()
    # FORMAT 18.2: what a record covers on a remote depends on what the remote holds
    released = remote_released(records, repo.store.has) if remote else local_released(records)

    def is_pruned(commit: Commit) -> bool:
        return released(commit) is not None

    pruned = {c for c, commit in candidates.items() if is_pruned(commit)}
    if policy.max_size is not None:
        _fit_budget(repo, plan, [c for c in candidates if c not in plan.kept and c not in pruned], is_pruned)
    for commit_id in candidates:
        if commit_id in plan.kept:
            continue
        if commit_id in pruned:
            plan.already_pruned.append(commit_id)
        else:
            plan.released.append(commit_id)
    return plan


def _fit_budget(repo: Repository, plan: RetentionPlan, others: list[str], is_pruned: Callable[[Commit], bool]) -> None:
    """max-size: keep, beyond the other rules, the newest of ``others`` while the data of
    everything kept fits in the budget (an object shared by several commits counted
    once, delta bases included); the first that does not fit and every older one go.
    Fills the plan's kept_bytes, frees and over_budget."""
    budget = plan.policy.max_size
    assert budget is not None
    source = graph.StoredObjects(repo)
    counted: set[bytes] = set()

    def data_of(commit_ids: list[str], have: set[bytes]) -> dict[bytes, int]:
        found = graph.closure(source, commit_ids, have=have.__contains__, history=False)
        return {oid: repo.store.locate(oid).record_size for oid in [*found.snapshots, *found.chunks]}

    # What gc keeps whatever this plan says: everything the refs reach (merged-in
    # history, tags, branches outside the policy included), but for the commits the
    # budget decides on and those pruned already.
    deciding = set(others)
    tips = list(dict.fromkeys(graph.ref_tips(repo, include_reflogs=False).values()))
    found = graph.closure(source, tips, pruned=lambda c: "decided here" if c.id in deciding or is_pruned(c) else None)
    base = {oid: repo.store.locate(oid).record_size for oid in [*found.snapshots, *found.chunks]}
    counted.update(base)
    total = sum(base.values())
    if total > budget:
        plan.over_budget = (
            f"the commits other rules keep (branch heads, tags, HEAD included) take {format_size(total)}, "
            f"over the budget of {format_size(budget)}: nothing else is kept"
        )
    commits = sorted(others, key=lambda c: repo.read_commit(c).time_ns, reverse=True)
    fitting = True
    for commit_id in commits:
        extra = data_of([commit_id], counted)
        size = sum(extra.values())
        if fitting and total + size <= budget:
            plan.kept.setdefault(commit_id, []).append(f"max-size {format_size(budget)}")
            counted.update(extra)
            total += size
        else:
            fitting = False  # the oldest go first: nothing older is kept in its place
    plan.kept_bytes = total
    for commit_id in commits:  # newest first: a shared object is freed by the newest that needed it
        if commit_id in plan.kept:
            continue
        freed = data_of([commit_id], counted)
        counted.update(freed)
        plan.frees[commit_id] = sum(freed.values())


def apply_retention(repo: Repository, plan: RetentionPlan, *, remote: bool = False) -> int:
    """Record the plan's released commits as pruned (on a remote, as the remote's own
    retention: FORMAT 17). Returns how many were new."""
    snapshots = {c: repo.read_commit(c).tree for c in plan.released} if remote else None
    return repo.prune_log.add(plan.released, plan.policy.describe(), snapshots=snapshots)


def stored_policy(repo: Repository) -> RetentionPolicy | None:
    """The policy the repository config holds, if any."""
    raw = repo.config.retention
    return RetentionPolicy.from_config(raw) if raw else None


def store_policy(repo: Repository, policy: RetentionPolicy | None) -> None:
    """Store ``policy`` in the repository config (None removes it)."""
    repo.require_writable("storing the retention policy")
    config = repo.stored_config()
    config.retention = policy.to_config() if policy is not None else None
    repo.save_config(config)


def retain(
    repo: Repository, policy: RetentionPolicy | None = None, *, dry_run: bool = False, remote: bool = False
) -> RetentionPlan:
    """Apply ``policy`` (default: the stored one): plan, then (unless ``dry_run``)
    record every released commit as pruned. Returns the plan. ``remote``: ``repo``
    is a remote's (ckvc.remote.gc.retain_remote)."""
    policy = policy or stored_policy(repo)
    if policy is None:
        raise InvalidInputError("no retention policy given or stored (ckvc retain --keep-last N ...)")
    if not dry_run:
        repo.require_writable("applying retention")
    plan = plan_retention(repo, policy, remote=remote)
    if not dry_run:
        apply_retention(repo, plan, remote=remote)
    return plan


def retain_after_commit(repo: Repository, policy: RetentionPolicy, commit_id: str) -> None:
    """Apply ``policy`` once commit ``commit_id`` has landed: the commit stands
    whatever happens here (an interrupt says so; a failure is a warning)."""
    try:
        retain(repo, policy)
    except KeyboardInterrupt:
        raise InterruptedOperationError(
            f"interrupted during retention after commit {commit_id[:12]} landed", landed=True, result=commit_id
        ) from None
    except CkvcError as exc:
        warnings.warn(
            DurabilityWarning(f"commit {commit_id[:12]} landed, but the retention policy failed: {exc}"), stacklevel=4
        )
