"""Training across machines that share only a bucket (issue 26): ckvc's remote
distributed commits against DCP's ``FsspecWriter`` over s3fs, the tool users reach
for, on 2 nodes x 2 gloo ranks on one machine and moto's S3 server on loopback.

    .venv/bin/python benchmarks/multinode.py [--size-mb 256] [--saves 10] [--rounds 2]
        [--steps-per-save 4] [--lr 1e-5] [--frozen 0] [--dir DIR] [--profile] [--json]

Nodes are directories ``node0`` and ``node1``, each its own ckvc repository
(``Repo.init`` + ``remotes.add("origin", s3://bucket/ckvc-<round>)``), ranks 0-1 on
node 0 and 2-3 on node 1; nothing but the S3 server (tests/s3server.py, moto in a
subprocess on 127.0.0.1, fake credentials) is shared. DCP writes
``s3://bucket/dcp-<round>/step<i>`` (a directory per save, as DCP users keep them)
with ``FsspecWriter`` (its defaults: one file per rank, one thread) over s3fs on the
same server, and reads back with ``FsspecReader``.

The state: ``--size-mb`` MiB per save over the 4 ranks (FSDP-like: each rank owns
its own layers), mixed-precision AdamW as a training loop holds it: bf16 model
weights, fp32 master weights, ``exp_avg`` and ``exp_avg_sq`` (14 bytes a parameter),
and a step counter. Between saves ``--steps-per-save`` AdamW steps (lr ``--lr``,
weight decay 0.01) on synthetic gradients: a fixed direction per tensor plus noise,
scales log-uniform per tensor and log-normal per row; the run starts mid-training
(step 10000, the moments at their steady state). So every tensor changes at every
save: the weights by about 1e-3 relative (the bf16 copy where the rounding moves),
Adam's first moment mostly anew (a third of it is fresh noise after 4 steps), the
second by about 0.4% (beta2 0.999). A dense run: no frozen layers, no rows without
gradients (a fine-tune's frozen parts or a large vocabulary's untouched embedding
rows would dedup or delta far better: ``--frozen 0.5`` freezes half of each rank's
layers, their weights unchanged and without optimizer state).

Per save, ckvc and DCP back to back, the order flipped every save and every round
(A B, B A, ...), with the same state; a host memcpy of each rank's state (``copy_``
into buffers allocated once, what an async checkpointer's staging does) beside them:

* ckvc: ``distributed.commit(..., remote="origin", blocking=False)`` on every rank
  (each rank's repository opened with ``threads=cores // 4``);
  stall = the slowest rank's time until ``commit`` returns; local = until
  ``pending.local()``; durable = from the common start until every rank's
  ``pending.result()`` has returned (the commit is on the bucket's branch).
* DCP: ``dcp.save`` with a fresh ``FsspecWriter``: durable = until every rank's
  ``save`` has returned (files and ``.metadata`` closed, i.e. uploaded).
* bytes uploaded: the sizes of the objects each save added under each side's
  prefix, listed after every save through ckvc's object-store client (neither
  side's own uploads). DCP's older step directories are deleted once counted (moto
  holds objects in memory). Tiny ckvc lease objects removed again are not counted.

Then a fresh node per side, the order flipped each round: ckvc: each node's first
rank ``Repo.clone(url, dir, lazy=True)``, then every rank ``distributed.load(repo,
rev, rank=r)``, fetching only its part; DCP: ``dcp.load`` of the last step into
tensors allocated beforehand (not timed). Both checked bit-exact against the state
saved last.

Timings are wall clock between barriers on rank 0, ``os.sync()`` before each; the
table shows medians (over saves 2..N of every round for the later saves; over rounds
for the first save and the resume) and ratios of the medians, with each goal; the
bytes are the mean over rounds of all saves' sum. The stall is also shown against
a ``clone()`` of the state (fresh memory, first-touch page faults included).
Without s3fs installed, ckvc's side runs alone (said so; the goals are left out).
``--profile``: rank 0's commits (the protocol, on the repository's background
commit thread) run under cProfile, the top functions printed to stderr.

Phases: the time each rank spends in ckvc's steps (timed by wrapping them from
here): staging and its private copy, local write (chunk, encode, packs), upload
of its part, waits in the gloo exchanges, the coordinator's remote open and
publish, each node's record. Shown per save as the slowest rank's seconds in each
(they overlap across ranks and do not add up to the durable time).

Loopback with moto measures the clients' and moto's work (Python, in memory), not a
network: an upload costs CPU on the same 2 cores the ranks compress on.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import functools
import io
import json
import math
import multiprocessing
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # s3server

NODES = 2
RANKS_PER_NODE = 2
WORLD = NODES * RANKS_PER_NODE
MiB = 1 << 20
BYTES_PER_PARAM = 2 + 4 + 4 + 4  # bf16 weight, fp32 master, exp_avg, exp_avg_sq
TENSORS_PER_RANK = 8
BETAS = (0.9, 0.999)
WEIGHT_DECAY = 0.01
WARMUP_STEPS = 8
START_STEP = 10_000  # the run is well under way when the benchmark's saves begin
SAMPLES = (
    "ckvc_stall",
    "ckvc_local",
    "ckvc_durable",
    "dcp_durable",
    "memcpy",
    "clone_copy",
    "ckvc_resume",
    "dcp_resume",
    "ckvc_bytes",
    "dcp_bytes",
    "phases",
)
GOALS = {"bytes": 0.4, "first": 1.3, "later": 0.6, "stall": 1.5, "resume": 1.2}


def log(msg: str) -> None:
    print(f"[multinode {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the training state ---------------------------------------------------------------


class Trainer:
    """One rank's mixed-precision AdamW state, moved by synthetic gradients."""

    def __init__(self, rank: int, size_mb: int, lr: float, frozen: float = 0.0) -> None:
        import torch

        self.lr = lr
        self.gen = torch.Generator().manual_seed(26_000 + rank)
        params = max(4096, size_mb * MiB // WORLD // BYTES_PER_PARAM)
        width = 1024 if params >= 64 * 1024 * TENSORS_PER_RANK else 256
        rows = max(1, params // TENSORS_PER_RANK // width)
        self.names = [f"layers.{rank * TENSORS_PER_RANK + i}.{kind}.weight" for i, kind in enumerate(self._kinds())]
        self.master = {n: torch.empty(rows, width).normal_(0.0, 0.02, generator=self.gen) for n in self.names}
        # per tensor: a gradient scale (log-uniform 1e-4..1e-2), per row a log-normal factor,
        # and a persistent direction (the signal the moments average over)
        self.scale = {
            n: 10 ** (-4 + 2 * torch.rand(1, generator=self.gen).item())
            * torch.empty(rows, 1).log_normal_(0.0, 0.5, generator=self.gen)
            for n in self.names
        }
        self.direction = {n: torch.randn(rows, width, generator=self.gen) * 0.3 for n in self.names}
        # mid-run moments, at their steady state (as after thousands of steps): exp_avg
        # the direction plus the noise an EMA over ~10 steps keeps, exp_avg_sq the mean
        # square within the noise of an EMA over ~1000 steps
        b1, b2 = BETAS
        keep1, keep2 = math.sqrt((1 - b1) / (1 + b1)), math.sqrt(2 * (1 - b2) / (1 + b2))
        self.exp_avg = {
            n: (self.direction[n] + keep1 * torch.randn(rows, width, generator=self.gen)).mul_(self.scale[n])
            for n in self.names
        }
        self.exp_avg_sq = {
            n: (self.direction[n] ** 2 + 1).mul_(self.scale[n] ** 2)
            * (1 + keep2 * torch.randn(rows, width, generator=self.gen)).clamp_(min=0.5)
            for n in self.names
        }
        self.model = {n: self.master[n].to(torch.bfloat16) for n in self.names}
        # --frozen: the first layers take no steps and have no optimizer state (a fine-tune)
        self.trained = self.names[round(frozen * len(self.names)) :]
        self.norms = {f"layers.{rank * TENSORS_PER_RANK + i}.norm.weight": torch.ones(width) for i in range(2)}
        self.step = START_STEP
        self.advance(WARMUP_STEPS)

    @staticmethod
    def _kinds() -> list[str]:
        kinds = ["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"]
        return [kinds[i % len(kinds)] for i in range(TENSORS_PER_RANK)]

    def advance(self, steps: int) -> None:
        import torch

        b1, b2 = BETAS
        for _ in range(steps):
            self.step += 1
            bias1, bias2 = 1 - b1**self.step, 1 - b2**self.step
            for n in self.trained:
                g = torch.randn(self.master[n].shape, generator=self.gen).add_(self.direction[n]).mul_(self.scale[n])
                self.exp_avg[n].mul_(b1).add_(g, alpha=1 - b1)
                self.exp_avg_sq[n].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (self.exp_avg_sq[n] / bias2).sqrt_().add_(1e-8)
                self.master[n].mul_(1 - self.lr * WEIGHT_DECAY).addcdiv_(self.exp_avg[n], denom, value=-self.lr / bias1)
                self.model[n].copy_(self.master[n])

    def state(self) -> dict[str, Any]:
        """The checkpoint a training loop would commit (the live tensors, not copies)."""
        return {
            "model": {**self.model, **self.norms},
            "optimizer": {
                "state": {
                    n: {
                        "step": self.step,
                        "master": self.master[n],
                        "exp_avg": self.exp_avg[n],
                        "exp_avg_sq": self.exp_avg_sq[n],
                    }
                    for n in self.trained
                },
                "param_groups": [{"lr": self.lr, "betas": list(BETAS), "weight_decay": WEIGHT_DECAY}],
            },
            "step": self.step,
        }


def tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    import torch

    if isinstance(state, dict):
        for k, v in state.items():
            yield from tensors(v, f"{prefix}{k}.")
    elif isinstance(state, list):
        for i, v in enumerate(state):
            yield from tensors(v, f"{prefix}{i}.")
    elif isinstance(state, torch.Tensor):
        yield prefix.rstrip("."), state


def state_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors(state))


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of the tensors of two states (same paths)."""
    import torch

    ta, tb = dict(tensors(a)), dict(tensors(b))
    return ta.keys() == tb.keys() and all(
        x.dtype == tb[k].dtype and torch.equal(x.view(torch.uint8), tb[k].view(torch.uint8)) for k, x in ta.items()
    )


def empty_like_state(state: Any) -> Any:
    import torch

    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [empty_like_state(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    return state


# ---- phases: ckvc's steps, timed by wrapping them ----------------------------------------


class Phases:
    """Seconds spent in wrapped functions, summed per name until taken."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spent: dict[str, float] = {}

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                with self.lock:
                    self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - started

        setattr(owner, attr, timed)

    def install(self) -> None:
        import ckvc.distributed as distributed
        import ckvc.write as write
        from ckvc.remote import publish

        self.wrap(write, "stage", "stage (tree, views)")
        self.wrap(write.StagingBuffers, "owned", "private copy (the stall)")
        self.wrap(write, "write_blobs", "write chunks (local)")
        self.wrap(publish, "open_for_commit", "open remote")
        self.wrap(publish, "upload_part", "upload part")
        self.wrap(publish, "publish", "publish (coordinator)")
        self.wrap(publish, "record", "record on node")
        self.wrap(distributed, "commit_group", "commit_group")
        self.wrap(distributed, "hold_parts_on", "hold_parts_on")
        self.wrap(distributed, "_all_gather_bytes", "gloo all_gather")
        self.wrap(distributed, "_broadcast_bytes", "gloo broadcast")

    def take(self) -> dict[str, float]:
        with self.lock:
            out, self.spent = self.spent, {}
        return out


# ---- the bucket: s3fs for DCP; objects counted with a client of their own ---------------


def s3fs_options(endpoint: str) -> dict[str, Any]:
    """What FsspecWriter/Reader pass to s3fs: the endpoint (the fake credentials
    come from the environment), a filesystem of their own, no listing cache."""
    return {"endpoint_url": endpoint, "skip_instance_cache": True, "use_listings_cache": False}


class Bucket:
    """The whole bucket through ckvc's object-store client (neither side's own):
    the sizes of the objects under a prefix, and their removal."""

    def __init__(self, bucket: str, endpoint: str) -> None:
        from ckvc.storage.cloud import open_object_store

        self.backend = open_object_store(f"s3://{bucket}", endpoint=endpoint)

    def bytes_under(self, prefix: str) -> int:
        return sum(self.backend.list_sizes(prefix.rstrip("/") + "/").values())

    def remove(self, prefix: str) -> None:
        for key in self.backend.list_sizes(prefix.rstrip("/") + "/"):
            self.backend.delete(key)

    def close(self) -> None:
        self.backend.close()


# ---- one rank --------------------------------------------------------------------------


def _fsspec_classes() -> tuple[Any, Any]:
    try:
        from torch.distributed.checkpoint import FsspecReader, FsspecWriter  # type: ignore[attr-defined]
    except ImportError:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    return FsspecWriter, FsspecReader


class Rank:
    """One rank's side of the benchmark: its node's repository, its part of the
    state, and the samples (rank 0 keeps them; every rank takes part in each step)."""

    def __init__(self, rank: int, args: argparse.Namespace, endpoint: str, bucket: str) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.args, self.endpoint, self.bucket = rank, args, endpoint, bucket
        self.threads = max(1, (os.cpu_count() or 1) // WORLD)
        self.work = Path(args.dir)
        self.node = rank // RANKS_PER_NODE
        self.leader = rank % RANKS_PER_NODE == 0
        self.fsspec_writer, self.fsspec_reader = _fsspec_classes()
        self.opts = s3fs_options(endpoint)
        self.phases = Phases()
        self.phases.install()
        self.view = Bucket(bucket, endpoint) if rank == 0 else None
        self.samples: dict[str, list[Any]] = {k: [] for k in SAMPLES}
        self.per_rank_bytes = 0

    def sync(self) -> None:
        if self.rank == 0:
            os.sync()
        self.dist.barrier()

    def gather(self, value: Any) -> list[Any]:
        got: list[Any] = [None] * WORLD
        self.dist.all_gather_object(got, value)
        return got

    def add(self, name: str, rnd: int, save: int, value: Any) -> None:
        self.samples[name].append((rnd, save, value))

    def ckvc_save(self, rnd: int, save: int, repo: Any, state: Any, step: int) -> str:
        import ckvc.distributed

        self.sync()
        self.phases.take()
        started = time.perf_counter()
        pending = ckvc.distributed.commit(repo, state, f"step {step}", remote="origin", blocking=False)
        stall = time.perf_counter() - started
        pending.local()
        local = time.perf_counter() - started
        commit_id = pending.result()
        self.dist.barrier()
        durable = time.perf_counter() - started
        got = self.gather((stall, local, self.phases.take()))
        self.add("ckvc_stall", rnd, save, max(g[0] for g in got))
        self.add("ckvc_local", rnd, save, max(g[1] for g in got))
        self.add("ckvc_durable", rnd, save, durable)
        self.add("phases", rnd, save, [g[2] for g in got])
        return commit_id

    def dcp_save(self, rnd: int, save: int, state: Any) -> None:
        import torch.distributed.checkpoint as dcp

        self.sync()
        started = time.perf_counter()
        writer = self.fsspec_writer(f"s3://{self.bucket}/dcp-{rnd}/step{save}", **self.opts)
        dcp.save({f"rank{self.rank}": state}, storage_writer=writer)
        self.dist.barrier()
        self.add("dcp_durable", rnd, save, time.perf_counter() - started)

    def copies(self, rnd: int, save: int, state: Any, buffers: Any) -> None:
        """The host memcpy of the state (into buffers allocated once), and a clone (fresh memory)."""
        self.sync()
        started = time.perf_counter()
        for (_, dst), (_, src) in zip(tensors(buffers), tensors(state), strict=True):
            dst.copy_(src)
        self.add("memcpy", rnd, save, max(self.gather(time.perf_counter() - started)))
        self.sync()
        started = time.perf_counter()
        clones = [t.clone() for _, t in tensors(state)]
        self.add("clone_copy", rnd, save, max(self.gather(time.perf_counter() - started)))
        del clones

    def count(self, rnd: int, save: int, ckvc_before: int) -> int:
        """Rank 0: the bytes each side added to the bucket with this save; DCP's
        previous step removed. Returns ckvc's bytes in the bucket now."""
        assert self.view is not None
        ckvc_now = self.view.bytes_under(f"ckvc-{rnd}")
        self.add("ckvc_bytes", rnd, save, ckvc_now - ckvc_before)
        said = ""
        if self.args.dcp:
            dcp_step = self.view.bytes_under(f"dcp-{rnd}/step{save}")
            self.add("dcp_bytes", rnd, save, dcp_step)
            said = f"DCP durable {self.samples['dcp_durable'][-1][2]:.2f} s, {dcp_step / MiB:.1f} MiB; "
            if save:
                self.view.remove(f"dcp-{rnd}/step{save - 1}")
        log(
            f"round {rnd} save {save + 1}/{self.args.saves}: ckvc stall {self.samples['ckvc_stall'][-1][2]:.2f} s, "
            f"durable {self.samples['ckvc_durable'][-1][2]:.2f} s, {self.samples['ckvc_bytes'][-1][2] / MiB:.1f} MiB; "
            f"{said}memcpy {self.samples['memcpy'][-1][2]:.3f} s"
        )
        return ckvc_now

    def ckvc_resume(self, rnd: int, commit_id: str) -> Any:
        """A fresh node: its first rank clones lazily, then each rank loads its part."""
        import ckvc
        import ckvc.distributed

        fresh_dir = self.work / f"round{rnd}" / f"fresh{self.node}"
        self.sync()
        started = time.perf_counter()
        if self.leader:
            ckvc.Repo.clone(f"s3://{self.bucket}/ckvc-{rnd}", fresh_dir, endpoint=self.endpoint, lazy=True).close()
        self.dist.barrier()
        with ckvc.Repo.open(fresh_dir, threads=self.threads) as fresh:
            loaded = ckvc.distributed.load(fresh, commit_id, rank=self.rank)
        self.dist.barrier()
        self.add("ckvc_resume", rnd, -1, time.perf_counter() - started)
        return loaded

    def dcp_resume(self, rnd: int, target: Any) -> None:
        import torch.distributed.checkpoint as dcp

        self.sync()
        started = time.perf_counter()
        reader = self.fsspec_reader(f"s3://{self.bucket}/dcp-{rnd}/step{self.args.saves - 1}", **self.opts)
        dcp.load(target, storage_reader=reader)
        self.dist.barrier()
        self.add("dcp_resume", rnd, -1, time.perf_counter() - started)

    def round(self, rnd: int) -> None:
        import ckvc

        args = self.args
        trainer = Trainer(self.rank, args.size_mb, args.lr, args.frozen)  # the same run every round
        state = trainer.state()
        self.per_rank_bytes = state_bytes(state)
        buffers = empty_like_state(state)
        node_dir = self.work / f"round{rnd}" / f"node{self.node}"
        if self.leader:
            with ckvc.Repo.init(node_dir) as made:
                made.remotes.add("origin", f"s3://{self.bucket}/ckvc-{rnd}", endpoint=self.endpoint)
        self.dist.barrier()
        in_bucket, last_id = 0, ""
        with ckvc.Repo.open(node_dir, threads=self.threads) as repo:
            for save in range(args.saves):
                if save:
                    trainer.advance(args.steps_per_save)
                ckvc_first = (save + rnd) % 2 == 0 or not args.dcp  # A B, then B A
                for side in ("ckvc", "dcp") if ckvc_first else ("dcp", "ckvc"):
                    if side == "ckvc":
                        last_id = self.ckvc_save(rnd, save, repo, state, trainer.step)
                    elif args.dcp:
                        self.dcp_save(rnd, save, state)
                self.copies(rnd, save, state, buffers)
                if self.rank == 0:
                    in_bucket = self.count(rnd, save, in_bucket)
                self.dist.barrier()
        # a fresh node resumes the last save
        expected = trainer.state()
        target = {f"rank{self.rank}": empty_like_state(expected)}
        loaded: Any = None
        ckvc_first = rnd % 2 == 0 or not args.dcp
        for side in ("ckvc", "dcp") if ckvc_first else ("dcp", "ckvc"):
            if side == "ckvc":
                loaded = self.ckvc_resume(rnd, last_id)
            elif args.dcp:
                self.dcp_resume(rnd, target)
        if not same(loaded, expected) or (args.dcp and not same(target[f"rank{self.rank}"], expected)):
            raise AssertionError(f"rank {self.rank}: a resumed state differs from the last save")
        self.dist.barrier()
        if self.rank == 0:
            assert self.view is not None
            said = f", DCP {self.samples['dcp_resume'][-1][2]:.2f} s" if args.dcp else ""
            log(f"round {rnd} resume: ckvc {self.samples['ckvc_resume'][-1][2]:.2f} s{said}")
            self.view.remove(f"ckvc-{rnd}")
            self.view.remove(f"dcp-{rnd}")
            shutil.rmtree(self.work / f"round{rnd}", ignore_errors=True)
        self.dist.barrier()


def _rank_main(rank: int, store: str, args: argparse.Namespace, endpoint: str, bucket: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import ckvc.distributed

    os.environ.setdefault("CKVC_AUTHOR", "bench@multinode")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=1800)
    )
    torch.set_num_threads(1)  # 4 ranks on this machine's cores; ckvc has its own threads
    me = Rank(rank, args, endpoint, bucket)
    profiler = cProfile.Profile() if args.profile and rank == 0 else None
    if profiler is not None:  # the protocol runs on the background commit thread: profile it there
        run_remote = ckvc.distributed._run_remote

        def profiled(*a: Any, **kw: Any) -> Any:
            assert profiler is not None
            return profiler.runcall(run_remote, *a, **kw)

        ckvc.distributed._run_remote = profiled
    for rnd in range(args.rounds):
        me.round(rnd)
    if rank == 0:
        assert me.view is not None
        me.view.close()
        result: dict[str, Any] = {"samples": me.samples, "per_rank_bytes": me.per_rank_bytes, "threads": me.threads}
        if profiler is not None:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
            result["profile"] = text.getvalue()
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)


