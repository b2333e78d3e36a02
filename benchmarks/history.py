"""History length (issue 33, "Scale"): ``ckvc du`` and ``ckvc log`` must stay linear
in the number of commits.

    PYTHONPATH=. .venv/bin/python benchmarks/history.py [--commits 10,50,100,200]
        [--tensors 256] [--elements 65536] [--rounds 3] [--dir DIR]

One repository grows commit by commit (a training run: ``--tensors`` fp32 tensors
of ``--elements`` values, a quarter of them changed per commit, with a metric);
at each length in ``--commits`` every command below runs ``--rounds`` times as a
user runs it (the CLI in a fresh process, output discarded), rounds alternating
the command order. Printed per length: the median seconds; then per commit and
as a growth exponent between the shortest and the longest history (time ~ N^k,
linear is k <= 1), the time over start-up (``ckvc --version``: the interpreter
and the CLI's imports, the same at every length).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import ckvc

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "du": ["du"],
    "du --json": ["du", "--json"],
    "log": ["log"],
    "log --json": ["log", "--json"],
    "log --oneline --graph": ["log", "--oneline", "--graph"],
    "log --best loss": ["log", "--best", "loss"],
}


def run_cli(repo: Path, args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "ckvc", "-C", str(repo), *args], check=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    return time.perf_counter() - start


def startup() -> float:
    """The interpreter and the CLI's imports alone (``ckvc --version``)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ckvc", "--version"], check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", default="10,50,100,200")
    parser.add_argument("--tensors", type=int, default=256)
    parser.add_argument("--elements", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args(argv)
    lengths = sorted(int(n) for n in args.commits.split(","))
    work = Path(tempfile.mkdtemp(prefix="ckvc-history-", dir=args.dir))
    try:
        table = run(args, lengths, work / "repo")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nhistory: {args.tensors} fp32 tensors of {args.elements} values, a quarter changed per commit")
    print(f"{'command':24s}" + "".join(f"{n:>10d}" for n in lengths) + "   ms/commit over start-up   exponent k")
    base = table["startup"]
    for name, times in table.items():
        over = [max(t - b, 1e-4) for t, b in zip(times, base, strict=True)]
        per = " ".join(f"{w / n * 1e3:.2f}" for w, n in zip(over, lengths, strict=True))
        k = math.log(over[-1] / over[0]) / math.log(lengths[-1] / lengths[0])
        shown_k = "" if name == "startup" else f"{k:.2f}"
        print(f"{name:24s}" + "".join(f"{t:10.3f}" for t in times) + f"   {per}   {shown_k}")
    print(
        "(medians in seconds, the CLI in a fresh process; per commit and k (time ~ N^k, from the shortest\n"
        " to the longest history) count the time over start-up, the interpreter and imports alone)"
    )


def run(args: argparse.Namespace, lengths: list[int], path: Path) -> dict[str, list[float]]:
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.w": torch.randn(args.elements, generator=g) for i in range(args.tensors)}
    table: dict[str, list[float]] = {name: [] for name in ["startup", *COMMANDS]}
    done = 0
    with ckvc.Repo.init(path) as repo:
        for length in lengths:
            while done < length:
                for i in range(done % 4, args.tensors, 4):
                    state[f"layers.{i}.w"] = state[f"layers.{i}.w"] + 1e-3
                repo.commit(state, message=f"step {done}", metrics={"loss": 1.0 / (done + 1)})
                done += 1
            samples: dict[str, list[float]] = {name: [] for name in table}
            for rnd in range(args.rounds):
                order = list(COMMANDS) if rnd % 2 == 0 else list(reversed(COMMANDS))
                samples["startup"].append(startup())
                for name in order:
                    samples[name].append(run_cli(path, COMMANDS[name]))
            medians = {name: statistics.median(v) for name, v in samples.items()}
            for name, value in medians.items():
                table[name].append(value)
            shown = ", ".join(f"{name} {value:.3f}" for name, value in medians.items())
            print(f"[history] {length} commits: {shown}", flush=True)
    return table


if __name__ == "__main__":
    main()
