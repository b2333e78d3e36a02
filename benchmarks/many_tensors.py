"""Many small tensors (issue 33, "Scale"): a MoE-like training state of ``--tensors``
tensors (a quarter weights, the rest AdamW state: exp_avg, exp_avg_sq and a step per
parameter), each ``--elements`` fp32 values.

    PYTHONPATH=. .venv/bin/python benchmarks/many_tensors.py [--tensors 40000] [--elements 256]
        [--rounds 3] [--dir DIR]

Per round, in alternating order (the machine drifts; the medians are printed):

* commit into a fresh repository against ``torch.save`` (+ fsync) and safetensors
  ``save_file`` (+ fsync) of the same tensors (flattened names for safetensors), the
  durable baselines of foundation.py;
* load in a fresh process (the time of the load call; torch imported before) against
  ``torch.load(weights_only=True)`` and safetensors ``load_file``;
* one tensor in a fresh process: ``repo.load(keys=[name])`` against ``safe_open`` +
  ``get_tensor`` (opening included, and torch's import, which both pay);
* ``ckvc diff --stat A B`` of two such commits (1% of the tensors changed), the CLI as a
  user runs it.

Figures per tensor are the median time divided by the tensor count.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import ckvc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import foundation as fd  # the durable save baselines every benchmark uses


def make_state(tensors: int, elements: int, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    params = tensors // 4
    model = {f"layers.{i // 64}.experts.{i % 64}.w": torch.randn(elements, generator=g) for i in range(params)}
    optim = {
        i: {
            "step": torch.tensor(float(seed + 1)),
            "exp_avg": torch.randn(elements, generator=g),
            "exp_avg_sq": torch.rand(elements, generator=g),
        }
        for i in range(params)
    }
    return {
        "model": model,
        "optimizer": {"state": optim, "param_groups": [{"lr": 1e-3, "params": list(range(params))}]},
    }


def flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].items()}
    for i, s in state["optimizer"]["state"].items():
        out.update({f"optimizer.state.{i}.{k}": v for k, v in s.items()})
    return out


def timed(fn: Callable[[], Any]) -> float:
    os.sync()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=40_000)
    parser.add_argument("--elements", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ckvc-many-", dir=args.dir))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> None:
    state = make_state(args.tensors, args.elements)
    flat_state = flat(state)
    n = len(flat_state)
    print(f"state: {n} tensors of {args.elements} fp32 ({sum(t.nbytes for t in flat_state.values()) >> 20} MiB)")
    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    # the repository the read rows use: two commits, 1% of the tensors changed in the second
    repo_path = work / "repo"
    with ckvc.Repo.init(repo_path) as repo:
        first = repo.commit(state, message="a")
        changed = dict(state["model"])
        for name in list(changed)[:: max(1, len(changed) // (n // 100 or 1))]:
            changed[name] = changed[name] + 1
        second = repo.commit({**state, "model": changed}, message="b")
    pt, st = work / "state.pt", work / "state.safetensors"
    torch.save(state, pt)
    save_file(flat_state, st)
    key = next(iter(flat_state))

    commit_ops: dict[str, Callable[[Path], Any]] = {
        "commit": lambda d: _commit(d, state),
        "torch.save": lambda d: fd.save_torch_durably(state, d / "s.pt"),
        "save_file": lambda d: fd.save_safetensors_durably(flat_state, d / "s.st"),
    }
    read_ops: dict[str, str] = {
        "load (fresh process)": (
            f"import time, torch, ckvc; r = ckvc.Repo.open({str(repo_path)!r}); t = time.perf_counter(); "
            f"r.load({first!r}); print(time.perf_counter() - t)"
        ),
        "torch.load": (
            f"import time, torch; t = time.perf_counter(); torch.load({str(pt)!r}, weights_only=True); "
            "print(time.perf_counter() - t)"
        ),
        "load_file": (
            "import time, torch; from safetensors.torch import load_file; t = time.perf_counter(); "
            f"load_file({str(st)!r}); print(time.perf_counter() - t)"
        ),
        "one tensor (fresh process)": (
            f"import time, ckvc; t = time.perf_counter(); r = ckvc.Repo.open({str(repo_path)!r}); "
            f"r.load({first!r}, keys=[{key!r}]); print(time.perf_counter() - t)"
        ),
        "get_tensor": (
            "import time; from safetensors import safe_open; t = time.perf_counter(); "
            f"f = safe_open({str(st)!r}, 'pt'); f.get_tensor({key!r}); print(time.perf_counter() - t)"
        ),
        "diff --stat (CLI)": (
            "import subprocess, sys, time; t = time.perf_counter(); "
            f"subprocess.run([sys.executable, '-m', 'ckvc', '-C', {str(repo_path)!r}, 'diff', '--stat', "
            f"{first!r}, {second!r}], check=True, capture_output=True); print(time.perf_counter() - t)"
        ),
    }
    for number in range(args.rounds):
        order = list(commit_ops) if number % 2 == 0 else list(reversed(commit_ops))
        for name in order:
            target = work / f"w-{name}-{number}"
            target.mkdir()
            op = commit_ops[name]
            record(name, timed(lambda op=op, target=target: op(target)))  # type: ignore[misc]
            shutil.rmtree(target)
        names = list(read_ops) if number % 2 == 0 else list(reversed(read_ops))
        for name in names:
            record(name, fd.fresh_process_seconds(read_ops[name]))
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"\n{'operation':<28} {'median s':>9} {'µs/tensor':>10}   rounds")
    for name, seconds in med.items():
        print(f"{name:<28} {seconds:>9.3f} {seconds / n * 1e6:>10.1f}   {', '.join(f'{x:.3f}' for x in times[name])}")
    print("\nratios (goal):")
    print(f"  commit / torch.save          {med['commit'] / med['torch.save']:.2f}")
    print(f"  commit / save_file           {med['commit'] / med['save_file']:.2f}")
    print(f"  commit per tensor            {med['commit'] / n * 1e6:.1f} µs (<= 50)")
    print(f"  load per tensor              {med['load (fresh process)'] / n * 1e6:.1f} µs (<= 50)")
    print(f"  load / torch.load            {med['load (fresh process)'] / med['torch.load']:.2f}")
    print(f"  load / load_file             {med['load (fresh process)'] / med['load_file']:.2f}")
    print(f"  one tensor / get_tensor      {med['one tensor (fresh process)'] / med['get_tensor']:.2f} (<= 2)")
    print(f"  diff --stat                  {med['diff --stat (CLI)']:.2f} s (<= 1)")


def _commit(directory: Path, state: dict[str, Any]) -> None:
    with ckvc.Repo.init(directory / "r") as repo:
        repo.commit(state, message="x")


if __name__ == "__main__":
    main()
