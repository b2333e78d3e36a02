"""Fault injection at every OS call of commit and gc: the outcome is exact.

Each write, writev, fsync, open, replace, rename, mkdir, unlink and ftruncate
call a commit (or gc) makes is failed in turn: once (one-shot) and from then on
(persistent), with ENOSPC, EIO and Ctrl-C. After every case the call either
succeeded (the commit is durable and reachable after reopening, bit-exact) or
raised a typed error with the branch unchanged; never "failed" with the branch
moved. A landed commit whose reflog write failed gets its entry back on the
next open.
"""

from __future__ import annotations

import errno
import os
import shutil
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_state_equal

import ckvc
from ckvc.errors import (
    CkvcError,
    DurabilityWarning,
    InterruptedOperationError,
    StorageError,
    StorageFullError,
    StorageIOError,
)
from ckvc.retention import RetentionPolicy

FAULT_FUNCS = ("open", "write", "writev", "fsync", "replace", "rename", "mkdir", "unlink", "ftruncate")


class Injector:
    """Wraps the os functions; call number ``fail_at`` (0-based, all functions
    counted together) fails, and with ``persistent`` every call after it too."""

    def __init__(self, fail_at: int | None = None, *, persistent: bool = False, error: int | None = errno.EIO):
        self.fail_at = fail_at
        self.persistent = persistent
        self.error = error  # None: raise KeyboardInterrupt
        self.calls = 0
        self.points: list[str] = []  # the function of each call, in order

    def wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            n = self.calls
            self.calls += 1
            self.points.append(name)
            if self.fail_at is not None and (n == self.fail_at or (self.persistent and n > self.fail_at)):
                if self.error is None:
                    raise KeyboardInterrupt
                raise OSError(self.error, os.strerror(self.error), args[0] if args and name != "write" else None)
            return real(*args, **kwargs)

        return wrapper


@contextmanager
def injected(injector: Injector) -> Iterator[Injector]:
    originals = {name: getattr(os, name) for name in FAULT_FUNCS}
    try:
        for name, real in originals.items():
            setattr(os, name, injector.wrap(name, real))
        yield injector
    finally:
        for name, real in originals.items():
            setattr(os, name, real)


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 256, generator=g), "b": torch.randn(256, generator=g)}, "step": seed}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository with one commit on main, copied for every case."""
    root = tmp_path_factory.mktemp("faults") / "template"
    with ckvc.Repo.init(root, chunk_size=64 << 10, threads=1) as repo:
        repo.commit(state(1), "one")
    return root


def fresh(template: Path, dest: Path) -> Path:
    shutil.copytree(template, dest, symlinks=True)
    return dest


def run_commit(root: Path, injector: Injector) -> tuple[str | None, BaseException | None, list[str]]:
    repo = ckvc.Repo.open(root, threads=1)
    result: str | None = None
    error: BaseException | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with injected(injector):
                result = repo.commit(state(2), "two")
        except BaseException as exc:
            error = exc
        finally:
            repo.close()
    return result, error, [str(w.message) for w in caught if issubclass(w.category, DurabilityWarning)]


def count_points(template: Path, tmp_path: Path, run: Callable[[Path, Injector], Any]) -> Injector:
    counter = Injector()
    run(fresh(template, tmp_path / "count"), counter)
    return counter


def check_commit_outcome(root: Path, before: str, result: str | None, error: BaseException | None) -> bool:
    """Asserts the exact-outcome rule; returns whether the commit landed."""
    with ckvc.Repo.open(root, threads=1) as repo:
        branch = repo.refs.read("refs/heads/main")
        if error is None:
            assert result is not None and branch == result
            assert_state_equal(repo.load(result), state(2))
            assert repo.refs.reflog("refs/heads/main")[0].new == result
            return True
        if isinstance(error, InterruptedOperationError) and error.landed:
            assert branch is not None and branch == error.result
            assert_state_equal(repo.load(branch), state(2))
            return True
        assert isinstance(error, CkvcError), f"untyped error {type(error).__name__}: {error}"
        assert "\n" not in str(error)
        assert branch == before, f"{type(error).__name__} '{error}' but the branch moved"
        assert_state_equal(repo.load("main"), state(1))
        return False


@pytest.mark.parametrize("mode", ["one-shot", "persistent"])
@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO, None], ids=["ENOSPC", "EIO", "SIGINT"])
def test_every_injection_point_of_commit_has_an_exact_outcome(
    template: Path, tmp_path: Path, mode: str, error: int | None
) -> None:
    with ckvc.Repo.open(template) as repo:
        before = repo.refs.read("refs/heads/main")
    assert before is not None
    points = count_points(template, tmp_path, run_commit).points
    kinds = Counter(points)
    # Every kind of step a commit takes is among the points: pack writes, fsyncs
    # of the pack, ref and directories, the renames, the reflog appends.
    assert {"open", "write", "fsync", "rename", "replace"} <= set(kinds), kinds
    assert len(points) >= 20, kinds
    landed = failed = 0
    for k in range(len(points)):
        root = fresh(template, tmp_path / f"case{k}")
        result, exc, warned = run_commit(root, Injector(k, persistent=mode == "persistent", error=error))
        if check_commit_outcome(root, before, result, exc):
            landed += 1
        else:
            failed += 1
            if error is not None:
                assert isinstance(exc, StorageFullError if error == errno.ENOSPC else StorageIOError), exc
                assert "nothing was committed" in str(exc) or "is unchanged" in str(exc), exc
            else:
                assert isinstance(exc, InterruptedOperationError | KeyboardInterrupt), exc
        if result is not None and points[k] in ("fsync", "open", "write") and mode == "one-shot" and warned:
            assert "landed" in warned[0] or "now names" in warned[0], warned
        shutil.rmtree(root)
    print(f"commit, {mode}, {error}: {len(points)} injection points {dict(kinds)}: {landed} landed, {failed} refused")
    assert landed and failed  # both sides of the move were hit


def test_a_failed_reflog_write_after_the_move_is_a_warning_and_repaired_on_open(template: Path, tmp_path: Path) -> None:
    """The exact case the issue found: the reflog append fails after the branch moved."""
    points = count_points(template, tmp_path, run_commit).points
    # The last write of a commit is its reflog append (HEAD's, after the branch's).
    last_write = max(i for i, p in enumerate(points) if p == "write")
    root = fresh(template, tmp_path / "case")
    result, exc, warned = run_commit(root, Injector(last_write, error=errno.ENOSPC))
    assert exc is None and result is not None
    assert len(warned) == 1 and f"commit {result[:12]} landed" not in warned[0]
    assert "now names" in warned[0] and "repaired on the next open" in warned[0]
    assert (root / ".ckvc" / "repair-pending").exists()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repo = ckvc.Repo.open(root)
    try:
        assert any("restored 1 reflog entries" in str(w.message) for w in caught)
        assert not (root / ".ckvc" / "repair-pending").exists()
        head_log = repo.reflog("HEAD")
        assert head_log[0].new == result and head_log[0].message.startswith("repair:")
        assert repo.reflog("main")[0].new == result
    finally:
        repo.close()


def test_ctrl_c_after_the_move_reports_that_the_commit_landed(template: Path, tmp_path: Path) -> None:
    points = count_points(template, tmp_path, run_commit).points
    last_write = max(i for i, p in enumerate(points) if p == "write")
    root = fresh(template, tmp_path / "case")
    _, exc, _ = run_commit(root, Injector(last_write, error=None))
    assert isinstance(exc, InterruptedOperationError) and exc.landed
    with ckvc.Repo.open(root) as repo:
        assert repo.refs.read("refs/heads/main") == exc.result
    first_write = points.index("write")
    root = fresh(template, tmp_path / "early")
    _, exc, _ = run_commit(root, Injector(first_write, error=None))
    assert isinstance(exc, InterruptedOperationError) and not exc.landed
    assert str(exc) == "interrupted: nothing was committed; refs/heads/main is unchanged"


# ---- gc -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gc_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three commits on main, a deleted branch whose commit is garbage, and a
    commit pruned by retention: gc has packs to delete and to repack."""
    root = tmp_path_factory.mktemp("gcfaults") / "template"
    with ckvc.Repo.init(root, chunk_size=64 << 10, threads=1) as repo:
        for seed in (1, 2, 3):
            repo.commit(state(seed), f"c{seed}")
        repo.branch("side")
        repo.switch("side")
        repo.commit(state(9), "side")
        repo.switch("main")
        repo.delete_branch("side")
        repo.set_config(reflog_expiry_s=0)
        repo.retain(RetentionPolicy(keep_last=2))  # c1's data goes: its pack is repacked
    return root


