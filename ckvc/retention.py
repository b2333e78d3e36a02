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
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ckvc import graph
from ckvc.core import Repository
from ckvc.errors import InvalidInputError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds in "90", "45s", "30m", "12h", "7d" or "2w"."""
    m = _DURATION.match(text)
    if m is None:
        raise InvalidInputError(f"not a duration: {text!r} (use e.g. 45s, 30m, 12h, 7d, 2w)")
    return float(m.group(1)) * _UNIT_S[m.group(2) or "s"]


def format_duration(seconds: float) -> str:
    for unit in ("w", "d", "h", "m"):
        if seconds >= _UNIT_S[unit] and seconds % _UNIT_S[unit] == 0:
            return f"{int(seconds // _UNIT_S[unit])}{unit}"
    return f"{seconds:g}s"


@dataclass(frozen=True)
class KeepBest:
    metric: str
    mode: str  # "min" or "max"
    count: int

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise InvalidInputError(f"keep-best needs a metric name, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise InvalidInputError(f"keep-best mode must be 'min' or 'max', got {self.mode!r}")
        _positive(self.count, "keep-best count")

    @classmethod
    def parse(cls, text: str) -> KeepBest:
        parts = text.rsplit(":", 2)
        if len(parts) != 3 or parts[1] not in ("min", "max") or not parts[0]:
            raise InvalidInputError(f"--keep-best takes METRIC:min|max:N, got {text!r}")
        try:
            count = int(parts[2])
        except ValueError:
            raise InvalidInputError(f"--keep-best count must be an integer, got {parts[2]!r}") from None
        return cls(parts[0], parts[1], count)

    def __str__(self) -> str:
        return f"{self.metric}:{self.mode}:{self.count}"


def _positive(value: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidInputError(f"{what} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int | None = None
    keep_best: tuple[KeepBest, ...] = ()
    keep_every: int | None = None
    keep_within_s: float | None = None
    branches: tuple[str, ...] | None = None  # None: every branch
    auto: bool = False  # apply after every commit

    def __post_init__(self) -> None:
        if self.keep_last is not None:
            _positive(self.keep_last, "keep-last")
        if self.keep_every is not None:
            _positive(self.keep_every, "keep-every")
        if self.keep_within_s is not None and not (self.keep_within_s > 0 and math.isfinite(self.keep_within_s)):
            raise InvalidInputError(f"keep-within must be a positive duration, got {self.keep_within_s!r}")
        if not (self.keep_last or self.keep_best or self.keep_every or self.keep_within_s):
            raise InvalidInputError("a retention policy needs at least one keep rule")

    def describe(self) -> str:
        rules = []
        if self.keep_last:
            rules.append(f"keep-last {self.keep_last}")
        rules += [f"keep-best {b}" for b in self.keep_best]
        if self.keep_every:
            rules.append(f"keep-every {self.keep_every}")
        if self.keep_within_s:
            rules.append(f"keep-within {format_duration(self.keep_within_s)}")
        if self.branches is not None:
            rules.append(f"branches {','.join(self.branches)}")
        return ", ".join(rules)

    def to_config(self) -> dict[str, Any]:
        out = asdict(self)
        out["keep_best"] = [str(b) for b in self.keep_best]
        out["branches"] = list(self.branches) if self.branches is not None else None
        return out

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> RetentionPolicy:
        branches = raw.get("branches")
        return cls(
            keep_last=raw.get("keep_last"),
            keep_best=tuple(KeepBest.parse(b) for b in raw.get("keep_best") or ()),
            keep_every=raw.get("keep_every"),
            keep_within_s=raw.get("keep_within_s"),
            branches=tuple(branches) if branches is not None else None,
            auto=bool(raw.get("auto", False)),
        )


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
            scored = [c for c in history if best.metric in c.metrics and not math.isnan(float(c.metrics[best.metric]))]
            scored.sort(key=lambda c: float(c.metrics[best.metric]), reverse=best.mode == "max")
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
