"""Remote benchmark (issue 19): push and clone against a directory remote and an S3
server on loopback, against moving the same checkpoints as safetensors files with
the same client and parallelism, in one run with alternating rounds.

    .venv/bin/python benchmarks/remote.py [--size-mb 256] [--rounds 3] [--history minilm|synthetic]
        [--epochs 10] [--remotes dir,s3] [--dir DIR] [--no-wire] [--json]

The S3 server is moto's (tests/s3server.py) in a subprocess on 127.0.0.1 and a port
the kernel picks, with fake credentials; nothing leaves loopback. It is started and
stopped here. Without moto or obstore installed, the S3 column is left out (said so).

Cases:

* history: ``--epochs`` checkpoints (model + AdamW) of the MiniLM fine-tune of
  benchmarks/minilm_data.py (``--history minilm``, the default; the ``bench`` extra,
  nothing downloaded), plus one more epoch, or a small synthetic sequence
  (``--history synthetic``: the smoke run). Each round, on a fresh remote: push of
  the whole history (bytes against the sum of the checkpoints' safetensors files;
  time against uploading those files), the same push again (must send no pack),
  clone + checkout of the tip (against downloading the files and loading the last),
  then push of one more epoch (bytes against that commit's unique stored bytes,
  ``repo.last_commit_stats.stored_bytes``: every record it appended, metadata included);
* state: one ``--size-mb`` fp32 state (benchmarks/foundation.py's GPT-like shapes;
  the issue's figure is at 1024): push against uploading it as one safetensors file;
  clone + checkout against downloading that file and loading it with safetensors,
  every tensor materialized (``load_file`` maps the file lazily; each tensor is
  cloned out of the map).

Baselines use the same client and parallelism as ckvc: on S3 obstore's ``put``
(multipart in the backend's part size, as many parts in flight as the backend's
connections, files in parallel as many as push sends packs) and ``get`` streamed to
a file, one GET per file, as a fetch reads its ranges one batch at a time; on a
directory a file copy. Every written file is fsynced, as ckvc's packs are.

Each round runs both remotes, and ckvc and its baseline back to back, the orders
flipped every round; ``os.sync()`` before each timed call. The table shows medians
and ratios of medians (ckvc / baseline: below 1 ckvc is faster or smaller).

Requests: per push and per clone, the Backend calls ckvc made (``PushResult`` counts
them; a clone's are counted by wrapping the backends it opens), and on S3, in one
more untimed pass through a counting proxy on loopback (``--no-wire``: skip it), the
HTTP requests and the bytes that crossed the wire (a multipart upload is several).

Loopback with moto measures ckvc's and the client's work plus moto's (Python, in
memory), not a network. moto answers a ranged GET by copying the whole object out of
its buffer first, so ranged reads of large packs cost it more than S3 would.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # s3server, fault_proxy

import foundation as fd
from compression import flat_tensors

import ckvc
from ckvc.remote.repository import RequestCounter

MB = 1e6
MiB = 1 << 20
STATE_SEED = 7


def log(msg: str) -> None:
    print(f"[remote {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def s3_available() -> str | None:
    """Why the S3 column cannot run, or None."""
    missing = [m for m in ("moto", "werkzeug", "obstore") if importlib.util.find_spec(m) is None]
    return f"{', '.join(missing)} not installed (pip install -e '.[test,remote]')" if missing else None


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    os.sync()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def materialized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor cloned out of safetensors' file map: its bytes read, as a checkout's are."""
    return {k: v.clone() for k, v in tensors.items()}


# ---- the places: a directory or a bucket, for ckvc and for files ---------------------


class Place:
    """One fresh remote location for one round: a URL ckvc pushes to, and beside it
    a place for the baseline's files, with the same client and parallelism."""

    kind: str
    url: str
    endpoint: str | None = None

    def upload(self, files: Sequence[Path], threads: int) -> None:
        raise NotImplementedError

    def download(self, names: Sequence[str], into: Path, threads: int) -> list[Path]:
        raise NotImplementedError

    def remove(self) -> None:
        raise NotImplementedError


