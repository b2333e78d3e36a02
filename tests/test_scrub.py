"""ckvc scrub: a budget at a time, every pack verified exactly once per cycle (read
through a counting backend), a flipped byte found in the cycle that reaches it, the
record surviving a SIGKILL mid-scrub, and a remote's packs scrubbed through its backend."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import counted, run

import ckvc
from ckvc.errors import InvalidInputError
from ckvc.scrub import SCRUB_FILE, ScrubState
from ckvc.storage.packs import pack_key

N = 4


def packed(repo: ckvc.Repo, n: int = N) -> list[str]:
    """n commits of fresh, equal-sized data: one data pack each (plus their metadata packs)."""
    for i in range(n):
        repo.commit({"w": torch.randn(32 << 10, generator=torch.Generator().manual_seed(i))}, f"c{i}")
    return repo.store.packs()


def test_n_runs_of_a_1_over_n_budget_cover_every_pack_once_per_cycle(make_repo: Any) -> None:
    repo = make_repo(codec={"name": "raw"})
    packs = packed(repo)
    total = sum(repo.store.pack_info(p).size for p in packs)
    counting = counted(repo.store)
    budget = -(-total // N)  # 1/N of the store: a run finishes the pack that reaches it
    reports = []
    for _ in range(N):
        before = dict(counting.reads)
        report = repo.scrub(max_bytes=budget)
        read = {k for k, n in counting.reads.items() if n > before.get(k, 0)}
        assert read == {pack_key(p) for p in report.packs_verified}  # what it says it read, and only that
        reports.append(report)
        if report.cycle_complete:
            break
    verified = [p for r in reports for p in r.packs_verified]
    assert sorted(verified) == sorted(packs)  # every pack exactly once
    assert reports[-1].cycle_complete and not any(r.cycle_complete for r in reports[:-1])
    assert {r.cycle for r in reports} == {1}
    assert reports[-1].last_complete is not None and reports[-1].last_complete["packs"] == len(packs)
    # the next run starts cycle 2 with the pack verified longest ago
    again = repo.scrub(max_bytes=1)
    assert again.cycle == 2 and again.packs_verified == [verified[0]]


def test_a_time_budget_is_checked_between_packs(make_repo: Any) -> None:
    repo = make_repo()
    packs = packed(repo)
    ticks = iter(range(100))
    report = repo.scrub(max_seconds=2, clock=lambda: float(next(ticks)))  # 1 s per clock read
    assert 1 <= len(report.packs_verified) < len(packs)
    with pytest.raises(InvalidInputError, match="positive"):
        repo.scrub(max_bytes=0)


def test_a_flipped_byte_is_found_in_the_cycle_that_reaches_it(make_repo: Any) -> None:
    repo = make_repo(codec={"name": "raw"})
    packs = packed(repo)
    victim = max(packs, key=lambda p: repo.store.pack_info(p).size)
    path = repo.core.local_dir / pack_key(victim)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    reports = [repo.scrub(max_bytes=1) for _ in packs]
    found = [r for r in reports if r.damage]
    assert len(found) == 1 and list(found[0].damage) == [victim]
    assert reports[-1].known_damage.keys() == {victim} and not reports[-1].ok
    done = run(repo.path, "scrub", "--json")  # the next cycle's run still reports it: exit 1
    assert done.exit_code == 1 and victim in json.loads(done.stdout)["known_damage"]
    assert "scrub found damage" in run(repo.path, "status").stdout


def test_the_record_survives_a_sigkill_mid_scrub(make_repo: Any, tmp_path: Path) -> None:
    repo = make_repo()
    packs = packed(repo)
    code = f"""
import os, signal
import ckvc, ckvc.scrub
saves = 0
original = ckvc.scrub.ScrubState.save
def save(self, path):
    global saves
    original(self, path)
    saves += 1
    if saves == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # after the second pack's record is durable
ckvc.scrub.ScrubState.save = save
ckvc.Repo.open({str(repo.path)!r}).scrub()
"""
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    state = ScrubState.load(repo.core.local_dir / SCRUB_FILE)
    assert len(state.verified) == 2
    rest = repo.scrub()
    assert rest.cycle_complete and sorted(rest.packs_verified) == sorted(set(packs) - set(state.verified))


def test_scrub_of_a_remote(make_repo: Any, tmp_path: Path, url: str) -> None:
    repo = make_repo()
    packed(repo, 2)
    repo.remotes.add("origin", url)
    repo.push()
    first = repo.scrub("origin", max_bytes=1)
    assert first.packs_verified and first.cycle == 1
    rest = repo.scrub("origin")
    assert rest.cycle_complete and rest.ok
    assert (repo.core.local_dir / "remotes" / "origin" / SCRUB_FILE).is_file()
    assert not (repo.core.local_dir / SCRUB_FILE).exists()  # the local cycle is its own
    assert os.path.exists(repo.core.local_dir)
