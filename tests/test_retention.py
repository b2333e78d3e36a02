"""Retention policies and the prune log: which commits keep their data, why, and
what a pruned commit still offers (history, metrics, parenthood) after gc."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_state_equal

import ckvc
from ckvc.fsck import UNREFERENCED
from ckvc.retention import KeepBest, RetentionPolicy, format_duration, parse_duration, plan_retention
from ckvc.storage.durable import list_packs

CHUNK = 16 << 10


# ---- helpers ----------------------------------------------------------------------
def big_state(seed: int) -> dict[str, Any]:
    """~97 KiB of incompressible-ish floats; different seeds share no chunk."""
    g = torch.Generator().manual_seed(1000 + seed)
    return {
        "model": {"w": torch.randn(64, 256, generator=g), "b": torch.randn(256, generator=g)},
        "optim": {"m": torch.randn(64, 128, generator=g)},
        "step": seed,
    }


def small_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(5000 + seed)
    return {"w": torch.randn(512, generator=g), "step": seed}


def ckvc_files(repo: ckvc.Repo) -> dict[str, bytes]:
    # The LMDB lock file changes on every open; it is not repository content.
    return {
        str(p.relative_to(repo.dir)): p.read_bytes()
        for p in sorted(repo.dir.rglob("*"))
        if p.is_file() and p.name != "lock.mdb"
    }


def pack_bytes(repo: ckvc.Repo) -> int:
    return sum((repo.dir / "packs" / n).stat().st_size for n in list_packs(repo.dir / "packs"))


def commits(repo: ckvc.Repo, n: int, *, seed: int = 0, metrics: list[dict[str, float]] | None = None) -> list[str]:
    return [
        repo.commit(small_state(seed + i), message=f"c{seed + i}", metrics=metrics[i] if metrics else None)
        for i in range(n)
    ]


@pytest.fixture
def repo(make_repo: Callable[..., ckvc.Repo]) -> ckvc.Repo:
    return make_repo(chunk_size=CHUNK)


# ---- the acceptance scenario ------------------------------------------------------
N = 30
LIGHT, ANNOTATED = 7, 15  # tagged positions
POLICY = RetentionPolicy(keep_last=3, keep_best=(KeepBest("val_loss", "min", 2),), keep_every=10)
DESCRIPTION = "keep-last 3, keep-best val_loss:min:2, keep-every 10"


def val_loss(i: int) -> float:
    return 1.0 + ((7 * i + 3) % 30) / 10  # a permutation of 1.0 .. 3.9 over positions 0..29


BEST = (21, 4)  # lowest and second-lowest val_loss
EXPECTED_REASONS = {
    0: ["keep-every 10 on main"],
    4: ["keep-best val_loss:min:2 on main"],
    LIGHT: ["tag light"],
    10: ["keep-every 10 on main"],
    ANNOTATED: ["tag annotated"],
    20: ["keep-every 10 on main"],
    21: ["keep-best val_loss:min:2 on main"],
    27: ["keep-last 3 on main"],
    28: ["keep-last 3 on main"],
    29: ["keep-last 3 on main", "head of branch main", "HEAD"],
}
KEPT = sorted(EXPECTED_REASONS)
RELEASED = [i for i in range(N) if i not in EXPECTED_REASONS]


def test_scenario_is_what_it_claims() -> None:
    assert sorted(val_loss(i) for i in range(N)) == [1.0 + k / 10 for k in range(N)]
    assert tuple(sorted(range(N), key=val_loss)[:2]) == BEST
    assert not set(BEST) & {0, 10, 20, 27, 28, 29, LIGHT, ANNOTATED}
    assert POLICY.describe() == DESCRIPTION
    assert len(KEPT) == 10 and len(RELEASED) == 20


def test_acceptance_keep_last_best_every_tags_then_gc(tmp_path: Path) -> None:
    repo = ckvc.Repo.init(tmp_path / "r", chunk_size=CHUNK)
    states = [big_state(i) for i in range(N)]
    ids = [repo.commit(s, message=f"step {i}", metrics={"val_loss": val_loss(i)}) for i, s in enumerate(states)]
    assert len(list_packs(repo.dir / "packs")) == N  # one pack per commit: no dedup between states
    assert repo.tag("light", ids[LIGHT]) == ids[LIGHT]
    tag_object = repo.tag("annotated", ids[ANNOTATED], message="a good one")
    assert tag_object != ids[ANNOTATED]
    assert repo.tags() == {"annotated": ids[ANNOTATED], "light": ids[LIGHT]}

    # Dry run: the plan, with every kept commit's reasons, and no change on disk.
    before = ckvc_files(repo)
    dry = repo.retain(POLICY, dry_run=True)
    assert ckvc_files(repo) == before
    assert repo.pruned() == {}
    assert dry.kept == {ids[i]: reasons for i, reasons in EXPECTED_REASONS.items()}
    assert dry.released == [ids[i] for i in reversed(RELEASED)]  # newest first
    assert dry.already_pruned == []
    assert dry.to_json()["policy"] == DESCRIPTION

    t0 = time.time_ns()
    plan = repo.retain(POLICY)
    t1 = time.time_ns()
    assert plan.kept == dry.kept and plan.released == dry.released
    records = repo.pruned()
    assert set(records) == {ids[i] for i in RELEASED}
    assert all(r.policy == DESCRIPTION and t0 <= r.time_ns <= t1 for r in records.values())

    pack_of = {c: repo.store.stat(bytes.fromhex(c)).pack for c in ids}
    report = repo.gc(now=True)
    assert report.executed and report.packs_deleted == 0 and report.kept_revived == []
    # Each released commit's pack held only one live object, its commit: rewritten into
    # a new pack. The kept commits' packs are fully live and stay as they are.
    packs_now = set(list_packs(repo.dir / "packs"))
    for i in KEPT:
        assert pack_of[ids[i]] in packs_now
        assert repo.store.stat(bytes.fromhex(ids[i])).pack == pack_of[ids[i]]
    for i in RELEASED:
        assert pack_of[ids[i]] not in packs_now
        assert repo.store.stat(bytes.fromhex(ids[i])).pack not in pack_of.values()

    with ckvc.Repo.open(repo.path) as again:
        for i in KEPT:
            assert_state_equal(again.load(ids[i]), states[i])
        assert_state_equal(again.load("light"), states[LIGHT])
        assert_state_equal(again.load("annotated"), states[ANNOTATED])
        assert_state_equal(again.load("HEAD"), states[N - 1])
        for i in RELEASED:
            with pytest.raises(ckvc.PrunedCommitError) as info:
                again.load(ids[i])
            err = info.value
            assert (err.commit, err.policy, err.time_ns) == (ids[i], DESCRIPTION, records[ids[i]].time_ns)
            assert err.exit_code == 15
            text = str(err)
            assert ids[i][:12] in text and f"[{DESCRIPTION}]" in text
            stamp = re.search(r"at (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) UTC", text)
            assert stamp is not None
            when = dt.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.UTC)
            assert abs(when.timestamp() - t0 / 1e9) < 2
            with pytest.raises(ckvc.PrunedCommitError):
                again.checkout(ids[i])
        assert again.head() == ("main", ids[-1])  # the refused checkouts left HEAD alone

        # History is whole: every commit with its metrics, parents unchanged.
        log = again.log()
        assert [c.id for c in log] == ids[::-1]
        assert [c.metrics for c in log] == [{"val_loss": val_loss(i)} for i in reversed(range(N))]
        assert [c.message for c in log] == [f"step {i}" for i in reversed(range(N))]
        assert set(again.pruned()) == {ids[i] for i in RELEASED}

        fsck = again.fsck()
        assert fsck.ok and fsck.problems == []
        assert fsck.commits_reachable == N

        usage = again.du()
        assert (usage.commits, usage.pruned_commits) == (len(KEPT), len(RELEASED))
        assert usage.logical_bytes == len(KEPT) * (64 * 256 + 256 + 64 * 128) * 4
        assert usage.pack_bytes == pack_bytes(again)
        gc_bytes = pack_bytes(again)

    # Within 5% of a repository that only ever held the kept states.
    with ckvc.Repo.init(tmp_path / "fresh", chunk_size=CHUNK) as fresh:
        for i in KEPT:
            fresh.commit(states[i], message=f"step {i}", metrics={"val_loss": val_loss(i)})
        fresh_bytes = pack_bytes(fresh)
    assert abs(gc_bytes - fresh_bytes) <= 0.05 * fresh_bytes, (gc_bytes, fresh_bytes)
    repo.close()


# ---- rules one by one ---------------------------------------------------------------
def test_keep_within_uses_commit_times(repo: ckvc.Repo) -> None:
    ids = commits(repo, 6)
    times = [repo.read_commit(c).time_ns for c in ids]
    assert times == sorted(times) and len(set(times)) == 6
    policy = RetentionPolicy(keep_within_s=5.0)
    # "now" placed so that the horizon falls exactly on commit 3: 3, 4, 5 are young enough.
    plan = plan_retention(repo.core, policy, now_ns=times[3] + 5_000_000_000)
    assert plan.kept == {
        ids[3]: ["keep-within 5s"],
        ids[4]: ["keep-within 5s"],
        ids[5]: ["keep-within 5s", "head of branch main", "HEAD"],
    }
    assert plan.released == [ids[2], ids[1], ids[0]]
    # One nanosecond later commit 3 is too old.
    later = plan_retention(repo.core, policy, now_ns=times[3] + 5_000_000_001)
    assert later.released == [ids[3], ids[2], ids[1], ids[0]]

    # Against the real clock: an hour keeps everything, a microsecond only the head.
    hour = repo.retain(RetentionPolicy(keep_within_s=parse_duration("1h")), dry_run=True)
    assert hour.released == [] and all("keep-within 1h" in r for r in hour.kept.values())
    tiny = repo.retain(RetentionPolicy(keep_within_s=1e-6), dry_run=True)
    assert list(tiny.kept) == [ids[5]] and tiny.released == ids[4::-1]


def test_keep_best_max_ignores_missing_and_nan(repo: ckvc.Repo) -> None:
    nan = float("nan")
    metrics: list[dict[str, float]] = [
        {"acc": 0.1},
        {"acc": nan},
        {"loss": 3.0},  # no acc at all
        {"acc": 0.9},
        {"acc": 0.5},
        {"acc": nan},
        {"acc": 0.7},
        {},
        {"acc": 0.2},
    ]
    ids = commits(repo, len(metrics), metrics=metrics)
    assert "acc" not in repo.read_commit(ids[2]).metrics and repo.read_commit(ids[7]).metrics == {}
    assert math.isnan(repo.read_commit(ids[1]).metrics["acc"])
    plan = repo.retain(RetentionPolicy(keep_best=(KeepBest.parse("acc:max:2"),)))
    assert plan.kept == {
        ids[6]: ["keep-best acc:max:2 on main"],
        ids[3]: ["keep-best acc:max:2 on main"],
        ids[8]: ["head of branch main", "HEAD"],
    }
    assert plan.released == [ids[i] for i in (7, 5, 4, 2, 1, 0)]
    assert set(repo.pruned()) == set(plan.released)

    # More asked for than scored: only the 5 commits with a finite acc count.
    wide = repo.retain(RetentionPolicy(keep_best=(KeepBest("acc", "max", 100),)), dry_run=True)
    assert {c for c, r in wide.kept.items() if r[0].startswith("keep-best")} == {ids[i] for i in (0, 3, 4, 6, 8)}


def test_multiple_keep_best_rules(repo: ckvc.Repo) -> None:
    metrics: list[dict[str, float]] = [
        {"loss": 5.0, "acc": 0.1},
        {"loss": 1.0, "acc": 0.2},  # best loss
        {"loss": 4.0, "acc": 0.8},  # best acc
        {"loss": 2.0, "acc": 0.7},  # second by both
        {"loss": 3.0, "acc": 0.3},
        {"loss": 6.0, "acc": 0.0},
    ]
    ids = commits(repo, len(metrics), metrics=metrics)
    policy = RetentionPolicy(keep_best=(KeepBest("loss", "min", 2), KeepBest("acc", "max", 2)))
    assert policy.describe() == "keep-best loss:min:2, keep-best acc:max:2"
    plan = repo.retain(policy, dry_run=True)
    assert plan.kept == {
        ids[1]: ["keep-best loss:min:2 on main"],
        ids[3]: ["keep-best loss:min:2 on main", "keep-best acc:max:2 on main"],
        ids[2]: ["keep-best acc:max:2 on main"],
        ids[5]: ["head of branch main", "HEAD"],
    }
    assert plan.released == [ids[4], ids[0]]


def test_keep_every_counts_from_the_root_of_each_branch(repo: ckvc.Repo) -> None:
    main = commits(repo, 5)  # positions 0..4 on main
    repo.branch("exp", main[2])
    repo.switch("exp")
    exp = commits(repo, 6, seed=100)  # positions 3..8 on exp's first-parent history
    chain = [c.id for c in repo.log("exp", first_parent=True)][::-1]
    assert chain == main[:3] + exp
    plan = repo.retain(RetentionPolicy(keep_every=4), dry_run=True)
    assert plan.kept == {
        main[0]: ["keep-every 4 on exp", "keep-every 4 on main"],
        exp[1]: ["keep-every 4 on exp"],  # position 4 from the root, not from the fork
        exp[5]: ["keep-every 4 on exp", "head of branch exp", "HEAD"],
        main[4]: ["keep-every 4 on main", "head of branch main"],
    }
    assert set(plan.released) == {main[1], main[2], main[3], exp[0], exp[2], exp[3], exp[4]}


def test_policy_on_one_branch_spares_what_other_branches_reach(repo: ckvc.Repo) -> None:
    main = commits(repo, 4)
    repo.branch("exp", main[1])
    repo.switch("exp")
    exp = commits(repo, 4, seed=100)
    repo.switch("main")
    policy = RetentionPolicy(keep_last=1, branches=("exp",))
    assert policy.describe() == "keep-last 1, branches exp"
    plan = repo.retain(policy)
    uncovered = "reachable from a branch the policy does not cover"
    assert plan.kept == {
        exp[3]: ["keep-last 1 on exp", "head of branch exp"],
        main[3]: ["head of branch main", "HEAD"],
        main[1]: [uncovered],
        main[0]: [uncovered],
    }
    assert plan.released == [exp[2], exp[1], exp[0]]
    repo.gc(now=True)
    for i, c in enumerate(main):
        assert_state_equal(repo.load(c), small_state(i))
    assert_state_equal(repo.load(exp[3]), small_state(103))
    for c in exp[:3]:
        with pytest.raises(ckvc.PrunedCommitError):
            repo.load(c)


def test_policy_naming_a_missing_branch_is_refused(repo: ckvc.Repo) -> None:
    commits(repo, 3)
    before = ckvc_files(repo)
    with pytest.raises(ckvc.InvalidInputError, match="nope"):
        repo.retain(RetentionPolicy(keep_last=1, branches=("nope",)))
    assert ckvc_files(repo) == before


def test_detached_head_keeps_its_commit(repo: ckvc.Repo) -> None:
    ids = commits(repo, 5)
    repo.switch(ids[1])
    assert repo.head() == (None, ids[1])
    plan = repo.retain(RetentionPolicy(keep_last=1))
    assert plan.kept == {ids[4]: ["keep-last 1 on main", "head of branch main"], ids[1]: ["HEAD"]}
    assert plan.released == [ids[3], ids[2], ids[0]]
    repo.gc(now=True)
    assert_state_equal(repo.load("HEAD"), small_state(1))
    assert_state_equal(repo.load("main"), small_state(4))
    for i in (0, 2, 3):
        with pytest.raises(ckvc.PrunedCommitError):
            repo.load(ids[i])
    assert repo.fsck().ok


# ---- the stored policy ------------------------------------------------------------------
def test_stored_policy_round_trips_through_config(repo: ckvc.Repo) -> None:
    assert repo.retention_policy() is None
    policy = RetentionPolicy(
        keep_last=3,
        keep_best=(KeepBest("val_loss", "min", 2), KeepBest("acc", "max", 1)),
        keep_every=10,
        keep_within_s=parse_duration("7d"),
        branches=("main", "exp"),
        auto=True,
    )
    repo.set_retention(policy)
    raw = json.loads((repo.dir / "config.json").read_text())["retention"]
    assert raw == {
        "keep_last": 3,
        "keep_best": ["val_loss:min:2", "acc:max:1"],
        "keep_every": 10,
        "keep_within_s": 604800.0,
        "branches": ["main", "exp"],
        "auto": True,
    }
    with ckvc.Repo.open(repo.path) as again:
        assert again.retention_policy() == policy
        again.set_retention(None)
        assert again.retention_policy() is None
    assert json.loads((repo.dir / "config.json").read_text())["retention"] is None
    with ckvc.Repo.open(repo.path) as again:
        assert again.retention_policy() is None


def test_commit_retain_true_applies_the_stored_policy(repo: ckvc.Repo) -> None:
    repo.set_retention(RetentionPolicy(keep_last=2))
    ids = commits(repo, 4)
    assert repo.pruned() == {}  # auto is off: plain commits prune nothing
    last = repo.commit(small_state(4), retain=True)
    assert set(repo.pruned()) == set(ids[:3])
    assert {r.policy for r in repo.pruned().values()} == {"keep-last 2"}
    assert_state_equal(repo.load(last), small_state(4))
    assert_state_equal(repo.load(ids[3]), small_state(3))
    # retain=False overrides even an auto policy.
    repo.set_retention(RetentionPolicy(keep_last=1, auto=True))
    repo.commit(small_state(5), retain=False)
    assert set(repo.pruned()) == set(ids[:3])


def test_auto_policy_applies_after_every_commit(repo: ckvc.Repo) -> None:
    repo.set_retention(RetentionPolicy(keep_last=2, auto=True))
    ids: list[str] = []
    for i in range(5):
        ids.append(repo.commit(small_state(i)))
        assert set(repo.pruned()) == set(ids[:-2])
    repo.gc(now=True)
    assert_state_equal(repo.load(ids[3]), small_state(3))
    assert_state_equal(repo.load(ids[4]), small_state(4))
    with pytest.raises(ckvc.PrunedCommitError, match=r"\[keep-last 2\]"):
        repo.load(ids[2])


def test_retain_true_without_a_stored_policy_raises(repo: ckvc.Repo) -> None:
    commits(repo, 1)
    with pytest.raises(ckvc.InvalidInputError, match="no retention policy"):
        repo.commit(small_state(9), retain=True)
    with pytest.raises(ckvc.InvalidInputError):
        repo.retain()


def test_retain_true_without_a_policy_commits_nothing(repo: ckvc.Repo) -> None:
    (first,) = commits(repo, 1)
    before = ckvc_files(repo)
    with pytest.raises(ckvc.InvalidInputError):
        repo.commit(small_state(9), retain=True)
    assert repo.head() == ("main", first)
    assert ckvc_files(repo) == before


@pytest.mark.parametrize(
    "make",
    [
        lambda: RetentionPolicy(keep_last=0),
        lambda: RetentionPolicy(keep_last=-1),
        lambda: RetentionPolicy(keep_last=True),
        lambda: RetentionPolicy(keep_every=0),
        lambda: RetentionPolicy(keep_within_s=0),
        lambda: RetentionPolicy(keep_within_s=float("inf")),
        lambda: RetentionPolicy(),
        lambda: RetentionPolicy(branches=("main",), auto=True),
        lambda: KeepBest.parse("bad"),
        lambda: KeepBest.parse("val_loss:median:2"),
        lambda: KeepBest.parse("val_loss:min:0"),
        lambda: KeepBest.parse("val_loss:min:two"),
        lambda: KeepBest.parse(":min:2"),
    ],
    ids=[
        "keep_last=0",
        "keep_last=-1",
        "keep_last=True",
        "keep_every=0",
        "keep_within=0",
        "keep_within=inf",
        "no-rules",
        "only-branches-and-auto",
        "keep-best-bad",
        "keep-best-mode",
        "keep-best-count-0",
        "keep-best-count-word",
        "keep-best-no-metric",
    ],
)
def test_invalid_policies_are_refused(make: Any) -> None:
    with pytest.raises(ckvc.InvalidInputError):
        make()


def test_keep_best_built_directly_is_validated(repo: ckvc.Repo) -> None:
    (first,) = commits(repo, 1)
    with pytest.raises(ckvc.InvalidInputError):
        repo.set_retention(RetentionPolicy(keep_best=(KeepBest("loss", "median", 1),)))
    assert repo.retention_policy() is None
    second = repo.commit(small_state(1))  # plain commits keep working
    assert repo.head() == ("main", second) and second != first


def test_keep_best_parse() -> None:
    assert KeepBest.parse("val_loss:min:2") == KeepBest("val_loss", "min", 2)
    assert KeepBest.parse("eval:top1:max:1") == KeepBest("eval:top1", "max", 1)
    assert str(KeepBest("acc", "max", 3)) == "acc:max:3"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("7d", 604800), ("90", 90), ("45s", 45), ("30m", 1800), ("12h", 43200), ("2w", 1209600), ("1.5h", 5400)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "d", "7y", "-1d", "1 d 2h", "1e3"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ckvc.InvalidInputError):
        parse_duration(text)


def test_format_duration() -> None:
    assert [format_duration(s) for s in (604800, 259200, 7200, 120, 90, 0.5)] == ["1w", "3d", "2h", "2m", "90s", "0.5s"]


# ---- the prune log: idempotence, parenthood, other readers ----------------------------------
def test_second_retain_adds_nothing(repo: ckvc.Repo) -> None:
    ids = commits(repo, 5)
    policy = RetentionPolicy(keep_last=2)
    first = repo.retain(policy)
    assert first.released == [ids[2], ids[1], ids[0]]
    log_bytes = (repo.dir / "pruned.jsonl").read_bytes()
    assert len(log_bytes.splitlines()) == 3
    second = repo.retain(policy)
    assert second.released == [] and second.already_pruned == first.released
    assert (repo.dir / "pruned.jsonl").read_bytes() == log_bytes
    # A stricter policy later adds only the newly released commit; the first record wins.
    records = repo.pruned()
    third = repo.retain(RetentionPolicy(keep_last=1))
    assert third.released == [ids[3]] and third.already_pruned == first.released
    assert {c: r for c, r in repo.pruned().items() if c != ids[3]} == records
    assert repo.pruned()[ids[3]].policy == "keep-last 1"


def test_pruned_commit_can_be_a_parent(repo: ckvc.Repo) -> None:
    ids = commits(repo, 4)
    repo.retain(RetentionPolicy(keep_last=1))
    repo.gc(now=True)
    # A pruned commit cannot be checked out, but it can be named as a parent.
    child = repo.commit(small_state(50), message="merge of a pruned commit", merge=[ids[1]])
    grandchild = repo.commit(small_state(51), message="next", merge=[ids[0], ids[1]])
    assert repo.read_commit(child).parents == (ids[3], ids[1])
    assert repo.read_commit(grandchild).parents == (child, ids[0], ids[1])
    assert_state_equal(repo.load(child), small_state(50))
    assert_state_equal(repo.load(grandchild), small_state(51))
    for i in range(3):
        with pytest.raises(ckvc.PrunedCommitError):
            repo.load(ids[i])  # pruning is never undone
    assert [c.id for c in repo.log()] == [grandchild, child, *ids[::-1]]
    repo.gc(now=True)
    assert_state_equal(repo.load(child), small_state(50))
    report = repo.fsck()
    assert report.ok and report.problems == []
    assert report.commits_reachable == 6


def test_show_and_diff_of_a_pruned_commit_after_gc_raise_typed_errors(repo: ckvc.Repo) -> None:
    ids = commits(repo, 3)
    repo.retain(RetentionPolicy(keep_last=1))
    repo.gc(now=True)
    for call in (lambda: repo.show(ids[0]), lambda: repo.diff(ids[0], ids[2]), lambda: repo.diff(ids[2], ids[1])):
        with pytest.raises(ckvc.CkvcError):
            call()
    # The kept commit still shows and diffs against itself.
    assert [t.path for t in repo.show(ids[2]).tensors] == ["w"]
    assert repo.diff(ids[2], ids[2]).changed == []


def test_show_and_diff_of_a_pruned_commit_say_it_was_pruned(repo: ckvc.Repo) -> None:
    ids = commits(repo, 3)
    repo.retain(RetentionPolicy(keep_last=1))
    repo.gc(now=True)
    with pytest.raises(ckvc.PrunedCommitError):
        repo.show(ids[0])
    with pytest.raises(ckvc.PrunedCommitError):
        repo.diff(ids[0], ids[2])


def test_pruned_but_not_collected_is_reported_by_fsck(repo: ckvc.Repo) -> None:
    ids = commits(repo, 3)
    repo.retain(RetentionPolicy(keep_last=1))
    report = repo.fsck()
    assert report.ok
    assert [p.kind for p in report.problems] == [UNREFERENCED]
    assert report.unreferenced_objects == 4  # two pruned commits: one snapshot and one chunk each
    repo.gc(now=True)
    report = repo.fsck()
    assert report.ok and report.problems == []
    with pytest.raises(ckvc.PrunedCommitError):
        repo.load(ids[0])


def test_torn_prune_log_line_does_not_swallow_the_next_record(repo: ckvc.Repo) -> None:
    ids = commits(repo, 4)
    with open(repo.dir / "pruned.jsonl", "ab") as f:
        f.write(b'{"commit": "00')  # what a crash mid-append leaves
    assert repo.pruned() == {}
    plan = repo.retain(RetentionPolicy(keep_last=1))
    assert plan.released == [ids[2], ids[1], ids[0]]
    assert set(repo.pruned()) == set(plan.released)


def _budget_repo(repo: ckvc.Repo, n: int = 8) -> list[str]:
    """n commits: a shared tensor (deduplicated) and a fresh 256 KiB one each, raw codec."""
    shared = torch.randn(64 << 10, generator=torch.Generator().manual_seed(99))
    ids = []
    for i in range(n):
        fresh = torch.randn(64 << 10, generator=torch.Generator().manual_seed(i))
        ids.append(repo.commit({"shared": shared, "fresh": fresh}, f"epoch {i}", time_ns=1_700_000_000_000_000_000 + i))
    return ids


def test_max_size_keeps_the_newest_that_fit_and_frees_what_it_says(make_repo: Any) -> None:
    """retain --max-size: stored bytes within the budget (shared chunks counted once), the
    oldest released first, and the dry run's per-commit "frees" add up to what gc frees."""
    from ckvc.gc import collect_garbage

    repo = make_repo(codec={"name": "raw"})
    ids = _budget_repo(repo)
    one = repo.du().stored_chunk_bytes
    head_only = plan_retention(repo.core, RetentionPolicy(max_size=0))
    assert head_only.released == ids[-2::-1] and head_only.over_budget is not None  # the head alone is over 0
    assert head_only.kept_bytes is not None
    budget = head_only.kept_bytes + 3 * (256 << 10) + 4096  # the head, then three more fresh tensors
    plan = repo.retain(RetentionPolicy(max_size=budget), dry_run=True)
    assert plan.released == ids[:4][::-1]  # the four oldest go; the head and the three newest stay
    assert plan.kept_bytes is not None and plan.kept_bytes <= budget and plan.over_budget is None
    assert all(plan.frees[c] >= 256 << 10 for c in plan.released)  # each its own fresh tensor
    assert set(plan.frees) == set(plan.released)
    repo.retain(RetentionPolicy(max_size=budget))
    report = collect_garbage(repo.core, now=True)
    expected = sum(plan.frees.values())
    assert abs(report.bytes_freed - expected) <= 0.01 * expected, (report.bytes_freed, expected)
    assert repo.du().stored_chunk_bytes <= budget < one
    for kept in ids[4:]:
        repo.load(kept)  # everything kept still loads


