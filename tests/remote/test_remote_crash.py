"""SIGKILL during a push at random instants, on a directory remote: afterwards no
remote ref names incomplete data (fsck of the remote is clean), and the next push
sends exactly what the remote still lacks; the same for a fetch, whose next run
resumes from what the killed one verified. 4 and 3 runs in the default tier, 30 and
15 in the stress tier, 200 and 100 with CKVC_SOAK=1. Where the random kills landed
is printed; the first push run is killed by itself once its first pack is on the
remote, so a kill inside a push is always among them. After each kill, what it could
touch: every byte of the remote (small) and the refs the next push or fetch moves."""

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

import pytest
import torch
from helpers import tier

import ckvc
from ckvc.fsck import run_fsck
from ckvc.gc import mark
from ckvc.remote.repository import open_remote

# A zygote: imports once, then forks one pusher (or fetcher) per line on stdin, so
# each run costs a fork, not an interpreter start. It prints the child's pid, the
# child prints "started" once it has opened the repository, "done <seconds>" if
# it finishes, and the zygote "reaped" once it is gone. A line "aim DIR" makes the
# child SIGKILL itself right after the first pack lands in DIR.
ZYGOTE = """
import os, signal, sys, time
from ckvc.repo import Repo
def say(*words):  # one write(2) per line: below PIPE_BUF, lines from both processes never mix
    os.write(1, (" ".join(map(str, words)) + "\\n").encode())
def aim(folder):
    for name in ("rename", "replace", "link"):
        def landed(src, dst, *args, _move=getattr(os, name), **kwargs):
            _move(src, dst, *args, **kwargs)
            if str(dst).startswith(folder) and str(dst).endswith(".pack"):
                os.kill(os.getpid(), signal.SIGKILL)
        setattr(os, name, landed)
import ckvc.remote.push, ckvc.remote.fetch
for _line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        if _line.startswith("aim "):
            aim(_line[4:].strip())
        repo = Repo.open(sys.argv[1])
        say("started")
        started = time.monotonic()
        if sys.argv[2] == "push":
            repo.push("origin", ["main", "dev"], tags=True)
        else:
            repo.fetch("origin")
        say("done", time.monotonic() - started)
        os._exit(0)
    say(pid)
    os.waitpid(pid, 0)
    say("reaped")
"""


def small_packs(root: Path) -> ckvc.Repo:
    """A new repository whose packs hold at most 1 MiB: several per transfer, so kills land between them."""
    ckvc.Repo.init(root, chunk_size=32 << 10).close()
    config = json.loads((root / ".ckvc" / "config.json").read_text())
    config["max_pack_size"] = 1 << 20
    (root / ".ckvc" / "config.json").write_text(json.dumps(config))
    return ckvc.Repo.open(root)


def build(root: Path) -> ckvc.Repo:
    repo = small_packs(root)
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
    def __init__(self, root: Path, action: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, str(root), action],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def run(self, kill_after: float | None, aim: Path | None = None) -> tuple[bool, float | None]:
        """One push or fetch, SIGKILLed after ``kill_after`` seconds unless None, or by itself
        once its first pack lands in ``aim``; (killed before it finished, its duration if it
        finished)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"aim {aim}\n" if aim is not None else "\n")
        self.proc.stdin.flush()
        # the zygote's pid line and the child's "started" share the pipe in either order
        first, second = self.proc.stdout.readline().strip(), self.proc.stdout.readline().strip()
        assert "started" in (first, second)  # the repository is open: the push begins
        pid = int(second if first == "started" else first)
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


@pytest.mark.parametrize("runs", tier(4, 30, 200))
def test_sigkill_during_push_then_repush_sends_only_what_is_missing(tmp_path: Path, runs: int) -> None:
    local = build(tmp_path / "local")
    remote_dir = tmp_path / "remote"
    local.remotes.add("origin", str(remote_dir))
    live = reachable(local)
    sizes = {oid: local.store.stat(oid).stored_size for oid in live}
    tips = {ref: local.refs.read(ref) for ref in ("refs/heads/main", "refs/heads/dev", "refs/tags/v0")}
    spec = local.remotes.get("origin")
    local.close()

    zygote = Zygote(tmp_path / "local", "push")
    durations = []
    for _ in range(2):  # whole pushes: how long one takes here, warm
        subprocess.run(["rm", "-rf", str(remote_dir)], check=True)
        killed, took = zygote.run(None)
        assert not killed and took is not None
        durations.append(took)
    duration = min(durations)
    rng = random.Random(19)
    outcomes = {"killed": 0, "finished": 0, "remote existed": 0}
    for run in range(runs):
        subprocess.run(["rm", "-rf", str(remote_dir)], check=True)
        if run == 0:  # aimed: right after its first pack is on the remote
            killed, _ = zygote.run(None, aim=remote_dir)
            assert killed
        else:
            killed, _ = zygote.run(rng.uniform(0, duration))
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
    print(f"push {duration:.3f} s, {runs} runs: {outcomes}")  # how many random kills landed: timing
    assert outcomes["killed"] >= 1 and outcomes["remote existed"] >= 1  # the aimed run: inside a push


@pytest.mark.parametrize("runs", tier(3, 15, 100))
def test_sigkill_during_fetch_then_fetch_resumes(tmp_path: Path, runs: int) -> None:
    source = build(tmp_path / "source")
    source.remotes.add("origin", str(tmp_path / "remote"))
    source.push("origin", ["main", "dev"], tags=True)
    live = reachable(source)
    sizes = {oid: source.store.stat(oid).stored_size for oid in live}
    branches = source.remote_branches()
    source.close()
    local = tmp_path / "local"

    def fresh() -> None:
        subprocess.run(["rm", "-rf", str(local)], check=True)
        with small_packs(local) as repo:
            repo.remotes.add("origin", str(tmp_path / "remote"))

    zygote = Zygote(local, "fetch")
    durations = []
    for _ in range(2):
        fresh()
        killed, took = zygote.run(None)
        assert not killed and took is not None
        durations.append(took)
    rng = random.Random(20)
    kept = 0
    for run in range(runs):
        fresh()
        if run == 0:  # aimed: right after its first verified pack is sealed
            killed, _ = zygote.run(None, aim=local / ".ckvc")
            assert killed
        else:
            # its first quarter reads metadata and writes nothing: most kills go after it
            zygote.run(rng.uniform(0.25, 1.0) * min(durations))
        with ckvc.Repo.open(local) as repo:
            assert repo.fsck().ok  # what the killed fetch left is whole, and no ref names anything missing
            have = {oid for oid in live if repo.store.has(oid)}
            kept += bool(have)
            # each ref is absent or moved (they move one by one), never anything else
            assert all(branches[name] == oid for name, oid in repo.remote_branches().items())
            again = repo.fetch()
            missing = live - have
            assert again.stats.objects == len(missing)
            assert again.stats.record_bytes == again.bytes_received == sum(sizes[oid] for oid in missing)
            assert repo.remote_branches() == branches and repo.fsck(level="metadata").ok
    zygote.close()
    print(f"fetch: {runs} runs, {kept} killed with verified packs already sealed")
    assert kept >= 1  # the aimed run, at least: the resume path
