"""Throughput benchmark (issue 4): ckvc commit, async commit, checkout and single-tensor load
against torch.save / torch.load, safetensors and a plain in-memory copy, in ONE run.

    PYTHONPATH=. .venv/bin/python benchmarks/throughput.py [--size-mb 1024] [--repeats 3]
        [--dtype fp32|bf16|both] [--dir DIR] [--json] [--memory-only]

``--size-mb 64 --repeats 1`` is a quick smoke run. ``--memory-only`` runs only the
peak-memory rows (a state of 8 GB and more in minutes, issue 33's memory bar).

The state is foundation.py's GPT-like state dict (realistic transformer shapes), about
``--size-mb`` of fp32 or bf16 weights. The measurement machinery is foundation.py's,
imported rather than copied:

* medians of ``--repeats`` timed rounds after one untimed warm-up round; the ops of one
  phase are interleaved round by round, so drifting machine load hits ckvc and its
  baselines alike, each round in a seeded random order (``measure(..., shuffle=True)``):
  with a fixed order the op right after one that frees a lot of memory was slowed every
  round (this VM hands freed pages back to the host, and touching them again is slow);
* ``os.sync()`` before every timed call; files and repositories are created and deleted
  outside the timed region;
* cold reads drop the page cache (``/proc/sys/vm/drop_caches``), or evict the files with
  ``posix_fadvise(DONTNEED)`` where that is not permitted (the header says which);
* peak RSS in a fresh subprocess per operation;
* per row: fresh pages touched per byte, CPU cores this process used, and cores other
  processes kept busy (contention; a warning names contended runs).

ckvc rows:

* commit of new data into a fresh repository, with the default codec ("auto") and with
  compression off (``Repo.init(path, codec={"name": "raw"})``);
* commit of unchanged data, and of data where about 10% of the bytes changed (a seeded
  pick of whole tensors, each given a small update);
* async stall: the time until ``repo.commit(state, blocking=False)`` returns; the
  background write is waited for outside the timed region;
* checkout (``Repo.load``) warm and cold; a repository with compression off is loaded too,
  for comparison; issue 33's resume baseline is ``torch.load(mmap=True)`` of the
  torch.save file followed by a first touch of every page (one byte read per 4 KiB), and
  the same mapping with every byte hashed (BLAKE3 on all cores, no copy) shows the floor
  of any load that verifies what it reads;
* one large tensor: through the public API when this ckvc has one
  (``repo.load(rev, keys=[name])`` or ``repo.view(rev)[name]``), else through the
  internal ``Repo._load_tensor`` path (the output says which);
* peak RSS minus the state size while committing, checking out and restoring in place
  (``load_into`` a module holding the state's tensors as buffers; the output is the
  module, allocated and touched before).

The acceptance block prints each ratio the issue asks for next to its target.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import blake3
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

import foundation as fd

import ckvc
from ckvc import state as state_mod

MIB = fd.MIB
GB = fd.GB
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
RSS_LIMIT = 64 * MIB  # issue 33: over the state during commit, over the output during checkout and load_into

# Row names, also the keys of the acceptance checks.
COPY = "in-memory copy of the state (clone every tensor)"
TOUCH = "alloc + first touch only (torch.empty + fill_)"
PT_SAVE = "torch.save + fsync"
ST_SAVE = "safetensors save_file + fsync"
NEW_AUTO = "ckvc commit, new data, codec auto (fresh repo)"
NEW_RAW = "ckvc commit, new data, codec raw (fresh repo)"
UNCHANGED = "ckvc commit, unchanged data"
ASYNC = "ckvc commit(blocking=False): stall until it returns"
PT_LOAD = "torch.load"
PT_MMAP = "torch.load(mmap=True) + first touch"
PT_MMAP_HASH = "torch.load(mmap=True) + BLAKE3 of every byte"
ST_LOAD = "safetensors load_file + clone (materialized)"
CK_LOAD = "ckvc checkout (Repo.load), codec auto"
CK_LOAD_RAW = "ckvc checkout (Repo.load), codec raw repo"
ST_ONE = "safetensors safe_open.get_tensor + clone"
CK_ONE = "ckvc single tensor"
COLD = ", cold"

GROUPS = {
    "save": "save / commit",
    "copy": "memory (async stall and its floor)",
    "load": "full load, warm page cache",
    "load-cold": "full load, cold page cache",
    "single": "one tensor, warm page cache",
    "single-cold": "one tensor, cold page cache",
}


# ---- ckvc's single-tensor path --------------------------------------------------------


def single_tensor_loader(repo: ckvc.Repo, rev: str, name: str) -> tuple[Callable[[], Any], str]:
    """A function loading tensor ``name`` of ``rev``, and which API it uses: the public partial
    load when this ckvc has one, else the internal path foundation.py uses."""
    load: Callable[..., Any] = repo.load
    if "keys" in inspect.signature(load).parameters:
        return (lambda: load(rev, keys=[name])[name]), "public API: Repo.load(rev, keys=[name])"
    view = getattr(repo, "view", None)
    if callable(view):
        return (lambda: view(rev)[name]), "public API: Repo.view(rev)[name]"

    def internal() -> Any:
        commit = repo.read_commit(repo.resolve(rev))
        snapshot = repo.read_snapshot(commit)
        info = state_mod.describe_state(snapshot.tree)[name]
        from ckvc.inspect import load_tensor

        return load_tensor(repo.core, commit, snapshot, info)

    return internal, "INTERNAL path: resolve + read snapshot + describe_state + Repo._load_tensor (no public API)"


# ---- acceptance -----------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    label: str
    value: float | None  # a ratio of medians (what is judged), or MiB for memory checks
    limit: float
    unit: str = ""
    best: float | None = None  # the ratio of the fastest runs, a check on noise in the medians

    @property
    def passed(self) -> bool | None:
        return None if self.value is None else self.value <= self.limit

    def line(self, width: int) -> str:
        target = f"(target <= {self.limit:g}{self.unit})"
        if self.value is None:
            return f"  {self.label:<{width}}{'n/a':>8}  {target:<22}n/a"
        value = f"{self.value:.0f}{self.unit}" if self.unit else f"{self.value:.2f}"
        best = "" if self.best is None else f"  (best/best {self.best:.2f})"
        return f"  {self.label:<{width}}{value:>8}  {target:<22}{'PASS' if self.passed else 'FAIL'}{best}"


def ratio(res: fd.Results, op: str, base: str, best: bool = False) -> float | None:
    """Median of ``op`` over median of ``base``; with ``best``, fastest over fastest."""
    times = {r.op: (min(r.seconds) if best else r.median) for r in res.rows if r.seconds}
    a, b = times.get(op), times.get(base)
    return a / b if a is not None and b else None


def check(res: fd.Results, label: str, op: str, base: str, limit: float) -> Check:
    return Check(label, ratio(res, op, base), limit, best=ratio(res, op, base, best=True))


def acceptance(res: fd.Results) -> list[Check]:
    changed = res.config.get("changed_op", "")
    checks = [
        check(res, "commit new (auto) / safetensors save", NEW_AUTO, ST_SAVE, 1.0),
        check(res, "commit new (raw) / safetensors save", NEW_RAW, ST_SAVE, 1.1),
        check(res, "commit unchanged / safetensors save", UNCHANGED, ST_SAVE, 0.25),
        check(res, "commit 10% changed / safetensors save", changed, ST_SAVE, 0.4),
        check(res, "async commit stall / in-memory copy", ASYNC, COPY, 1.5),
        check(res, "checkout warm / safetensors load+clone warm", CK_LOAD, ST_LOAD, 1.5),
        check(res, "checkout warm / torch.load mmap + first touch", CK_LOAD, PT_MMAP, 1.0),
        # not a goal: how far under that bar the floor of any verified read lies
        check(res, "(mmap + BLAKE3 of every byte / mmap + first touch)", PT_MMAP_HASH, PT_MMAP, 1.0),
        check(res, "checkout cold / safetensors load+clone cold", CK_LOAD + COLD, ST_LOAD + COLD, 0.8),
        check(res, "one tensor warm / safe_open get_tensor+clone warm", CK_ONE, ST_ONE, 2.0),
        check(res, "one tensor cold / safe_open get_tensor+clone cold", CK_ONE + COLD, ST_ONE + COLD, 2.0),
    ]
    for m in res.memory:
        if m["op"] in JUDGED_MEMORY_OPS:
            checks.append(Check(f"peak RSS - state, {m['label']}", m["extra"] / MIB, RSS_LIMIT / MIB, " MiB"))
    return checks


# ---- peak memory in a fresh process -----------------------------------------------------


MEMORY_OPS = {
    "commit-auto": "ckvc commit, codec auto",
    "commit-raw": "ckvc commit, codec raw",
    "checkout": "ckvc checkout (Repo.load)",
    "load-into": "ckvc load_into (in place)",
}
JUDGED_MEMORY_OPS = ("commit-auto", "checkout", "load-into")


def module_holding(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose state_dict() is ``state`` (the same tensors, as buffers at the
    same dotted names), for ``load_into``."""
    root = torch.nn.Module()
    for name, tensor in state.items():
        *parents, leaf = name.split(".")
        owner = root
        for part in parents:
            child = owner._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                owner.add_module(part, child)
            owner = child
        owner.register_buffer(leaf, tensor)
    return root


