"""The read engine (ckvc.read): reads planned per pack in offset order, handed to
the store in batches, decoded byte-exact into their destinations by load, views
and load_into alike, and errors that name the commit and the tensor."""

from __future__ import annotations

import collections
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_state_equal, tensor_bytes

import ckvc
from ckvc import read
from ckvc.errors import CorruptObjectError, ObjectNotFoundError
from ckvc.objects import Snapshot
from ckvc.state import flatten
from ckvc.storage.packs import RECORD_HEADER_SIZE

CHUNK = 4096
LAYERS = 100  # two tensors each: 200 model tensors


def make_model(seed: int) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    # Widths 8..56: biases of one small chunk, weights of one to four chunks.
    return torch.nn.ModuleList(torch.nn.Linear(8 + (i % 7) * 8, 8 + (i % 7) * 8) for i in range(LAYERS))


def layers(model: torch.nn.ModuleList) -> list[torch.nn.Linear]:
    return [m for m in model if isinstance(m, torch.nn.Linear)]


def train_step(model: torch.nn.ModuleList, opt: torch.optim.Optimizer) -> None:
    loss = sum(layer(torch.ones(layer.in_features)).square().sum() for layer in layers(model))
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    opt.step()


@dataclass
class Setup:
    root: Path
    a: str  # the 200-tensor model, its Adam state and extras
    b: str  # child of a: the even layers changed, so its chunks lie in two packs
    state_a: dict[str, Any]
    state_b: dict[str, Any]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("read-engine")
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_step(model, opt)
    weight0 = layers(model)[0].weight.detach()
    extras = {
        "bf16": torch.randn(3000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
        "np": np.arange(2500, dtype=np.int64),
        "tied": weight0,  # shares the model's storage: one blob
        "column": weight0[:, 1],  # a strided view of it
    }
    state_a = {"model": model.state_dict(), "optimizer": opt.state_dict(), "extra": extras, "epoch": 1}
    with ckvc.Repo.init(root, chunk_size=CHUNK, codec={"name": "raw"}, keyframe_interval=1) as repo:
        a = repo.commit(state_a, message="a")
        expected_a = clone(state_a)
        with torch.no_grad():
            for layer in layers(model)[::2]:
                layer.weight.add_(1.0)
        state_b = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 2}
        b = repo.commit(state_b, message="b")
    return Setup(root, a, b, expected_a, clone(state_b))


def clone(state: Any) -> Any:
    """A deep copy that keeps the storage sharing inside ``state`` apart from the live model."""
    return torch.utils._pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)


