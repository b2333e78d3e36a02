"""Scale benchmark (issue 33): a state of 6 GB and more loaded in a FRESH process, warm and
cold, by ckvc, ``torch.load`` and safetensors' ``load_file``, in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/scale.py [--size-mb 6144] [--rounds 3]
        [--dtype fp32|bf16] [--dir DIR]

The state is foundation.py's GPT-like state dict (N(0, 0.02) weights). It is written once
(untimed) as a ckvc commit with the default codec, a ``torch.save`` file and a safetensors
file; the parent then drops it, so that a loader's process, the page cache of the file it
reads and nothing else fit in memory.

Each timed load runs in a new interpreter that imports torch first (every loader needs it);
the timed part starts before ``import ckvc`` (ckvc's import and ``Repo.open`` count against
it) and ends when the whole state is in memory:

* ckvc: ``ckvc.Repo.open(path).load("HEAD")``: every chunk is read, verified (BLAKE3) and
  decoded into fresh tensors;
* ``torch.load(path, weights_only=True)``: the file read into memory (no mmap);
* ``safetensors.torch.load_file(path)`` and a clone of each tensor: load_file maps the file
  and its tensors share the mapping, so the clone is what brings the state into memory.

Warm: the page cache is dropped and the loader's own files read through just before it
runs (with all three copies cached, a loader's fresh memory would come from evicting the
others' pages: slow on this VM, and it hit whichever loader ran at the time). Cold: the
page cache is dropped before each load (drop_caches, or posix_fadvise where that is not
permitted). Rounds alternate the order of the loaders; figures are medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import foundation as fd
import torch
from safetensors.torch import save_file

import ckvc

MIB = 1 << 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

LOADERS = {
    "ckvc load": "t = time.perf_counter(); import ckvc; ckvc.Repo.open({repo!r}).load('HEAD')",
    "torch.load": "t = time.perf_counter(); torch.load({pt!r}, weights_only=True)",
    # load_file maps the file and its tensors share the mapping: cloned here, so the state is
    # in memory at the end as it is for the other two (throughput.py's baseline too)
    "safetensors load_file + clone": (
        "from safetensors.torch import load_file; t = time.perf_counter(); "
        "{{k: v.clone() for k, v in load_file({st!r}).items()}}"
    ),
}
GOALS = {  # (row, baseline, limit): issue 33's scale bar
    "warm": ("ckvc load", "torch.load", 1.0),
    "cold": ("ckvc load", "safetensors load_file + clone", 1.2),
}


def child_seconds(code: str) -> float:
    """Run ``code`` (which sets ``t`` and then loads) in a fresh interpreter; the seconds
    from ``t`` to the end of the load."""
    return fd.fresh_process_seconds(f"import time, torch\n{code}\nprint(time.perf_counter() - t)")


def read_through(path: Path) -> None:
    """Bring every file under ``path`` into the page cache."""
    for p in fd.tree_files(path):
        with open(p, "rb", buffering=0) as f:
            while f.read(64 * MIB):
                pass


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=6144, help="target state size in MiB (default 6144)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ckvc-scale-", dir=args.dir))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> None:
    dtype = DTYPES[args.dtype]
    shape = fd.pick_shape(args.size_mb * MIB, dtype.itemsize)
    state = fd.build_state(shape, dtype=dtype)
    nbytes = fd.state_nbytes(state)
    files = {"repo": work / "repo", "pt": work / "state.pt", "st": work / "state.safetensors"}
    fd.log(f"state {nbytes / 1e9:.2f} GB in {len(state)} tensors ({args.dtype}); writing the three copies")
    with ckvc.Repo.init(files["repo"]) as repo:
        repo.commit(state, message="scale")
    torch.save(state, files["pt"])
    save_file(state, str(files["st"]))
    del state
    paths = {name: str(p) for name, p in files.items()}
    where = {"ckvc load": files["repo"], "torch.load": files["pt"], "safetensors load_file + clone": files["st"]}
    cold = fd.Cold()
    times: dict[str, list[float]] = {}
    for number in range(args.rounds):
        order = list(LOADERS) if number % 2 == 0 else list(reversed(LOADERS))
        for name in order:
            # only this loader's files cached: with all three in the page cache a loader's
            # fresh memory would come from evicting the others' (slow here, and unfair)
            cold.evict(*where.values())
            read_through(where[name])
            times.setdefault(f"{name}, warm", []).append(child_seconds(LOADERS[name].format(**paths)))
        for name in order:
            cold.evict(where[name])
            times.setdefault(f"{name}, cold", []).append(child_seconds(LOADERS[name].format(**paths)))
        fd.log(f"round {number + 1} of {args.rounds} done")
    med = {name: statistics.median(v) for name, v in times.items()}
    print(
        f"\n{nbytes / 1e9:.2f} GB ({args.dtype}, {shape.layers} layers of d {shape.d}), fresh process per load, "
        f"median of {args.rounds}; cold via {cold.method}; {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print(f"{'load':<36}{'median s':>9}{'GB/s':>8}   rounds")
    for name, seconds in med.items():
        runs = ", ".join(f"{x:.2f}" for x in times[name])
        print(f"{name:<36}{seconds:>9.2f}{nbytes / seconds / 1e9:>8.2f}   {runs}")
    print("\nacceptance (ratio of medians):")
    for kind, (row, base, limit) in GOALS.items():
        value = med[f"{row}, {kind}"] / med[f"{base}, {kind}"]
        verdict = "PASS" if value <= limit else "FAIL"
        print(f"  {kind}: {row} / {base:<32}{value:6.2f}  (target <= {limit:g})  {verdict}")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"(wall time {time.perf_counter() - started:.0f} s)")
