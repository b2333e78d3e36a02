"""gc benchmark: time and peak memory of ``Repo.gc(now=True)`` after a retention policy,
as history grows with the live data fixed, and as the live data grows with history fixed,
once with all of the history as garbage and once in steady state (gc run regularly).

    .venv/bin/python benchmarks/gc_time.py [--commits 100] [--size-mb 100] [--keep 5,10,20]
                                      [--history 25,50,100] [--gc-every 3] [--repeats 3]
                                      [--quick] [--cold] [--json]

The repository: ``--commits`` commits of a GPT-like fp32 state of ``--size-mb`` MiB on one
branch. A fixed, seeded set of tensors (``--changed`` of the bytes, default 30%) gets new
random N(0, 0.02) values in every commit; the rest never changes and deduplicates against
the first commit (training with frozen layers). Each commit writes its own pack(s).

The matrix, in one run:

* history series: ``--history`` commits (default N/4, N/2, N), keep-last = the smallest
  ``--keep``: live data fixed, garbage grows with history;
* live series: N commits, keep-last each of ``--keep`` (default 5, 10, 20): history fixed,
  live data grows;
* steady-state series: for each ``--history`` size, the gc a user who runs retain + gc
  regularly pays. In the two series above gc runs once, at the end, so all of the history
  is garbage and deleting it grows with the history. Here a copy of the source gets
  keep-last K (the smallest ``--keep``) and one gc, untimed (the backlog); then
  ``--gc-every`` more commits (default 3, the same state evolution: each adds about
  ``--changed`` new data), and the cell measures the next retain(keep_last=K) + gc exactly
  as the other cells do. The garbage is the data of the ``--gc-every`` commits that fell
  out of the window, so the history grows while both the live data and the garbage stay
  fixed. Its "commits" column counts the N + ``--gc-every`` commits the repository holds.

One build serves every cell: the N-commit repository is built once and copied (untimed) at
the history sizes on the way; every cell copies its source with ``shutil.copytree``
(untimed), applies ``Repo.retain(keep_last=K)`` (untimed), then runs in FRESH subprocesses
``Repo.gc(dry_run=True)`` (the plan, which writes nothing) and ``Repo.gc(now=True)``. Each
child reports the wall time of that call, its peak RSS minus the RSS it had after importing
ckvc and opening the repository (VmHWM reset via ``/proc/self/clear_refs`` where allowed,
ru_maxrss otherwise), and the GcReport (bytes freed, packs deleted / repacked, critical
section). ``os.sync()`` runs before every child, so writeback of the copy does not land in
the measurement. Page cache: warm (the copy was just written) unless ``--cold``, which
evicts the copy's files (drop_caches or posix_fadvise) before each child.

Columns: "live" is the stored bytes of live records (plan.live_bytes), "garbage" what the
plan can reclaim, "repack" the live bytes gc copies out of mostly-dead packs. The growth
lines give log-log slopes: 0 = flat, 1 = proportional.

Columns "copy s" and "unlink s" split gc's execution by wrapping PRIVATE helpers of
``ckvc.gc`` (``_copy_live``: the repack copy; ``_unlink``: deleting the removed packs after
the critical section); they show "nan" if those helpers are renamed.

Every cell is repeated ``--repeats`` times (default 3), each on a fresh copy, and the table
shows medians. The default matrix took about 5 minutes on 2 cores (about 30 s of it the
build). Single gc runs on a busy 2-core machine vary by +-30%: compare the trend across
rows, not one row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from foundation import (
    GB,
    MIB,
    SEED,
    Cold,
    Shape,
    _loadavg,
    _reset_hwm,
    _status_kb,
    build_state,
    disk_bytes,
    log,
    machine_busy_seconds,
    own_cpu_seconds,
    pick_changed,
    pick_shape,
    remove,
    state_nbytes,
)

import ckvc
from ckvc.errors import PrunedCommitError
from ckvc.retention import RetentionPolicy

State = dict[str, torch.Tensor]


# ---- the synthetic history ----------------------------------------------------------


def step_state(prev: State, changed: list[str], step: int) -> State:
    """``prev`` with the ``changed`` tensors replaced by new random values (a shallow copy)."""
    gen = torch.Generator().manual_seed(SEED + 1000 + step)
    out = dict(prev)
    for name in changed:
        t = torch.empty_like(prev[name])
        t.normal_(0.0, 0.02, generator=gen)
        out[name] = t
    return out


def build_sources(work: Path, shape: Shape, changed: list[str], sizes: list[int]) -> dict[int, Path]:
    """Build one repository of max(sizes) commits; copy it (untimed) at every other size."""
    n_max = max(sizes)
    base = work / f"src-{n_max}"
    sources: dict[int, Path] = {n_max: base}
    state = build_state(shape)
    repo = ckvc.Repo.init(base)
    started = time.perf_counter()
    commit_s: list[float] = []
    try:
        for i in range(n_max):
            if i:
                state = step_state(state, changed, i)
            repo.commit(state, message=f"step {i}", metrics={"step": i})
            assert repo.last_commit_stats is not None
            commit_s.append(repo.last_commit_stats.seconds)
            n = i + 1
            if n % 10 == 0 or n == n_max:
                log(
                    f"built {n}/{n_max} commits ({time.perf_counter() - started:.0f} s, "
                    f"median commit {statistics.median(commit_s):.2f} s)"
                )
            if n in sizes and n != n_max:
                repo.close()
                sources[n] = work / f"src-{n}"
                shutil.copytree(base, sources[n], symlinks=True)
                repo = ckvc.Repo.open(base)
    finally:
        repo.close()
    return sources


def build_steady_source(
    src: Path, dst: Path, shape: Shape, changed: list[str], commits: int, keep: int, every: int
) -> dict[str, Any]:
    """Copy ``src`` (``commits`` commits) to ``dst``, clear its backlog (retain keep-last
    ``keep`` + gc, untimed as a measurement), then add ``every`` commits continuing the
    builder's state evolution, without retention: the repository a regular retain + gc meets.
    Returns what the backlog gc did."""
    remove(dst)
    shutil.copytree(src, dst, symlinks=True)
    with ckvc.Repo.open(dst) as repo:
        t0 = time.perf_counter()
        repo.retain(RetentionPolicy(keep_last=keep))
        report = repo.gc(now=True)
        backlog = {"seconds": time.perf_counter() - t0, "bytes_freed": report.bytes_freed}
        # step_state replaces every changed tensor, so the state of step i is the base with
        # step i's values: the same tensors the builder would have committed next.
        state = build_state(shape)
        for i in range(commits, commits + every):
            state = step_state(state, changed, i)
            repo.commit(state, message=f"step {i}", metrics={"step": i})
        del state
    log(
        f"steady-state source: {commits} commits, backlog retain + gc {backlog['seconds']:.1f} s "
        f"(freed {backlog['bytes_freed'] / MIB:.0f} MiB), then {every} commits"
    )
    return backlog


def estimate_stored(state_bytes: int, changed_fraction: float, commits: int) -> int:
    """Pack bytes of a ``commits``-commit source, assuming no compression (random fp32)."""
    return int(state_bytes * (1 + changed_fraction * (commits - 1)) * 1.02)


# ---- one measurement in a fresh process --------------------------------------------


def _wrap_phases() -> dict[str, float | None]:
    """Time gc's phases by wrapping PRIVATE helpers of ckvc.gc (looked up at call time):
    ``_copy_live`` (the repack copy) and ``_unlink`` (deleting trash after the critical
    section). A helper that no longer exists reports None."""
    import ckvc.gc as gc_mod

    phases: dict[str, float | None] = {}
    for attr, name in (("_copy_live", "copy_s"), ("_unlink", "unlink_s")):
        fn = getattr(gc_mod, attr, None)
        if not callable(fn):
            phases[name] = None
            continue
        phases[name] = 0.0

        def timed(*a: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                phases[_name] = (phases[_name] or 0.0) + time.perf_counter() - t0

        setattr(gc_mod, attr, timed)
    return phases


def child_main(op: str, path: Path) -> None:
    """Run ``Repo.gc`` (op "gc") or its dry run (op "plan"); print what it cost as JSON."""
    phases = _wrap_phases()
    repo = ckvc.Repo.open(path)
    rss_before = _status_kb("VmRSS") * 1024
    hwm_reset = _reset_hwm()
    c0, m0 = own_cpu_seconds(), machine_busy_seconds()
    t0 = time.perf_counter()
    report = repo.gc(dry_run=op == "plan", now=True)
    elapsed = time.perf_counter() - t0
    c1, m1 = own_cpu_seconds(), machine_busy_seconds()
    peak = _status_kb("VmHWM") * 1024 if hwm_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss_file = _status_kb("RssFile") * 1024
    plan = report.plan
    repo.close()
    out = {
        "op": op,
        "seconds": elapsed,
        "rss_before": rss_before,
        "peak": peak,
        "extra": peak - rss_before,
        "hwm_reset": hwm_reset,
        "rss_file_after": rss_file,
        "own_cores": (c1 - c0) / elapsed,
        "other_cores": max(0.0, (m1 - m0) - (c1 - c0)) / elapsed,
        "packs_before": len(plan.packs),
        "pack_bytes_before": sum(p.size for p in plan.packs),
        "repack_live_bytes": sum(p.live_bytes for p in plan.packs if p.action == "repack"),
        "report": report.to_json(),
        **phases,
    }
    print(json.dumps(out))


def run_child(op: str, path: Path) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child-op", op, "--child-path", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child {op} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    data: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return data


# ---- the matrix --------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


@dataclass
class Cell:
    commits: int
    kept: int
    history_bytes: int  # logical: commits x state size
    released: int = 0  # commits the retention plan pruned
    retain_s: list[float] = field(default_factory=list)
    plan_s: list[float] = field(default_factory=list)
    plan_peak_extra: list[int] = field(default_factory=list)
    gc_s: list[float] = field(default_factory=list)
    execute_s: list[float] = field(default_factory=list)  # GcReport.seconds: after planning
    critical_s: list[float] = field(default_factory=list)
    copy_s: list[float] = field(default_factory=list)  # repack: copy live records out of mostly-dead packs
    unlink_s: list[float] = field(default_factory=list)  # unlinking the removed packs (after the critical section)
    peak_extra: list[int] = field(default_factory=list)
    rss_before: list[int] = field(default_factory=list)
    other_cores: list[float] = field(default_factory=list)
    hwm_reset: bool = True
    live_bytes: int = 0
    garbage_bytes: int = 0
    freed_bytes: int = 0
    repack_bytes: int = 0
    packs_before: int = 0
    pack_bytes_before: int = 0
    pack_bytes_after: int = 0
    packs_after: int = 0
    packs_deleted: int = 0
    packs_repacked: int = 0
    packs_written: int = 0
    objects_copied: int = 0
    verified: str = ""
    gc_every: int = 0  # steady state: commits since the last gc (0: one gc over the whole history)
    backlog_gc_s: float | None = None  # steady state: the untimed gc that cleared the backlog
    backlog_freed_bytes: int | None = None

    @property
    def gc_median(self) -> float:
        return _median(self.gc_s)

    @property
    def peak_median(self) -> float:
        return _median([float(x) for x in self.peak_extra])

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            gc_median_s=self.gc_median,
            plan_median_s=_median(self.plan_s),
            execute_median_s=_median(self.execute_s),
            critical_median_s=_median(self.critical_s),
            copy_median_s=_median(self.copy_s),
            unlink_median_s=_median(self.unlink_s),
            peak_extra_median_bytes=self.peak_median,
            gc_s_per_live_gb=self.gc_median / (self.live_bytes / GB) if self.live_bytes else None,
            gc_s_per_garbage_gb=self.gc_median / (self.garbage_bytes / GB) if self.garbage_bytes else None,
        )
        return out


def verify(path: Path, keep: int) -> str:
    """After gc: metadata fsck is clean, the oldest kept commit loads, the one before is pruned."""
    with ckvc.Repo.open(path) as repo:
        fsck = repo.fsck(level="metadata")
        if not fsck.ok:
            raise RuntimeError(f"fsck after gc failed: {fsck.problems[:3]}")
        oldest = repo.resolve(f"HEAD~{keep - 1}")
        loaded = repo.load(oldest)
        n = len(loaded)
        del loaded
        try:
            repo.load(f"HEAD~{keep}")
        except PrunedCommitError:
            return f"fsck ok, HEAD~{keep - 1} loads ({n} tensors), HEAD~{keep} pruned"
        raise RuntimeError(f"HEAD~{keep} should be pruned")


def run_cell(src: Path, commits: int, keep: int, state_bytes: int, args: argparse.Namespace, work: Path) -> Cell:
    cell = Cell(commits, keep, commits * state_bytes)
    cold = Cold() if args.cold else None
    for r in range(args.repeats):
        dst = work / "run"
        remove(dst)
        shutil.copytree(src, dst, symlinks=True)
        with ckvc.Repo.open(dst) as repo:
            t0 = time.perf_counter()
            plan = repo.retain(RetentionPolicy(keep_last=keep))
            cell.retain_s.append(time.perf_counter() - t0)
            cell.released = len(plan.released)
        for op in ("plan", "gc"):
            os.sync()
            if cold is not None:
                cold.evict(dst)
            data = run_child(op, dst)
            rep = data["report"]
            if op == "plan":
                cell.plan_s.append(data["seconds"])
                cell.plan_peak_extra.append(data["extra"])
                continue
            cell.gc_s.append(data["seconds"])
            cell.execute_s.append(rep["seconds"])
            cell.critical_s.append(rep["critical_section_s"])
            if data.get("copy_s") is not None:
                cell.copy_s.append(data["copy_s"])
            if data.get("unlink_s") is not None:
                cell.unlink_s.append(data["unlink_s"])
            cell.peak_extra.append(data["extra"])
            cell.rss_before.append(data["rss_before"])
            cell.other_cores.append(data["other_cores"])
            cell.hwm_reset = cell.hwm_reset and data["hwm_reset"]
            cell.live_bytes = rep["live_bytes"]
            cell.garbage_bytes = rep["reclaimable_bytes"]
            cell.freed_bytes = rep["bytes_freed"]
            cell.repack_bytes = data["repack_live_bytes"]
            cell.packs_before = data["packs_before"]
            cell.pack_bytes_before = data["pack_bytes_before"]
            cell.packs_deleted = rep["packs_deleted"]
            cell.packs_repacked = rep["packs_repacked"]
            cell.packs_written = rep["packs_written"]
            cell.objects_copied = rep["objects_copied"]
            log(
                f"  N={commits} keep={keep} #{r + 1}: gc {data['seconds']:.2f} s "
                f"(copy {data.get('copy_s') or float('nan'):.2f} s, "
                f"unlink {data.get('unlink_s') or float('nan'):.2f} s, "
                f"critical {rep['critical_section_s'] * 1e3:.0f} ms), plan {cell.plan_s[-1]:.2f} s, "
                f"peak +{data['extra'] / MIB:.0f} MiB, freed {rep['bytes_freed'] / MIB:.0f} MiB"
            )
        packs = dst / ".ckvc" / "packs"
        cell.pack_bytes_after = sum(p.stat().st_size for p in packs.glob("*.pack"))
        cell.packs_after = len(list(packs.glob("*.pack")))
        if r == 0:
            cell.verified = verify(dst, keep)
        remove(dst)
    return cell


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Log-log slope from the first to the last point: 0 = flat, 1 = proportional."""
    if len(xs) < 2 or min(xs[0], xs[-1], ys[0], ys[-1]) <= 0 or xs[0] == xs[-1]:
        return None
    return math.log(ys[-1] / ys[0]) / math.log(xs[-1] / xs[0])