class DirPlace(Place):
    kind = "dir"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root / "repo")
        self.files = root / "files"
        self.files.mkdir(parents=True)

    def upload(self, files: Sequence[Path], threads: int) -> None:
        def copy(path: Path) -> None:
            shutil.copyfile(path, self.files / path.name)
            fd.fsync_path(self.files / path.name)

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(copy, files))

    def download(self, names: Sequence[str], into: Path, threads: int) -> list[Path]:
        def copy(name: str) -> Path:
            shutil.copyfile(self.files / name, into / name)
            fd.fsync_path(into / name)
            return into / name

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            return list(pool.map(copy, names))

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class S3Place(Place):
    kind = "s3"

    def __init__(self, server: Any, endpoint: str) -> None:
        import obstore

        from ckvc.storage.cloud import open_object_store

        self.obs = obstore
        self.server = server
        self.bucket = server.create_bucket()
        self.endpoint = endpoint
        self.url = f"s3://{self.bucket}/repo"
        # the baseline's client: the backend's own obstore store, part size and connections
        self.backend = open_object_store(f"s3://{self.bucket}/files", endpoint=endpoint)

    def upload(self, files: Sequence[Path], threads: int) -> None:
        b = self.backend

        def put(path: Path) -> None:
            size = path.stat().st_size
            self.obs.put(
                b.upload_store,
                b.path(path.name),
                path,
                use_multipart=size > b.part_size,
                chunk_size=b.part_size,
                max_concurrency=b.capabilities.max_connections,
            )

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(put, files))

    def download(self, names: Sequence[str], into: Path, threads: int) -> list[Path]:
        b = self.backend

        def get(name: str) -> Path:
            result = self.obs.get(b.store, b.path(name))
            with open(into / name, "wb") as f:
                for part in result.stream(min_chunk_size=b.part_size):
                    f.write(part)
                f.flush()
                os.fsync(f.fileno())
            return into / name

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            return list(pool.map(get, names))

    def remove(self) -> None:
        """Every object of the bucket, then the bucket (moto frees their memory)."""
        from ckvc.storage.cloud import open_object_store

        whole = open_object_store(f"s3://{self.bucket}", endpoint=self.server.endpoint)
        try:
            for key in list(whole.list("")):
                whole.delete(key)
        finally:
            whole.close()
            self.backend.close()
        self.server.request("DELETE", f"/{self.bucket}")


class Places:
    """Makes fresh places of each kind; owns the S3 server."""

    def __init__(self, work: Path, kinds: list[str]) -> None:
        self.work = work
        self.kinds = kinds
        self.server: Any = None
        self.count = 0
        if "s3" in kinds:
            from s3server import CLEARED, FAKE_CREDENTIALS, S3Server

            for name in CLEARED:
                os.environ.pop(name, None)
            os.environ.update(FAKE_CREDENTIALS)
            self.server = S3Server.start()
            log(f"S3 server (moto) at {self.server.endpoint}")

    def make(self, kind: str, endpoint: str | None = None) -> Place:
        self.count += 1
        if kind == "dir":
            return DirPlace(self.work / f"remote-{self.count}")
        return S3Place(self.server, endpoint or self.server.endpoint)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


# ---- the wire: a counting proxy in front of the S3 server ----------------------------


def counting_proxy(upstream: str) -> Any:
    """tests/fault_proxy.py's proxy with no faults, adding up the bytes each
    way (request bodies; response bodies)."""
    from fault_proxy import FaultProxy

    class Counting(FaultProxy):
        def __init__(self) -> None:
            super().__init__(upstream)
            self.sent = 0
            self.received = 0

        def forward(self, h: Any, body: bytes) -> Any:
            out = super().forward(h, body)
            with self.lock:
                self.sent += len(body)
                self.received += len(out[3])
            return out

        def take(self) -> dict[str, Any]:
            """What was counted since the last take, and reset."""
            with self.lock:
                methods: dict[str, int] = {}
                for method, path in self.requests:
                    what = method + (" part" if "partNumber=" in path else "")
                    methods[what] = methods.get(what, 0) + 1
                out = {"requests": len(self.requests), "by_method": methods, "sent": self.sent}
                out["received"] = self.received
                self.requests.clear()
                self.sent = self.received = 0
            return out

    return Counting()


@contextlib.contextmanager
def counted_clone_backends() -> Iterator[list[RequestCounter]]:
    """Every backend a clone opens, wrapped in a RequestCounter (clone opens one for
    its checks, then fetch one more)."""
    import ckvc.remote.clone as clone_module
    import ckvc.remote.repository as repository_module

    opened: list[RequestCounter] = []
    originals = clone_module.open_backend, repository_module.open_backend

    def counting(url: str, **kwargs: Any) -> Any:
        backend = RequestCounter(originals[0](url, **kwargs))
        opened.append(backend)
        return backend

    clone_module.open_backend = repository_module.open_backend = counting
    try:
        yield opened
    finally:
        clone_module.open_backend, repository_module.open_backend = originals