def child_main(op: str, path: Path, size_mb: int, dtype_name: str, rev: str) -> None:
    """One operation in this fresh process; prints its memory figures as JSON."""
    state = None
    if op.startswith("commit") or op == "load-into":
        dtype = DTYPES[dtype_name]
        state = fd.build_state(fd.pick_shape(size_mb * MIB, dtype.itemsize), dtype=dtype)

    def run() -> Any:
        if op == "checkout":
            with ckvc.Repo.open(path) as repo:
                return repo.load(rev)
        if op == "load-into":
            assert state is not None
            with ckvc.Repo.open(path) as repo:
                repo.load_into(rev, model=module_holding(state), model_key=None)
            return None
        codec = {"name": "raw"} if op == "commit-raw" else None
        with ckvc.Repo.init(path, codec=codec) as repo:
            repo.commit(state, message="mem")
        return None

    figures = fd.peak_memory(op, run, state)
    if op == "load-into":
        figures["state_held"] = 0  # the output, held before: peak - rss_before is all extra
    print(json.dumps(figures))


# ---- the benchmark ------------------------------------------------------------------------


def run_dtype(args: argparse.Namespace, dtype_name: str) -> fd.Results:
    dtype = DTYPES[dtype_name]
    shape = fd.pick_shape(args.size_mb * MIB, dtype.itemsize)
    fd.log(f"[{dtype_name}] building state: vocab={shape.vocab} d={shape.d} layers={shape.layers}")
    state = fd.build_state(shape, dtype=dtype)
    nbytes = fd.state_nbytes(state)
    changed = fd.pick_changed(state, fd.CHANGED_FRACTION)
    changed_bytes = sum(state[n].numel() * state[n].element_size() for n in changed)
    single = f"h.{shape.layers // 2}.attn.q_proj.weight"  # d x d: 16 MiB at 1 GB fp32 (issue 33's one tensor)

    base_dir = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base_dir.mkdir(parents=True, exist_ok=True)
    free, need = shutil.disk_usage(base_dir).free, 8 * nbytes
    if free < need:
        raise SystemExit(f"{base_dir} has {free / GB:.1f} GB free; this run needs about {need / GB:.1f} GB")
    work = Path(tempfile.mkdtemp(prefix="ckvc-throughput-", dir=base_dir))
    cold = fd.Cold()
    fd.log(f"[{dtype_name}] state {nbytes / GB:.3f} GB in {len(state)} tensors; work dir {work}; cold: {cold.method}")
    res = fd.Results(
        config={
            "dtype": dtype_name,
            "size_mb": args.size_mb,
            "state_bytes": nbytes,
            "tensors": len(state),
            "shape": asdict(shape),
            "repeats": args.repeats,
            "work_dir": str(work),
            "cold_method": cold.method,
            "changed_tensors": len(changed),
            "changed_bytes": changed_bytes,
            "changed_op": f"ckvc commit, {changed_bytes / nbytes:.0%} of bytes changed "
            f"({len(changed)} of {len(state)} tensors)",
            "single_tensor": single,
            "single_tensor_bytes": state[single].numel() * state[single].element_size(),
            "cpus": os.cpu_count(),
            "loadavg_start": fd._loadavg(),
            "torch": torch.__version__,
            "ckvc": ckvc.__version__,
        }
    )
    try:
        _run_all(args, res, state, work, cold, changed, single)
    finally:
        fd.log(f"[{dtype_name}] cleaning up {work}")
        shutil.rmtree(work, ignore_errors=True)
    res.config["loadavg_end"] = fd._loadavg()
    return res


