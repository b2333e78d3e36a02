"""Signing benchmark (issue 28): what a signature costs a commit and an export.

    .venv/bin/python benchmarks/signing.py [--size-mb 1024] [--rounds 3] [--dir DIR]

Three comparisons, each in alternating rounds in this process (A B A B ...), medians:

* commit of a fresh ``--size-mb`` fp32 state (random, so nothing deduplicates) into a
  fresh repository, with ``sign_commits`` (Ed25519) vs without. Goal <= 1.01x.
* export of that commit as a folder, with ``--sign-key`` (ECDSA P-256, an OpenSSF
  model-signing bundle hashed while writing) vs plain. Goal <= 1.10x.
* what signing adds to an export (signed - plain) vs what ``model_signing sign key``
  (the reference tool, which re-reads the folder) takes on the plain export.
  Goal <= 0.5x. Left out, with a line saying so, when model_signing is not installed.

The state is a dict of 64 MiB tensors (the last one smaller), so a 1 GiB state is 16
tensors; the export writes it as one .safetensors file in a folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import ckvc
from ckvc import signing

TENSOR_MB = 64


def state_of(size_mb: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    left = size_mb
    i = 0
    while left > 0:
        mb = min(TENSOR_MB, left)
        out[f"layer{i:03d}.weight"] = torch.randn(mb << 18, generator=g)  # 4-byte floats
        left -= mb
        i += 1
    return out


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ckvc-sign-", dir=args.dir))
    try:
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    ed = signing.generate_key(work / "ed25519")
    ec = signing.generate_key(work / "p256", "ecdsa-p256")
    state = state_of(args.size_mb, 0)
    commits: dict[str, list[float]] = {"plain": [], "signed": []}
    n = 0

    def commit(kind: str) -> None:
        nonlocal n
        n += 1
        repo = ckvc.Repo.init(work / f"c{n}")
        if kind == "signed":
            signing.set_trust(repo.core, "sign_key", str(ed.path))
            signing.set_trust(repo.core, "sign_commits", "true")
        os.sync()  # the last round's writeback does not land in this one
        commits[kind].append(timed(lambda: repo.commit(state, "epoch")))
        if kind == "signed":
            assert signing.verify(repo.core, repo.resolve("HEAD"), "commit", {ed.key_id: ed.public}).good
        repo.close()
        shutil.rmtree(work / f"c{n}")  # outside the timed region

    for _ in range(args.rounds):
        commit("plain")
        commit("signed")
    # the median of each round's signed/plain: rounds drift together, pairs cancel it
    ratio_commit = statistics.median(s / p for s, p in zip(commits["signed"], commits["plain"], strict=True))
    print(f"commit of {args.size_mb} MiB (median of {args.rounds}):")
    print(f"  plain  {statistics.median(commits['plain']):.3f} s   signed {statistics.median(commits['signed']):.3f} s")
    print(f"  signed/plain {ratio_commit:.3f}x, median of the rounds' ratios (goal <= 1.01x)")
    # What signing adds to a commit, alone: the key loaded, the id signed, the record made durable.
    probe = ckvc.Repo.init(work / "probe")
    signing.set_trust(probe.core, "sign_key", str(ed.path))
    steps = []
    for i in range(20):
        oid = f"{i:064x}"
        start = time.perf_counter()
        key = signing.signer_for(probe.core, True)
        assert key is not None
        signing.sign(probe.core, oid, "commit", key)
        steps.append(time.perf_counter() - start)
    probe.close()
    step = statistics.median(steps)
    print(
        f"  the signing step alone (key load, sign, durable record): {step * 1e3:.2f} ms = "
        f"{step / statistics.median(commits['plain']):.4f} of the plain commit"
    )

    repo = ckvc.Repo.init(work / "src")
    repo.commit(state, "epoch")
    exports: dict[str, list[float]] = {"plain": [], "signed": []}
    reference: list[float] = []
    have_tool = shutil.which("model_signing") is not None or _importable("model_signing")
    m = 0

    def export(kind: str) -> Path:
        nonlocal m
        m += 1
        out = work / f"e{m}"
        out.mkdir()
        target = out / "model.safetensors"
        key = ec.path if kind == "signed" else None
        os.sync()
        exports[kind].append(timed(lambda: repo.export("HEAD", target, sign_key=key)))
        return out

    for _ in range(args.rounds):
        plain = export("plain")
        if have_tool:
            command = [sys.executable, "-m", "model_signing", "sign", "key", str(plain), "--private_key",
                       str(ec.path), "--signature", str(work / "reference.sig")]  # fmt: skip
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            reference.append(time.perf_counter() - start)
        shutil.rmtree(plain)
        shutil.rmtree(export("signed"))
    plain_s, signed_s = statistics.median(exports["plain"]), statistics.median(exports["signed"])
    print(f"export of {args.size_mb} MiB as a folder (median of {args.rounds}):")
    print(f"  plain  {plain_s:.3f} s   signed {signed_s:.3f} s")
    ratio_export = statistics.median(s / p for s, p in zip(exports["signed"], exports["plain"], strict=True))
    print(f"  signed/plain {ratio_export:.3f}x, median of the rounds' ratios (goal <= 1.10x)")
    if have_tool:
        tool = statistics.median(reference)
        added = max(signed_s - plain_s, 0.0)
        print(
            f"  model_signing sign key on the plain export: {tool:.3f} s (process start included); "
            f"signing's cost in ckvc {added:.3f} s = {added / tool:.3f}x of it (goal <= 0.5x)"
        )
    else:
        print("  model_signing not installed: the comparison with the reference tool is left out")
    repo.close()
    return 0


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    sys.exit(main())
