"""gc under stress: concurrent with a committer, and SIGKILLed at random instants.

1. One process makes a number of commits (and keeps making throwaway branches
   whose tensors later main commits deduplicate against) while another runs
   ``gc(now=True)`` (no grace period: only the gc lock protects writers) in a
   loop until the committer is done. Every acknowledged commit must restore
   bit-exact, fsck must be clean. 24 commits in the default tier, 400 (about a
   minute) in the stress tier; how the runs interleaved (e.g. how often gc spared a
   pack a commit had just deduplicated against) is printed, not asserted
   (tests/test_gc.py makes that race happen deterministically).
2. A child runs gc on a repository full of garbage and is SIGKILLed at a random
   instant, over and over (plus kills aimed at the narrow windows: after a copy
   pack is sealed, after the index swap, mid-rename, mid-unlink). After every
   kill nothing reachable is lost (fsck's metadata level, a sample of commits
   loaded), every tenth kill and at the end every commit is loaded and every byte
   re-hashed; a final gc reclaims all the leftovers. Default tier: 3 random kills
   and each aimed kill once; stress tier: 50 random kills and each aimed kill 3 times.
3. Deterministic reproductions of two bugs these stress tests found (a pack
   sealed while gc plans; more packs than the open-file limit), now fixed.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import resource
import shutil
import signal
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_state_equal, tier

import ckvc
import ckvc.gc as ckvc_gc
from ckvc.codecs import make_codec
from ckvc.ids import ObjectType
from ckvc.retention import RetentionPolicy

CHUNK_SIZE = 64 << 10
ELEMENTS = (256 << 10) // 4  # one 256 KiB float32 tensor: 4 chunks
# Pause between the committer's iterations (it lets gc runs in between); the
# repository (one pack per commit) stays at a few hundred packs, well under the
# common 1024 open-file limit (see test_fsck_and_gc_with_more_packs_than_the_open_file_limit).
COMMIT_PAUSE_S = 0.1
AIMED_KILLS = ("copy-sealed", "index-swapped", "renamed", "trash-unlinked")


def _ctx() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    # The forkserver imports these once; each child then starts in milliseconds.
    ctx.set_forkserver_preload(["torch", "numpy", "ckvc", "ckvc.gc", "ckvc.retention", __name__])
    return ctx


def _randn(seed: int) -> torch.Tensor:
    return torch.randn(ELEMENTS, generator=torch.Generator().manual_seed(seed))


def _write_line(fd: int, line: str) -> None:
    os.write(fd, line.encode())
    os.fsync(fd)


def _report_error(err_path: str) -> None:
    with open(err_path, "a", encoding="utf-8") as f:
        f.write(traceback.format_exc())


def _pack_leftovers(root: Path) -> list[str]:
    packs = root / ".ckvc" / "packs"
    return sorted(p.name for p in packs.iterdir() if p.name.endswith((ckvc_gc.TRASH_SUFFIX, ".pack.tmp")))


# ---- 1. gc concurrent with a committer ---------------------------------------


def throwaway_state(j: int) -> dict[str, Any]:
    """1 MiB on a branch that is deleted right away: garbage, except for the
    tensors later main commits reuse."""
    return {name: _randn(1_000_000 + 4 * j + i) for i, name in enumerate("abcd")}


def main_state(k: int) -> dict[str, Any]:
    """State k on main. After the throwaway commit j = k - k % 3 (made when
    k % 3 == 0), main commits k = j and j + 1 reuse its tensors "a" and "b" for
    every other j (deduplicated against an object gc may have planned to delete);
    the other throwaway commits stay all garbage."""
    state: dict[str, Any] = {"w": _randn(k), "step": k}
    j = k - k % 3
    if k >= 3 and (j // 3) % 2 == 0 and k % 3 < 2:
        state["reused"] = _randn(1_000_000 + 4 * j + k % 3)  # = throwaway_state(j)["a" or "b"]
    return state


def _committer(root: str, log_path: str, err_path: str, commits: int, go: Any, finished: Any) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        torch.set_num_threads(1)
        with ckvc.Repo.open(root) as repo:
            go.wait()
            for k in range(1, commits + 1):
                if k % 3 == 0:
                    name = f"tmp-{k}"
                    repo.branch(name)
                    repo.checkout(name)
                    repo.commit(throwaway_state(k), message=f"throwaway {k}")
                    repo.checkout("main")
                    repo.delete_branch(name)
                commit_id = repo.commit(main_state(k), message=f"k={k}")
                _write_line(fd, f"{k} {commit_id}\n")
                time.sleep(COMMIT_PAUSE_S)
    except BaseException:
        _report_error(err_path)
        finished.set()
        os._exit(1)
    finished.set()
    os._exit(0)


def _gc_loop(root: str, out_path: str, err_path: str, commits: int, go: Any, finished: Any) -> None:
    """gc(now=True) in a loop until the committer has finished, and once more after.
    A run that raises is recorded (the parent asserts there were none, after checking
    that nothing was lost) and the loop goes on: a failed run is like a crashed one,
    the next run must cope."""
    totals: dict[str, Any] = {
        "runs": 0,
        "failed_runs": 0,
        "errors": [],  # the first few tracebacks of failed runs
        "bytes_freed": 0,
        "packs_deleted": 0,
        "packs_repacked": 0,
        "objects_copied": 0,
        "kept_revived": 0,
        "max_seconds": 0.0,
        "max_critical_section_s": 0.0,
    }
    try:
        torch.set_num_threads(1)
        with ckvc.Repo.open(root) as repo:
            go.wait()
            last = False
            while not last:
                last = finished.is_set()  # the run after the committer's last commit is the last
                try:
                    report = repo.gc(now=True)
                except Exception:
                    totals["failed_runs"] += 1
                    if len(totals["errors"]) < 3:
                        totals["errors"].append(traceback.format_exc())
                    continue
                totals["runs"] += 1
                for key in ("bytes_freed", "packs_deleted", "packs_repacked", "objects_copied"):
                    totals[key] += getattr(report, key)
                totals["kept_revived"] += len(report.kept_revived)
                totals["max_seconds"] = max(totals["max_seconds"], report.seconds)
                totals["max_critical_section_s"] = max(totals["max_critical_section_s"], report.critical_section_s)
        Path(out_path).write_text(json.dumps(totals))
    except BaseException:
        _report_error(err_path)
        os._exit(1)
    os._exit(0)


@pytest.mark.parametrize("commits", tier(24, 400))
def test_gc_concurrent_with_commits(tmp_path: Path, commits: int) -> None:
    root = tmp_path / "repo"
    with ckvc.Repo.init(root, chunk_size=CHUNK_SIZE) as repo:
        repo.set_config(reflog_expiry_s=0)  # deleted branches' commits are garbage at once
        base = repo.commit(main_state(0), message="k=0")
    log_path, err_path, out_path = tmp_path / "commits.log", tmp_path / "errors.txt", tmp_path / "gc.json"
    ctx = _ctx()
    go, finished = ctx.Event(), ctx.Event()
    common = (str(err_path), commits, go, finished)
    committer = ctx.Process(target=_committer, args=(str(root), str(log_path), *common), daemon=True)
    collector = ctx.Process(target=_gc_loop, args=(str(root), str(out_path), *common), daemon=True)
    committer.start()
    collector.start()
    go.set()  # each child opens the repository, then waits for go
    for proc in (committer, collector):
        proc.join(timeout=1800)
        if proc.exitcode is None:
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
    errors = err_path.read_text() if err_path.exists() else ""
    assert not errors, errors
    assert (committer.exitcode, collector.exitcode) == (0, 0)

    acknowledged: dict[int, str] = {0: base}
    for line in log_path.read_text().splitlines():
        number, commit_id = line.split()
        acknowledged[int(number)] = commit_id
    assert sorted(acknowledged) == list(range(commits + 1))
    gc_totals = json.loads(out_path.read_text())
    errors = gc_totals.pop("errors")
    print(f"\ncommits acknowledged: {len(acknowledged) - 1}; gc: {gc_totals}")

    with ckvc.Repo.open(root) as repo:
        chain = [c.id for c in repo.log("main", first_parent=True)][::-1]
        assert chain == [acknowledged[k] for k in range(len(acknowledged))]
        for k, commit_id in acknowledged.items():
            assert_state_equal(repo.load(commit_id), main_state(k))
        report = repo.fsck()
        assert report.ok, report.problems
        assert repo.branches() == {"main": acknowledged[len(acknowledged) - 1]}

        # The last gc run came after the last commit: it (if no earlier one) reclaimed
        # the throwaway commits that no main commit reuses. How often gc repacked,
        # and how often it spared a pack that a commit deduplicated against between
        # its plan and its critical section, depends on how the runs interleaved:
        # printed above, not asserted.
        assert gc_totals["runs"] >= 1
        assert gc_totals["bytes_freed"] > 0 and gc_totals["packs_deleted"] > 0

        final = repo.gc(now=True)
        assert final.executed
        report = repo.fsck()
        assert report.ok, report.problems
        assert report.unreferenced_objects == 0, report.problems
        assert _pack_leftovers(root) == []
        for k in random.Random(7).sample(sorted(acknowledged), min(40, len(acknowledged))):
            assert_state_equal(repo.load(acknowledged[k]), main_state(k))
    # Last, so that a failing gc run does not hide whether anything was lost.
    assert gc_totals["failed_runs"] == 0, "".join(errors)


# ---- 2. gc SIGKILLed at random instants --------------------------------------


def junk_state(g: int) -> dict[str, Any]:
    return {name: _randn(3_000_000 + 4 * g + i) for i, name in enumerate("abcd")}


def main_round_state(g: int) -> dict[str, Any]:
    return {"w": _randn(2_000_000 + g), "round": g}


def side_state(g: int) -> dict[str, Any]:
    """Kept forever (the side branch is outside the retention policy); reuses
    half of junk commit g, so junk g's pack is repacked, not deleted."""
    junk = junk_state(g)
    return {"a": junk["a"], "b": junk["b"], "round": g}


