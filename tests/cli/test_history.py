"""History and queries (issue 13): best-by-metric, log --all/--graph/--sort, diff
summaries and filters, tags with messages, checkout vs load, switch, export --prefix,
and JSON-like commit metadata."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers import run

import ckvc
from ckvc.objects import Commit, pack_canonical
from ckvc.repo import is_rng_path


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[ckvc.Repo]:
    with ckvc.Repo.init(tmp_path) as r:
        yield r


def state(i: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(i)
    return {
        "model": {"w": torch.randn(16, 16, generator=g), "b": torch.zeros(16)},
        "optimizer": {"step": i},
        "rng": {"torch": torch.randint(0, 255, (32,), dtype=torch.uint8, generator=g), "seed": i},
    }


def test_best_and_rank_by_metric(repo: ckvc.Repo) -> None:
    ids = [repo.commit(state(i), message=f"e{i}", metrics={"val_loss": v}) for i, v in enumerate([0.5, 0.2, 0.2, 0.9])]
    repo.commit(state(9), message="no metric")
    repo.commit(state(10), message="nan", metrics={"val_loss": math.nan})
    assert repo.best("val_loss").id == ids[2]  # the newest among equals
    assert repo.best("val_loss", mode="max").id == ids[3]
    assert [c.id for c in repo.rank("val_loss")] == [ids[2], ids[1], ids[0], ids[3]]
    assert repo.best("val_loss", rev=ids[1]).id == ids[1]
    with pytest.raises(ckvc.InvalidInputError, match=r"did you mean 'val_loss'\?"):
        repo.best("val-loss")
    with pytest.raises(ckvc.InvalidInputError, match="mode must be 'min' or 'max'"):
        repo.best("val_loss", mode="low")  # type: ignore[arg-type]


def test_log_all_is_topological_and_best_all(repo: ckvc.Repo) -> None:
    root = repo.commit(state(0), message="root", metrics={"acc": 0.1})
    main1 = repo.commit(state(1), message="main1", metrics={"acc": 0.2})
    repo.switch(root, new_branch="side")
    side1 = repo.commit(state(2), message="side1", metrics={"acc": 0.9})
    repo.switch("main")
    assert [c.id for c in repo.log()] == [main1, root]
    assert [c.id for c in repo.log(all=True)] == [side1, main1, root]
    assert repo.best("acc", mode="max").id == main1
    assert repo.best("acc", mode="max", all=True).id == side1


def test_log_graph_draws_branches_and_merges(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        root = repo.commit(state(0), message="root")
        repo.commit(state(1), message="main1")
        repo.switch(root, new_branch="side")
        side1 = repo.commit(state(2), message="side1")
        repo.switch("main")
        merged = repo.commit(state(3), message="merge", merge=[side1])
        ids = {c.message: c.id[:12] for c in repo.log(all=True)}
    r = run(tmp_path, "log", "--all", "--graph", "--oneline")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [
        f"* {ids['merge']} (HEAD -> main) merge",
        "|\\",
        f"| * {ids['side1']} (side) side1",
        f"* | {ids['main1']} main1",
        "|/",
        f"* {ids['root']} root",
    ]
    full = run(tmp_path, "log", "--graph").stdout.splitlines()
    assert full[0] == f"* commit {merged} (HEAD -> main)"
    assert full[1] == "|\\"
    assert full[2].startswith("| | Merge:  ")


def test_diff_summary_filters_metrics_and_rng(repo: ckvc.Repo, tmp_path: Path) -> None:
    a = state(0)
    b = {**state(1), "model": {**state(1)["model"], "b": torch.zeros(16), "extra": torch.ones(3)}}  # type: ignore[dict-item]
    repo.commit(a, message="a", metrics={"loss": 1.0, "acc": 0.5})
    repo.commit(b, message="b", metrics={"loss": 0.5, "lr": 0.1})
    d = repo.diff("HEAD~1")
    assert [c.path for c in d.changed] == ["model.w"]
    assert d.changed[0].rel_l2 is not None and d.changed[0].rel_l2 > 0.5
    assert (d.added, d.removed, d.unchanged) == (["model.extra"], [], 1)
    assert (d.added_bytes, d.changed_bytes) == (12, 1024)
    assert d.values_changed == [("optimizer.step", 0, 1)]
    assert sorted(d.rng_changed) == ["rng.seed", "rng.torch"]
    assert d.metrics_changed == [("acc", 0.5, None), ("loss", 1.0, 0.5), ("lr", None, 0.1)]
    only = repo.diff("HEAD~1", "HEAD", ["optimizer"])
    assert (only.changed, only.values_changed, only.metrics_changed != []) == ([], [("optimizer.step", 0, 1)], True)
    assert [c.path for c in repo.diff("HEAD~1", "HEAD", ["*.w"]).changed] == ["model.w"]
    stat = repo.diff("HEAD~1", "HEAD", data=False)
    assert [(c.path, c.rel_l2) for c in stat.changed] == [("model.w", None)]
    r = run(tmp_path, "diff", "HEAD~1")
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[0] == (
        "1 tensor changed (1.0 KiB), 1 added (12 B), 0 removed (0 B), 1 unchanged, 1 value changed, 3 metrics changed"
    )
    assert lines[1:5] == ["metric acc: 0.5 -> (none)", "metric loss: 1 -> 0.5", "metric lr: (none) -> 0.1",
                          "rng: 2 RNG state leaves changed (expected between steps)"]  # fmt: skip
    assert lines[5] == "+ model.extra"
    assert lines[6].startswith("~ model.w  rel_l2=")
    assert lines[7] == "~ optimizer.step  0 -> 1"
    assert len(lines) == 8
    assert run(tmp_path, "diff", "HEAD", "HEAD").stdout == "no differences (4 tensors identical)\n"
    js = json.loads(run(tmp_path, "diff", "HEAD~1", "HEAD", "model", "--stat", "--json").stdout)
    assert js["summary"] == {
        "changed": 1, "added": 1, "removed": 0, "unchanged": 1, "changed_bytes": 1024, "added_bytes": 12,
        "removed_bytes": 0, "values_changed": 0, "rng_changed": 0,
    }  # fmt: skip


def test_largest_relative_change_first(repo: ckvc.Repo) -> None:
    w = {f"t{i}": torch.ones(8) for i in range(3)}
    repo.commit(w)
    repo.commit({"t0": torch.ones(8) * 1.01, "t1": torch.ones(8) * 3, "t2": torch.ones(8) * 1.5})
    assert [c.path for c in repo.diff("HEAD~1").changed] == ["t1", "t2", "t0"]


@pytest.mark.parametrize(
    ("path", "rng"),
    [
        ("rng.torch", True), ("rng_state.pth.python", True), ("rng_state_3.pth.cpu", True),
        ("trainer.generator", True), ("model.rng_proj.weight", False), ("strong.w", False),
        ("model.w", False),
    ],
)  # fmt: skip
def test_rng_paths(path: str, rng: bool) -> None:
    assert is_rng_path(path) is rng


def test_tags_with_messages(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        repo.commit(state(0), message="first commit")
        repo.tag("light")
        repo.tag("v1", message="release one\n\nnotes")
        tag = repo.tag_object("v1")
        assert tag is not None and (tag.name, tag.message) == ("v1", "release one\n\nnotes")
        assert repo.tag_object("light") is None
        with pytest.raises(ckvc.RefNotFoundError):
            repo.tag_object("v2")
        commit_id = repo.resolve("HEAD")
    r = run(tmp_path, "tag", "-n")
    assert r.stdout.splitlines() == [
        f"light                {commit_id[:12]}  first commit",
        f"v1                   {commit_id[:12]}  release one",
    ]
    shown = run(tmp_path, "show", "v1", "--no-data").stdout.splitlines()
    assert shown[0] == "tag v1" and shown[4:7] == ["    release one", "", "    notes"]
    assert f"commit {commit_id}" in shown
    assert "3 blobs" in run(tmp_path, "show", "v1", "--no-data").stdout
    js = json.loads(run(tmp_path, "show", "v1", "--json").stdout)
    assert js["tag"]["message"] == "release one\n\nnotes" and js["id"] == commit_id and "tensors" in js
    assert "tensors" not in json.loads(run(tmp_path, "show", "light", "--no-data", "--json").stdout)


def test_checkout_then_commit_continues_from_rev_load_does_not(repo: ckvc.Repo) -> None:
    e0 = repo.commit(state(0), message="e0")
    e1 = repo.commit(state(1), message="e1")
    repo.load(e0)
    after_load = repo.commit(state(2), message="after load")
    assert repo.read_commit(after_load).parents == (e1,)  # load does not move HEAD
    repo.checkout(e0)
    resumed = repo.commit(state(3), message="resumed")
    assert repo.read_commit(resumed).parents == (e0,)  # as git: from the checked-out commit
    assert repo.head() == (None, resumed)  # detached; main is untouched
    assert repo.branches()["main"] == after_load
    repo.switch(e0, new_branch="retry")
    on_branch = repo.commit(state(4), message="on retry")
    assert repo.head() == ("retry", on_branch) and repo.read_commit(on_branch).parents == (e0,)


def test_export_prefix_writes_the_weights_alone(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        s = state(0)
        repo.commit(s, message="train state")
    out = tmp_path / "model.safetensors"
    r = run(tmp_path, "export", "HEAD", str(out), "--prefix", "model")
    assert r.exit_code == 0, r.output
    loaded = safetensors.torch.load_file(str(out))
    assert sorted(loaded) == ["b", "w"]
    assert torch.equal(loaded["w"], s["model"]["w"])  # type: ignore[index]


def test_metadata_takes_json_like_values(repo: ckvc.Repo) -> None:
    args = argparse.Namespace(lr=3e-4, epochs=3, name="run", tags=("a", "b"), amp=True, resume=None,
                              sched={"warmup": 100, "kind": "cosine"})  # fmt: skip
    cid = repo.commit(state(0), metadata=vars(args))
    got = repo.read_commit(cid).metadata
    assert got == {"amp": True, "epochs": 3, "lr": 3e-4, "name": "run", "resume": None,
                   "sched": {"kind": "cosine", "warmup": 100}, "tags": ["a", "b"]}  # fmt: skip
    assert type(got["epochs"]) is int and type(got["lr"]) is float
    with pytest.raises(ckvc.InvalidInputError, match=r"metadata\['p'\] is a PosixPath"):
        repo.commit(state(0), metadata={"p": Path("/x")})
    with pytest.raises(ckvc.InvalidInputError, match=r"metadata\['d'\] has a key 1 that is not a str"):
        repo.commit(state(0), metadata={"d": {1: "x"}})
    with pytest.raises(ckvc.InvalidInputError, match="does not fit in 64 bits"):
        repo.commit(state(0), metadata={"n": 1 << 70})


def test_metadata_with_an_unsorted_nested_map_is_refused_on_read() -> None:
    good = Commit("00" * 32, (), "a", 1, "m", metadata={"x": {"b": 1, "a": 2}})
    assert Commit.decode(good.encode()).metadata == {"x": {"a": 2, "b": 1}}
    raw = {"v": 1, "tree": bytes(32), "parents": [], "author": "a", "time": 1, "message": "m", "metrics": {},
           "metadata": {"x": {"b": 1, "a": 2}}, "pickled": False}  # fmt: skip
    with pytest.raises(ckvc.CorruptObjectError, match="bad field types"):
        Commit.decode(pack_canonical(raw))


def test_diff_compares_values_whatever_file_format_held_them(repo: ckvc.Repo, tmp_path: Path) -> None:
    """A .pt whose tensors are views of one storage, then a .safetensors of the same
    values but one: only that one is changed (the bytes decide, not how the file
    stored them), in text and in JSON (issue 32)."""
    big = torch.randn(1100, generator=torch.Generator().manual_seed(0))
    torch.save({"a": big[:1000], "b": big[1000:].view(10, 10)}, tmp_path / "m.pt")
    safetensors.torch.save_file(
        {"a": big[:1000].clone(), "b": big[1000:].view(10, 10) + 1}, str(tmp_path / "m.safetensors")
    )
    assert run(repo.path, "commit", str(tmp_path / "m.pt"), "-m", "pt").exit_code == 0
    assert run(repo.path, "commit", str(tmp_path / "m.safetensors"), "-m", "st").exit_code == 0
    d = repo.diff("HEAD~1", "HEAD")
    assert [c.path for c in d.changed] == ["b"] and d.unchanged == 1
    text = run(repo.path, "diff", "HEAD~1").output
    assert "~ b " in text and "~ a " not in text and "1 unchanged" in text
