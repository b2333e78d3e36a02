"""Two source trees of ckvc against each other (a refactor's "no slower" check).

    .venv/bin/python benchmarks/ab_trees.py --before /tmp/ckvc-before --after . [--size-mb 256] [--rounds 5]

Two ckvc packages cannot share one interpreter, so each round runs one fresh child
process per tree (``PYTHONPATH=<tree>``), the two in alternating order (A B, B A, ...),
so that a machine drifting 2x between minutes hits both alike. A child builds
foundation.py's GPT-like state (the same seed in both trees), then times:

* ``commit``: the state into a fresh repository (default codec), ``os.sync()`` first,
  after an untimed small commit in another repository (imports done in both trees);
* ``commit_10pct``: the state with about 10% of its bytes changed, on top of it;
* ``checkout``: ``Repo.load`` of the first commit, warm (one untimed load first).

The parent prints each operation's median per tree and the ratio after/before
(above 1.0: the after tree is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

OPS = ("commit", "commit_10pct", "checkout")

_CHILD = r"""
import json, os, shutil, sys, tempfile, time
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
import foundation as f
import ckvc
state = f.build_state(f.pick_shape(int(sys.argv[2]) << 20))
changed = f.perturbed(state, f.pick_changed(state, 0.1), seed=7)
work = tempfile.mkdtemp(dir=sys.argv[3])
out = {}
try:
    # An untimed commit elsewhere first: each tree imports its write path (and this
    # sandbox compiles it, PYTHONDONTWRITEBYTECODE) before the clock starts, so a
    # tree that imports lazily is not charged its imports in the first timing.
    warm = ckvc.Repo.init(os.path.join(work, "warm"))
    warm.commit({"w": next(iter(state.values()))[:4].clone()}, message="warm")
    warm.close()
    repo = ckvc.Repo.init(os.path.join(work, "r"))
    os.sync(); t = time.perf_counter(); first = repo.commit(state, message="a"); out["commit"] = time.perf_counter() - t
    os.sync(); t = time.perf_counter(); repo.commit(changed, message="b"); out["commit_10pct"] = time.perf_counter() - t
    repo.load(first)
    t = time.perf_counter(); loaded = repo.load(first); out["checkout"] = time.perf_counter() - t
    assert all(loaded[k].equal(v) for k, v in state.items())
    repo.close()
finally:
    shutil.rmtree(work, ignore_errors=True)
print(json.dumps(out))
"""


def run_child(tree: Path, size_mb: int, workdir: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tree), str(size_mb), workdir],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"child for {tree} failed:\n{proc.stderr[-4000:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="source tree of the baseline")
    ap.add_argument("--after", type=Path, required=True, help="source tree under test")
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where repositories are made (default: system temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    times: dict[str, dict[str, list[float]]] = {name: {op: [] for op in OPS} for name in trees}
    with tempfile.TemporaryDirectory(dir=args.dir) as workdir:
        for round_no in range(args.rounds):
            order = ["before", "after"] if round_no % 2 == 0 else ["after", "before"]
            for name in order:
                for op, seconds in run_child(trees[name], args.size_mb, workdir).items():
                    times[name][op].append(seconds)
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)
    medians = {name: {op: statistics.median(v) for op, v in ops.items()} for name, ops in times.items()}
    summary: dict[str, Any] = {
        "size_mb": args.size_mb,
        "rounds": args.rounds,
        "medians_s": medians,
        "ratio_after_over_before": {op: medians["after"][op] / medians["before"][op] for op in OPS},
        # Each round's two runs are back to back: their ratio cancels slower drift.
        "median_round_ratio": {
            op: statistics.median(a / b for a, b in zip(times["after"][op], times["before"][op], strict=True))
            for op in OPS
        },
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{args.size_mb} MiB state, {args.rounds} alternating rounds, medians (s)")
    print(f"{'op':<14}{'before':>10}{'after':>10}{'after/before':>14}{'median of round ratios':>24}")
    for op in OPS:
        b, a = medians["before"][op], medians["after"][op]
        print(f"{op:<14}{b:>10.3f}{a:>10.3f}{a / b:>14.3f}{summary['median_round_ratio'][op]:>24.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