def growth(cells: list[Cell], x_name: str, x: list[float]) -> dict[str, Any]:
    gc_s = [c.gc_median for c in cells]
    peak = [c.peak_median for c in cells]
    plan = [_median(c.plan_s) for c in cells]
    unlink = [_median(c.unlink_s) for c in cells]
    return {
        "x": x_name,
        "x_ratio": x[-1] / x[0] if x[0] else None,
        "gc_time_ratio": gc_s[-1] / gc_s[0] if gc_s[0] else None,
        "gc_time_slope": slope(x, gc_s),
        "plan_time_ratio": plan[-1] / plan[0] if plan[0] else None,
        "plan_time_slope": slope(x, plan),
        "unlink_time_ratio": unlink[-1] / unlink[0] if unlink[0] else None,
        "unlink_time_slope": slope(x, unlink),
        "peak_rss_ratio": peak[-1] / peak[0] if peak[0] else None,
        "peak_rss_slope": slope(x, peak),
    }


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    shape = pick_shape(args.size_mb * MIB)
    state = build_state(shape)
    state_bytes = state_nbytes(state)
    changed = pick_changed(state, args.changed)
    changed_bytes = sum(state[n].numel() * state[n].element_size() for n in changed)
    fraction = changed_bytes / state_bytes
    del state
    history, keeps = args.history, args.keep
    history_keep = min(keeps)
    sizes = sorted(set(history) | {args.commits})

    base_dir = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base_dir.mkdir(parents=True, exist_ok=True)
    need = sum(estimate_stored(state_bytes, fraction, n) for n in sizes)
    need += estimate_stored(state_bytes, fraction, args.commits) + 2 * state_bytes + int(GB)
    need += estimate_stored(state_bytes, fraction, history_keep + args.gc_every)  # a steady-state source
    free = shutil.disk_usage(base_dir).free
    if free < need:
        raise SystemExit(f"{base_dir} has {free / GB:.1f} GB free; this run needs about {need / GB:.1f} GB")
    work = Path(tempfile.mkdtemp(prefix="ckvc-gc-bench-", dir=base_dir))
    log(
        f"state {state_bytes / MIB:.0f} MiB in {shape.layers} layers (d {shape.d}), {len(changed)} tensors "
        f"= {fraction:.0%} change per commit; work dir {work} ({free / GB:.0f} GB free, need ~{need / GB:.1f})"
    )
    config: dict[str, Any] = {
        "commits": args.commits,
        "size_mb": args.size_mb,
        "state_bytes": state_bytes,
        "shape": asdict(shape),
        "changed_tensors": len(changed),
        "changed_fraction": fraction,
        "history": history,
        "history_keep": history_keep,
        "keep": keeps,
        "gc_every": args.gc_every,
        "repeats": args.repeats,
        "cache": "cold" if args.cold else "warm",
        "cpus": os.cpu_count(),
        "loadavg_start": _loadavg(),
        "torch": torch.__version__,
        "ckvc": ckvc.__version__,
        "work_dir": str(work),
    }
    cells: dict[tuple[int, int, int], Cell] = {}  # (commits, kept, gc_every)
    try:
        t0 = time.perf_counter()
        sources = build_sources(work, shape, changed, sizes)
        config["build_seconds"] = time.perf_counter() - t0
        config["source_pack_bytes"] = {str(n): disk_bytes(p / ".ckvc" / "packs") for n, p in sources.items()}
        wanted = [(n, history_keep) for n in history] + [(args.commits, k) for k in keeps]
        for n, k in dict.fromkeys(wanted):
            log(f"cell: {n} commits, keep-last {k}")
            cells[(n, k, 0)] = run_cell(sources[n], n, k, state_bytes, args, work)
        for n in history:
            src = work / f"steady-{n}"
            backlog = build_steady_source(sources[n], src, shape, changed, n, history_keep, args.gc_every)
            m = n + args.gc_every
            log(f"cell: steady state, {m} commits, keep-last {history_keep}, gc every {args.gc_every} commits")
            cell = run_cell(src, m, history_keep, state_bytes, args, work)
            cell.gc_every = args.gc_every
            cell.backlog_gc_s = backlog["seconds"]
            cell.backlog_freed_bytes = backlog["bytes_freed"]
            cells[(m, history_keep, args.gc_every)] = cell
            remove(src)
    finally:
        log(f"cleaning up {work}")
        shutil.rmtree(work, ignore_errors=True)
    hist_cells = [cells[(n, history_keep, 0)] for n in history]
    live_cells = [cells[(args.commits, k, 0)] for k in keeps]
    steady_cells = [cells[(n + args.gc_every, history_keep, args.gc_every)] for n in history]
    config["loadavg_end"] = _loadavg()
    return {
        "config": config,
        "cells": [c.to_json() for c in cells.values()],
        "series": {
            "history": {
                "cells": [[c.commits, c.kept] for c in hist_cells],
                "growth": growth(hist_cells, "garbage_bytes", [float(c.garbage_bytes) for c in hist_cells]),
            },
            "live": {
                "cells": [[c.commits, c.kept] for c in live_cells],
                "growth": growth(live_cells, "live_bytes", [float(c.live_bytes) for c in live_cells]),
            },
            "steady": {
                "cells": [[c.commits, c.kept, c.gc_every] for c in steady_cells],
                "growth": growth(steady_cells, "history_bytes", [float(c.history_bytes) for c in steady_cells]),
            },
        },
    }


