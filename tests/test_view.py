"""Lazy views (repo.view / repo.open) and partial loads (load(keys=, prefix=))."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_state_equal, counting_reads, tensor_bytes

import ckvc
from ckvc import state as state_mod
from ckvc.retention import RetentionPolicy
from ckvc.state import flatten

CHUNK = 4096  # small chunks: every test tensor spans several


def tt(value: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A view's value, known to be a torch tensor."""
    assert isinstance(value, torch.Tensor)
    return value


def blob_chunks(repo: ckvc.Repo, path: str, rev: str = "HEAD") -> tuple[bytes, ...]:
    snapshot = repo.read_snapshot(repo.read_commit(repo.resolve(rev)))
    info = state_mod.describe_state(snapshot.tree)[path]
    return snapshot.blobs[info.blob].chunks


def rich_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(4096, generator=g)  # 16 KiB: 4 chunks
    emb = torch.nn.Parameter(torch.randn(64, 32, generator=g))
    return {
        "model": {
            "emb.weight": emb,
            "head.weight": emb,  # tied
            "bias": torch.randn(32, generator=g).to(torch.bfloat16),
            "mask": torch.rand(100, generator=g) > 0.5,
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.empty(0, 7),
            "frozen": torch.nn.Parameter(torch.randn(3, 3, generator=g), requires_grad=False),
        },
        "halves": {"lo": big[:2048], "hi": big[2048:]},  # two views of one storage: one blob
        "every_other": big[::2],
        "optimizer": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(64, 32, generator=g)}}},
        "np": np.arange(12, dtype=np.int16).reshape(3, 4),
        "epoch": 3,
        "lr": 0.1,
        "betas": (0.9, 0.999),
        "name": "run",
    }


@pytest.fixture
def repo(make_repo: Callable[..., ckvc.Repo]) -> ckvc.Repo:
    return make_repo(chunk_size=CHUNK)


# ---- lazy view ---------------------------------------------------------------


def test_view_keys_read_no_chunks_and_a_tensor_reads_only_its_own(repo: ckvc.Repo) -> None:
    state = rich_state()
    repo.commit(state)
    reads = counting_reads(repo)
    view = repo.view("HEAD")
    paths = list(view)
    assert len(view) == len(paths) and set(view.keys()) == set(paths)
    assert "model.emb.weight" in view and "epoch" not in view and "nope" not in view
    assert "optimizer.state.0.exp_avg" in paths
    assert view.info("model.bias").dtype == "bfloat16"
    assert reads == []  # only the snapshot so far

    weight = tt(view["model.emb.weight"])
    assert sorted(reads) == sorted(blob_chunks(repo, "model.emb.weight"))
    assert len(reads) == 2  # 8 KiB of float32
    assert torch.equal(weight, state["model"]["emb.weight"])

    # A view of a shared storage reads only the chunks under it.
    reads.clear()
    hi = tt(view["halves.hi"])
    assert torch.equal(hi, state["halves"]["hi"])
    shared = blob_chunks(repo, "halves.hi")
    assert len(shared) == 4 and sorted(reads) == sorted(shared[2:])


def test_view_values_match_a_full_load(repo: ckvc.Repo) -> None:
    state = rich_state()
    repo.commit(state)
    full = flatten(repo.load())
    view = repo.open()  # instance open = view of HEAD
    assert isinstance(view, ckvc.CommitView)
    assert set(view) | set(view.non_tensors) == set(full)
    for path in view:
        got: Any = view[path]
        want = full[path]
        assert type(got) is type(want), path
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
        else:
            assert (got.dtype, got.shape, got.requires_grad) == (want.dtype, want.shape, want.requires_grad), path
            assert tensor_bytes(got) == tensor_bytes(want), path
    assert view.non_tensors == {p: v for p, v in full.items() if not isinstance(v, (torch.Tensor, np.ndarray))}
    assert view.commit.id == repo.resolve("HEAD")
    info = view.info("model.emb.weight")
    assert (info.dtype, info.shape, info.nbytes, info.kind) == ("float32", (64, 32), 64 * 32 * 4, "parameter")
    assert repr(view).startswith(f"<CommitView {view.commit.id[:12]}")


def test_view_unknown_paths_raise_keyerror(repo: ckvc.Repo) -> None:
    repo.commit(rich_state())
    view = repo.view()
    for path in ("nope", "epoch", "model"):
        with pytest.raises(KeyError) as info:
            view[path]
        assert isinstance(info.value, ckvc.UnknownKeyError)
    with pytest.raises(ckvc.UnknownKeyError, match=r"subtree: use prefix='model\.'"):
        view["model"]
    with pytest.raises(ckvc.UnknownKeyError, match="not a tensor"):
        view.info("epoch")
    assert view.get("nope") is None