# ---- the cases -----------------------------------------------------------------------


@dataclass
class Case:
    """A local repository to push, and the same checkpoints as safetensors files."""

    name: str
    repo: Path
    branch: str  # what the push / clone measure
    files: list[Path]  # the branch's checkpoints as safetensors files, in order
    files_bytes: int  # their sizes, added up
    next_branch: str | None = None  # one more epoch on top of ``branch``
    next_stored: int = 0  # that commit's unique stored bytes
    next_file: int = 0  # that checkpoint's safetensors size
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # kind -> metric -> values

    def add(self, kind: str, metric: str, value: float) -> None:
        self.samples.setdefault(kind, {}).setdefault(metric, []).append(value)

    def median(self, kind: str, metric: str) -> float:
        values = self.samples.get(kind, {}).get(metric)
        return statistics.median(values) if values else float("nan")


def synthetic_sequence(epochs: int) -> Iterator[dict[str, Any]]:
    """A small stand-in for the fine-tune (smoke runs): eight 256 KiB fp32 weights that
    move a little each epoch, and AdamW-like moments."""
    gen = torch.Generator().manual_seed(STATE_SEED)
    weights = {f"layer{i}.weight": torch.empty(256, 256).normal_(0.0, 0.02, generator=gen) for i in range(8)}
    avg = {k: torch.zeros_like(v) for k, v in weights.items()}
    sq = {k: torch.zeros_like(v) for k, v in weights.items()}
    for epoch in range(epochs):
        for name, w in weights.items():
            grad = torch.empty_like(w).normal_(0.0, 1e-3, generator=gen)
            avg[name].mul_(0.9).add_(grad, alpha=0.1)
            sq[name].mul_(0.999).addcmul_(grad, grad, value=0.001)
            w.sub_(avg[name] * 1e-3)
        yield {
            "model": {k: v.clone() for k, v in weights.items()},
            "optimizer": {
                "state": {i: {"exp_avg": avg[k].clone(), "exp_avg_sq": sq[k].clone()} for i, k in enumerate(weights)}
            },
            "epoch": epoch,
        }


def history_states(kind: str, epochs: int) -> Iterator[dict[str, Any]]:
    """``epochs`` + 1 checkpoints: the history and one more epoch."""
    if kind == "synthetic":
        yield from synthetic_sequence(epochs + 1)
        return
    from minilm_data import cached_sequence

    # a cache of its own (epochs + 1): the fine-tune is deterministic, so its first
    # ``epochs`` are the same checkpoints as compression.py's cache
    cache = Path.home() / ".cache" / "ckvc-bench" / f"minilm-all-{epochs + 1}"
    for path in cached_sequence("all", epochs + 1, cache):
        yield torch.load(path, weights_only=True)


def build_history(work: Path, kind: str, epochs: int) -> Case:
    repo_dir, files_dir = work / "history-repo", work / "history-files"
    files_dir.mkdir(parents=True)
    case = Case(f"{kind} history", repo_dir, "main", [], 0, next_branch="next")
    with ckvc.Repo.init(repo_dir) as repo:
        for i, state in enumerate(history_states(kind, epochs)):
            flat = flat_tensors(state)
            if i == epochs:  # one more epoch, on a branch of its own
                repo.branch("next", "main")
                repo.switch("next")
            repo.commit(state, message=f"epoch {i}")
            stats = repo.last_commit_stats
            assert stats is not None
            path = files_dir / f"epoch_{i:02d}.safetensors"
            fd.save_safetensors_durably(flat, path)
            if i == epochs:
                case.next_stored, case.next_file = stats.stored_bytes, path.stat().st_size
                path.unlink()
            else:
                case.files.append(path)
                case.files_bytes += path.stat().st_size
            log(f"  epoch {i}: {stats.stored_bytes / MB:.1f} MB stored, {path.name if i < epochs else 'next'}")
        repo.switch("main")
    return case


def build_state(work: Path, size_mb: int) -> Case:
    state = fd.build_state(fd.pick_shape(size_mb * MiB), seed=STATE_SEED)
    repo_dir, path = work / "state-repo", work / "state.safetensors"
    with ckvc.Repo.init(repo_dir) as repo:
        repo.commit(state, message="state")
    fd.save_safetensors_durably(state, path)
    return Case(f"{size_mb} MB fp32 state", repo_dir, "main", [path], path.stat().st_size)


