"""SIGKILL during a push at random instants, on a directory remote: afterwards no
remote ref names incomplete data (fsck of the remote is clean), and the next push
sends exactly what the remote still lacks. 30 runs by default; CKVC_SOAK=1 runs 200."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import ckvc
from ckvc.fsck import run_fsck
from ckvc.gc import mark
from ckvc.remote.repository import open_remote

RUNS = 200 if os.environ.get("CKVC_SOAK") == "1" else 30
# A zygote: imports once, then forks one pusher per line on stdin, so each run
# costs a fork, not an interpreter start. It prints the pusher's pid, the pusher
# prints "started" once it has opened the repository, "done <seconds>" if it
# finishes, and the zygote "reaped" once it is gone.
ZYGOTE = """
import os, sys, time
from ckvc.repo import Repo
import ckvc.remote.push
for _line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        repo = Repo.open(sys.argv[1])
        print("started", flush=True)
        started = time.monotonic()
        repo.push("origin", ["main", "dev"], tags=True)
        print("done", time.monotonic() - started, flush=True)
        os._exit(0)
    print(pid, flush=True)
    os.waitpid(pid, 0)
    print("reaped", flush=True)
"""


def build(root: Path) -> ckvc.Repo:
    repo = ckvc.Repo.init(root, chunk_size=32 << 10)
    config = json.loads((root / ".ckvc" / "config.json").read_text())
    config["max_pack_size"] = 1 << 20  # several packs per wave: kills land between them
    (root / ".ckvc" / "config.json").write_text(json.dumps(config))
    repo.close()
    repo = ckvc.Repo.open(root)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 512, generator=g)
    for i in range(4):
        w = w + 0.01 * torch.randn(512, 512, generator=g)
        repo.commit({"w": w, "noise": torch.randn(200, 200, generator=g), "i": i}, message=f"epoch {i}")
    repo.tag("v0", "HEAD~2", message="tagged")
    repo.branch("dev", "HEAD~1")
    return repo


def reachable(repo: ckvc.Repo) -> set[bytes]:
    live: set[bytes] = set()
    mark(repo.core, live, set(), reflog_expiry_s=0)
    return live


class Zygote:
    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, str(root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def push(self, kill_after: float | None) -> tuple[bool, float | None]:
        """One push, SIGKILLed after ``kill_after`` seconds unless None; (killed before
        it finished, its duration if it finished)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        pid = int(self.proc.stdout.readline())
        assert self.proc.stdout.readline().strip() == "started"  # the repository is open: the push begins
        if kill_after is not None:
            time.sleep(kill_after)
            with contextlib.suppress(ProcessLookupError):  # it finished and was reaped already
                os.kill(pid, signal.SIGKILL)
        duration = None
        while (line := self.proc.stdout.readline().strip()) != "reaped":
            assert line.startswith("done"), line
            duration = float(line.split()[1])
        return duration is None, duration

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def test_sigkill_during_push_then_repush_sends_only_what_is_missing(tmp_path: Path) -> None:
    local = build(tmp_path / "local")
    remote_dir = tmp_path / "remote"
    local.remotes.add("origin", str(remote_dir))
    live = reachable(local)
    sizes = {oid: local.store.stat(oid).stored_size for oid in live}
    tips = {ref: local.refs.read(ref) for ref in ("refs/heads/main", "refs/heads/dev", "refs/tags/v0")}
    spec = local.remotes.get("origin")
    local.close()

    zygote = Zygote(tmp_path / "local")
    durations = []
    for _ in range(2):  # whole pushes: how long one takes here, warm
        subprocess.run(["rm", "-rf", str(remote_dir)], check=True)
        killed, took = zygote.push(None)
        assert not killed and took is not None
        durations.append(took)
    duration = min(durations)
    rng = random.Random(19)
    outcomes = {"killed": 0, "finished": 0, "remote existed": 0}
    for _run in range(RUNS):
        subprocess.run(["rm", "-rf", str(remote_dir)], check=True)
        killed, _ = zygote.push(rng.uniform(0, duration))
        outcomes["killed" if killed else "finished"] += 1
        with ckvc.Repo.open(tmp_path / "local") as repo:
            if not (remote_dir / "config.json").exists():
                continue  # killed before the remote existed
            outcomes["remote existed"] += 1
            remote = open_remote(repo.core, spec)
            try:
                report = run_fsck(remote.core)
                assert report.ok, report.to_json()
                refs = remote.core.refs.list_refs()
                assert all(tips[ref] == oid for ref, oid in refs.items())  # old (absent) or new, never other
                have = {oid for oid in live if remote.core.store.has(oid)}
            finally:
                remote.close()
            again = repo.push("origin", ["main", "dev"], tags=True)
            missing = live - have
            assert again.stats.objects == len(missing)
            assert again.stats.record_bytes == sum(sizes[oid] for oid in missing)
            assert repo.ls_remote() == {"HEAD": tips["refs/heads/main"], **tips}
            remote = open_remote(repo.core, spec)
            try:
                assert run_fsck(remote.core, level="metadata").ok  # every object each ref needs is there
            finally:
                remote.close()
    zygote.close()
    print(f"push {duration:.3f} s, {outcomes}")
    assert outcomes["killed"] >= RUNS // 3 and outcomes["remote existed"] >= RUNS // 3  # inside pushes
