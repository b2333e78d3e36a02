"""Shared test helpers (plain functions; the fixtures are in conftest.py): compare
states by their raw bytes, never by values (so NaN payloads and -0.0 count), make
small states, run the CLI in this process."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from click.testing import CliRunner, Result

import ckvc
from ckvc.cli import cli
from ckvc.storage.backend import Backend, ForwardingBackend
from ckvc.storage.object_store import ObjectStore
from ckvc.storage.packs import pack_key

STRESS = os.environ.get("CKVC_STRESS") == "1" or os.environ.get("CKVC_SOAK") == "1"
"""The stress tier runs (``bash .ci/test --all`` sets CKVC_STRESS=1; CKVC_SOAK=1 implies it)."""
SOAK = os.environ.get("CKVC_SOAK") == "1"
"""The even longer soaks run: ``slow`` tests, and the stress tier's loops at their soak counts."""


def tier(default: object, stress: object, soak: object | None = None) -> list[Any]:
    """Parameters for a loop's count: ``default`` in the default tier, ``stress`` marked
    ``stress`` (and ``soak`` instead under CKVC_SOAK=1), e.g. ``@pytest.mark.parametrize("kills",
    tier(4, 50, 200))``: both run in the stress tier, the short one in every tier."""
    return [default, pytest.param(soak if SOAK and soak is not None else stress, marks=pytest.mark.stress)]


def run(repo_dir: Path, *args: str) -> Result:
    """``ckvc -C repo_dir ARGS...`` through click's CliRunner; exceptions propagate."""
    return CliRunner().invoke(cli, ["-C", str(repo_dir), *args], catch_exceptions=False)


def files_of(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path, but LMDB's lock file (it changes
    on every open; it is not repository content)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.endswith("lock.mdb")
    }


def random_state(seed: int, shape: tuple[int, ...] = (16, 16)) -> dict[str, Any]:
    """A small state: one float32 tensor of ``shape`` drawn from ``seed``, and the seed."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(*shape, generator=g), "step": seed}


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_state_equal(a: Any, b: Any, path: str = "") -> None:
    """``a`` and ``b`` have the same structure, types, tensor dtypes, shapes and bytes."""
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert tensor_bytes(a) == tensor_bytes(b), path
    elif type(a).__module__ == "numpy" and hasattr(a, "tobytes"):  # an ndarray (numpy's RNG state)
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_state_equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_equal(x, y, f"{path}.{i}")
    else:
        assert a == b, path


def describe_state(value: Any, path: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """A state flattened to ``path -> description`` that JSON can hold: tensors by
    dtype, shape and the BLAKE3 of their bytes, containers by type and keys, other
    values by type and repr (exact for ints, floats, str, bytes and torch types).
    Equal descriptions mean bit-identical states (tests/data/old_repository.json)."""
    out = {} if out is None else out
    if isinstance(value, torch.Tensor):
        out[path] = {
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "blake3": blake3.blake3(tensor_bytes(value)).hexdigest(),
        }
    elif isinstance(value, dict):
        out[path] = {"type": type(value).__name__, "keys": [repr(k) for k in value]}
        for key, item in value.items():
            describe_state(item, f"{path}/{key}", out)
    elif isinstance(value, (list, tuple)):
        out[path] = {"type": type(value).__name__, "len": len(value)}
        for i, item in enumerate(value):
            describe_state(item, f"{path}/{i}", out)
    else:
        out[path] = {"type": type(value).__name__, "repr": repr(value)}
    return out


class CountingBackend(ForwardingBackend):
    """Counts the read requests per key."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.reads: Counter[str] = Counter()

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self.reads[key] += 1
        self.inner.read_into(key, offset, out)

    def readv_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.reads[key] += 1
        self.inner.readv_into(key, offset, buffers)

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[int, memoryview]]:
        self.reads[key] += 1
        return self.inner.read_ranges(key, ranges)


def counted(store: ObjectStore) -> CountingBackend:
    counting = CountingBackend(store.backend)
    store.backend = counting
    store.reader.backend = counting
    return counting


def runs_of(store: ObjectStore, oids: list[bytes]) -> Counter[str]:
    """How many runs of back-to-back records ``oids`` make in each pack."""
    by_pack: dict[str, list[tuple[int, int]]] = {}
    for oid in set(oids):
        e = store.locate(oid)
        by_pack.setdefault(e.pack, []).append((e.offset, e.record_size))
    runs: Counter[str] = Counter()
    for pack, spans in by_pack.items():
        spans.sort()
        end = None
        for offset, size in spans:
            if offset != end:
                runs[pack_key(pack)] += 1
            end = offset + size
    return runs


def counting_reads(repo: ckvc.Repo) -> list[bytes]:
    """Every chunk id the store reads from now on (store.read_into,
    read_many_into and read_located_into wrapped: the read engine hands batches
    to the last two)."""
    seen: list[bytes] = []
    original = repo.store.read_into

    def read_into(oid: bytes, out: memoryview) -> None:
        seen.append(oid)
        original(oid, out)

    def read_many_into(items: Sequence[tuple[bytes, memoryview]]) -> None:
        for oid, out in items:
            read_into(oid, out)

    def read_located_into(items: Sequence[tuple[bytes, Any, memoryview]]) -> None:
        read_many_into([(oid, out) for oid, _entry, out in items])

    repo.store.read_into = read_into  # type: ignore[method-assign]
    repo.store.read_many_into = read_many_into  # type: ignore[method-assign]
    repo.store.read_located_into = read_located_into  # type: ignore[method-assign]
    return seen