def test_view_follows_map_location_and_reports_progress(repo: ckvc.Repo) -> None:
    repo.commit(rich_state())
    calls: list[tuple[str, tuple[int, int]]] = []

    def to_cpu(storage: Any, location: str) -> Any:
        calls.append((location, (0, 0)))
        return storage

    seen: list[tuple[int, int]] = []
    view = repo.view("HEAD", map_location=to_cpu, progress=lambda d, t: seen.append((d, t)))
    view["model.emb.weight"]
    assert calls and calls[0][0] == "cpu"
    assert seen[-1] == (8192, 8192) and len(seen) == 2
    assert tt(repo.view(map_location="cpu")["halves.lo"]).device.type == "cpu"


def test_view_refuses_pruned_and_pickled_commits_like_load(repo: ckvc.Repo) -> None:
    old = repo.commit({"w": torch.ones(3)})
    repo.commit({"w": torch.zeros(3)})
    repo.retain(RetentionPolicy(keep_last=1))
    with pytest.raises(ckvc.PrunedCommitError):
        repo.view(old)
    with pytest.raises(ckvc.PrunedCommitError):
        repo.load(old, keys=["w"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pickled = repo.commit({"w": torch.ones(2), "odd": {1, 2}}, allow_pickle=True)
    with pytest.raises(ckvc.UnsafeContentError):
        repo.view(pickled)
    with pytest.raises(ckvc.UnsafeContentError):
        repo.load(pickled, keys=["w"])
    view = repo.view(pickled, allow_pickle=True)
    assert view.non_tensors == {"odd": {1, 2}} and torch.equal(tt(view["w"]), torch.ones(2))


def test_open_on_the_class_opens_a_repository_on_an_instance_a_commit(repo: ckvc.Repo) -> None:
    first = repo.commit({"w": torch.ones(3)})
    repo.commit({"w": torch.zeros(3)})
    (repo.path / "sub").mkdir()
    with ckvc.Repo.open(repo.path / "sub") as again:  # found from a subdirectory, like git
        assert isinstance(again, ckvc.Repo) and again.resolve("HEAD") == repo.resolve("HEAD")
        assert torch.equal(tt(again.open(first)["w"]), torch.ones(3))
        assert torch.equal(tt(again.open()["w"]), torch.zeros(3))

    class MyRepo(ckvc.Repo):
        pass

    with MyRepo.open(repo.path, threads=1) as mine:
        assert type(mine) is MyRepo and mine.threads == 1
        assert isinstance(mine.open("HEAD~1"), ckvc.CommitView)
    with pytest.raises(ckvc.NotARepositoryError):
        ckvc.Repo.open("/")


# ---- partial load ------------------------------------------------------------


def test_load_keys_and_prefix_read_only_what_they_need(repo: ckvc.Repo) -> None:
    state = rich_state()
    repo.commit(state)
    reads = counting_reads(repo)
    out = repo.load(keys=["model.emb.weight", "epoch", "betas.1"])
    assert list(out) == ["model.emb.weight", "epoch", "betas.1"]
    assert out["epoch"] == 3 and out["betas.1"] == 0.999
    assert torch.equal(out["model.emb.weight"], state["model"]["emb.weight"])
    assert sorted(reads) == sorted(blob_chunks(repo, "model.emb.weight"))

    reads.clear()
    model = repo.load(prefix="model.")
    assert list(model) == [f"model.{k}" for k in state["model"]]
    for key, want in state["model"].items():
        assert tensor_bytes(model[f"model.{key}"]) == tensor_bytes(want)
    assert model["model.emb.weight"] is model["model.head.weight"]  # tied: one tensor, as load gives
    wanted = {c for k in state["model"] for c in blob_chunks(repo, f"model.{k}")}
    assert set(reads) == wanted and len(reads) == len(wanted)  # each chunk read once

    both = repo.load(keys=["halves.lo"], prefix="halves.")  # a union, in stored order
    assert list(both) == ["halves.lo", "halves.hi"]
    assert both["halves.lo"].untyped_storage().data_ptr() == both["halves.hi"].untyped_storage().data_ptr()


def test_load_unknown_key_is_a_typed_keyerror_and_changes_nothing(repo: ckvc.Repo) -> None:
    repo.commit(rich_state())
    head = repo.head()
    packs = sorted(os.listdir(repo.dir / "packs"))
    for kwargs in ({"keys": ["model.emb.weight", "model.nope"]}, {"prefix": "modle."}, {"keys": ["mod"]}):
        with pytest.raises(KeyError) as info:
            repo.load(**kwargs)
        err = info.value
        assert isinstance(err, ckvc.UnknownKeyError) and isinstance(err, ckvc.InvalidInputError)
        assert err.exit_code == 16
    with pytest.raises(ckvc.UnknownKeyError) as info:
        repo.load(keys=["a", "model.bias", "b"])
    assert info.value.keys == ("a", "b") and "'a', 'b'" in str(info.value)
    with pytest.raises(ckvc.InvalidInputError, match="keys=\\[path\\]"):
        repo.load(keys="epoch")
    assert repo.head() == head and sorted(os.listdir(repo.dir / "packs")) == packs
    assert repo.load(keys=[]) == {}
    # a key naming a subtree (no leaf itself) gives its nested value
    assert_state_equal(repo.load(keys=["model"])["model"], repo.load()["model"])
