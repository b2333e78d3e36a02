"""In-place loads: repo.load_into(rev, model=..., optimizer=..., scheduler=...)."""

from __future__ import annotations

import copy
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_state_equal, tensor_bytes

import ckvc
from ckvc import state as state_mod
from ckvc.restore import write_range

CHUNK = 4096  # small chunks: every parameter spans several


@pytest.fixture
def repo(make_repo: Callable[..., ckvc.Repo]) -> ckvc.Repo:
    return make_repo(chunk_size=CHUNK)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU())
        self.head = torch.nn.Linear(32, 50, bias=False)
        self.head.weight = torch.nn.Parameter(torch.empty(50, 32))
        # Non-contiguous parameters: written through staging, chunk edges inside rows.
        self.proj = torch.nn.Parameter(torch.empty(32, 24).t())
        self.odd = torch.nn.Parameter(torch.empty(30, 70).t())  # 3 chunks of 1024 elements, rows of 30

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.body(self.emb(idx))
        return self.head(h) + (h @ self.proj.t()).sum() + self.odd.square().mean()


def make_training(seed: int) -> tuple[Net, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():
        net.head.weight.normal_()
        net.proj.normal_()
        net.odd.normal_()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return net, opt, sched


def train_step(net: Net, opt: torch.optim.Optimizer, sched: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 50, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(idx), idx).backward()
    opt.step()
    sched.step()


def full_state(net: Net, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    return {"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "epoch": 1}


def test_load_into_is_bit_identical_to_load_state_dict_and_keeps_storage(repo: ckvc.Repo) -> None:
    net, opt, sched = make_training(0)
    for step in range(3):
        train_step(net, opt, sched, step)
    repo.commit(full_state(net, opt, sched))

    ours, our_opt, our_sched = make_training(1)
    ptrs = {k: v.data_ptr() for k, v in ours.state_dict().items()}
    seen: list[tuple[int, int]] = []
    result = repo.load_into(
        model=ours, optimizer=our_opt, scheduler=our_sched, progress=lambda d, t: seen.append((d, t))
    )
    assert result == ckvc.IncompatibleKeys([], [])
    assert {k: v.data_ptr() for k, v in ours.state_dict().items()} == ptrs
    assert not ours.proj.is_contiguous() and not ours.odd.is_contiguous()
    assert seen and seen[-1][0] == seen[-1][1] > 0

    ref, ref_opt, ref_sched = make_training(2)
    state = repo.load()
    ref.load_state_dict(state["model"])
    ref_opt.load_state_dict(state["optimizer"])
    ref_sched.load_state_dict(state["scheduler"])

    assert_state_equal(ours.state_dict(), ref.state_dict())
    assert_state_equal(ours.state_dict(), net.state_dict())
    assert_state_equal(our_opt.state_dict(), ref_opt.state_dict())
    assert our_sched.state_dict() == ref_sched.state_dict()
    idx = torch.arange(8)
    ours.eval(), ref.eval()
    assert tensor_bytes(ours(idx)) == tensor_bytes(ref(idx))
    ours.train(), ref.train()
    train_step(ours, our_opt, our_sched, 99)
    train_step(ref, ref_opt, ref_sched, 99)
    assert_state_equal(ours.state_dict(), ref.state_dict())
    assert_state_equal(our_opt.state_dict(), ref_opt.state_dict())


def test_load_into_makes_no_second_copy_of_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One worker thread: the warm-up below then warms the very thread the measured load
    # uses (with several, which pool thread decodes which chunk is up to scheduling, and
    # a cold one's first scratch buffers counted against the load).
    repo = ckvc.Repo.init(tmp_path, chunk_size=64 << 10, threads=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))  # 2 MiB of float32
    repo.commit({"model": model.state_dict()})
    target = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    allocations: list[int] = []
    original = state_mod.allocate_blob

    def counting(dtype: str, nbytes: int) -> Any:
        allocations.append(nbytes)
        return original(dtype, nbytes)

    repo.load_into(model=target)  # warm up: the codecs keep per-thread scratch buffers (a few MiB, any model size)
    monkeypatch.setattr(state_mod, "allocate_blob", counting)
    tracemalloc.start()
    try:
        repo.load_into(model=target)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert allocations == []
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert peak < model_bytes // 8, peak
    assert_state_equal(target.state_dict(), model.state_dict())
    repo.load(keys=["model.0.bias"])
    assert allocations == [512 * 4]  # the counter does see ordinary loads
    repo.close()


def test_load_into_strict_checks_everything_before_changing_anything(repo: ckvc.Repo) -> None:
    net, opt, sched = make_training(0)
    repo.commit(full_state(net, opt, sched))

    def snapshot(m: torch.nn.Module) -> dict[str, bytes]:
        return {k: tensor_bytes(v) for k, v in m.state_dict().items()}

    wider = torch.nn.Sequential(torch.nn.Linear(16, 33))
    other, other_opt, _ = make_training(1)
    before = snapshot(other)
    other.extra = torch.nn.Linear(2, 2)  # an unexpected key... for the model: a missing one
    with pytest.raises(ckvc.IncompatibleStateError) as info:
        repo.load_into(model=other, optimizer=other_opt)
    assert info.value.missing == ("extra.weight", "extra.bias") and info.value.unexpected == ()
    assert snapshot(other) == {**before, **{k: v for k, v in snapshot(other).items() if k.startswith("extra")}}

    # strict=False: loads what matches, returns the rest
    result = repo.load_into(model=other, strict=False)
    assert result.missing_keys == ["extra.weight", "extra.bias"] and result.unexpected_keys == []
    assert tensor_bytes(other.emb.weight) == tensor_bytes(net.emb.weight)

    # shape mismatch: raises even with strict=False, nothing changed
    bad, _, _ = make_training(3)
    bad.body[0] = torch.nn.Linear(16, 32, bias=False)
    bad.head.weight = torch.nn.Parameter(torch.zeros(50, 31))
    before = snapshot(bad)
    for strict in (True, False):
        with pytest.raises(ckvc.IncompatibleStateError, match=r"head\.weight: stored shape") as info:
            repo.load_into(model=bad, strict=strict)
        assert snapshot(bad) == before
    assert info.value.unexpected == ("body.0.bias",) and info.value.exit_code == 17

    # optimizer that does not fit: raised before the model changes
    fresh, _, _ = make_training(4)
    before = snapshot(fresh)
    with pytest.raises(ckvc.IncompatibleStateError, match="parameter group 0"):
        repo.load_into(model=fresh, optimizer=torch.optim.SGD(list(fresh.parameters())[:2], lr=0.1))
    assert snapshot(fresh) == before

    # dtype mismatch: strict refuses, non-strict casts (as load_state_dict would)
    double, _, _ = make_training(5)
    double.double()
    before = snapshot(double)
    with pytest.raises(ckvc.IncompatibleStateError, match="stored dtype float32"):
        repo.load_into(model=double)
    assert snapshot(double) == before
    repo.load_into(model=double, strict=False)
    ref = copy.deepcopy(double)
    ref.load_state_dict(net.state_dict())
    assert_state_equal(double.state_dict(), ref.state_dict())

    with pytest.raises(ckvc.UnknownKeyError):
        repo.load_into(model=wider, model_key="ema")
    with pytest.raises(ckvc.IncompatibleStateError):
        repo.load_into(model=wider, model_key="epoch")


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(40, 8)
        self.out = torch.nn.Linear(8, 40, bias=False)
        self.out.weight = self.emb.weight  # tied


def test_load_into_flat_state_tied_weights_and_key_paths(repo: ckvc.Repo) -> None:
    torch.manual_seed(0)
    lm = TiedLM()
    repo.commit(lm.state_dict())  # the whole state is the state_dict
    repo.commit({"runs": {"a": {"model": lm.state_dict()}}})
    for rev, key in (("HEAD~1", None), ("HEAD", "runs.a.model")):
        torch.manual_seed(1)
        target = TiedLM()
        ptr = target.emb.weight.data_ptr()
        repo.load_into(rev, model=target, model_key=key)
        assert target.out.weight is target.emb.weight and target.emb.weight.data_ptr() == ptr
        assert torch.equal(target.emb.weight, lm.emb.weight)


class Odd(torch.nn.Module):
    """Two parameters stored as views of one storage (one of them strided), and an extra state."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(30, 40))
        self.b = torch.nn.Parameter(torch.zeros(40, 30))
        self.extra: Any = None

    def get_extra_state(self) -> Any:
        return self.extra

    def set_extra_state(self, state: Any) -> None:
        self.extra = state


def test_load_into_strided_sources_and_extra_state(repo: ckvc.Repo) -> None:
    base = torch.randn(30, 40)
    extra = {"count": 3, "table": torch.arange(5)}
    repo.commit({"model": {"a": base, "b": base.t(), "_extra_state": extra}})  # a and b share one blob
    snapshot = repo.read_snapshot(repo.read_commit(repo.resolve("HEAD")))
    assert len(snapshot.blobs) == 2
    target = Odd()
    ptrs = (target.a.data_ptr(), target.b.data_ptr())
    repo.load_into(model=target)
    assert (target.a.data_ptr(), target.b.data_ptr()) == ptrs
    assert torch.equal(target.a, base) and torch.equal(target.b, base.t())
    assert target.extra["count"] == 3 and torch.equal(target.extra["table"], torch.arange(5))


def test_write_range_matches_a_flat_copy() -> None:
    g = torch.Generator().manual_seed(0)
    for shape, perm in (((5, 7, 3), (2, 0, 1)), ((6, 4), (1, 0)), ((9,), (0,)), ((), ()), ((4, 1, 5), (1, 2, 0))):
        base = torch.zeros(*[shape[i] for i in perm]) if shape else torch.zeros(())
        dst = base.permute(*[perm.index(i) for i in range(len(shape))]) if shape else base
        n = dst.numel()
        for _ in range(10):
            a = int(torch.randint(0, n + 1, (1,), generator=g))
            b = int(torch.randint(a, n + 1, (1,), generator=g))
            src = torch.randn(b - a, generator=g)
            want = dst.clone().reshape(-1)
            want[a:b] = src
            write_range(dst, a, b, src)
            assert torch.equal(dst.reshape(-1), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_into_cuda_model_through_staging(repo: ckvc.Repo) -> None:
    torch.manual_seed(0)
    source = torch.nn.Linear(64, 300)
    repo.commit({"model": source.state_dict()})
    target = torch.nn.Linear(64, 300).cuda()
    ptr = target.weight.data_ptr()
    repo.load_into(model=target)
    assert target.weight.data_ptr() == ptr
    assert torch.equal(target.weight.cpu(), source.weight) and torch.equal(target.bias.cpu(), source.bias)
