"""How the chunk size trades throughput against dedup granularity.

For each candidate chunk size, on one synthetic transformer-like state:
- commit of new data, re-commit of unchanged data, full load (medians, seconds);
- bytes newly stored when 1% of an embedding's rows change (sparse updates),
  as a fraction of the embedding's size: smaller chunks dedupe finer;
- index entries and per-chunk overhead per GB.

    python benchmarks/chunk_size.py [--size-mb 256] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from foundation import median_time

import ckvc

SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20]


def make_state(size_mb: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = 1024
    state = {"embed": torch.randn(32000, d, generator=g) * 0.02}  # 125 MiB of fp32
    layer = 0
    while sum(t.numel() * 4 for t in state.values()) < size_mb << 20:
        for name, shape in (("qkv", (3 * d, d)), ("o", (d, d)), ("up", (4 * d, d)), ("down", (d, 4 * d))):
            state[f"layers.{layer}.{name}"] = torch.randn(*shape, generator=g) * 0.02
        layer += 1
    return state


def measure(chunk_size: int, state: dict[str, torch.Tensor], repeats: int, base: Path) -> dict[str, Any]:
    logical = sum(t.numel() * t.element_size() for t in state.values())
    commit_new = []
    for i in range(repeats):
        path = base / f"r{chunk_size}-{i}"
        repo = ckvc.Repo.init(path, chunk_size=chunk_size)
        t = time.perf_counter()
        repo.commit(state)
        commit_new.append(time.perf_counter() - t)
        if i < repeats - 1:
            repo.close()
            shutil.rmtree(path)
    recommit = median_time(lambda: repo.commit(state), repeats)
    load = median_time(lambda: repo.load(), repeats)
    # Sparse update: 1% of the embedding rows change.
    changed = dict(state)
    embed = state["embed"].clone()
    rows = torch.randperm(embed.shape[0], generator=torch.Generator().manual_seed(1))[: embed.shape[0] // 100]
    embed[rows] += 1e-3
    changed["embed"] = embed
    repo.commit(changed)
    stats = repo.last_commit_stats
    assert stats is not None
    embed_bytes = embed.numel() * 4
    chunks = -(-logical // chunk_size)
    repo.close()
    return {
        "chunk_size": chunk_size,
        "commit_new_s": statistics.median(commit_new),
        "recommit_s": recommit,
        "load_s": load,
        "commit_GBps": logical / statistics.median(commit_new) / 1e9,
        "load_GBps": logical / load / 1e9,
        "sparse_update_new_fraction": stats.new_chunk_raw_bytes / embed_bytes,
        "index_entries_per_GB": chunks * (1 << 30) // logical,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    state = make_state(args.size_mb)
    base = Path(tempfile.mkdtemp(prefix="ckvc-chunk-bench-"))
    try:
        rows = [measure(size, state, args.repeats, base) for size in SIZES]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    logical = sum(t.numel() * 4 for t in state.values())
    print(f"state: {logical / 2**20:.0f} MiB fp32, {len(state)} tensors; medians of {args.repeats}")
    print(f"{'chunk':>8} {'commit s':>9} {'GB/s':>6} {'re-commit s':>12} {'load s':>8} {'GB/s':>6} "
          f"{'1%-rows new':>12} {'entries/GB':>11}")  # fmt: skip
    for r in rows:
        print(
            f"{r['chunk_size'] >> 10:>6}Ki {r['commit_new_s']:>9.3f} {r['commit_GBps']:>6.2f} {r['recommit_s']:>12.3f} "
            f"{r['load_s']:>8.3f} {r['load_GBps']:>6.2f} {r['sparse_update_new_fraction']:>12.3f} "
            f"{r['index_entries_per_GB']:>11}"
        )


if __name__ == "__main__":
    main()
