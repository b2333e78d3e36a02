"""What operations teams watch: ``ckvc stats [--json]`` and ``GET /metrics`` of
``ckvc serve`` (the Prometheus text format, version 0.0.4) give the same values:
storage (du's figures), commits and the age of the newest per branch, how far each
remote-tracking branch is behind its local branch, auto_push's backlog, and the
local cache's usage and hit rate."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckvc import graph, inspect
from ckvc.hybrid.status import count_only_in

if TYPE_CHECKING:
    from ckvc.repo import Repo


@dataclass(frozen=True)
class Metric:
    name: str
    help: str
    kind: str  # gauge or counter
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


def collect(repo: Repo, *, now_ns: int | None = None) -> list[Metric]:
    """Every metric with its samples, read from the repository now."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    core = repo.core
    du = inspect.disk_usage(core)
    out = [
        Metric("ckvc_pack_bytes", "Bytes of every pack file, reachable or not", "gauge", [({}, du.pack_bytes)]),
        Metric("ckvc_packs", "Pack files", "gauge", [({}, du.pack_count)]),
        Metric("ckvc_logical_bytes", "Tensor bytes of every live commit, as loaded", "gauge", [({}, du.logical_bytes)]),
        Metric("ckvc_unique_raw_bytes", "Distinct chunks, before compression", "gauge", [({}, du.unique_raw_bytes)]),
        Metric("ckvc_stored_chunk_bytes", "Distinct chunks as stored", "gauge", [({}, du.stored_chunk_bytes)]),
        Metric("ckvc_dedup_ratio", "Logical bytes over distinct raw bytes", "gauge", [({}, du.dedup_ratio)]),
        Metric("ckvc_compression_ratio", "Distinct raw bytes over stored bytes", "gauge", [({}, du.compression_ratio)]),
        Metric("ckvc_commits_live", "Reachable commits whose tensors are kept", "gauge", [({}, du.commits)]),
        Metric("ckvc_commits_pruned", "Reachable commits released by retention", "gauge", [({}, du.pruned_commits)]),
    ]
    commits = Metric("ckvc_branch_commits", "Commits reachable from the branch", "gauge")
    age = Metric("ckvc_branch_newest_commit_age_seconds", "Seconds since the branch's tip was committed", "gauge")
    behind = Metric(
        "ckvc_remote_commits_not_pushed", "Commits of the local branch its remote-tracking branch lacks", "gauge"
    )
    branches = repo.branches()
    remotes = [spec.name for spec in repo.remotes.list()]
    for name, tip in sorted(branches.items()):
        labels = {"branch": name}
        commits.samples.append((labels, sum(1 for _ in graph.walk(core, [tip]))))
        age.samples.append((labels, max(0.0, (now_ns - core.read_commit(tip).time_ns) / 1e9)))
        for remote in remotes:
            theirs = core.refs.read(f"refs/remotes/{remote}/{name}")
            if theirs is None:
                continue
            lacking = 0 if theirs == tip else count_only_in(core, tip, theirs)
            behind.samples.append(({"remote": remote, "branch": name}, lacking))
    out += [commits, age, behind]
    backlog = repo.backup_status()
    if backlog is not None:
        out += [
            Metric(
                "ckvc_auto_push_pending_commits", "Commits auto_push has not pushed yet", "gauge",
                [({"remote": backlog.remote}, len(backlog.entries))],
            ),
            Metric(
                "ckvc_auto_push_failures", "auto_push attempts failed in a row", "gauge",
                [({"remote": backlog.remote}, backlog.failures)],
            ),
        ]  # fmt: skip
    if core.dir is not None:
        from ckvc.scrub import SCRUB_FILE, scrub_status

        scrubbed = scrub_status(core.dir / SCRUB_FILE, du.pack_count)
        last = scrubbed["last_complete"]
        out += [
            Metric("ckvc_scrub_cycle_coverage_ratio", "Packs the current scrub cycle has verified, of all packs",
                   "gauge", [({}, scrubbed["coverage"] or 0.0)]),
            Metric("ckvc_scrub_damaged_packs", "Packs a scrub found damaged and no later cycle read clean", "gauge",
                   [({}, len(scrubbed["damage"]))]),
        ]  # fmt: skip
        if last is not None:
            out.append(
                Metric("ckvc_scrub_last_complete_timestamp_seconds", "When the last complete scrub cycle ended",
                       "gauge", [({}, last["finished_ns"] / 1e9)])
            )  # fmt: skip
    if core.hybrid is not None:
        report = repo.cache.report()
        out += [
            Metric("ckvc_cache_bytes", "Bytes of local packs", "gauge", [({}, report.used_bytes)]),
            Metric("ckvc_cache_hit_bytes_total", "Chunk bytes read from the local cache", "counter",
                   [({}, report.hit_bytes)]),
            Metric("ckvc_cache_miss_bytes_total", "Chunk bytes fetched from a remote", "counter",
                   [({}, report.miss_bytes)]),
        ]  # fmt: skip
    return out


def as_json(metrics: list[Metric]) -> dict[str, Any]:
    """``ckvc stats --json``: a metric with no labels is its value; one with labels a
    list of {labels..., "value"}."""
    out: dict[str, Any] = {}
    for m in metrics:
        if len(m.samples) == 1 and not m.samples[0][0]:
            out[m.name] = m.samples[0][1]
        else:
            out[m.name] = [{**labels, "value": value} for labels, value in m.samples]
    return out


def _number(value: float) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 2**53):
        return str(int(value))
    return "NaN" if math.isnan(value) else repr(float(value))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def prometheus_text(metrics: list[Metric]) -> str:
    """The Prometheus text exposition format (0.0.4)."""
    lines = []
    for m in metrics:
        lines.append(f"# HELP {m.name} {m.help}")
        lines.append(f"# TYPE {m.name} {m.kind}")
        for labels, value in m.samples:
            text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            lines.append(f"{m.name}{{{text}}} {_number(value)}" if text else f"{m.name} {_number(value)}")
    return "\n".join(lines) + "\n"
