"""Per-tensor manifests (issue 28): a commit's, from chunk ids alone, equal to
ckvc.manifest_of for the live state, for every dtype; a one-element change shows;
the hash is the one docs/FORMAT.md specifies (a test vector)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch
from helpers import counting_reads, run

import ckvc
from ckvc.errors import InvalidInputError
from ckvc.state import TORCH_DTYPES

CHUNK = 4096


def every_dtype() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    state: dict[str, object] = {}
    for name, dtype in TORCH_DTYPES.items():
        raw = torch.randint(0, 256, (3000 * dtype.itemsize,), dtype=torch.uint8, generator=g)
        state[name] = raw.view(dtype)[:3000].reshape(30, 100)  # several chunks, whole-element bytes
    state["numpy"] = {"f8": np.arange(1000.0), "i2": np.arange(7, dtype=np.int16).reshape(7, 1)}
    state["empty"] = torch.zeros(0, 3)
    state["scalar"] = torch.tensor(2.5)
    shared = torch.arange(100.0)  # two views of one buffer: stored once, each read to hash
    state["tied"] = {"a": shared[10:60], "b": shared[50:90].reshape(4, 10)}
    state["not-a-tensor"] = {"epoch": 3}
    return state


def test_a_commit_manifest_equals_the_live_one_for_every_dtype_and_reads_nothing(tmp_path: Path) -> None:
    state = every_dtype()
    with ckvc.Repo.init(tmp_path, chunk_size=CHUNK) as repo:
        repo.commit(state, message="all dtypes")
        live = ckvc.manifest_of(state, chunk_size=CHUNK)
        reads = counting_reads(repo)
        stored = repo.manifest("HEAD")
        assert stored == live
        snapshot = repo.read_snapshot(repo.read_commit(repo.resolve("HEAD")))
        (tied,) = [b for b in snapshot.blobs if b.path == "tied.a"]
        assert reads and set(reads) == set(tied.chunks)  # every other hash comes from chunk ids
        assert [e.shape for e in stored if e.path.startswith("tied.")] == [(50,), (4, 10)]
        paths = [e.path for e in stored]
        assert set(TORCH_DTYPES) <= set(paths) and "numpy.f8" in paths and "not-a-tensor.epoch" not in paths
        assert {e.chunk_size for e in stored if e.dtype == "float32"} == {CHUNK}
        assert len({e.hash for e in stored}) == len(stored)


def test_one_changed_element_changes_only_its_tensor(tmp_path: Path) -> None:
    state = {"a": torch.randn(5000), "b": torch.randn(5000)}
    changed = {"a": state["a"].clone(), "b": state["b"]}
    changed["a"][4321] += 1
    with ckvc.Repo.init(tmp_path, chunk_size=CHUNK) as repo:
        one, two = repo.commit(state, message="1"), repo.commit(changed, message="2")
        a, b = repo.manifest(one), repo.manifest(two)
    assert a[0].hash != b[0].hash and a[1].hash == b[1].hash
    assert ckvc.manifest_of(changed, chunk_size=CHUNK) == b
    # same bytes, another dtype or shape: another hash
    assert ckvc.manifest_of({"a": state["a"].view(torch.int32)})[0].hash != ckvc.manifest_of({"a": state["a"]})[0].hash
    assert ckvc.manifest_of({"a": state["a"].reshape(50, 100)})[0].hash != ckvc.manifest_of({"a": state["a"]})[0].hash


def test_the_hash_is_the_one_format_md_specifies() -> None:
    """docs/FORMAT.md 13: float32 [0, 1, 2, 3], chunk size 8 (two chunks)."""
    (entry,) = ckvc.manifest_of({"w": torch.arange(4, dtype=torch.float32)}, chunk_size=8)
    data = struct.pack("<4f", 0, 1, 2, 3)
    chunk_ids = [blake3.blake3(b"ckvc-chunk\x00" + data[i : i + 8]).digest() for i in (0, 8)]
    by_hand = blake3.blake3(b"ckvc-manifest-v1\x00float32\x00" + struct.pack("<QQQ", 1, 4, 8) + b"".join(chunk_ids))
    assert entry.hash == by_hand.hexdigest() == "fdab47ac4188bb85aa3aaa85aa40e711c72a0984485a221662cea18af3da49ee"
    assert (entry.dtype, entry.shape, entry.nbytes, entry.chunk_size) == ("float32", (4,), 16, 8)


def test_cli_manifest_matches_the_api(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        repo.commit({"w": torch.randn(10), "b": torch.zeros(2, dtype=torch.int64)}, message="m")
        api = repo.manifest()
    result = run(tmp_path, "manifest", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tensors"] == [e.to_json() for e in api]
    text = run(tmp_path, "manifest").stdout.splitlines()
    assert [line.split()[:2] for line in text] == [[e.hash, e.path] for e in api]


def test_bad_arguments_are_typed_errors() -> None:
    with pytest.raises(InvalidInputError, match="chunk_size"):
        ckvc.manifest_of({"w": torch.zeros(2)}, chunk_size=0)