def run_gc(root: Path, injector: Injector) -> tuple[Any, BaseException | None, list[str]]:
    repo = ckvc.Repo.open(root, threads=1)
    report, error = None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with injected(injector):
                report = repo.gc(now=True)
        except BaseException as exc:
            error = exc
        finally:
            repo.close()
    return report, error, [str(w.message) for w in caught if issubclass(w.category, DurabilityWarning)]


@pytest.mark.parametrize("mode", ["one-shot", "persistent"])
@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO, None], ids=["ENOSPC", "EIO", "SIGINT"])
def test_every_injection_point_of_gc_keeps_every_commit(
    gc_template: Path, tmp_path: Path, mode: str, error: int | None
) -> None:
    counter = count_points(gc_template, tmp_path, run_gc)
    kinds = Counter(counter.points)
    assert {"open", "writev", "rename", "unlink", "fsync"} <= set(kinds), kinds
    done = refused = 0
    for k in range(len(counter.points)):
        root = fresh(gc_template, tmp_path / f"case{k}")
        report, exc, _ = run_gc(root, Injector(k, persistent=mode == "persistent", error=error))
        if exc is None or (isinstance(exc, InterruptedOperationError) and exc.landed):
            assert exc is not None or report.executed
            done += 1
        else:
            refused += 1
            if error is None:
                assert isinstance(exc, KeyboardInterrupt | InterruptedOperationError), exc
            else:
                assert isinstance(exc, StorageError), f"{type(exc).__name__}: {exc}"
                assert "gc deleted nothing" in str(exc), exc
        with ckvc.Repo.open(root, threads=1) as repo:
            for seed, rev in ((3, "main"), (2, "main~1")):
                assert_state_equal(repo.load(rev), state(seed))
            assert repo.read_commit(repo.resolve("main~2")).message == "c1"  # pruned: history stays
            assert repo.fsck(level="full").ok
            repo.gc(now=True)  # a later gc finishes the job
            assert_state_equal(repo.load("main~1"), state(2))
            assert not [p for p in (root / ".ckvc" / "packs").iterdir() if not p.name.endswith(".pack")]
        shutil.rmtree(root)
    print(f"gc, {mode}, {error}: {len(counter.points)} injection points {dict(kinds)}: {done} done, {refused} refused")
    assert done and refused