# ---- the report ------------------------------------------------------------------------


def med(rows: list[Any], first: bool | None = None) -> float:
    """Median of the values of (round, save, value) rows: all, the first saves, or the later ones."""
    values = [v for _, i, v in rows if first is None or (i == 0) == first]
    return statistics.median(values) if values else math.nan


def report(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    s = result["samples"]
    rounds = args.rounds
    ckvc_bytes = sum(v for _, _, v in s["ckvc_bytes"]) / rounds
    dcp_bytes = sum(v for _, _, v in s["dcp_bytes"]) / rounds if s["dcp_bytes"] else math.nan
    rows = [
        ("bytes uploaded, all saves (MiB)", ckvc_bytes / MiB, dcp_bytes / MiB, "DCP+s3fs", "bytes"),
        ("durable in bucket, first save (s)", med(s["ckvc_durable"], True), med(s["dcp_durable"], True), "DCP+s3fs",
         "first"),
        ("durable in bucket, saves 2.. (s)", med(s["ckvc_durable"], False), med(s["dcp_durable"], False), "DCP+s3fs",
         "later"),
        ("stall, blocking=False (s)", med(s["ckvc_stall"]), med(s["memcpy"]), "memcpy", "stall"),
        ("fresh-node resume (s)", med(s["ckvc_resume"]), med(s["dcp_resume"]), "DCP+s3fs", "resume"),
    ]  # fmt: skip
    total_mib = result["per_rank_bytes"] * WORLD / MiB
    print(
        f"multinode: {NODES} nodes x {RANKS_PER_NODE} ranks, {total_mib:.0f} MiB per save "
        f"({result['per_rank_bytes'] / MiB:.1f} MiB a rank: bf16 weights, fp32 master + AdamW moments), "
        f"{args.saves} saves x {args.rounds} round(s), {args.steps_per_save} AdamW steps (lr {args.lr:g}) between "
        f"saves{f', {args.frozen:g} of the layers frozen' if args.frozen else ''}; moto S3 on loopback; "
        f"{result['threads']} ckvc thread(s) a rank; medians"
    )
    print(f"  {'':<36} {'ckvc':>10} {'baseline':>10}  {'vs':<9} {'ratio':>6}  {'goal':>6}")
    ratios: dict[str, float] = {}
    for label, mine, theirs, against, goal in rows:
        ratio = mine / theirs if theirs else math.nan
        ratios[goal] = ratio
        verdict = "ok" if ratio <= GOALS[goal] else "MISSED" if ratio == ratio else "left out"
        print(f"  {label:<36} {mine:>10.3f} {theirs:>10.3f}  {against:<9} {ratio:>6.3f}  <= {GOALS[goal]:<4} {verdict}")
    print(
        f"  also: ckvc local stage (pending.local) {med(s['ckvc_local'], True):.3f} s first, "
        f"{med(s['ckvc_local'], False):.3f} s later; stall vs clone() of the state "
        f"{med(s['ckvc_stall']) / med(s['clone_copy']):.2f} ({med(s['clone_copy']):.3f} s)"
    )
    print(
        "  bytes per save (MiB, round 0): ckvc " + " ".join(f"{v / MiB:.1f}" for r, _, v in s["ckvc_bytes"] if r == 0)
    )
    print("                                 DCP  " + " ".join(f"{v / MiB:.1f}" for r, _, v in s["dcp_bytes"] if r == 0))
    # phases: per save, the slowest rank's seconds in each step; medians over saves
    names: list[str] = sorted({n for _, _, ranks in s["phases"] for spent in ranks for n in spent})
    print("  where ckvc's time goes (slowest rank's seconds per save; medians: first save / saves 2..):")
    for name in names:

        def worst(first: bool, name: str = name) -> float:
            return med([(r, i, max(spent.get(name, 0.0) for spent in ranks)) for r, i, ranks in s["phases"]], first)

        print(f"    {name:<24} {worst(True):7.3f} / {worst(False):7.3f}")
    if not args.dcp:
        print("  DCP+s3fs left out: s3fs is not installed (pip install -e '.[bench]')")
    print(
        "  goals: "
        + ", ".join(
            f"{k} {ratios[k]:.2f} <= {v} {'yes' if ratios[k] <= v else 'NO' if ratios[k] == ratios[k] else '-'}"
            for k, v in GOALS.items()
        )
    )
    if "profile" in result:
        print(result["profile"], file=sys.stderr)
    return {"ratios": ratios, "ckvc_bytes": ckvc_bytes, "dcp_bytes": dcp_bytes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=256, help="MiB per save over the 4 ranks (the issue: 256-1024)")
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps-per-save", type=int, default=4, help="AdamW steps between saves")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--frozen",
        type=float,
        default=0.0,
        help="fraction of each rank's layers frozen (a fine-tune; default 0: dense)",
    )
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--profile", action="store_true", help="cProfile rank 0's ckvc commits (stderr)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.saves < 2:
        parser.error("--saves must be at least 2 (the first save and the later ones)")
    import importlib.util

    missing = [m for m in ("moto", "werkzeug", "obstore") if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"{', '.join(missing)} not installed (pip install -e '.[test,remote]')")
    args.dcp = importlib.util.find_spec("s3fs") is not None  # the baseline; without it, ckvc's side only
    from s3server import CLEARED, FAKE_CREDENTIALS, S3Server

    for name in CLEARED:
        os.environ.pop(name, None)
    os.environ.update(FAKE_CREDENTIALS)
    scratch = tempfile.mkdtemp(prefix="ckvc-multinode-", dir=args.dir)
    args.dir = scratch
    server = S3Server.start()
    try:
        bucket = server.create_bucket()
        log(f"S3 server (moto) at {server.endpoint}, bucket {bucket}")
        ctx = multiprocessing.get_context("spawn")
        store, out = os.path.join(scratch, "store"), os.path.join(scratch, "result.json")
        procs = [
            ctx.Process(target=_rank_main, args=(r, store, args, server.endpoint, bucket, out)) for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs) or not os.path.exists(out):
            sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        result = json.loads(Path(out).read_text())
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    summary = report(result, args)
    if args.json:
        print(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "dir"}, **result, **summary}))


if __name__ == "__main__":
    main()