# ---- output ---------------------------------------------------------------------------


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(res: dict[str, Any]) -> None:
    c = res["config"]
    cells = {(d["commits"], d["kept"], d["gc_every"]): d for d in res["cells"]}
    print()
    print(
        f"ckvc gc benchmark: {c['state_bytes'] / MIB:.0f} MiB fp32 state per commit, "
        f"{c['changed_fraction']:.0%} of it new random data per commit ({c['changed_tensors']} tensors), "
        f"the rest deduplicated; {c['cpus']} CPUs, {c['cache']} page cache, "
        f"{'median of ' + str(c['repeats']) if c['repeats'] > 1 else 'single run (1 repeat)'}"
    )
    print(
        "gc = Repo.gc(now=True) after retain(keep_last=K), fresh process; plan = gc(dry_run=True); "
        "peak = peak RSS - RSS after import + open"
    )
    print("MB = MiB; live / garbage = stored bytes (zstd-1 on random fp32 saves little)")
    print()
    head = (
        f"{'commits':>7}{'kept':>5}{'hist GB':>8}{'live MB':>9}{'garb MB':>9}{'freed MB':>9}{'repack MB':>10}"
        f"{'packs':>6}{'del/rep':>8}{'plan s':>7}{'gc s':>6}{'copy s':>7}{'unlink s':>9}{'crit ms':>8}{'peak MB':>8}"
        f"{'s/live GB':>10}{'s/garb GB':>10}"
    )
    for series, title in (
        ("history", f"history grows, live fixed (keep-last {c['history_keep']})"),
        ("live", f"live grows, history fixed ({c['commits']} commits)"),
        (
            "steady",
            f"steady state: history grows, live fixed (keep-last {c['history_keep']}; "
            f"gc after every {c['gc_every']} commits)",
        ),
    ):
        print(f"[{title}]")
        print(head)
        print("-" * len(head))
        for n, k, *every in res["series"][series]["cells"]:
            d = cells[(n, k, every[0] if every else 0)]
            print(
                f"{n:>7}{k:>5}{d['history_bytes'] / GB:>8.2f}{d['live_bytes'] / MIB:>9.0f}"
                f"{d['garbage_bytes'] / MIB:>9.0f}{d['freed_bytes'] / MIB:>9.0f}{d['repack_bytes'] / MIB:>10.0f}"
                f"{d['packs_before']:>6}{str(d['packs_deleted']) + '/' + str(d['packs_repacked']):>8}"
                f"{d['plan_median_s']:>7.2f}{d['gc_median_s']:>6.2f}{d['copy_median_s']:>7.2f}"
                f"{d['unlink_median_s']:>9.2f}{d['critical_median_s'] * 1e3:>8.0f}"
                f"{d['peak_extra_median_bytes'] / MIB:>8.0f}"
                f"{_fmt(d['gc_s_per_live_gb']):>10}{_fmt(d['gc_s_per_garbage_gb']):>10}"
            )
        g = res["series"][series]["growth"]
        what = {"history": "garbage", "live": "live data", "steady": "history"}[series]
        print(
            f"  growth: {what} x{_fmt(g['x_ratio'])} -> gc time x{_fmt(g['gc_time_ratio'])} "
            f"(slope {_fmt(g['gc_time_slope'])}), plan time x{_fmt(g['plan_time_ratio'])} "
            f"(slope {_fmt(g['plan_time_slope'])}), unlink time x{_fmt(g['unlink_time_ratio'])} "
            f"(slope {_fmt(g['unlink_time_slope'])}), peak RSS x{_fmt(g['peak_rss_ratio'])} "
            f"(slope {_fmt(g['peak_rss_slope'])})"
        )
        print()
    print("details")
    for d in res["cells"]:
        steady = (
            f"steady: backlog gc {d['backlog_gc_s']:.1f} s freed {d['backlog_freed_bytes'] / MIB:.0f} MB, "
            f"then {d['gc_every']} commits  "
            if d["gc_every"]
            else ""
        )
        print(
            f"  N={d['commits']:<4} keep={d['kept']:<3} {steady}released {d['released']:>4}  "
            f"execute {d['execute_median_s']:.2f} s  packs {d['packs_before']} -> {d['packs_after']} "
            f"(written {d['packs_written']}, objects copied {d['objects_copied']})  "
            f"pack MB {d['pack_bytes_before'] / MIB:.0f} -> {d['pack_bytes_after'] / MIB:.0f}  "
            f"RSS before {_median(d['rss_before']) / MIB:.0f} MB  "
            f"plan peak +{_median(d['plan_peak_extra']) / MIB:.0f} MB  "
            f"other cores {_median(d['other_cores']):.2f}  "
            f"[{'VmHWM reset' if d['hwm_reset'] else 'ru_maxrss'}]"
        )
        print(f"      verified: {d['verified']}")
    busy = [d for d in res["cells"] if _median(d["other_cores"]) > 0.25]
    if busy:
        print(
            f"\nWARNING: other processes kept >0.25 CPU cores busy during gc in {len(busy)} of "
            f"{len(res['cells'])} cells (load average {c['loadavg_start']} -> {c['loadavg_end']})"
        )
    print(
        f"\nslope = log-log slope from the first to the last row (0 flat, 1 proportional); "
        f"build {c['build_seconds']:.0f} s"
    )


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commits", type=int, default=None, help="commits in the largest repository (default 100)")
    ap.add_argument("--size-mb", type=int, default=None, help="state size per commit in MiB (default 100)")
    ap.add_argument("--changed", type=float, default=0.30, help="fraction of bytes new in each commit (default 0.3)")
    ap.add_argument("--keep", type=_int_list, default=None, help="keep-last values for the live series (5,10,20)")
    ap.add_argument("--history", type=_int_list, default=None, help="commit counts for the history series (N/4,N/2,N)")
    ap.add_argument("--gc-every", type=int, default=3, help="steady-state series: commits between two gcs (default 3)")
    ap.add_argument("--repeats", type=int, default=3, help="gc runs per cell, each on a fresh copy (default 3)")
    ap.add_argument("--quick", action="store_true", help="small check: 20 commits x 20 MiB, keep 2,4,8")
    ap.add_argument("--cold", action="store_true", help="evict the repository from the page cache before each gc")
    ap.add_argument("--dir", default=None, help="where to make the temporary work dir (default: system temp dir)")
    ap.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")
    ap.add_argument("--child-op", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_op:
        child_main(args.child_op, Path(args.child_path))
        return
    args.commits = args.commits or (20 if args.quick else 100)
    args.size_mb = args.size_mb or (20 if args.quick else 100)
    args.keep = args.keep or ([2, 4, 8] if args.quick else [5, 10, 20])
    n = args.commits
    args.history = args.history or sorted({max(1, n // 4), max(1, n // 2), n})
    if args.repeats < 1 or args.size_mb < 1 or args.gc_every < 1 or n < 2:
        ap.error("--repeats, --size-mb and --gc-every must be positive and --commits at least 2")
    if not 0 < args.changed < 1:
        ap.error("--changed must be between 0 and 1")
    if max(args.history) > n:
        ap.error("--history values must not exceed --commits")
    if max(args.keep) >= n or min(args.keep) >= min(args.history):
        ap.error("every --keep must be below --commits, and the smallest below the smallest --history")
    args.keep = sorted(set(args.keep))
    args.history = sorted(set(args.history))
    started = time.perf_counter()
    res = run_benchmark(args)
    res["config"]["wall_seconds"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_table(res)
        print(f"(total wall time {res['config']['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
