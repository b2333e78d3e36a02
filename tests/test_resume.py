"""``ckvc.resume`` (issue 32): a plain training loop, stopped after some epochs and
restarted in a fresh process, continues bit-exact (dropout draws from the RNG, so
the RNG state must come back too), each chunk read once."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch
from helpers import assert_state_equal, counting_reads
from preloaded import run_script

import ckvc

EPOCHS = 6
STOP_AFTER = 3

# A loop whose every step draws from torch's RNG (dropout, the data): resumed
# without the RNG it would diverge at once.
LOOP = """
import json, random, sys
import numpy as np
import torch
import ckvc

repo_dir, out, stop = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0); random.seed(0); np.random.seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
with ckvc.Repo.open(repo_dir) as repo:
    start = 0
    if repo.head()[1] is not None:  # a restart: everything back in one call
        rest = ckvc.resume(repo, model=model, optimizer=opt, scheduler=sched)
        start = rest["epoch"] + 1
    losses = []
    for epoch in range(start, EPOCHS):
        x = torch.randn(32, 8)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad(); loss.backward(); opt.step(); sched.step()
        losses.append(loss.item())
        repo.commit({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                     "rng": ckvc.rng_state(), "epoch": epoch}, message=f"epoch {epoch}")
        if epoch + 1 == stop:
            break
json.dump({"losses": losses, "weights": [p.detach().double().sum().item() for p in model.parameters()]},
          open(out, "w"))