def assert_same(a: Any, b: Any) -> None:
    """assert_state_equal, numpy arrays compared by dtype, shape and bytes."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert list(a) == list(b)
        arrays = [k for k in a if isinstance(a[k], np.ndarray)]
        for key in arrays:
            assert type(b[key]) is np.ndarray and (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape)
            assert a[key].tobytes() == b[key].tobytes(), key
        for key in a:
            if key not in arrays:
                assert_same(a[key], b[key])
        return
    assert_state_equal(a, b)


def chunk_reads(snapshot: Snapshot, commit: Any) -> list[read.ChunkRead]:
    return [
        read.ChunkRead(blob, oid, end - start)
        for blob in snapshot.blobs
        for oid, (start, end) in zip(blob.chunks, read.blob_spans(blob, commit), strict=True)
    ]


def test_plan_groups_reads_per_pack_sorted_by_offset(setup: Setup) -> None:
    with ckvc.Repo.open(setup.root) as repo:
        commit = repo.read_commit(setup.b)
        snapshot = repo.read_snapshot(commit)
        reads = chunk_reads(snapshot, commit)
        random.Random(0).shuffle(reads)
        missing = read.ChunkRead(snapshot.blobs[0], bytes(32), 1)  # no such object
        groups = read.plan(repo.store, [*reads, missing])

        assert groups[-1].pack is None and groups[-1].reads == [missing]
        groups = groups[:-1]
        packs = [g.pack for g in groups]
        where = {r.oid: repo.store.index.location(r.oid) for r in reads}
        assert len(set(packs)) == len(packs) == len({loc[0] for loc in where.values() if loc}) >= 2
        for group in groups:
            locations = [where[r.oid] for r in group.reads]
            assert {loc[0] for loc in locations if loc} == {group.pack}
            offsets = [loc[1] for loc in locations if loc]
            assert offsets == sorted(offsets)
        # Every read planned exactly once, none lost or doubled.
        planned = [id(r) for g in groups for r in g.reads]
        assert sorted(planned) == sorted(id(r) for r in reads)


def spy_store(repo: ckvc.Repo) -> list[list[bytes]]:
    """Each store read call from now on, as the chunk ids it was given."""
    calls: list[list[bytes]] = []
    read_into = repo.store.read_into

    def one(oid: bytes, out: memoryview) -> None:
        calls.append([oid])
        read_into(oid, out)

    def many(items: Sequence[tuple[bytes, memoryview]]) -> None:
        calls.append([oid for oid, _ in items])
        for oid, out in items:
            read_into(oid, out)

    def located(items: Sequence[tuple[bytes, Any, memoryview]]) -> None:
        many([(oid, out) for oid, _entry, out in items])

    repo.store.read_into = one  # type: ignore[method-assign]
    repo.store.read_many_into = many  # type: ignore[method-assign]
    repo.store.read_located_into = located  # type: ignore[method-assign]
    return calls


def test_the_store_gets_batches_in_pack_order(setup: Setup) -> None:
    with ckvc.Repo.open(setup.root, threads=1) as repo:  # serial: calls in plan order
        snapshot = repo.read_snapshot(repo.read_commit(setup.b))
        calls = spy_store(repo)
        loaded = repo.load(setup.b)
    assert_state_equal(loaded, setup.state_b)
    wanted = collections.Counter(oid for blob in snapshot.blobs for oid in blob.chunks)
    got = [oid for call in calls for oid in call]
    assert collections.Counter(got) == wanted
    assert max(len(call) for call in calls) > 1  # small chunks reach the store together
    with ckvc.Repo.open(setup.root) as repo:
        locations = [repo.store.index.location(oid) for oid in got]
    assert all(loc is not None for loc in locations)
    runs = [loc[0] for i, loc in enumerate(locations) if loc and (i == 0 or locations[i - 1][0] != loc[0])]  # type: ignore[index]
    assert len(runs) == len(set(runs)) >= 2  # one run per pack
    for pack in runs:
        offsets = [loc[1] for loc in locations if loc and loc[0] == pack]
        assert offsets == sorted(offsets)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_load_looks_each_chunk_up_in_the_index_once(setup: Setup, threads: int) -> None:
    with ckvc.Repo.open(setup.root, threads=threads) as repo:
        snapshot = repo.read_snapshot(repo.read_commit(setup.b))
        index = repo.store.index
        looked_up: collections.Counter[bytes] = collections.Counter()
        real_get, real_get_many = index.get, index.get_many

        def get(oid: bytes) -> Any:
            looked_up[oid] += 1
            return real_get(oid)

        def get_many(oids: Any) -> Any:
            oids = list(oids)
            looked_up.update(oids)
            return real_get_many(oids)

        index.get, index.get_many = get, get_many  # type: ignore[method-assign]
        loaded = repo.load(setup.b)
    assert_state_equal(loaded, setup.state_b)
    chunks = {oid for blob in snapshot.blobs for oid in blob.chunks}
    uses = collections.Counter(oid for blob in snapshot.blobs for oid in blob.chunks)
    assert {oid: looked_up[oid] for oid in chunks} == {oid: uses[oid] for oid in chunks}


@pytest.mark.parametrize("threads", [1, 4])
def test_load_view_and_load_into_are_byte_exact(setup: Setup, threads: int) -> None:
    with ckvc.Repo.open(setup.root, threads=threads) as repo:
        loaded = repo.load(setup.a)
        assert_same(loaded, setup.state_a)
        extra = loaded["extra"]
        assert extra["tied"].untyped_storage().data_ptr() == loaded["model"]["0.weight"].untyped_storage().data_ptr()
        assert extra["column"].untyped_storage().data_ptr() == extra["tied"].untyped_storage().data_ptr()

        view = repo.view(setup.a)
        flat = flatten(setup.state_a)
        tensors = [p for p in flat if isinstance(flat[p], (torch.Tensor, np.ndarray))]
        assert len([p for p in tensors if p.startswith("model.")]) == 2 * LAYERS
        assert sorted(view) == sorted(tensors)
        for path in tensors:
            got, want = view[path], flat[path]
            if isinstance(want, np.ndarray):
                assert isinstance(got, np.ndarray) and got.dtype == want.dtype
                assert got.tobytes() == want.tobytes(), path
            else:
                assert isinstance(got, torch.Tensor)
                assert (got.dtype, got.shape) == (want.dtype, want.shape), path
                assert tensor_bytes(got) == tensor_bytes(want), path
        part = repo.load(setup.a, prefix="model.")
        assert list(part) == [p for p in flat if p.startswith("model.")]
        for path, value in part.items():
            assert tensor_bytes(value) == tensor_bytes(flat[path]), path

        model = make_model(1)  # other values, same shapes
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        train_step(model, opt)
        pointers = [p.data_ptr() for p in model.parameters()]
        done: list[tuple[int, int]] = []
        result = repo.load_into(setup.a, model=model, optimizer=opt, progress=lambda d, t: done.append((d, t)))
        assert result == ckvc.IncompatibleKeys([], [])
        assert [p.data_ptr() for p in model.parameters()] == pointers  # written in place
        assert_state_equal(model.state_dict(), setup.state_a["model"])
        assert_state_equal(opt.state_dict(), setup.state_a["optimizer"])
        assert done and done[-1][0] == done[-1][1] > 0


def damage(root: Path, oid: bytes) -> None:
    """Flip a byte inside ``oid``'s stored record (raw codec: its plain bytes)."""
    with ckvc.Repo.open(root) as repo:
        location = repo.store.index.location(oid)
        assert location is not None
        path = repo.dir / "packs" / location[0]
    with open(path, "r+b") as f:
        f.seek(location[1] + RECORD_HEADER_SIZE + 16)
        old = f.read(1)
        f.seek(location[1] + RECORD_HEADER_SIZE + 16)
        f.write(bytes([old[0] ^ 0xFF]))