def _run_all(
    args: argparse.Namespace,
    res: fd.Results,
    state: fd.State,
    work: Path,
    cold: fd.Cold,
    changed: list[str],
    single: str,
) -> None:
    reps = args.repeats
    nbytes = fd.state_nbytes(state)
    single_bytes = res.config["single_tensor_bytes"]
    changed_op = res.config["changed_op"]
    tag = f"[{res.config['dtype']}]"

    # -- untimed setup: the files and repositories the reads use --------------------------
    st_path, pt_path = work / "state.safetensors", work / "state.pt"
    fd.log(f"{tag} setup (untimed): safetensors file, torch file, base commits (auto and raw repos)")
    save_file(state, str(st_path))
    with open(pt_path, "wb") as f:
        torch.save(state, f)
    repo = ckvc.Repo.init(work / "repo-main")
    base = repo.commit(state, message="base")
    raw_repo = ckvc.Repo.init(work / "repo-raw", codec={"name": "raw"})
    raw_base = raw_repo.commit(state, message="base")
    res.sizes.append({"format": "safetensors file", "bytes": fd.disk_bytes(st_path)})
    res.sizes.append({"format": "torch.save file", "bytes": fd.disk_bytes(pt_path)})
    res.sizes.append({"format": "ckvc packs, 1 commit, codec auto", "bytes": repo.du().pack_bytes})
    res.sizes.append({"format": "ckvc packs, 1 commit, codec raw", "bytes": raw_repo.du().pack_bytes})

    # -- saves, commits and the async stall ------------------------------------------------
    def st_save(i: int) -> None:
        fd.save_safetensors_durably(state, work / f"st-{i}.safetensors")

    def pt_save(i: int) -> None:
        fd.save_torch_durably(state, work / f"pt-{i}.pt")

    fresh: dict[str, ckvc.Repo] = {}
    stats: dict[str, list[ckvc.CommitStats]] = {}

    def keep_stats(key: str, r: ckvc.Repo) -> None:
        assert r.last_commit_stats is not None
        stats.setdefault(key, []).append(r.last_commit_stats)

    def fresh_op(name: str, key: str, codec: dict[str, Any] | None) -> fd.Op:
        def before(i: int) -> None:
            fresh[key] = ckvc.Repo.init(work / f"repo-{key}-{i}", codec=codec)

        def after(i: int, _r: Any) -> None:
            r = fresh.pop(key)
            keep_stats(key, r)
            r.close()
            fd.remove(work / f"repo-{key}-{i}")

        return fd.Op(name, lambda i: fresh[key].commit(state, message="new"), before=before, after=after)

    variants: dict[int, fd.State] = {}

    def make_variant(i: int) -> None:
        variants[i] = fd.perturbed(state, changed, seed=fd.SEED + 100 + i)

    def variant_after(i: int, _r: Any) -> None:
        variants.pop(i)
        keep_stats("changed", repo)

    def async_after(i: int, handle: Any) -> None:
        handle.result()  # the background write, outside the timed region
        keep_stats("async", repo)

    fd.log(f"{tag} timing saves, commits and the async stall")
    sv = fd.measure(
        [
            fd.Op(ST_SAVE, st_save, after=lambda i, _r: fd.remove(work / f"st-{i}.safetensors")),
            fd.Op(PT_SAVE, pt_save, after=lambda i, _r: fd.remove(work / f"pt-{i}.pt")),
            fresh_op(NEW_AUTO, "auto", None),
            fresh_op(NEW_RAW, "raw", {"name": "raw"}),
            fd.Op(
                UNCHANGED, lambda i: repo.commit(state, message="same"), after=lambda i, _r: keep_stats("same", repo)
            ),
            fd.Op(changed_op, lambda i: repo.commit(variants[i], message=f"changed {i}"), make_variant, variant_after),
            fd.Op(COPY, lambda i: {k: v.clone() for k, v in state.items()}),
            fd.Op(ASYNC, lambda i: repo.commit(state, message=f"async {i}", blocking=False), after=async_after),
        ],
        reps,
        shuffle=True,
    )
    for name in (ST_SAVE, PT_SAVE, NEW_AUTO, NEW_RAW, UNCHANGED, changed_op):
        res.add(fd.Row(name, "save", sv[name], nbytes, ST_SAVE))
    res.add(fd.Row(COPY, "copy", sv[COPY], nbytes, COPY))
    res.add(fd.Row(ASYNC, "copy", sv[ASYNC], nbytes, COPY, "background write waited for outside the timed region"))
    res.commit_stats = {key: asdict(v[-1]) for key, v in stats.items()}

    # -- full loads, warm --------------------------------------------------------------------
    def st_load(i: int) -> fd.State:
        return {k: v.clone() for k, v in load_file(str(st_path)).items()}

    def pt_load(i: int) -> Any:
        return torch.load(pt_path, weights_only=True)

    def pt_mmap(i: int) -> Any:
        # issue 33's resume baseline: the file mapped, then one byte of every 4 KiB page
        # read, so every page is in memory as a training step would need it
        loaded = torch.load(pt_path, weights_only=True, mmap=True)
        for tensor in loaded.values():
            tensor.reshape(-1).view(torch.uint8)[::4096].sum()
        return loaded

    def pt_mmap_hash(i: int) -> Any:
        # the floor of any load that verifies what it reads: the same mapping, every byte
        # hashed (on every core, no copy); a first touch reads one byte in 4096
        loaded = torch.load(pt_path, weights_only=True, mmap=True)
        for tensor in loaded.values():
            blake3.blake3(tensor.reshape(-1).view(torch.uint8).numpy(), max_threads=blake3.blake3.AUTO).digest()
        return loaded

    loaded = repo.load(base)
    assert all(torch.equal(loaded[k], v) for k, v in state.items()), "ckvc load returned different bytes"
    del loaded
    fd.log(f"{tag} timing warm loads")
    ld = fd.measure(
        [
            fd.Op(ST_LOAD, st_load),
            fd.Op(PT_LOAD, pt_load),
            fd.Op(PT_MMAP, pt_mmap),
            fd.Op(PT_MMAP_HASH, pt_mmap_hash),
            fd.Op(CK_LOAD, lambda i: repo.load(base)),
            fd.Op(CK_LOAD_RAW, lambda i: raw_repo.load(raw_base)),
            fd.Op(TOUCH, lambda i: {k: torch.empty_like(v).fill_(0.0) for k, v in state.items()}),
        ],
        reps,
        shuffle=True,
    )
    for name in (ST_LOAD, PT_LOAD, PT_MMAP, PT_MMAP_HASH, CK_LOAD, CK_LOAD_RAW):
        res.add(fd.Row(name, "load", ld[name], nbytes, ST_LOAD))
    res.add(fd.Row(TOUCH, "load", ld[TOUCH], nbytes, ST_LOAD, "floor for any load into fresh memory"))

    # -- one tensor, warm ----------------------------------------------------------------------
    def st_one(i: int) -> torch.Tensor:
        with safe_open(str(st_path), framework="pt") as f:
            return f.get_tensor(single).clone()

    ck_load_one, single_api = single_tensor_loader(repo, base, single)
    res.config["single_tensor_api"] = single_api
    one = ck_load_one()
    assert torch.equal(one, state[single]), "ckvc single-tensor load returned different bytes"
    del one
    fd.log(f"{tag} timing single-tensor loads ({single_api})")
    sg = fd.measure([fd.Op(ST_ONE, st_one), fd.Op(CK_ONE, lambda i: ck_load_one())], reps, shuffle=True)
    res.add(fd.Row(ST_ONE, "single", sg[ST_ONE], single_bytes, ST_ONE))
    res.add(fd.Row(CK_ONE, "single", sg[CK_ONE], single_bytes, ST_ONE, single_api))

    # -- cold reads ----------------------------------------------------------------------------
    cold_full: list[tuple[str, Callable[[int], Any], Path]] = [
        (ST_LOAD + COLD, st_load, st_path),
        (CK_LOAD + COLD, lambda i: repo.load(base), repo.dir),
        (CK_LOAD_RAW + COLD, lambda i: raw_repo.load(raw_base), raw_repo.dir),
    ]
    cold_one: list[tuple[str, Callable[[int], Any], Path]] = [
        (ST_ONE + COLD, st_one, st_path),
        (CK_ONE + COLD, lambda i: ck_load_one(), repo.dir),
    ]
    if cold.method is None:
        for name, _fn, _p in cold_full:
            res.rows.append(fd.Row(name, "load-cold", fd.Samples(), nbytes, ST_LOAD + COLD, "cannot drop caches"))
        for name, _fn, _p in cold_one:
            res.rows.append(fd.Row(name, "single-cold", fd.Samples(), single_bytes, ST_ONE + COLD, "cannot drop"))
    else:

        def evictor(path: Path) -> Callable[[int], None]:
            return lambda i: cold.evict(path)

        fd.log(f"{tag} timing cold loads (page cache dropped via {cold.method})")
        cl = fd.measure([fd.Op(n, fn, before=evictor(p)) for n, fn, p in cold_full], reps, shuffle=True)
        for name, _fn, _p in cold_full:
            res.add(fd.Row(name, "load-cold", cl[name], nbytes, ST_LOAD + COLD))
        cs = fd.measure([fd.Op(n, fn, before=evictor(p)) for n, fn, p in cold_one], reps, shuffle=True)
        for name, _fn, _p in cold_one:
            res.add(fd.Row(name, "single-cold", cs[name], single_bytes, ST_ONE + COLD))
    repo.close()
    raw_repo.close()

    measure_memory(args, res, work / "repo-main", base, nbytes, tag)


