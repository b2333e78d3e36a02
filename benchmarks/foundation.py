"""Foundation benchmark: ckvc commit / load against torch.save / torch.load and safetensors.

Everything is measured in ONE run on the same synthetic GPT-like fp32 state dict, so
ratios against the safetensors baselines are meaningful even on a noisy machine:

    .venv/bin/python benchmarks/foundation.py [--size-mb 1024] [--repeats 3] [--dir DIR] [--json]

Method:

* Timings are medians of ``--repeats`` runs. The ops of one phase (saves, warm loads,
  single-tensor loads, cold loads) are interleaved round by round, with a rotating
  start, after one untimed warm-up round (first touch of fresh memory and lazy
  initialisation are slow here), so drifting machine load hits ckvc and its baselines alike.
* ``os.sync()`` runs before every timed call; files are created and deleted outside the
  timed region.
* Cold reads drop the page cache (``/proc/sys/vm/drop_caches``); where that is not
  permitted the files are evicted with ``posix_fadvise(DONTNEED)`` instead (rows say which).
* Peak memory is measured in a fresh subprocess per operation (VmHWM, reset through
  ``/proc/self/clear_refs`` when allowed, ru_maxrss otherwise).
* Per row the table also shows minor page faults per byte (fresh memory touched), the CPU
  cores this process used, and the cores other processes kept busy (contention).
* The single-tensor ckvc row uses INTERNAL API (``Repo._load_tensor``): there is no public
  partial-load API yet.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ckvc
from ckvc import state as state_mod
from ckvc.codecs import make_codec
from ckvc.ids import ObjectType, object_id

MIB = 1 << 20
GB = 1e9
SEED = 1234
CHANGED_FRACTION = 0.10
COMPONENT_SAMPLE_BYTES = 64 * MIB
COMPONENT_CHUNK = 4 * MIB

State = dict[str, torch.Tensor]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the synthetic state -----------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    vocab: int
    d: int
    layers: int
    n_ctx: int

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """GPT-2-like parameter names and shapes (Linear weights are [out, in])."""
        d = self.d
        shapes: dict[str, tuple[int, ...]] = {"wte.weight": (self.vocab, d), "wpe.weight": (self.n_ctx, d)}
        for i in range(self.layers):
            p = f"h.{i}."
            shapes[p + "ln_1.weight"] = (d,)
            shapes[p + "ln_1.bias"] = (d,)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                shapes[p + f"attn.{proj}.weight"] = (d, d)
                shapes[p + f"attn.{proj}.bias"] = (d,)
            shapes[p + "ln_2.weight"] = (d,)
            shapes[p + "ln_2.bias"] = (d,)
            shapes[p + "mlp.fc.weight"] = (4 * d, d)
            shapes[p + "mlp.fc.bias"] = (4 * d,)
            shapes[p + "mlp.proj.weight"] = (d, 4 * d)
            shapes[p + "mlp.proj.bias"] = (d,)
        shapes["ln_f.weight"] = (d,)
        shapes["ln_f.bias"] = (d,)
        return shapes

    def nbytes(self, itemsize: int = 4) -> int:
        return itemsize * sum(_numel(s) for s in self.tensor_shapes().values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def pick_shape(target_bytes: int, itemsize: int = 4) -> Shape:
    """The widest model with at least 4 layers that fits, then as many layers as fill the target
    (``itemsize``: bytes per element, 4 for fp32, 2 for bf16)."""
    vocab = 32000 if target_bytes >= 512 * MIB else 8192
    n_ctx = 1024
    per_layer = lambda d: itemsize * (12 * d * d + 13 * d)  # noqa: E731
    embed = lambda d: itemsize * (vocab + n_ctx + 2) * d  # noqa: E731
    dims = [128, 256, 384, 512, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192]
    d = dims[0]
    for cand in dims:
        if embed(cand) + 4 * per_layer(cand) <= target_bytes * 1.05:
            d = cand
    layers = max(1, round((target_bytes - embed(d)) / per_layer(d)))
    return Shape(vocab, d, layers, n_ctx)


def build_state(shape: Shape, seed: int = SEED, dtype: torch.dtype = torch.float32) -> State:
    """N(0, 0.02) weights (fp32 unless ``dtype`` says otherwise); layernorm weights around 1.
    Generated in place (no temporaries)."""
    gen = torch.Generator().manual_seed(seed)
    out: State = {}
    for name, shp in shape.tensor_shapes().items():
        t = torch.empty(shp, dtype=dtype)
        t.normal_(0.0, 0.02, generator=gen)
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            t.add_(1.0)
        out[name] = t
    return out


def state_nbytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def pick_changed(state: State, fraction: float, seed: int = SEED) -> list[str]:
    """Tensors to change: a seeded random pick whose bytes come to about ``fraction`` of the state."""
    total = state_nbytes(state)
    goal = fraction * total
    order = torch.randperm(len(state), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    names = list(state)
    picked: list[str] = []
    acc = 0
    for i in order:
        name = names[i]
        size = state[name].numel() * state[name].element_size()
        if acc + size <= goal * 1.1:
            picked.append(name)
            acc += size
        if acc >= goal * 0.9:
            break
    return picked


def perturbed(state: State, names: list[str], seed: int) -> State:
    """A shallow copy of ``state`` where ``names`` get a small new update (like one optimizer step)."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(state)
    for name in names:
        t = torch.empty_like(state[name])
        t.normal_(0.0, 1e-3, generator=gen)
        t.add_(state[name])
        out[name] = t
    return out


