"""Retention policies: which commits keep their data. History is never rewritten:
a released commit keeps its commit object and is recorded in the prune log; gc
then frees its snapshot and chunks.

Rules combine as a union, evaluated on each branch's first-parent history:
keep-last N, keep-best METRIC:min|max:N, keep-every K (position from the root,
root = 0), keep-within DURATION. Tags, branch heads and HEAD are always kept, and
so is everything reachable from a branch the policy does not cover.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from ckvc import graph, notes
from ckvc.core import Repository
from ckvc.errors import CkvcError, DurabilityWarning, InterruptedOperationError, InvalidInputError
from ckvc.retention_policy import KeepBest, RetentionPolicy, format_duration, parse_duration

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

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy.describe(),
            "kept": self.kept,
            "released": self.released,
            "already_pruned": self.already_pruned,
        }


def plan_retention(repo: Repository, policy: RetentionPolicy, *, now_ns: int | None = None) -> RetentionPlan:
    """Decide which commits to keep and which to release. Reads only commit objects."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    plan = RetentionPlan(policy)
    branches = graph.branches(repo)
    covered = list(branches) if policy.branches is None else list(policy.branches)
    for name in covered:
        if name not in branches:
            raise InvalidInputError(f"retention policy names branch {name!r}, which does not exist")

    def keep(commit_id: str, reason: str) -> None:
        reasons = plan.kept.setdefault(commit_id, [])
        if reason not in reasons:
            reasons.append(reason)

    candidates: dict[str, None] = {}
    noted = notes.all_notes(repo) if policy.keep_best else {}  # a metric added later by a note counts
    for name in covered:
        history = graph.log(repo, name, first_parent=True)  # tip first, root last
        for commit in history:
            candidates.setdefault(commit.id)
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

    pruned = repo.pruned()
    for commit_id in candidates:
        if commit_id in plan.kept:
            continue
        if commit_id in pruned:
            plan.already_pruned.append(commit_id)
        else:
            plan.released.append(commit_id)
    return plan


def apply_retention(repo: Repository, plan: RetentionPlan) -> int:
    """Record the plan's released commits as pruned. Returns how many were new."""
    return repo.prune_log.add(plan.released, plan.policy.describe())


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


def retain(repo: Repository, policy: RetentionPolicy | None = None, *, dry_run: bool = False) -> RetentionPlan:
    """Apply ``policy`` (default: the stored one): plan, then (unless ``dry_run``)
    record every released commit as pruned. Returns the plan."""
    policy = policy or stored_policy(repo)
    if policy is None:
        raise InvalidInputError("no retention policy given or stored (ckvc retain --keep-last N ...)")
    if not dry_run:
        repo.require_writable("applying retention")
    plan = plan_retention(repo, policy)
    if not dry_run:
        apply_retention(repo, plan)
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