def measure_memory(args: argparse.Namespace, res: fd.Results, main: Path, rev: str, nbytes: int, tag: str) -> None:
    """Peak memory, one fresh process per op; the reads read ``rev`` of ``main``."""
    for op, label in MEMORY_OPS.items():
        reads = op in ("checkout", "load-into")
        path = main if reads else main.parent / f"repo-mem-{op}"
        fd.log(f"{tag} peak memory: {label}")
        data = fd.run_child(op, path, args.size_mb, rev if reads else "", __file__, ["--dtype", res.config["dtype"]])
        data["label"] = label
        data["state_bytes"] = nbytes
        res.memory.append(data)
        if not reads:
            fd.remove(path)


def run_memory_only(args: argparse.Namespace, dtype_name: str) -> fd.Results:
    """Only the peak-memory rows: the repository the reads read is committed by a
    child too, so this process never holds the state."""
    dtype = DTYPES[dtype_name]
    nbytes = fd.pick_shape(args.size_mb * MIB, dtype.itemsize).nbytes(dtype.itemsize)
    base_dir = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="ckvc-memory-", dir=base_dir))
    res = fd.Results(config={"dtype": dtype_name, "size_mb": args.size_mb, "state_bytes": nbytes})
    try:
        main = work / "repo-main"
        fd.log(f"[{dtype_name}] committing {nbytes / GB:.2f} GB for the reads (a child)")
        fd.run_child("commit-main", main, args.size_mb, "", __file__, ["--dtype", dtype_name])
        measure_memory(args, res, main, "HEAD", nbytes, f"[{dtype_name}]")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res