# ---- measurement helpers -----------------------------------------------------------


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_safetensors_durably(state: State, path: Path) -> None:
    """The safetensors baseline: save_file, then fsync, as durable as a commit."""
    save_file(state, str(path))
    fsync_path(path)


def save_torch_durably(state: object, path: Path) -> None:
    """The torch.save baseline, fsynced."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tree_files(path: Path) -> Iterator[Path]:
    if path.is_file():
        yield path
        return
    for root, _dirs, files in os.walk(path):
        for f in files:
            yield Path(root) / f


def disk_bytes(path: Path) -> int:
    """Apparent size of a file or of all files under a directory."""
    return sum(p.stat().st_size for p in tree_files(path))


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class Cold:
    """Evicts files from the page cache: drop_caches if permitted, else posix_fadvise(DONTNEED).
    CKVC_BENCH_FADVISE=1 skips drop_caches (the test suite's smoke runs must not
    empty the whole machine's cache)."""

    def __init__(self) -> None:
        self.method = self._probe()

    @staticmethod
    def _probe() -> str | None:
        try:
            if os.environ.get("CKVC_BENCH_FADVISE"):
                raise PermissionError("drop_caches not wanted")
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass
        if hasattr(os, "posix_fadvise"):
            return "fadvise"
        return None

    def evict(self, *paths: Path) -> None:
        os.sync()
        if self.method == "drop_caches":
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        elif self.method == "fadvise":
            for path in paths:
                for p in tree_files(path):
                    fd = os.open(p, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
        else:
            raise RuntimeError("no way to drop the page cache")


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def machine_busy_seconds() -> float:
    """CPU seconds all CPUs of the machine spent busy (not idle / iowait) since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / _CLK_TCK  # user..steal; guest time is counted in user


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class Samples:
    """Per timed repeat: wall seconds, minor page faults, CPU cores this process used, and
    CPU cores other processes on the machine kept busy (contention)."""

    seconds: list[float] = field(default_factory=list)
    faults: list[int] = field(default_factory=list)
    own_cores: list[float] = field(default_factory=list)
    other_cores: list[float] = field(default_factory=list)


@dataclass
class Op:
    """One timed operation. ``before(i)`` and ``after(i, result)`` run outside the timed region
    (setup, eviction, deleting files); ``i`` is the repeat index, -1 for the untimed warm-up."""

    name: str
    run: Callable[[int], Any]
    before: Callable[[int], None] | None = None
    after: Callable[[int, Any], None] | None = None


def measure(ops: list[Op], repeats: int, shuffle: bool = False) -> dict[str, Samples]:
    """Samples per op. Ops are interleaved: each round runs every op once, starting at a
    rotating position, so slow drifts in machine load hit all of them alike. Round -1 is an
    untimed warm-up. ``os.sync()`` runs before every timed call.

    Rotation keeps each op's neighbours: an op that always follows one freeing a lot of
    memory pays for it every round (this VM hands freed pages back to the host, and
    touching them again is slow). ``shuffle`` runs each round in a seeded random order
    instead, so no op is stuck behind the same neighbour."""
    out = {op.name: Samples() for op in ops}
    rng = random.Random(SEED)
    for i in range(-1, repeats):
        shift = (i + 1) % len(ops)
        for op in rng.sample(ops, len(ops)) if shuffle else ops[shift:] + ops[:shift]:
            if op.before is not None:
                op.before(i)
            os.sync()
            f0, c0, m0 = minor_faults(), own_cpu_seconds(), machine_busy_seconds()
            t0 = time.perf_counter()
            result = op.run(i)
            elapsed = time.perf_counter() - t0
            f1, c1, m1 = minor_faults(), own_cpu_seconds(), machine_busy_seconds()
            if op.after is not None:
                op.after(i, result)
            del result
            if i >= 0:
                smp = out[op.name]
                smp.seconds.append(elapsed)
                smp.faults.append(f1 - f0)
                smp.own_cores.append((c1 - c0) / elapsed)
                smp.other_cores.append(max(0.0, (m1 - m0) - (c1 - c0)) / elapsed)
    return out


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _median(xs: list[float] | list[int]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


@dataclass
class Row:
    op: str
    group: str  # "save", "load", "load-cold", "single", "single-cold", "copy"
    samples: Samples
    nbytes: int
    baseline: str | None = None  # the op whose median this row is compared to
    note: str = ""

    @property
    def seconds(self) -> list[float]:
        return self.samples.seconds

    @property
    def fresh_pages(self) -> float:
        """Median minor page faults x 4 KiB over the bytes handled: ~1.0 means every output
        byte landed in freshly faulted memory once."""
        return _median(self.samples.faults) * 4096 / self.nbytes

    @property
    def median(self) -> float:
        return _median(self.seconds)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median / GB if self.seconds else float("nan")


@dataclass
class Results:
    config: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    sizes: list[dict[str, Any]] = field(default_factory=list)
    components: list[dict[str, Any]] = field(default_factory=list)
    commit_stats: dict[str, Any] = field(default_factory=dict)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        log(f"{row.op}: median {row.median:.3f} s of {len(row.seconds)} ({', '.join(f'{s:.3f}' for s in row.seconds)})")
        return row

    def median_of(self, op: str) -> float | None:
        for r in self.rows:
            if r.op == op and r.seconds:
                return r.median
        return None

    def ratio(self, row: Row) -> float | None:
        if row.baseline is None or not row.seconds:
            return None
        base = self.median_of(row.baseline)
        return row.median / base if base else None

    def to_json(self) -> dict[str, Any]:
        rows = []
        for r in self.rows:
            d = asdict(r)
            d.pop("samples")
            d.update(asdict(r.samples))
            d.update(median_s=r.median if r.seconds else None, gb_per_s=r.gbps if r.seconds else None)
            d["fresh_page_multiple"] = r.fresh_pages if r.seconds else None
            d["ratio_vs_baseline"] = self.ratio(r)
            rows.append(d)
        return {
            "config": self.config,
            "timings": rows,
            "memory": self.memory,
            "sizes": self.sizes,
            "components": self.components,
            "commit_stats": self.commit_stats,
        }


# ---- peak memory in a fresh subprocess ---------------------------------------------


def _status_kb(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise KeyError(field_name)


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory(op: str, run: Callable[[], Any], state: State | None = None) -> dict[str, Any]:
    """Run ``run`` once and return its memory figures: RSS before, peak RSS during (VmHWM reset
    through clear_refs when allowed, ru_maxrss otherwise), the state the process held before
    (``state``, for saves) and the bytes of the state ``run`` returned (for loads)."""
    rss_before = _status_kb("VmRSS") * 1024
    hwm_reset = _reset_hwm()
    result = run()
    peak = _status_kb("VmHWM") * 1024 if hwm_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    loaded = state_nbytes(result) if isinstance(result, dict) else 0
    held = state_nbytes(state) if state is not None else 0
    return {
        "op": op,
        "rss_before": rss_before,
        "peak": peak,
        "hwm_reset": hwm_reset,
        "state_held": held,
        "loaded": loaded,
        "rss_file_after": _status_kb("RssFile") * 1024,
    }


def child_main(op: str, path: Path, size_mb: int, rev: str) -> None:
    """Run one operation and print its memory figures as JSON (run in a fresh process)."""
    needs_state = op in ("ckvc_commit", "torch_save", "st_save")
    state = build_state(pick_shape(size_mb * MIB)) if needs_state else None

    def run() -> Any:
        if op == "ckvc_commit":
            with ckvc.Repo.init(path) as repo:
                repo.commit(state, message="mem")
        elif op == "ckvc_load":
            with ckvc.Repo.open(path) as repo:
                return repo.load(rev)
        elif op == "torch_save":
            assert state is not None
            save_torch_durably(state, path)
        elif op == "torch_load":
            return torch.load(path, weights_only=True)
        elif op == "st_save":
            assert state is not None
            save_safetensors_durably(state, path)
        elif op == "st_load":
            return {k: v.clone() for k, v in load_file(str(path)).items()}
        else:
            raise SystemExit(f"unknown child op {op}")
        return None

    print(json.dumps(peak_memory(op, run, state)))


def run_child(
    op: str, path: Path, size_mb: int, rev: str = "", script: str | None = None, extra_args: Sequence[str] = ()
) -> dict[str, Any]:
    """Run ``script`` (default: this file) with ``--child-op op`` in a fresh process; its memory figures."""
    cmd = [sys.executable, os.path.abspath(script or __file__), "--child-op", op, "--child-path", str(path)]
    cmd += ["--size-mb", str(size_mb), "--child-rev", rev, *extra_args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    data: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    # Extra memory beyond the state itself: for saves the state is already held
    # before the op; for loads the loaded result is the state.
    data["extra"] = data["peak"] - data["rss_before"] - data["loaded"]
    return data


def fresh_process_seconds(code: str) -> float:
    """Run ``code`` in a fresh interpreter with this repository importable; it prints
    the seconds of its timed part as its last line."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    return float(done.stdout.strip().splitlines()[-1])


# ---- the benchmark -----------------------------------------------------------------


def component_bench(state: State) -> list[dict[str, Any]]:
    """Single-thread throughput of ckvc's per-chunk work on real fp32 weights."""
    flat = torch.cat([t.reshape(-1) for t in state.values()])[: COMPONENT_SAMPLE_BYTES // 4].contiguous()
    data = memoryview(flat.numpy().tobytes())
    chunks = [data[i : i + COMPONENT_CHUNK] for i in range(0, len(data), COMPONENT_CHUNK)]
    codec = make_codec("zstd", 1)
    n = len(data)
    out: list[dict[str, Any]] = []

    def timed(name: str, fn: Callable[[], Any], note: str = "") -> Any:
        fn()  # warm-up
        best = float("inf")
        result = None
        for _ in range(3):
            t0 = time.perf_counter()
            result = fn()
            best = min(best, time.perf_counter() - t0)
        out.append({"component": name, "seconds": best, "gb_per_s": n / best / GB, "note": note})
        return result

    timed("blake3 object_id, 1 thread, 4 MiB chunks", lambda: [object_id(ObjectType.CHUNK, c) for c in chunks])
    try:
        import blake3

        timed(
            "blake3 max_threads=AUTO, 4 MiB chunks",
            lambda: [blake3.blake3(c, max_threads=blake3.blake3.AUTO).digest() for c in chunks],
            "for comparison; ckvc hashes each chunk on one thread",
        )
    except (ImportError, AttributeError, TypeError):
        pass
    encoded: list[bytes] = timed("zstd-1 compress, 1 thread", lambda: [codec.encode(c) for c in chunks])
    ratio = n / sum(len(e) for e in encoded)
    out[-1]["note"] = f"compression ratio {ratio:.3f}x on fp32 N(0,0.02)"
    timed("zstd decompress, 1 thread", lambda: [codec.decode(e, len(c)) for e, c in zip(encoded, chunks, strict=True)])
    timed("bytes copy (memoryview -> bytes), 1 thread", lambda: [bytes(c) for c in chunks])
    return out


def run_benchmark(args: argparse.Namespace) -> Results:
    shape = pick_shape(args.size_mb * MIB)
    log(f"building state: vocab={shape.vocab} d={shape.d} layers={shape.layers}")
    state = build_state(shape)
    nbytes = state_nbytes(state)
    changed = pick_changed(state, CHANGED_FRACTION)
    changed_bytes = sum(state[n].numel() * 4 for n in changed)
    single = f"h.{shape.layers // 2}.mlp.fc.weight"
    single_bytes = state[single].numel() * 4

    base_dir = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(base_dir).free
    need = 8 * nbytes
    if free < need:
        raise SystemExit(f"{base_dir} has {free / GB:.1f} GB free; this run needs about {need / GB:.1f} GB")
    work = Path(tempfile.mkdtemp(prefix="ckvc-bench-", dir=base_dir))
    cold = Cold()
    log(f"state {nbytes / GB:.3f} GB in {len(state)} tensors; work dir {work}; cold reads via {cold.method}")
    res = Results(
        config={
            "size_mb": args.size_mb,
            "state_bytes": nbytes,
            "tensors": len(state),
            "shape": asdict(shape),
            "dtype": "float32",
            "repeats": args.repeats,
            "work_dir": str(work),
            "cold_method": cold.method,
            "changed_tensors": len(changed),
            "changed_bytes": changed_bytes,
            "single_tensor": single,
            "single_tensor_bytes": single_bytes,
            "cpus": os.cpu_count(),
            "loadavg_start": _loadavg(),
            "torch": torch.__version__,
            "ckvc": ckvc.__version__,
        }
    )
    try:
        _run_all(args, res, state, work, cold, changed, single)
    finally:
        log(f"cleaning up {work}")
        shutil.rmtree(work, ignore_errors=True)
    return res


def _run_all(
    args: argparse.Namespace, res: Results, state: State, work: Path, cold: Cold, changed: list[str], single: str
) -> None:
    nbytes = state_nbytes(state)
    reps = args.repeats
    single_bytes = state[single].numel() * state[single].element_size()
    changed_frac = sum(state[n].numel() * state[n].element_size() for n in changed) / nbytes
    st_save_op, st_load_op = "safetensors save_file + fsync", "safetensors load_file + clone (materialized)"
    st_cold_op = "safetensors load_file + clone, cold"
    st_single, st_single_cold = "safetensors safe_open.get_tensor + clone", "safetensors get_tensor + clone, cold"
    single_note = "INTERNAL path: resolve + read snapshot + describe_state + Repo._load_tensor (no public API yet)"
    touch_note = "floor for any load that returns fresh memory; page faults are slow on this VM"

    # -- untimed setup: the files and repository the read benchmarks use ------------------
    st_path, pt_path, main_repo_dir = work / "state.safetensors", work / "state.pt", work / "repo-main"
    log("setup: writing the safetensors file, torch file and base ckvc commit (untimed)")
    save_file(state, str(st_path))
    with open(pt_path, "wb") as f:
        torch.save(state, f)
    repo = ckvc.Repo.init(main_repo_dir)
    base_commit = repo.commit(state, message="base")

    # -- saves and commits ---------------------------------------------------------------------
    def st_save(i: int) -> None:
        save_safetensors_durably(state, work / f"st-{i}.safetensors")

    def pt_save(i: int) -> None:
        save_torch_durably(state, work / f"pt-{i}.pt")

    new_repos: dict[int, ckvc.Repo] = {}
    new_stats: list[ckvc.CommitStats] = []

    def fresh_repo(i: int) -> None:
        new_repos[i] = ckvc.Repo.init(work / f"repo-new-{i}")

    def new_after(i: int, _r: Any) -> None:
        r = new_repos.pop(i)
        assert r.last_commit_stats is not None
        new_stats.append(r.last_commit_stats)
        if i == reps - 1:
            usage = r.du()
            ckvc_dir = disk_bytes(r.dir)
            res.sizes.append({"format": "ckvc packs (1 commit)", "bytes": usage.pack_bytes})
            res.sizes.append({"format": "ckvc .ckvc dir (packs + index + refs)", "bytes": ckvc_dir})
        r.close()
        remove(work / f"repo-new-{i}")

    variants: dict[int, State] = {}

    def make_variant(i: int) -> None:
        variants[i] = perturbed(state, changed, seed=SEED + 100 + i)

    changed_stats: list[ckvc.CommitStats] = []

    def variant_after(i: int, _r: Any) -> None:
        variants.pop(i)
        assert repo.last_commit_stats is not None
        changed_stats.append(repo.last_commit_stats)

    unchanged_stats: list[ckvc.CommitStats] = []

    def unchanged_after(i: int, _r: Any) -> None:
        assert repo.last_commit_stats is not None
        unchanged_stats.append(repo.last_commit_stats)

    changed_op = f"ckvc commit, {changed_frac:.0%} of bytes changed ({len(changed)} tensors)"
    log("timing saves and commits")
    sv = measure(
        [
            Op(st_save_op, st_save, after=lambda i, _r: remove(work / f"st-{i}.safetensors")),
            Op("torch.save + fsync", pt_save, after=lambda i, _r: remove(work / f"pt-{i}.pt")),
            Op(
                "ckvc commit, new data (fresh repo)",
                lambda i: new_repos[i].commit(state, message="new"),
                before=fresh_repo,
                after=new_after,
            ),
            Op(
                "ckvc commit, unchanged (all chunks dedup)",
                lambda i: repo.commit(state, message="same"),
                after=unchanged_after,
            ),
            Op(
                changed_op,
                lambda i: repo.commit(variants[i], message=f"changed {i}"),
                before=make_variant,
                after=variant_after,
            ),
        ],
        reps,
    )
    res.add(Row(st_save_op, "save", sv[st_save_op], nbytes, st_save_op))
    for name in list(sv)[1:]:
        res.add(Row(name, "save", sv[name], nbytes, st_save_op))
    res.commit_stats = {
        "new": asdict(new_stats[-1]),
        "unchanged": asdict(unchanged_stats[-1]),
        "changed": asdict(changed_stats[-1]),
    }
    res.sizes.append({"format": "torch.save file", "bytes": disk_bytes(pt_path)})
    res.sizes.append({"format": "safetensors file", "bytes": disk_bytes(st_path)})
    res.sizes.append(
        {
            "format": f"ckvc packs added by one {changed_frac:.0%}-changed commit",
            "bytes": changed_stats[-1].stored_bytes,
        }
    )
    for entry in res.sizes:
        entry["ratio_vs_raw"] = entry["bytes"] / nbytes

    # -- full loads, warm page cache ------------------------------------------------------------
    def st_load(i: int) -> State:
        return {k: v.clone() for k, v in load_file(str(st_path)).items()}

    def st_touch(i: int) -> float:
        return sum(float(v.sum()) for v in load_file(str(st_path)).values())

    log("timing warm loads")
    ld = measure(
        [
            Op("in-memory copy (clone every tensor)", lambda i: {k: v.clone() for k, v in state.items()}),
            Op(
                "alloc + first touch only (torch.empty + fill_, no data)",
                lambda i: {k: torch.empty_like(v).fill_(0.0) for k, v in state.items()},
            ),
            Op(st_load_op, st_load),
            Op("safetensors load_file + sum (mmap, no copy)", st_touch),
            Op("torch.load", lambda i: torch.load(pt_path, weights_only=True)),
            Op("ckvc load (Repo.load), warm", lambda i: repo.load(base_commit)),
            Op("ckvc checkout (load + move HEAD), warm", lambda i: repo.checkout(base_commit)),
        ],
        reps,
    )
    notes = {
        "alloc + first touch only (torch.empty + fill_, no data)": touch_note,
        "safetensors load_file + sum (mmap, no copy)": "tensors stay mmapped views of the page cache",
    }
    for k, name in enumerate(ld):
        group = "copy" if k < 2 else "load"
        res.add(Row(name, group, ld[name], nbytes, st_load_op, notes.get(name, "")))

    # -- one tensor, warm --------------------------------------------------------------------
    def st_get(i: int) -> torch.Tensor:
        with safe_open(str(st_path), framework="pt") as f:
            return f.get_tensor(single).clone()

    def ckvc_single(i: int) -> Any:
        commit = repo.read_commit(repo.resolve(base_commit))
        snapshot = repo.read_snapshot(commit)
        info = state_mod.describe_state(snapshot.tree)[single]
        from ckvc.inspect import load_tensor

        return load_tensor(repo.core, commit, snapshot, info)

    loaded = ckvc_single(0)
    assert torch.equal(loaded, state[single]), "ckvc single-tensor load returned different bytes"
    del loaded
    log("timing single-tensor loads")
    sg = measure([Op(st_single, st_get), Op("ckvc single tensor (internal _load_tensor)", ckvc_single)], reps)
    res.add(Row(st_single, "single", sg[st_single], single_bytes, st_single))
    res.add(
        Row(
            "ckvc single tensor (internal _load_tensor)",
            "single",
            sg["ckvc single tensor (internal _load_tensor)"],
            single_bytes,
            st_single,
            single_note,
        )
    )

    # -- cold reads ----------------------------------------------------------------------------
    cold_full = [
        (st_cold_op, st_load, st_path),
        ("torch.load, cold", lambda i: torch.load(pt_path, weights_only=True), pt_path),
        ("ckvc load, cold", lambda i: repo.load(base_commit), main_repo_dir),
    ]
    cold_single = [
        (st_single_cold, st_get, st_path),
        ("ckvc single tensor (internal), cold", ckvc_single, main_repo_dir),
    ]
    if cold.method is None:
        for name, _fn, _p in cold_full:
            res.rows.append(Row(name, "load-cold", Samples(), nbytes, st_cold_op, "n/a: cannot drop the page cache"))
        for name, _fn, _p in cold_single:
            res.rows.append(
                Row(name, "single-cold", Samples(), single_bytes, st_single_cold, "n/a: cannot drop the page cache")
            )
    else:
        note = f"page cache dropped via {cold.method}"

        def evictor(path: Path) -> Callable[[int], None]:
            return lambda i: cold.evict(path)

        log("timing cold loads")
        cl = measure([Op(n, fn, before=evictor(p)) for n, fn, p in cold_full], reps)
        for name, _fn, _p in cold_full:
            res.add(Row(name, "load-cold", cl[name], nbytes, st_cold_op, note))
        cs = measure([Op(n, fn, before=evictor(p)) for n, fn, p in cold_single], reps)
        for name, _fn, _p in cold_single:
            extra = "; " + single_note if name.startswith("ckvc") else ""
            res.add(Row(name, "single-cold", cs[name], single_bytes, st_single_cold, note + extra))
    repo.close()

    # -- single-thread components ----------------------------------------------------------------
    log("component micro-benchmarks")
    res.components = component_bench(state)

    # -- peak memory, one fresh process per op ----------------------------------------------------
    for op, label, path, rev in (
        ("ckvc_commit", "ckvc commit (new data, fresh repo)", work / "repo-mem", ""),
        ("ckvc_load", "ckvc load", main_repo_dir, base_commit),
        ("st_save", "safetensors save_file", work / "mem.safetensors", ""),
        ("st_load", "safetensors load_file + clone", st_path, ""),
        ("torch_save", "torch.save", work / "mem.pt", ""),
        ("torch_load", "torch.load", pt_path, ""),
    ):
        log(f"peak memory: {label}")
        data = run_child(op, path, args.size_mb, rev)
        data["label"] = label
        res.memory.append(data)
        if op in ("ckvc_commit", "st_save", "torch_save"):
            remove(path)


# ---- output ---------------------------------------------------------------------------


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


GROUP_TITLES = {
    "copy": "memory",
    "save": "save / commit",
    "load": "load, warm page cache",
    "single": "single tensor, warm",
    "load-cold": "load, cold page cache",
    "single-cold": "single tensor, cold",
}


def print_commit_stats(res: Results, key_width: int) -> None:
    """What each measured ckvc commit wrote, as the last repeat saw it."""
    if not res.commit_stats:
        return
    print()
    print("ckvc commit stats (last repeat)")
    for k, st in res.commit_stats.items():
        print(
            f"  {k:<{key_width}} chunks {st['chunks']:>5}  new {st['new_chunks']:>5}  "
            f"new raw {st['new_chunk_raw_bytes'] / MIB:>8.1f} MiB  stored {st['stored_bytes'] / MIB:>8.1f} MiB"
        )


def print_timing_rows(res: Results, group_titles: dict[str, str] | None = None) -> None:
    """The timing table (group by group, in ``group_titles`` order), the contention warning and row notes."""
    w = max(len(r.op) for r in res.rows) + 2
    cols = f"{'median s':>10}{'best s':>8}{'GB/s':>8}{'ratio':>9}{'faults':>8}{'cpu':>6}{'other':>7}"
    header = f"{'operation':<{w}}{cols}  baseline"
    print(header)
    print("-" * (len(header) + 40))
    for group, title in (group_titles or GROUP_TITLES).items():
        rows = [r for r in res.rows if r.group == group]
        if not rows:
            continue
        print(f"[{title}]")
        for r in rows:
            if not r.seconds:
                print(f"{r.op:<{w}}{'n/a':>10}{'n/a':>8}{'n/a':>8}{'n/a':>9}{'':>21}  {r.note}")
                continue
            base = "" if r.baseline in (None, r.op) else r.baseline
            faults = f"{r.fresh_pages:.2f}"
            cpu, other = f"{_median(r.samples.own_cores):.2f}", f"{_median(r.samples.other_cores):.2f}"
            ratio = fmt_ratio(res.ratio(r))
            best = min(r.seconds)
            print(
                f"{r.op:<{w}}{r.median:>10.3f}{best:>8.3f}{r.gbps:>8.2f}{ratio:>9}{faults:>8}{cpu:>6}{other:>7}  {base}"
            )
    c = res.config
    busy = [r.op for r in res.rows if r.seconds and _median(r.samples.other_cores) > 0.25]
    if busy:
        print(
            f"\nWARNING: other processes kept >0.25 CPU cores busy during {len(busy)} of {len(res.rows)} rows "
            f"(load average at start {c['loadavg_start']}, end {c.get('loadavg_end', '?')}); timings are contended"
        )
    notes = [r for r in res.rows if r.note and r.seconds]
    if notes:
        print()
        for r in notes:
            print(f"  note ({r.op}): {r.note}")


def print_table(res: Results) -> None:
    c = res.config
    sh = c["shape"]
    print()
    print(
        f"ckvc foundation benchmark: {c['state_bytes'] / GB:.3f} GB fp32 state, {c['tensors']} tensors "
        f"(vocab {sh['vocab']}, d {sh['d']}, {sh['layers']} layers), median of {c['repeats']}, "
        f"{c['cpus']} CPUs, torch {c['torch']}"
    )
    print(
        f"cold reads: {c['cold_method'] or 'n/a'}; single tensor = {c['single_tensor']} "
        f"({c['single_tensor_bytes'] / MIB:.0f} MiB); ratio = median / baseline median (lower is better)"
    )
    print()
    print_timing_rows(res)

    print()
    print("stored size")
    for s in res.sizes:
        print(f"  {s['format']:<52}{s['bytes'] / MIB:>10.1f} MiB  {s['ratio_vs_raw']:.3f} of raw")

    print_commit_stats(res, key_width=10)

    print()
    print("peak RSS minus state size (fresh process per op; saves hold the state before, loads return it)")
    for m in res.memory:
        how = "VmHWM reset" if m["hwm_reset"] else "ru_maxrss"
        extra = f"  (RssFile after: {m['rss_file_after'] / MIB:.0f} MiB)" if m["op"] == "st_load" else ""
        print(f"  {m['label']:<40}{m['extra'] / MIB:>10.1f} MiB  [{how}]{extra}")

    print()
    print("ckvc components (best of 3, 64 MiB of the state)")
    for comp in res.components:
        note = f"  {comp['note']}" if comp["note"] else ""
        print(f"  {comp['component']:<46}{comp['gb_per_s']:>7.2f} GB/s{note}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024, help="target state size in MiB (default 1024)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per operation (default 3)")
    ap.add_argument("--dir", default=None, help="where to make the temporary work dir (default: system temp dir)")
    ap.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")
    ap.add_argument("--child-op", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-rev", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_op:
        child_main(args.child_op, Path(args.child_path), args.size_mb, args.child_rev)
        return
    if args.repeats < 1 or args.size_mb < 1:
        ap.error("--repeats and --size-mb must be positive")
    started = time.perf_counter()
    res = run_benchmark(args)
    res.config["wall_seconds"] = time.perf_counter() - started
    res.config["loadavg_end"] = _loadavg()
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
    else:
        print_table(res)
        print(f"\n(total wall time {res.config['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