def test_errors_name_the_commit_and_the_tensor(setup: Setup, tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(setup.root, root)
    victim = "model.50.bias"  # one small chunk, batched with its neighbours
    with ckvc.Repo.open(root) as repo:
        snapshot = repo.read_snapshot(repo.read_commit(setup.a))
    (blob,) = [b for b in snapshot.blobs if b.path == victim]
    (oid,) = blob.chunks
    damage(root, oid)

    with ckvc.Repo.open(root) as repo:
        attempts = [
            lambda: repo.load(setup.a),
            lambda: repo.load(setup.a, prefix="model."),
            lambda: repo.view(setup.a)[victim],
            lambda: repo.load_into(setup.a, model=make_model(2), optimizer=None),
        ]
        for attempt in attempts:
            with pytest.raises(CorruptObjectError) as info:
                attempt()
            assert (info.value.tensor, info.value.commit) == (victim, setup.a)
            assert f"tensor {victim!r}" in str(info.value)
        # What does not need the damaged chunk still loads.
        kept = repo.view(setup.a)["model.50.weight"]
        assert isinstance(kept, torch.Tensor)
        assert tensor_bytes(kept) == tensor_bytes(setup.state_a["model"]["50.weight"])


def test_a_lost_pack_is_named_with_commit_and_tensor(setup: Setup, tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(setup.root, root)
    with ckvc.Repo.open(root) as repo:
        snapshot = repo.read_snapshot(repo.read_commit(setup.b))
        kept = next(b for b in snapshot.blobs if b.path == "model.1.weight")  # unchanged since a
        location = repo.store.index.location(kept.chunks[0])
        assert location is not None
        assert location[0] != repo.store.index.location(bytes.fromhex(setup.b))[0]  # type: ignore[index]
        (repo.dir / "packs" / location[0]).unlink()  # a's pack
    with ckvc.Repo.open(root) as repo, pytest.raises(ObjectNotFoundError) as info:
        repo.load(setup.b)
    message = str(info.value)
    assert f"commit {setup.b}" in message
    assert "(tensor 'model." in message