def test_max_size_combines_with_other_rules_and_says_when_it_cannot(make_repo: Any) -> None:
    repo = make_repo(codec={"name": "raw"})
    ids = _budget_repo(repo, 5)
    plan = plan_retention(repo.core, RetentionPolicy(keep_last=3, max_size=1))
    assert plan.over_budget is not None and "over the budget" in plan.over_budget
    assert plan.released == ids[:2][::-1]  # keep-last wins over the budget; nothing more is kept
    policy = RetentionPolicy(keep_last=1, max_size=50 << 30)
    assert RetentionPolicy.from_config(policy.to_config()) == policy
    assert "max-size 50.0 GiB" in policy.describe()
    assert plan_retention(repo.core, policy).released == []  # everything fits in 50 GiB


def test_max_size_counts_what_gc_keeps_beyond_the_first_parent_line(make_repo: Any) -> None:
    """A merged-in commit (a second parent, on no branch) keeps its data whatever the
    policy says: the budget counts it, and the dry run's frees still equal gc's."""
    from ckvc.gc import collect_garbage

    repo = make_repo(codec={"name": "raw"})
    ids = _budget_repo(repo, 3)
    repo.branch("side", ids[0])
    repo.switch("side")
    side = repo.commit({"side": torch.randn(64 << 10, generator=torch.Generator().manual_seed(50))}, "side work")
    repo.switch("main")
    repo.commit({"shared": torch.zeros(1)}, "merge", merge=[side])
    repo.delete_branch("side")
    plan = repo.retain(RetentionPolicy(max_size=1), dry_run=True)
    assert plan.kept_bytes is not None and plan.kept_bytes >= 256 << 10  # the side commit's tensor is in it
    repo.retain(RetentionPolicy(max_size=1))
    report = collect_garbage(repo.core, now=True)
    expected = sum(plan.frees.values())
    assert abs(report.bytes_freed - expected) <= 0.01 * expected, (report.bytes_freed, expected)