""".replace("EPOCHS", str(EPOCHS))


def _run(tmp_path: Path, name: str, stop: int) -> dict[str, list[float]]:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    out = tmp_path / f"{name}.json"
    done = run_script(script, [str(tmp_path / name), str(out), str(stop)])
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, list[float]] = json.loads(out.read_text())
    return result


def test_a_fresh_process_resumes_bit_exact_with_one_call(tmp_path: Path) -> None:
    ckvc.Repo.init(tmp_path / "whole").close()
    ckvc.Repo.init(tmp_path / "split").close()
    whole = _run(tmp_path, "whole", EPOCHS)
    first = _run(tmp_path, "split", STOP_AFTER)
    second = _run(tmp_path, "split", EPOCHS)  # a new process: ckvc.resume, then the remaining epochs
    assert first["losses"] + second["losses"] == whole["losses"]  # floats compared exactly
    assert second["weights"] == whole["weights"]
    with ckvc.Repo.open(tmp_path / "whole") as a, ckvc.Repo.open(tmp_path / "split") as b:
        assert_state_equal(a.load("HEAD"), b.load("HEAD"))


def test_resume_reads_each_chunk_once_and_returns_the_rest(repo: ckvc.Repo) -> None:
    torch.manual_seed(1)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    saved_rng = ckvc.rng_state()
    repo.commit({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": saved_rng, "epoch": 7})
    expected = torch.rand(5)  # what the RNG gives right after the save
    fresh = torch.nn.Linear(64, 64)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(99)
    reads = counting_reads(repo)
    rest = ckvc.resume(repo, model=fresh, optimizer=fresh_opt)
    assert len(reads) == len(set(reads)) > 0  # each chunk once
    assert torch.equal(torch.rand(5), expected)  # the RNG is back where it was saved
    assert rest["epoch"] == 7 and set(rest) == {"rng", "epoch"}
    assert_state_equal(fresh.state_dict(), model.state_dict())
    assert_state_equal(fresh_opt.state_dict()["state"], opt.state_dict()["state"])
    no_rng = repo.commit({"model": model.state_dict(), "step": 3})
    assert ckvc.resume(repo, no_rng, model=fresh) == {"step": 3}  # no RNG saved: nothing to restore


def test_load_into_with_rng_restores_it_reading_each_chunk_once(repo: ckvc.Repo) -> None:
    torch.manual_seed(2)
    model = torch.nn.Linear(32, 32)
    saved_rng = ckvc.rng_state()
    repo.commit({"model": model.state_dict(), "rng": saved_rng, "epoch": 1})
    expected = torch.rand(4)
    fresh = torch.nn.Linear(32, 32)
    torch.manual_seed(123)
    reads = counting_reads(repo)
    repo.load_into(model=fresh, rng=True)
    assert len(reads) == len(set(reads)) > 0
    assert torch.equal(torch.rand(4), expected)
    assert_state_equal(fresh.state_dict(), model.state_dict())

    # without rng=True the RNG is left alone
    torch.manual_seed(123)
    after_seed = torch.rand(4)
    torch.manual_seed(123)
    repo.load_into(model=fresh)
    assert torch.equal(torch.rand(4), after_seed)

    # asked for explicitly, a missing RNG is an error before anything changes
    bare = repo.commit({"model": {k: v + 1 for k, v in model.state_dict().items()}})
    before = collections.OrderedDict((k, v.clone()) for k, v in fresh.state_dict().items())
    with pytest.raises(ckvc.UnknownKeyError, match="'rng'"):
        repo.load_into(bare, model=fresh, rng=True)
    assert_state_equal(fresh.state_dict(), before)


def test_subtree_and_subtree_keys_return_nested_values(repo: ckvc.Repo) -> None:
    rng = ckvc.rng_state()
    enc = {"w": torch.randn(8, 8), "b": torch.randn(8)}
    head_weight = torch.randn(3, 8)
    state = {"model": {"enc": enc, "head": head_weight}, "rng": rng, "epoch": 4}
    commit = repo.commit(state)
    reads = counting_reads(repo)
    assert_state_equal(repo.load(commit, subtree="rng"), rng)
    assert_state_equal(repo.load(commit, subtree="model.enc"), enc)
    assert repo.load(commit, subtree="epoch") == 4
    got = repo.load(commit, keys=["rng", "model.head"])
    assert set(got) == {"rng", "model.head"}
    assert_state_equal(got["rng"], rng)
    assert torch.equal(got["model.head"], head_weight)
    # set_rng_state takes the nested value as it is
    ckvc.set_rng_state(repo.load(commit, subtree="rng"))
    assert len(reads) > 0
    enc_reads = counting_reads(repo)
    repo.load(commit, subtree="model.enc")
    head = {
        c
        for blob in repo.read_snapshot(repo.read_commit(commit)).blobs
        if blob.path == "model.head"
        for c in blob.chunks
    }
    assert enc_reads and not set(enc_reads) & head  # only the subtree's chunks are read
    for bad in ("nope", "model.enc.x"):
        with pytest.raises(ckvc.UnknownKeyError):
            repo.load(commit, subtree=bad)
    with pytest.raises(ckvc.InvalidInputError):
        repo.load(commit, subtree="rng", keys=["epoch"])


def test_a_resume_at_another_world_size_is_refused_naming_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run a commit comes from (issue 28): recorded under "ckvc.run" when there is
    a run (torchrun's WORLD_SIZE and run id here), checked by load_into and resume."""
    import torch

    from ckvc.errors import RunMismatchError

    model = torch.nn.Linear(3, 2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-17")
    with ckvc.Repo.init(tmp_path) as repo:
        cid = repo.commit({"model": model.state_dict(), "step": 3}, message="at 4")
        assert repo.read_commit(cid).metadata["ckvc.run"] == {"id": "job-17", "world_size": 4, "step": 3}
        monkeypatch.setenv("WORLD_SIZE", "2")
        target = torch.nn.Linear(3, 2)
        before = [p.detach().clone() for p in target.parameters()]
        for resume in (lambda: repo.load_into(cid, model=target), lambda: ckvc.resume(repo, cid, model=target)):
            with pytest.raises(
                RunMismatchError, match=r"made at world size 4 \(run job-17\); this process runs at world size 2"
            ):
                resume()
            assert all(torch.equal(a, b) for a, b in zip(before, target.parameters(), strict=True))  # untouched
        repo.load_into(cid, model=target, check_run=False)
        assert torch.equal(target.weight, model.weight)
        monkeypatch.setenv("WORLD_SIZE", "4")
        assert ckvc.resume(repo, cid, model=target) == {"step": 3}
        monkeypatch.delenv("WORLD_SIZE")  # a process outside any run: nothing to compare
        repo.load_into(cid, model=target)
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
        plain = repo.commit({"model": model.state_dict()}, message="no run")
        assert "ckvc.run" not in repo.read_commit(plain).metadata


def test_a_resume_on_another_device_mesh_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mesh shape (ckvc.set_mesh, or $CKVC_MESH) is recorded with the run and a
    resume on another shape of the same world size is refused, naming both."""
    from types import SimpleNamespace

    import torch

    from ckvc.errors import InvalidInputError, RunMismatchError

    model = torch.nn.Linear(3, 2)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with ckvc.Repo.init(tmp_path) as repo:
        try:
            ckvc.set_mesh({"dp": 2, "tp": 4})
            cid = repo.commit({"model": model.state_dict()}, message="2x4")
            assert repo.read_commit(cid).metadata["ckvc.run"] == {"world_size": 8, "mesh": "dp=2,tp=4"}
            ckvc.set_mesh("dp=4,tp=2")
            with pytest.raises(RunMismatchError, match=r"made on device mesh dp=2,tp=4; this process's mesh is dp=4"):
                repo.load_into(cid, model=torch.nn.Linear(3, 2))
            ckvc.set_mesh(None)
            monkeypatch.setenv("CKVC_MESH", "dp=2,tp=4")
            repo.load_into(cid, model=torch.nn.Linear(3, 2))
            monkeypatch.delenv("CKVC_MESH")
            # what set_mesh reads of a DeviceMesh (which needs a process group to exist)
            ckvc.set_mesh(SimpleNamespace(mesh=torch.arange(8).reshape(2, 4), mesh_dim_names=("dp", "tp")))
            repo.load_into(cid, model=torch.nn.Linear(3, 2))
            for bad in ("dp=0", "tp", {"dp": "x"}, 3):
                with pytest.raises(InvalidInputError, match="mesh"):
                    ckvc.set_mesh(bad)
        finally:
            ckvc.set_mesh(None)
