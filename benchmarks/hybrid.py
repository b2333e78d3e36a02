"""Hybrid storage benchmark (issue 16): eviction policies on a training trace, lazy
clone bytes, and a cold lazy resume against downloading one safetensors file.

    .venv/bin/python benchmarks/hybrid.py [--sections policy,lazy,resume] [--ops 50] [--seeds 5]
        [--size-mb 256] [--rounds 3] [--dir DIR] [--json]

Sections:

* policy: a lazy clone of a directory remote holding a 16-epoch history (model 1 MiB
  drifting slowly, so deltas; optimizer moment 1 MiB, new each epoch), ``cache_size``
  30% of the history's stored chunks, then a trace of ``--ops`` operations drawn
  with a seed: *resume* (50%: load the latest epoch, train one more, push it),
  *evaluate* (35%: a session evaluating one to three consecutive older epochs, their
  model only), *branch* (15%: from a past epoch, load it, train a step on a new
  branch, push it). The same traces run under each policy (lru, lfu with aging,
  slru); the figure is the byte hit rate (stored bytes a read found local over all
  it read) over ``--seeds`` traces, and the budget is checked after every operation.
* lazy: a 10-commit history on the S3 server (moto on loopback): the lazy clone's
  bytes against the metadata objects' size, then one commit's checkout and one
  tensor's view against their stored chunks (+ the keyframes they decode through).
* resume: one ``--size-mb`` fp32 state (benchmarks/foundation.py's shapes; 1024 for
  the issue's 1 GB) on the S3 server: ``clone --lazy`` + ``load("main")`` against
  downloading the state as one safetensors file with the same client (obstore,
  streamed to a file, fsynced) and loading it, every tensor materialized; alternating
  rounds (the order flips each round), medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import foundation as fd
from remote import MiB, Places, materialized, timed
from safetensors.torch import load_file

import ckvc
from ckvc.hybrid.cache import POLICIES
from ckvc.ids import ObjectType
from ckvc.remote.repository import open_remote

CHUNK = 256 << 10


def log(msg: str) -> None:
    print(f"[hybrid {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def epoch_state(step: int, branch: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * branch)
    w = torch.randn(512, 512, generator=g) + 0.001 * step
    m = torch.randn(512, 512, generator=torch.Generator().manual_seed(step + 7919 * branch))
    return {"model": {"w": w, "b": torch.full((1024,), float(step))}, "optimizer": {"m": m}, "epoch": step}


def pack_bytes(repo: ckvc.Repo) -> int:
    total = 0
    for name in repo.store.packs():
        info = repo.store.pack_info(name)
        total += 0 if info is None else info.size
    return total


def make_trace(ops: int, seed: int, epochs: int) -> list[tuple[str, list[int]]]:
    """(kind, epochs it reads) per operation; resume reads the latest (-1)."""
    rng = random.Random(seed)
    trace: list[tuple[str, list[int]]] = []
    for _ in range(ops):
        kind = rng.choices(["resume", "eval", "branch"], [0.5, 0.35, 0.15])[0]
        if kind == "eval":
            start = rng.randrange(epochs)
            trace.append((kind, list(range(start, min(epochs, start + rng.randint(1, 3))))))
        elif kind == "branch":
            trace.append((kind, [rng.randrange(epochs)]))
        else:
            trace.append((kind, [-1]))
    return trace


# ---- policy ----------------------------------------------------------------------


def policy_section(work: Path, ops: int, seeds: int, epochs: int = 16) -> dict[str, Any]:
    src_dir = work / "policy-src"
    remote_dir = work / "policy-remote"
    with ckvc.Repo.init(src_dir, chunk_size=CHUNK) as src:
        ids = [src.commit(epoch_state(i), message=f"epoch {i}") for i in range(epochs)]
        src.remotes.add("origin", str(remote_dir))
        src.push()
        handle = open_remote(src.core, src.remotes.get("origin"))
        history = sum(e.record_size for _, e in handle.core.store.index.iter_entries() if e.kind == ObjectType.CHUNK)
        handle.close()
    budget = int(0.3 * history)
    names = [*POLICIES, "unlimited"]  # unlimited: no budget, the bound no policy can pass
    results: dict[str, list[float]] = {p: [] for p in names}
    violations: dict[str, int] = {p: 0 for p in names}
    for seed in range(seeds):
        trace = make_trace(ops, seed, epochs)
        order = names if seed % 2 == 0 else names[::-1]
        for policy in order:
            # The remote grows with each run's pushes: every run starts from the same copy.
            run_remote = work / f"remote-{policy}-{seed}"
            shutil.copytree(remote_dir, run_remote)
            target = work / f"lazy-{policy}-{seed}"
            with ckvc.Repo.clone(str(run_remote), target, lazy=True) as lazy:
                if policy != "unlimited":
                    lazy.cache.set_policy(policy)
                    lazy.set_config(cache_size=budget)
                main = list(ids)
                step = epochs
                for n, (kind, reads) in enumerate(trace):
                    if kind == "resume":
                        lazy.load(main[-1])
                        main.append(lazy.commit(epoch_state(step), message=f"epoch {step}"))
                        lazy.push()
                        step += 1
                    elif kind == "eval":
                        for e in reads:
                            lazy.load(ids[e], prefix="model.")
                    else:
                        name = f"b{n}"
                        lazy.switch(ids[reads[0]], new_branch=name)
                        lazy.load(ids[reads[0]])
                        lazy.commit(epoch_state(reads[0] + 1, branch=n + 1), message=name)
                        lazy.push("origin", [name])
                        lazy.switch("main")
                    if policy != "unlimited" and pack_bytes(lazy) > budget:
                        violations[policy] += 1
                report = lazy.cache.report()
                assert report.hit_rate is not None
                results[policy].append(report.hit_rate)
            shutil.rmtree(target)
            shutil.rmtree(run_remote)
        log(f"seed {seed}: " + ", ".join(f"{p} {results[p][-1]:.3f}" for p in names))
    return {
        "budget_bytes": budget,
        "history_chunk_bytes": history,
        "ops": ops,
        "seeds": seeds,
        "hit_rate": {p: statistics.mean(v) for p, v in results.items()},
        "hit_rate_per_seed": results,
        "budget_violations": violations,
    }


# ---- lazy bytes --------------------------------------------------------------------


def closure(repo: ckvc.Repo, rev: str, paths: list[str] | None = None) -> set[bytes]:
    out: set[bytes] = set()
    for blob in repo.read_snapshot(repo.read_commit(repo.resolve(rev))).blobs:
        if paths is not None and blob.path not in paths:
            continue
        for chunk in blob.chunks:
            below: bytes | None = chunk
            while below is not None and below not in out:
                out.add(below)
                below = repo.store.delta_base(below)
    return out


def lazy_section(work: Path, places: Places) -> dict[str, Any]:
    place = places.make("s3")
    src = ckvc.Repo.init(work / "lazy-src", chunk_size=CHUNK)
    ids = [src.commit(epoch_state(i), message=f"epoch {i}") for i in range(10)]
    src.remotes.add("origin", place.url, endpoint=place.endpoint)
    src.push()
    handle = open_remote(src.core, src.remotes.get("origin"))
    index = handle.core.store.index
    meta = sum(e.record_size for _, e in index.iter_entries() if e.kind != ObjectType.CHUNK)

    def stored(oids: set[bytes]) -> int:
        return sum(handle.core.store.locate(o).record_size for o in oids)

    seconds, lazy = timed(lambda: ckvc.Repo.clone(place.url, work / "lazy-clone", endpoint=place.endpoint, lazy=True))
    received = sum(e.record_size for _, e in lazy.store.index.iter_entries())
    totals = lazy.cache.promisor.totals
    lazy.view(ids[6])["model.w"]
    view_got, view_want = totals.record_bytes, stored(closure(src, ids[6], ["model.w"]))
    before = totals.record_bytes
    lazy.checkout(ids[8])
    co_got = totals.record_bytes - before
    co_want = stored(closure(src, ids[8]) - closure(src, ids[6], ["model.w"]))
    out = {
        "metadata_bytes": meta,
        "clone_received_bytes": received,
        "clone_ratio": received / meta,
        "clone_seconds": seconds,
        "view_fetched": view_got,
        "view_chunks": view_want,
        "view_ratio": view_got / view_want,
        "checkout_fetched": co_got,
        "checkout_chunks": co_want,
        "checkout_ratio": co_got / co_want,
    }
    lazy.close()
    handle.close()
    src.close()
    place.remove()
    return out


# ---- cold resume -------------------------------------------------------------------


def resume_section(work: Path, places: Places, size_mb: int, rounds: int, kind: str) -> dict[str, Any]:
    place = places.make(kind)
    state = fd.build_state(fd.pick_shape(size_mb * MiB), seed=7)
    path = work / "state.safetensors"
    fd.save_safetensors_durably(state, path)
    shutil.rmtree(work / "resume-src", ignore_errors=True)
    with ckvc.Repo.init(work / "resume-src") as src:
        src.commit(state, message="state")
        src.remotes.add("origin", place.url, endpoint=place.endpoint)
        src.push()
    place.upload([path], 1)
    del state
    ckvc_s: list[float] = []
    files_s: list[float] = []
    for rnd in range(rounds):
        for side in ("ckvc", "files") if rnd % 2 == 0 else ("files", "ckvc"):
            if side == "ckvc":
                target = work / f"resume-{rnd}"

                def lazy_resume(target: Path = target) -> int:
                    with ckvc.Repo.clone(place.url, target, endpoint=place.endpoint, lazy=True) as lazy:
                        return len(lazy.load("main"))

                seconds, _ = timed(lazy_resume)
                ckvc_s.append(seconds)
                shutil.rmtree(target)
            else:
                into = work / f"download-{rnd}"
                into.mkdir()

                def download_and_load(into: Path = into) -> int:
                    (got,) = place.download([path.name], into, 1)
                    return len(materialized(load_file(str(got))))

                seconds, _ = timed(download_and_load)
                files_s.append(seconds)
                shutil.rmtree(into)
        log(f"{kind} round {rnd}: ckvc {ckvc_s[-1]:.2f} s, safetensors {files_s[-1]:.2f} s")
    place.remove()
    return {
        "remote": kind,
        "size_mb": size_mb,
        "rounds": rounds,
        "ckvc_s": ckvc_s,
        "safetensors_s": files_s,
        "median_ckvc_s": statistics.median(ckvc_s),
        "median_safetensors_s": statistics.median(files_s),
        "ratio": statistics.median(ckvc_s) / statistics.median(files_s),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="policy,lazy,resume")
    parser.add_argument("--ops", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--resume-remotes", default="s3,dir", help="where the resume section's state lives")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    work = Path(tempfile.mkdtemp(prefix="ckvc-hybrid-", dir=args.dir))
    out: dict[str, Any] = {}
    places = Places(work, ["s3"] if {"lazy", "resume"} & set(sections) else [])
    try:
        if "policy" in sections:
            out["policy"] = policy_section(work, args.ops, args.seeds)
        if "lazy" in sections:
            out["lazy"] = lazy_section(work, places)
        if "resume" in sections:
            out["resume"] = [
                resume_section(work, places, args.size_mb, args.rounds, kind) for kind in args.resume_remotes.split(",")
            ]
    finally:
        places.close()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    if "policy" in out:
        p = out["policy"]
        print(f"policy: {p['ops']} ops x {p['seeds']} seeds, budget {p['budget_bytes']} B "
              f"(30% of {p['history_chunk_bytes']} B of chunks)")  # fmt: skip
        for name, rate in sorted(p["hit_rate"].items(), key=lambda kv: -kv[1]):
            print(f"  {name:<5} byte hit rate {rate:.3f}  budget violations {p['budget_violations'][name]}")
        chosen = ckvc.hybrid.cache.DEFAULT_POLICY
        best = max((n for n in p["hit_rate"] if n != "unlimited"), key=lambda n: p["hit_rate"][n])
        verdict = "ok" if p["hit_rate"][chosen] >= p["hit_rate"]["lru"] else "WORSE"
        print(f"  chosen {chosen} vs lru: {p['hit_rate'][chosen]:.3f} vs {p['hit_rate']['lru']:.3f} ({verdict}); "
              f"best measured {best}; no budget {p['hit_rate']['unlimited']:.3f}")  # fmt: skip
    if "lazy" in out:
        lz = out["lazy"]
        print(f"lazy clone: {lz['clone_received_bytes']} B received for {lz['metadata_bytes']} B of metadata "
              f"({lz['clone_ratio']:.3f}x, goal <= 1.02); checkout {lz['checkout_ratio']:.3f}x of its chunks "
              f"(goal <= 1.05); single-tensor view {lz['view_ratio']:.3f}x (goal <= 1.05)")  # fmt: skip
    for r in out.get("resume", []):
        where = "S3 (moto, loopback)" if r["remote"] == "s3" else "a directory remote"
        print(f"cold lazy resume, {r['size_mb']} MB fp32 on {where}, {r['rounds']} alternating rounds: "
              f"ckvc {r['median_ckvc_s']:.2f} s, safetensors download+load {r['median_safetensors_s']:.2f} s, "
              f"ratio {r['ratio']:.2f} (goal <= 1.2)")  # fmt: skip


if __name__ == "__main__":
    main()