# ---- one round -------------------------------------------------------------------------

PACKS_IN_FLIGHT = 8  # what a push sends at once (open_remote's executor: min(connections, 8))


def ckvc_side(case: Case, place: Place, work: Path, wire: Any = None) -> dict[str, Any]:
    """Push the case's branch to ``place``, push it again, clone it back and check it
    out, then push one more epoch. Returns what each step reported (``wire``: the
    counting proxy, read after each step)."""

    def on_wire() -> Any:
        return wire.take() if wire is not None else None

    out: dict[str, Any] = {}
    name = f"bench-{place.kind}"
    with ckvc.Repo.open(case.repo) as repo:
        tip = repo.resolve(case.branch)
        repo.remotes.add(name, place.url, endpoint=place.endpoint)
        seconds, pushed = timed(lambda: repo.push(name, [case.branch]))
        out["push"] = {**pushed.to_json(), "seconds": seconds, "wire": on_wire()}
        again = repo.push(name, [case.branch])
        out["repush"] = {**again.to_json(), "wire": on_wire()}
        target = work / f"clone-{place.kind}"
        with counted_clone_backends() as opened:

            def clone_and_checkout() -> str:
                with ckvc.Repo.clone(place.url, target, endpoint=place.endpoint) as cloned:
                    cloned.checkout(case.branch)
                    return cloned.resolve(case.branch)

            seconds, cloned_tip = timed(clone_and_checkout)
        if cloned_tip != tip:
            raise RuntimeError(f"the clone's {case.branch} is {cloned_tip}, not {tip}")
        calls: dict[str, int] = {}
        for backend in opened:
            for call, n in backend.calls.items():
                calls[call] = calls.get(call, 0) + n
        out["clone"] = {"seconds": seconds, "requests": sum(calls.values()), "calls": calls, "wire": on_wire()}
        shutil.rmtree(target)
        if case.next_branch is not None:
            more = repo.push(name, [case.next_branch])
            out["next"] = {**more.to_json(), "wire": on_wire()}
        repo.remotes.remove(name)
    return out


def files_side(case: Case, place: Place, work: Path, wire: Any = None) -> dict[str, Any]:
    """Upload the case's files; download them all and load the last, every tensor read."""
    up, _ = timed(lambda: place.upload(case.files, PACKS_IN_FLIGHT))
    up_wire = wire.take() if wire is not None else None
    into = work / f"download-{place.kind}"
    into.mkdir()

    def download_and_load() -> dict[str, torch.Tensor]:
        paths = place.download([p.name for p in case.files], into, PACKS_IN_FLIGHT)
        return materialized(load_file(str(paths[-1])))

    down, _ = timed(download_and_load)
    shutil.rmtree(into)
    return {
        "upload_s": up,
        "download_load_s": down,
        "upload_wire": up_wire,
        "download_wire": wire.take() if wire is not None else None,
    }


