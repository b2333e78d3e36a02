"""DCP through ckvc against DCP's FileSystemWriter/Reader, at world size 2 (gloo, CPU).

    .venv/bin/python benchmarks/distributed.py [--size-mb 1024] [--rounds 3] [--saves 10] [--dir DIR] [--json]

Both ranks are spawned local processes; each holds half of ``--size-mb`` of fp32
tensors (an FSDP-like split: rank r owns its own layers). Measured, rounds
alternating ckvc and FileSystemWriter (A B A B, start rotating; these machines
drift 2x between minutes), medians over ``--rounds``:

* first save: ``dcp.save`` into a fresh repository / a fresh directory;
* unchanged re-save: the same state again (ckvc: into the same repository, a new
  commit; FileSystemWriter: a new directory, what a DCP user keeps per step);
* load (warm): ``dcp.load`` of the last save, after one untimed load.

Then bytes on disk after ``--saves`` saves of a slowly changing state (half the
layers frozen, the other half moving by 1e-3 relative per step, like a fine-tune):
ckvc's packs against the sum of the FileSystemWriter directories. Each timing is
the coordinator's wall time of the whole collective call, ``os.sync()`` before
it; directories are removed outside timed regions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORLD = 2
LAYER_MB = 4


def _state(rank: int, size_mb: int) -> dict[str, Any]:
    import torch

    per_rank = max(1, size_mb // WORLD)
    layers = max(2, per_rank // LAYER_MB)
    numel = per_rank * (1 << 20) // 4 // layers
    g = torch.Generator().manual_seed(rank)
    return {f"rank{rank}.layer{i}": torch.randn(numel, generator=g) * 0.02 for i in range(layers)}


def _step(state: dict[str, Any], step: int) -> None:
    """A fine-tune step: the first half of the layers frozen, the rest nudged."""
    import torch

    names = sorted(state)
    g = torch.Generator().manual_seed(1000 + step)
    for name in names[len(names) // 2 :]:
        t = state[name]
        t.add_(torch.randn(t.shape, generator=g) * (1e-3 * 0.02))


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _timed(fn: Callable[[], Any]) -> float:
    import torch.distributed as dist

    os.sync()
    dist.barrier()
    started = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - started


def _rank_main(rank: int, store: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckvc
    import ckvc.dcp

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=600)
    )
    work = Path(args.dir)
    state = _state(rank, args.size_mb)
    times: dict[str, list[float]] = {k: [] for k in ("ckvc_first", "fs_first", "ckvc_resave", "fs_resave")}
    times.update({"ckvc_load": [], "fs_load": []})

    def fresh(name: str) -> Path:
        path = work / name
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        return path

    for round_ in range(args.rounds):
        repo_dir = fresh(f"repo{round_}")
        if rank == 0:
            ckvc.Repo.init(repo_dir).close()
        dist.barrier()
        fs_dirs = [fresh(f"fs{round_}a"), fresh(f"fs{round_}b")]
        with ckvc.Repo.open(repo_dir) as repo:
            target = {k: torch.empty_like(v) for k, v in state.items()}

            def ckvc_save(repo: ckvc.Repo = repo) -> None:
                dcp.save(state, storage_writer=ckvc.dcp.Writer(repo, message="bench"))

            def ckvc_load(repo: ckvc.Repo = repo, target: dict[str, Any] = target) -> None:
                dcp.load(target, storage_reader=ckvc.dcp.Reader(repo))

            def fs_save(path: Path) -> Callable[[], None]:
                return lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))

            def fs_load(target: dict[str, Any] = target, path: Path = fs_dirs[1]) -> None:
                dcp.load(target, storage_reader=dcp.FileSystemReader(str(path)))

            order: list[tuple[str, Callable[[], None]]] = [("ckvc_first", ckvc_save), ("fs_first", fs_save(fs_dirs[0]))]
            order += [("ckvc_resave", ckvc_save), ("fs_resave", fs_save(fs_dirs[1]))]
            if round_ % 2:
                order = [order[1], order[0], order[3], order[2]]
            for name, fn in order:
                times[name].append(_timed(fn))
            loads: list[tuple[str, Callable[[], None]]] = [("ckvc_load", ckvc_load), ("fs_load", fs_load)]
            for _, load in loads:
                load()  # warm: page cache and first touch of the destination
            for name, load in loads if round_ % 2 == 0 else loads[::-1]:
                times[name].append(_timed(load))
            assert all(torch.equal(target[k], state[k]) for k in state)
        for path in (repo_dir, *fs_dirs):
            fresh(path.name)  # removed outside the timed regions

    # Bytes after a sequence of saves of a slowly changing state.
    repo_dir = fresh("repo-seq")
    if rank == 0:
        ckvc.Repo.init(repo_dir).close()
    dist.barrier()
    fs_total = 0
    with ckvc.Repo.open(repo_dir) as repo:
        for step in range(args.saves):
            _step(state, step)
            dcp.save(state, storage_writer=ckvc.dcp.Writer(repo, message=f"step {step}"))
            path = fresh(f"fs-seq{step}")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))
            dist.barrier()
            if rank == 0:
                fs_total += _tree_bytes(path)
            fresh(path.name)
    dist.barrier()
    if rank == 0:
        packs = _tree_bytes(repo_dir / ".ckvc" / "packs")
        Path(out).write_text(json.dumps({"times": times, "ckvc_bytes": packs, "fs_bytes": fs_total}))
    fresh("repo-seq")
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=64, help="fp32 MiB over both ranks (the issue: 1024)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="ckvc-dist-bench-", dir=args.dir)
    args.dir = scratch
    try:
        ctx = multiprocessing.get_context("spawn")
        store, out = os.path.join(scratch, "store"), os.path.join(scratch, "result.json")
        procs = [ctx.Process(target=_rank_main, args=(r, store, args, out)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs) or not os.path.exists(out):
            sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        result = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in result["times"].items()}
    ratios = {
        "first_save": med["ckvc_first"] / med["fs_first"],
        "unchanged_resave": med["ckvc_resave"] / med["fs_resave"],
        "load_warm": med["ckvc_load"] / med["fs_load"],
        "bytes_after_saves": result["ckvc_bytes"] / result["fs_bytes"],
    }
    if args.json:
        print(json.dumps({"size_mb": args.size_mb, "world": WORLD, "medians_s": med, **result, "ratios": ratios}))
        return
    print(f"DCP at world size {WORLD}, {args.size_mb} MiB fp32, {args.rounds} rounds (medians, seconds)")
    gb = args.size_mb / 1024
    for label, a, b in (
        ("first save", "ckvc_first", "fs_first"),
        ("unchanged re-save", "ckvc_resave", "fs_resave"),
        ("load (warm)", "ckvc_load", "fs_load"),
    ):
        print(
            f"  {label:18} ckvc {med[a]:7.3f} s ({gb / med[a]:5.2f} GB/s)   FileSystem {med[b]:7.3f} s "
            f"({gb / med[b]:5.2f} GB/s)   ratio {med[a] / med[b]:.2f}"
        )
    print(
        f"  bytes after {args.saves} saves: ckvc {result['ckvc_bytes'] / 2**20:.1f} MiB, FileSystem "
        f"{result['fs_bytes'] / 2**20:.1f} MiB, ratio {ratios['bytes_after_saves']:.3f}"
    )
    goals = {"first_save": 1.3, "unchanged_resave": 0.5, "load_warm": 1.5, "bytes_after_saves": 0.5}
    met = ", ".join(f"{k} {ratios[k]:.2f} <= {v} {'yes' if ratios[k] <= v else 'NO'}" for k, v in goals.items())
    print(f"goals (ratio to FileSystemWriter/Reader): {met}")


if __name__ == "__main__":
    main()
