"""Peak memory of ``ckvc export --format hf`` (issue 29): one output shard in memory at
a time, whatever the model's size.

    .venv/bin/python benchmarks/hf_export.py [--size-mb 2200] [--shard-mb 512] [--dir DIR]

A commit of a ``--size-mb`` fp32 state (tensors of 64 MiB, random) is exported with
``--shard-mb`` shards in a fresh child process, which reports its peak RSS (VmHWM)
above the RSS it had after importing ckvc and opening the repository, and the
export's time. Goal: peak <= shard + 256 MiB (issue: <= 800 MB for 512 MB shards).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0
import ckvc, torch, safetensors.torch  # noqa: E401
from ckvc.integrations.hf_export import export_hf
repo = ckvc.Repo.open(sys.argv[1])
try:
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
except OSError:
    pass
base = rss("VmRSS:")
start = time.perf_counter()
written = export_hf(repo, "HEAD", sys.argv[2], max_shard_bytes=int(sys.argv[3]))
seconds = time.perf_counter() - start
print(json.dumps({"peak_above_base": rss("VmHWM:") - base, "seconds": seconds, "files": len(written)}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=2200)
    parser.add_argument("--shard-mb", type=int, default=512)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args(argv)
    import torch

    import ckvc

    work = Path(tempfile.mkdtemp(prefix="ckvc-hf-", dir=args.dir))
    try:
        repo = ckvc.Repo.init(work / "repo", codec={"name": "raw"})
        g = torch.Generator().manual_seed(0)
        state = {}
        left, i = args.size_mb, 0
        while left > 0:
            mb = min(64, left)
            state[f"layers.{i:03d}.weight"] = torch.randn(mb << 18, generator=g)
            left -= mb
            i += 1
        start = time.perf_counter()
        repo.commit({"model": state}, "big")
        print(f"committed {args.size_mb} MiB in {time.perf_counter() - start:.1f} s")
        del state
        repo.close()
        out = work / "hf"
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(work / "repo"), str(out), str(args.shard_mb << 20)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        result = json.loads(done.stdout.strip().splitlines()[-1])
        peak_mb = result["peak_above_base"] / 2**20
        goal = args.shard_mb + 256
        print(
            f"export --format hf of {args.size_mb} MiB with {args.shard_mb} MiB shards: {result['files']} files in "
            f"{result['seconds']:.1f} s; peak RSS above the interpreter {peak_mb:.0f} MiB "
            f"(goal <= shard + 256 = {goal} MiB: {'met' if peak_mb <= goal else 'NOT met'})"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