POLICY = RetentionPolicy(keep_last=4, keep_every=5, branches=("main",))


def _add_round(repo: ckvc.Repo, g: int, expected: dict[str, dict[str, Any]]) -> None:
    """One round of garbage: a junk branch of two commits (deleted), a main commit (retention
    then prunes an older one: its pack keeps only the commit object live) and a
    side commit reusing half of the junk commit's tensors."""
    name = f"junk-{g}"
    repo.branch(name, "main")
    repo.switch(name)
    repo.commit(junk_state(g), message=f"junk {g}")
    repo.commit({"e": _randn(4_000_000 + g)}, message=f"junk {g} again")  # a pack that is all garbage
    repo.switch("main")
    repo.delete_branch(name)
    expected[repo.commit(main_round_state(g), message=f"main {g}")] = main_round_state(g)
    repo.switch("side")
    expected[repo.commit(side_state(g), message=f"side {g}")] = side_state(g)
    repo.switch("main")
    repo.retain(POLICY)


def _check_repo(
    repo: ckvc.Repo,
    expected: dict[str, dict[str, Any]],
    heads: dict[str, str],
    what: str,
    sample: random.Random | None = None,
) -> Any:
    """Every commit that must survive restores bit-exact, pruned ones still have
    their commit object, the branches did not move, fsck is clean. With ``sample``:
    what a killed gc could have touched (packs, the index: every chunk of every commit
    present, fsck's metadata level), and 3 commits drawn from it loaded, not all."""
    assert repo.branches() == heads, what
    pruned = repo.pruned()
    chosen = list(expected.items())
    if sample is not None:
        chosen = sample.sample(chosen, min(3, len(chosen)))
    for commit_id, state in chosen:
        if commit_id in pruned:
            repo.read_commit(commit_id)
            continue
        try:
            assert_state_equal(repo.load(commit_id), state)
        except Exception as exc:
            raise AssertionError(
                f"{what}: commit {commit_id} ({repo.read_commit(commit_id).message}): {exc!r}"
            ) from exc
    report = repo.fsck(level="full" if sample is None else "metadata")
    assert report.ok, f"{what}: {report.problems}"
    return report


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _gc_victim(root: str, phase_path: str, started: Any, aim: str | None) -> None:
    """Run one gc(now=True), writing each phase it enters to ``phase_path`` (no
    fsync needed: the page cache outlives a SIGKILL). With ``aim``, SIGKILL
    itself right at that point."""
    fd = os.open(phase_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def phase(name: str) -> None:
        os.write(fd, f"{name}\n".encode())

    try:
        repo = ckvc.Repo.open(root)
        store = repo.store

        copy_live = ckvc_gc.copy_verified

        def copy_phase(*args: Any) -> Any:
            phase("copy")
            return copy_live(*args)

        ckvc_gc.copy_verified = copy_phase  # type: ignore[assignment]
        exclusive = store.exclusive

        @contextlib.contextmanager
        def critical(timeout: float) -> Iterator[None]:
            with exclusive(timeout):
                phase("critical")
                yield
            phase("unlink")

        store.exclusive = critical  # type: ignore[method-assign]

        if aim == "copy-sealed":
            base_writer = ckvc_gc.PackWriter

            class KillAfterSeal(base_writer):  # type: ignore[valid-type,misc]
                def seal(self) -> str:
                    path = super().seal()
                    _kill_self()
                    return path

            ckvc_gc.PackWriter = KillAfterSeal  # type: ignore[misc]
        elif aim == "index-swapped":
            swap = store.index.swap_packs

            def swap_then_die(added: Any, removed: Any) -> None:
                swap(added, removed)
                _kill_self()

            store.index.swap_packs = swap_then_die  # type: ignore[method-assign]
        elif aim == "renamed":
            rename = os.rename

            def rename_then_die(src: Any, dst: Any) -> None:
                rename(src, dst)
                if str(dst).endswith(ckvc_gc.TRASH_SUFFIX):
                    _kill_self()

            os.rename = rename_then_die  # type: ignore[assignment]
        elif aim == "trash-unlinked":
            unlink = ckvc_gc._unlink

            def unlink_then_die(backend: Any, path: Any) -> None:
                unlink(backend, path)
                if str(path).endswith(ckvc_gc.TRASH_SUFFIX):
                    _kill_self()

            ckvc_gc._unlink = unlink_then_die  # type: ignore[assignment]
        phase("plan")
        started.set()
        repo.gc(now=True)
        phase("done")
    except BaseException:
        phase("error " + traceback.format_exc().replace("\n", " | "))
        os._exit(1)
    os._exit(0)


def _last_phase(phase_path: Path) -> str:
    lines = phase_path.read_text().splitlines() if phase_path.exists() else []
    return lines[-1] if lines else "start"


@pytest.mark.parametrize("kills", tier((3, 1), (50, 3)), ids=lambda k: f"{k[0]}-random-{k[1]}-aimed-rounds")
def test_sigkill_gc_at_random_instants(tmp_path: Path, kills: tuple[int, int]) -> None:
    random_kills, aimed_rounds = kills
    rng = random.Random(20240917)
    root = tmp_path / "repo"
    expected: dict[str, dict[str, Any]] = {}  # commit id -> its state (pruned ones: history only)
    with ckvc.Repo.init(root, chunk_size=CHUNK_SIZE) as repo:
        repo.set_config(reflog_expiry_s=0)
        root_id = repo.commit({"round": -1}, message="root")
        expected[root_id] = {"round": -1}
        repo.branch("side")
        rounds = 16
        for g in range(rounds):
            _add_round(repo, g, expected)
        heads = repo.branches()
        plan = repo.gc(dry_run=True, now=True).plan
        assert plan.count("delete") > 0 and plan.count("repack") > 0, plan.to_json()
        target_reclaimable = plan.reclaimable_bytes // 2
    assert len(repo.pruned()) >= 8

    # How long one gc of this much garbage takes (on a copy): kills land in [0, 1.2 x that].
    calibration = tmp_path / "calibration"
    shutil.copytree(root, calibration)
    with ckvc.Repo.open(calibration) as repo:
        t0 = time.perf_counter()
        calibration_report = repo.gc(now=True)
        gc_seconds = time.perf_counter() - t0
    shutil.rmtree(calibration)
    assert calibration_report.packs_deleted > 0 and calibration_report.packs_repacked > 0
    window = max(0.02, 1.2 * gc_seconds)

    ctx = _ctx()
    aimed = [a for a in AIMED_KILLS for _ in range(aimed_rounds)]
    schedule: list[str | None] = [None] * random_kills + aimed
    rng.shuffle(schedule)
    landed = 0  # random kills that hit a running gc
    phases: dict[str, int] = {}
    aimed_hit: dict[str, int] = {}
    for i, aim in enumerate(schedule):
        phase_path = tmp_path / f"phase-{i}.log"
        started = ctx.Event()
        proc = ctx.Process(target=_gc_victim, args=(str(root), str(phase_path), started, aim), daemon=True)
        proc.start()
        if aim is None:
            if not started.wait(timeout=60):
                proc.join(timeout=5)
                pytest.fail(f"iteration {i}: gc child did not start: {_last_phase(phase_path)}")
            time.sleep(rng.uniform(0, window))
            assert proc.pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=120)
        last = _last_phase(phase_path)
        assert not last.startswith("error"), f"iteration {i}: {last}"
        assert proc.exitcode in (0, -signal.SIGKILL), f"iteration {i}: exit code {proc.exitcode}"
        if aim is None:
            landed += proc.exitcode == -signal.SIGKILL
            phases[last] = phases.get(last, 0) + 1
        elif proc.exitcode == -signal.SIGKILL:
            aimed_hit[aim] = aimed_hit.get(aim, 0) + 1

        with ckvc.Repo.open(root) as repo:
            every_byte = i % 10 == 9
            what = f"iteration {i} (aim {aim}, last phase {last})"
            _check_repo(repo, expected, heads, what, None if every_byte else rng)
            # Keep gc busy: replenish the garbage when a gc got far (and now and then
            # anyway), so that there is always something to delete and to repack.
            added = 0
            plan = repo.gc(dry_run=True, now=True).plan
            while added < 8 and (
                plan.reclaimable_bytes < target_reclaimable or not plan.count("delete") or not plan.count("repack")
            ):
                _add_round(repo, rounds, expected)
                rounds, added = rounds + 1, added + 1
                plan = repo.gc(dry_run=True, now=True).plan
            if not added and rng.random() < 0.1:
                _add_round(repo, rounds, expected)
                rounds += 1
            heads = repo.branches()

    print(
        f"\ngc calibration {gc_seconds * 1000:.0f} ms ({calibration_report.packs_deleted} packs deleted, "
        f"{calibration_report.packs_repacked} repacked); random kills landed {landed}/{random_kills}, "
        f"by last phase {phases}; aimed kills hit {aimed_hit}; rounds {rounds}"
    )
    # Where the random kills landed depends on timing: printed above. The aimed ones
    # always land: before each gc there is garbage to delete and to repack.
    assert aimed_hit == {aim: aimed_rounds for aim in AIMED_KILLS}, aimed_hit

    with ckvc.Repo.open(root) as repo:
        final = repo.gc(now=True)
        assert final.executed
        assert _pack_leftovers(root) == []
        report = _check_repo(repo, expected, heads, "after the final gc")
        assert report.unreferenced_objects == 0, report.problems
        assert not [p for p in report.problems if p.kind == "unreferenced"]
        again = repo.gc(dry_run=True, now=True).plan
        assert again.reclaimable_bytes == 0, again.to_json()