def run_round(case: Case, places: Places, rnd: int, work: Path, firsts: dict[str, Any]) -> None:
    """Every remote kind, ckvc and the files back to back; both orders flip each round."""
    kinds = places.kinds if rnd % 2 == 0 else places.kinds[::-1]
    for kind in kinds:
        place = places.make(kind)
        try:
            sides = ("ckvc", "files") if (rnd // 2) % 2 == 0 else ("files", "ckvc")
            for side in sides:
                if side == "ckvc":
                    got = ckvc_side(case, place, work)
                    firsts.setdefault(kind, got)
                    case.add(kind, "push_s", got["push"]["seconds"])
                    case.add(kind, "clone_s", got["clone"]["seconds"])
                    case.add(kind, "push_bytes", got["push"]["bytes_sent"])
                    if "next" in got:
                        case.add(kind, "next_bytes", got["next"]["bytes_sent"])
                else:
                    base = files_side(case, place, work)
                    case.add(kind, "upload_s", base["upload_s"])
                    case.add(kind, "download_load_s", base["download_load_s"])
        finally:
            place.remove()
        s = case.samples[kind]
        log(
            f"  round {rnd} {kind}: push {s['push_s'][-1]:.2f} s vs upload {s['upload_s'][-1]:.2f} s; "
            f"clone+checkout {s['clone_s'][-1]:.2f} s vs download+load {s['download_load_s'][-1]:.2f} s"
        )


def wire_pass(case: Case, places: Places, work: Path) -> dict[str, Any]:
    """One untimed pass through the counting proxy: HTTP requests and bytes each way."""
    proxy = counting_proxy(places.server.endpoint)
    with proxy:
        place = places.make("s3", endpoint=proxy.endpoint)
        try:
            proxy.take()  # the bucket's creation
            got = ckvc_side(case, place, work, wire=proxy)
            base = files_side(case, place, work, wire=proxy)
        finally:
            place.remove()
    return {"ckvc": got, "files": base}


# ---- the report ------------------------------------------------------------------------


@dataclass
class Check:
    label: str
    value: float
    limit: float
    detail: str

    @property
    def passed(self) -> bool:
        return self.value <= self.limit

    def line(self) -> str:
        verdict = "ok" if self.passed else "MISSED"
        return f"  {self.label:<58} {self.value:7.3f}  (<= {self.limit:g})  {verdict}  {self.detail}"


def per_round_ratio(case: Case, kind: str, a: str, b: str) -> float:
    s = case.samples[kind]
    return statistics.median(x / y for x, y in zip(s[a], s[b], strict=True))


def checks(history: Case | None, state: Case | None, firsts: dict[str, dict[str, Any]], kind: str) -> list[Check]:
    out: list[Check] = []
    if history is not None:
        sent = history.median(kind, "push_bytes")
        out.append(
            Check(
                f"whole history: bytes pushed / safetensors files ({kind})",
                sent / history.files_bytes,
                0.45,
                f"{sent / MB:,.1f} / {history.files_bytes / MB:,.1f} MB",
            )
        )
        more = history.median(kind, "next_bytes")
        out.append(
            Check(
                f"one more epoch: bytes pushed / its unique stored bytes ({kind})",
                more / history.next_stored,
                1.05,
                f"{more / MB:,.2f} / {history.next_stored / MB:,.2f} MB",
            )
        )
        again = firsts[history.name][kind]["repush"]
        out.append(
            Check(
                f"re-push of an unchanged ref: packs sent ({kind})",
                again["packs"],
                0,
                f"{again['bytes_sent']} B, {again['requests']} requests",
            )
        )
    if state is not None:
        for label, a, b in (
            ("push / upload", "push_s", "upload_s"),
            ("clone+checkout / download+load", "clone_s", "download_load_s"),
        ):
            ratio = state.median(kind, a) / state.median(kind, b)
            out.append(
                Check(
                    f"{state.name}: {label} time ({kind})",
                    ratio,
                    1.2,
                    f"{state.median(kind, a):.2f} / {state.median(kind, b):.2f} s; "
                    f"per-round median {per_round_ratio(state, kind, a, b):.3f}",
                )
            )
    return out


def http(wire: dict[str, Any] | None) -> str:
    if not wire:
        return "-"
    methods = ", ".join(f"{n} {m}" for m, n in sorted(wire["by_method"].items()))
    return f"{wire['requests']} ({methods})"


def times(case: Case, kind: str, ckvc_metric: str, files_metric: str) -> str:
    """ "ckvc s (files s, ratio)" of the medians."""
    mine, theirs = case.median(kind, ckvc_metric), case.median(kind, files_metric)
    return f"{mine:.2f} ({theirs:.2f}, {mine / theirs:.2f})"


def print_case(case: Case, kinds: list[str], firsts: dict[str, Any], wires: dict[str, Any]) -> None:
    width = 44
    print(f"\n{case.name}: {len(case.files)} checkpoint file(s), {case.files_bytes / MB:,.1f} MB as safetensors")
    print(f"  {'':<{width}}" + "".join(f"{k:>30}" for k in kinds))

    def row(label: str, cell: Callable[[str], str]) -> None:
        print(f"  {label:<{width}}" + "".join(f"{cell(k):>30}" for k in kinds))

    def sent(k: str, metric: str, of: int) -> str:
        return f"{case.median(k, metric) / MB:,.2f} MB ({case.median(k, metric) / of:.3f})"

    row("push: bytes sent (/ files)", lambda k: sent(k, "push_bytes", case.files_bytes))
    row("push: s (upload s, ratio)", lambda k: times(case, k, "push_s", "upload_s"))
    row("clone+checkout: s (download+load s, ratio)", lambda k: times(case, k, "clone_s", "download_load_s"))
    row("push: Backend calls, packs", lambda k: f"{firsts[k]['push']['requests']}, {firsts[k]['push']['packs']}")
    again = {k: firsts[k]["repush"] for k in kinds}
    row(
        "re-push: Backend calls, packs, bytes",
        lambda k: f"{again[k]['requests']}, {again[k]['packs']}, {again[k]['bytes_sent']}",
    )
    row("clone: Backend calls", lambda k: f"{firsts[k]['clone']['requests']}")
    if case.next_branch is not None:
        row("one more epoch: bytes sent (/ stored)", lambda k: sent(k, "next_bytes", case.next_stored))
        row("one more epoch: Backend calls", lambda k: f"{firsts[k]['next']['requests']}")
        print(
            f"  one more epoch: its commit stored {case.next_stored / MB:,.2f} MB "
            f"({case.next_file / MB:,.1f} MB as a file)"
        )
    varied = [k for k in kinds if len(set(case.samples[k]["push_bytes"])) > 1]
    if varied:
        print(f"  note: the bytes pushed differed between rounds on {', '.join(varied)}")
    wire = wires.get(case.name)
    if wire:
        c, f = wire["ckvc"], wire["files"]
        print("  HTTP on S3 (one untimed pass through a counting proxy):")
        lines = [
            ("push", c["push"]["wire"], "sent"),
            ("re-push", c["repush"]["wire"], "sent"),
            ("clone+checkout", c["clone"]["wire"], "received"),
            *([("one more epoch", c["next"]["wire"], "sent")] if "next" in c else []),
            ("files upload", f["upload_wire"], "sent"),
            ("files download", f["download_wire"], "received"),
        ]
        for label, counted, way in lines:
            print(f"    {label + ':':<16} {http(counted)}; {counted[way] / MB:,.2f} MB {way}")
    print("  rounds: " + ", ".join(f"{k} {len(case.samples[k]['push_s'])}" for k in kinds))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=256, help="the fp32 state (the issue's figure: 1024); 0: skip")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--history", choices=("minilm", "synthetic", "none"), default="minilm")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--remotes", default="dir,s3", help="comma-separated: dir, s3")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--no-wire", action="store_true", help="skip the pass through the counting proxy")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.remotes.split(",") if k.strip()]
    if unknown := set(kinds) - {"dir", "s3"}:
        parser.error(f"unknown remote kind(s): {', '.join(sorted(unknown))}")
    why = s3_available()
    if "s3" in kinds and why:
        print(f"S3 left out: {why}")
        kinds.remove("s3")
    with contextlib.ExitStack() as stack:
        work = args.dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckvc-remote-bench-")))
        work.mkdir(parents=True, exist_ok=True)
        places = Places(work, kinds)
        stack.callback(places.close)
        cases: list[Case] = []
        history = state = None
        if args.history != "none":
            log(f"building the {args.history} history ({args.epochs} epochs + 1)")
            history = build_history(work, args.history, args.epochs)
            cases.append(history)
        if args.size_mb:
            log(f"building the {args.size_mb} MB fp32 state")
            state = build_state(work, args.size_mb)
            cases.append(state)
        firsts: dict[str, dict[str, Any]] = {}
        for rnd in range(args.rounds):
            for case in cases if rnd % 2 == 0 else cases[::-1]:
                log(f"round {rnd}: {case.name}")
                run_round(case, places, rnd, work, firsts.setdefault(case.name, {}))
        wires: dict[str, Any] = {}
        if "s3" in kinds and not args.no_wire:
            for case in cases:
                log(f"counting pass on S3: {case.name}")
                wires[case.name] = wire_pass(case, places, work)
    print(
        f"ckvc remotes: push and clone vs the same checkpoints as safetensors files, {args.rounds} rounds, "
        f"medians (ratios ckvc / files){'; s3: moto on loopback' if 's3' in kinds else ''}"
    )
    for case in cases:
        print_case(case, kinds, firsts[case.name], wires)
    all_checks: list[Check] = []
    kind = "s3" if "s3" in kinds else kinds[0]
    print(f"\nacceptance ({kind}):")
    for check in checks(history, state, firsts, kind):
        all_checks.append(check)
        print(check.line())
    if args.json:
        print(
            json.dumps(
                {
                    "rounds": args.rounds,
                    "remotes": kinds,
                    "cases": {
                        c.name: {
                            "files": [p.name for p in c.files],
                            "files_bytes": c.files_bytes,
                            "next_stored_bytes": c.next_stored or None,
                            "samples": c.samples,
                            "first_round": firsts[c.name],
                            "wire": wires.get(c.name),
                        }
                        for c in cases
                    },
                    "acceptance": [
                        {"label": c.label, "value": c.value, "limit": c.limit, "passed": c.passed, "detail": c.detail}
                        for c in all_checks
                    ],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
