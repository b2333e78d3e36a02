"""A hypothesis state machine of commit / branch / tag / switch / checkout / delete
branch / abandoned detached work / retain / gc against a plain model: which commits exist and what each holds,
their parents, the branches, tags and HEAD, which commits retention pruned. After
every step the repository agrees with the model: refs and HEAD, the prune log, every
commit that exists loads bit-exact (a pruned one refuses), every commit gc collected
is gone; after gc, fsck finds nothing.

The model of gc: reflog entries expire at once (reflog_expiry_s 0) and every pack
with a dead record is rewritten (repack_threshold 1), so exactly the commits
reachable from branches, tags and HEAD survive. The model of retention:
``keep-last N`` on every branch's history, plus branch heads, tags and HEAD.

200 examples by default; 2,000 with CKVC_SOAK=1 (the ``slow`` marker).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_state_equal
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import ckvc
from ckvc.core import Repository
from ckvc.retention import RetentionPolicy

BRANCH_NAMES = ("main", "a", "b")
TAG_NAMES = ("t1", "t2")
CHUNK = 4 << 10
MAX_COMMITS = 10  # every step loads every commit: keep the examples quick
# tmpfs where there is one: the machine makes thousands of small fsynced writes
SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def new_repository(root: Path) -> ckvc.Repo:
    """The one place this machine builds a repository: the in-memory twin by default;
    $CKVC_SM_BACKEND picks "object-store" (the twin without rename, appends or OS
    locks) or "local" (a directory under ``root``)."""
    kind = os.environ.get("CKVC_SM_BACKEND", "memory")
    if kind == "local":
        repo = ckvc.Repo.init(root, chunk_size=CHUNK, threads=1)
    else:
        core = Repository.in_memory(chunk_size=CHUNK, threads=1, object_store_semantics=kind == "object-store")
        repo = ckvc.Repo(core)
    # gc keeps exactly what refs and HEAD reach: reflog entries expire at once, and
    # every pack holding anything else is rewritten (else a mostly-live pack stays).
    repo.set_config(reflog_expiry_s=0, repack_threshold=1.0)
    return repo


def make_state(seed: int, step: int) -> dict[str, Any]:
    """Two chunks of ``w``: the first drawn from ``seed`` (few seeds, so commits
    share it), the second the same in every state; a small bf16 tensor per step."""
    g = torch.Generator().manual_seed(seed)
    w = torch.cat([torch.randn(CHUNK // 4, generator=g), torch.linspace(-1, 1, CHUNK // 4)])
    return {"w": w, "b": (torch.arange(8) * step).to(torch.bfloat16), "step": step}


@dataclass
class Model:
    holds: dict[str, tuple[int, int]] = field(default_factory=dict)  # commit -> (seed, step)
    order: list[str] = field(default_factory=list)  # existing commits, oldest first
    parents: dict[str, str | None] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    head_branch: str | None = "main"  # None: detached
    head_commit: str | None = None  # the detached commit (the branch's tip otherwise)
    pruned: set[str] = field(default_factory=set)

    def head(self) -> tuple[str | None, str | None]:
        if self.head_branch is not None:
            return self.head_branch, self.branches.get(self.head_branch)
        return None, self.head_commit

    def history(self, tip: str) -> list[str]:
        """``tip`` and its ancestors, tip first (every commit has at most one parent)."""
        out: list[str] = []
        commit: str | None = tip
        while commit is not None:
            out.append(commit)
            commit = self.parents[commit]
        return out

    def reachable(self) -> set[str]:
        tips = [*self.branches.values(), *self.tags.values(), self.head()[1]]
        return {c for tip in tips if tip is not None for c in self.history(tip)}

    def released_by(self, keep_last: int) -> set[str]:
        candidates: set[str] = set()
        kept = set(self.branches.values()) | set(self.tags.values()) | {self.head()[1]}
        for tip in self.branches.values():
            history = self.history(tip)
            candidates.update(history)
            kept.update(history[:keep_last])
        return candidates - kept - self.pruned


class RepositoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="ckvc-sm-", dir=SCRATCH))
        self.repo = new_repository(self.tmp / "r")
        self.model = Model()
        self.steps = 0
        self.gone: set[str] = set()  # commits gc collected

    def teardown(self) -> None:
        self.repo.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def pick_commit(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(self.model.order), label="commit")

    # ---- rules ---------------------------------------------------------------
    @precondition(lambda self: len(self.model.order) < MAX_COMMITS)
    @rule(seeds=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def commit(self, seeds: list[int]) -> None:
        """One to three commits in a row, each on the last."""
        for seed in seeds:
            self.steps += 1
            parent = self.model.head()[1]
            cid = self.repo.commit(make_state(seed, self.steps), f"step {self.steps}")
            assert self.repo.read_commit(cid).parents == (() if parent is None else (parent,))
            self.model.holds[cid] = (seed, self.steps)
            self.model.order.append(cid)
            self.model.parents[cid] = parent
            if self.model.head_branch is not None:
                self.model.branches[self.model.head_branch] = cid
            else:
                self.model.head_commit = cid

    def create_ref(self, create: Callable[[str, str], str], refs: dict[str, str], name: str, target: str) -> None:
        """``repo.branch`` / ``repo.tag``: a new name points at ``target``, an existing one is refused."""
        if name in refs:
            with pytest.raises(ckvc.RefConflictError):
                create(name, target)
        else:
            assert create(name, target) == target
            refs[name] = target

    @precondition(lambda self: self.model.order)
    @rule(name=st.sampled_from(BRANCH_NAMES), data=st.data())
    def branch(self, name: str, data: st.DataObject) -> None:
        self.create_ref(self.repo.branch, self.model.branches, name, self.pick_commit(data))

    @precondition(lambda self: self.model.order)
    @rule(name=st.sampled_from(TAG_NAMES), data=st.data())
    def tag(self, name: str, data: st.DataObject) -> None:
        self.create_ref(self.repo.tag, self.model.tags, name, self.pick_commit(data))

    @rule(name=st.sampled_from(BRANCH_NAMES))
    def delete_branch(self, name: str) -> None:
        if name not in self.model.branches:
            with pytest.raises(ckvc.RefNotFoundError):
                self.repo.delete_branch(name)
        elif self.model.head_branch == name:
            with pytest.raises(ckvc.InvalidInputError):
                self.repo.delete_branch(name)
        else:
            assert self.repo.delete_branch(name) == self.model.branches.pop(name)

    @precondition(lambda self: self.model.order)
    @rule(to_branch=st.booleans(), name=st.sampled_from(BRANCH_NAMES), data=st.data())
    def switch(self, to_branch: bool, name: str, data: st.DataObject) -> None:
        """``switch`` onto a branch, or detached at a commit; refused at a pruned one."""
        if to_branch and name not in self.model.branches:
            with pytest.raises(ckvc.InvalidRevisionError):
                self.repo.switch(name)
            return
        target = self.model.branches[name] if to_branch else self.pick_commit(data)
        if target in self.model.pruned:
            with pytest.raises(ckvc.PrunedCommitError):
                self.repo.switch(name if to_branch else target)
            return
        assert self.repo.switch(name if to_branch else target) == target
        self.model.head_branch = name if to_branch else None
        self.model.head_commit = None if to_branch else target

    @precondition(lambda self: self.model.order)
    @rule(data=st.data())
    def checkout(self, data: st.DataObject) -> None:
        """``checkout`` of a commit id: its state, bit-exact, and HEAD detached there."""
        target = self.pick_commit(data)
        if target in self.model.pruned:
            with pytest.raises(ckvc.PrunedCommitError):
                self.repo.checkout(target)
            return
        assert_state_equal(self.repo.checkout(target), make_state(*self.model.holds[target]))
        self.model.head_branch, self.model.head_commit = None, target

    @precondition(lambda self: self.model.head_branch is not None and 0 < len(self.model.order) < MAX_COMMITS)
    @rule(seed=st.integers(0, 2), data=st.data())
    def abandon_detached_work(self, seed: int, data: st.DataObject) -> None:
        """Commit on a detached HEAD, then switch back: only reflogs name that commit
        now, so the next gc collects it unless a ref reached it meanwhile."""
        branch = self.model.head_branch
        assert branch is not None
        target = self.pick_commit(data)
        if target in self.model.pruned:
            return
        self.repo.switch(target)
        self.model.head_branch, self.model.head_commit = None, target
        self.commit([seed])
        self.repo.switch(branch)
        self.model.head_branch, self.model.head_commit = branch, None

    @precondition(lambda self: len(self.model.order) >= 3)
    @rule(keep_last=st.integers(1, 2))
    def retain(self, keep_last: int) -> None:
        plan = self.repo.retain(RetentionPolicy(keep_last=keep_last))
        expected = self.model.released_by(keep_last)
        assert set(plan.released) == expected
        event("retain released commits" if expected else "retain released nothing")
        self.model.pruned |= expected

    @precondition(lambda self: self.model.order)
    @rule()
    def gc(self) -> None:
        self.repo.gc(now=True)
        live = self.model.reachable()
        collected = [c for c in self.model.order if c not in live]
        self.gone.update(collected)
        event("gc collected commits" if collected else "gc collected nothing")
        if any(c in self.model.pruned for c in self.model.order):
            event("gc freed pruned commits' data")
        self.model.order = [c for c in self.model.order if c in live]
        for cid in collected:
            with pytest.raises(ckvc.ObjectNotFoundError):
                self.repo.read_commit(cid)
        report = self.repo.fsck(level="full")
        assert report.ok and report.problems == [], report.problems
        assert report.commits_reachable == len(live)

    # ---- after every step --------------------------------------------------------
    @invariant()
    def agrees_with_the_model(self) -> None:
        assert self.repo.branches() == self.model.branches
        assert self.repo.tags() == self.model.tags
        assert self.repo.head() == self.model.head()
        assert set(self.repo.pruned()) == self.model.pruned
        for cid in self.model.order:
            if cid in self.model.pruned:
                with pytest.raises(ckvc.PrunedCommitError):
                    self.repo.load(cid)
            else:
                assert_state_equal(self.repo.load(cid), make_state(*self.model.holds[cid]))


def run_machine(examples: int) -> None:
    run_state_machine_as_test(
        RepositoryMachine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=16,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


@pytest.mark.parametrize(
    ("backend", "examples"),
    [("memory", 100), pytest.param("memory", 400, marks=pytest.mark.stress), ("object-store", 50), ("local", 25)],
)
def test_repository_agrees_with_a_plain_model(backend: str, examples: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-memory twin at the most examples (400 in the stress tier); the
    object-store variants of refs, logs and gc and the local directory at fewer (the
    same machine, other backends)."""
    monkeypatch.setenv("CKVC_SM_BACKEND", backend)
    run_machine(examples)


@pytest.mark.slow
def test_repository_agrees_with_a_plain_model_soak() -> None:
    run_machine(2000)