# ---- 3. deterministic reproductions of what the stress tests found -----------


def test_gc_copes_with_a_pack_sealed_while_it_plans(tmp_path: Path) -> None:
    """A commit in flight seals its pack (renames *.pack.tmp to *.pack) between
    gc's listing of packs/ and its look at the temporary file. The concurrency
    test above hits this a few times a minute; here it is made to happen."""
    with ckvc.Repo.init(tmp_path / "r") as repo:
        repo.commit({"w": torch.zeros(4)})
        writer = repo.store.writer(make_codec("zstd", 1))
        oid = writer.put(ObjectType.CHUNK, b"in flight" * 100)  # now a *.pack.tmp exists
        sealed: list[str] = []

        real_stat = os.stat

        def seals_before_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            if str(path).endswith(".pack.tmp") and not sealed:
                sealed.append(str(path))
                writer.commit()  # the writer finishes: *.pack.tmp -> *.pack
            return real_stat(path, *args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "stat", seals_before_stat)
            repo.gc()  # the default grace period: any gc concurrent with a commit
        assert sealed
        assert repo.store.has(oid)
        assert repo.fsck().ok


def test_fsck_and_gc_with_more_packs_than_the_open_file_limit(tmp_path: Path) -> None:
    """Every commit writes a pack, so a repository of a few thousand commits has
    more packs than the usual soft limit of 1024 open files."""
    root = tmp_path / "r"
    with ckvc.Repo.init(root) as repo:
        commits = [repo.commit({"w": torch.full((4,), float(i))}) for i in range(200)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 100, hard))
    try:
        with ckvc.Repo.open(root) as repo:
            assert repo.fsck().ok
            repo.gc(now=True)
            for i, commit_id in enumerate(commits):
                assert repo.load(commit_id)["w"][0].item() == i
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