# ---- output -----------------------------------------------------------------------------------


def print_report(res: fd.Results, checks: list[Check]) -> None:
    c = res.config
    sh = c["shape"]
    print()
    print(
        f"ckvc throughput benchmark, {c['dtype']}: {c['state_bytes'] / GB:.3f} GB in {c['tensors']} tensors "
        f"(vocab {sh['vocab']}, d {sh['d']}, {sh['layers']} layers), median of {c['repeats']}, "
        f"{c['cpus']} CPUs, torch {c['torch']}, ckvc {c['ckvc']}"
    )
    print(
        f"cold reads: {c['cold_method'] or 'n/a'}; one tensor = {c['single_tensor']} "
        f"({c['single_tensor_bytes'] / MIB:.0f} MiB) via {c.get('single_tensor_api', '?')}"
    )
    print("rounds interleaved in seeded random order; ratio = median / baseline median (lower is better);")
    print("faults = fresh pages per byte; cpu = cores this process used;")
    print("other = cores other processes kept busy (contention)")
    print()
    fd.print_timing_rows(res, GROUPS)

    print()
    print("stored size")
    for s in res.sizes:
        print(f"  {s['format']:<40}{s['bytes'] / MIB:>10.1f} MiB  {s['bytes'] / c['state_bytes']:.3f} of raw")
    fd.print_commit_stats(res, key_width=8)
    print()
    print_memory(res)
    print()
    print_acceptance(c["dtype"], checks)


def print_memory(res: fd.Results) -> None:
    print(
        "peak RSS minus state size (fresh process per op; a commit holds the state before, a checkout returns it,"
        " load_into fills it)"
    )
    for m in res.memory:
        how = "VmHWM reset" if m["hwm_reset"] else "ru_maxrss"
        print(f"  {m['label']:<40}{m['extra'] / MIB:>10.1f} MiB  [{how}]")


def print_acceptance(dtype: str, checks: list[Check]) -> None:
    width = max(len(ch.label) for ch in checks) + 2
    failed = [ch for ch in checks if ch.passed is False]
    print(f"acceptance ({dtype}): {len(checks) - len(failed)} of {len(checks)} pass (ratios of medians)")
    for ch in checks:
        print(ch.line(width))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024, help="target state size in MiB (default 1024)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per operation (default 3)")
    ap.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both", help="state dtype (default both)")
    ap.add_argument("--dir", default=None, help="where to make the temporary work dir (default: system temp dir)")
    ap.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")
    ap.add_argument("--memory-only", action="store_true", help="only the peak-memory rows (in fresh processes)")
    ap.add_argument("--child-op", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-rev", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_op:
        child_main(args.child_op, Path(args.child_path), args.size_mb, args.dtype, args.child_rev)
        return
    if args.repeats < 1 or args.size_mb < 1:
        ap.error("--repeats and --size-mb must be positive")
    started = time.perf_counter()
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    results: list[tuple[fd.Results, list[Check]]] = []
    if args.memory_only:
        for name in dtypes:
            res = run_memory_only(args, name)
            print(f"\npeak RSS, {name} state of {res.config['state_bytes'] / GB:.2f} GB (fresh process per op)")
            print_memory(res)
            print_acceptance(name, [ch for ch in acceptance(res) if ch.unit])
        print(f"\n(total wall time {time.perf_counter() - started:.0f} s)")
        return
    for name in dtypes:
        t0 = time.perf_counter()
        res = run_dtype(args, name)
        res.config["wall_seconds"] = time.perf_counter() - t0
        results.append((res, acceptance(res)))
    wall = time.perf_counter() - started
    if args.json:
        out = {
            "wall_seconds": wall,
            "runs": [
                {**res.to_json(), "acceptance": [{**asdict(ch), "passed": ch.passed} for ch in checks]}
                for res, checks in results
            ],
        }
        print(json.dumps(out, indent=2))
        return
    for res, checks in results:
        print_report(res, checks)
        print(f"\n({res.config['dtype']} wall time {res.config['wall_seconds']:.0f} s)")
    if len(results) > 1:
        for res, checks in results:
            print()
            print_acceptance(res.config["dtype"], checks)
    print(f"\n(total wall time {wall:.0f} s)")


if __name__ == "__main__":
    main()
