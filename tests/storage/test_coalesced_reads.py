"""ObjectStore.read_many_into: one backend request per run of adjacent records
per pack, the same bytes as one read_into per chunk, and read_into's errors."""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import counted, runs_of

import ckvc
from ckvc.codecs import DELTA, RAW, RawCodec, ZstdCodec
from ckvc.errors import CorruptObjectError, ObjectNotFoundError
from ckvc.ids import ObjectType
from ckvc.storage.memory import MemoryBackend
from ckvc.storage.object_store import ObjectStore
from ckvc.storage.packs import RECORD_HEADER_SIZE, pack_key


def destinations(store: ObjectStore, oids: list[bytes]) -> list[tuple[bytes, memoryview]]:
    return [(oid, np.empty(store.stat(oid).raw_size, dtype=np.uint8).data) for oid in oids]


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    s = ObjectStore(tmp_path) if request.param == "local" else ObjectStore(MemoryBackend())
    yield s
    s.close()


def write_chunks(store: ObjectStore, n: int = 200) -> tuple[list[bytes], dict[bytes, bytes]]:
    rng = random.Random(7)
    blobs = []
    for i in range(n):  # random (stored raw), compressible (zstd), and empty chunks
        size = rng.randrange(1, 5000)
        blobs.append(os.urandom(size) if i % 3 else bytes([i % 7]) * size)
    blobs.append(b"")
    with store.writer(ZstdCodec(1)) as w:
        ids = [w.put(ObjectType.CHUNK, b) for b in blobs]
        w.commit()
    return ids, dict(zip(ids, blobs, strict=True))


def test_one_request_per_run_and_the_same_bytes(store: ObjectStore) -> None:
    ids, plain = write_chunks(store)
    assert {store.stat(i).codec for i in ids} >= {RAW, ZstdCodec.codec_id}
    counting = counted(store)
    shuffled = random.Random(3).sample(ids, len(ids))
    items = destinations(store, shuffled)
    store.read_many_into(items)
    assert [bytes(out) for _, out in items] == [plain[oid] for oid in shuffled]
    assert runs_of(store, ids) == Counter({pack_key(store.stat(ids[0]).pack): 1})
    assert counting.reads == runs_of(store, ids)  # 201 chunks, one pack, one request

    # Every other chunk: each one a run of its own.
    counting.reads.clear()
    some = ids[::2]
    items = destinations(store, some)
    store.read_many_into(items)
    assert [bytes(out) for _, out in items] == [plain[oid] for oid in some]
    assert counting.reads == runs_of(store, some) and sum(counting.reads.values()) == len(some)


def test_runs_span_packs_and_the_same_chunk_twice(store: ObjectStore) -> None:
    with store.writer(RawCodec(), max_pack_size=40_000) as w:
        ids = [w.put(ObjectType.CHUNK, os.urandom(3000)) for _ in range(40)]
        w.commit()
    packs = {store.stat(i).pack for i in ids}
    assert len(packs) >= 3
    counting = counted(store)
    wanted = [*ids, ids[5]]
    items = destinations(store, wanted)
    store.read_many_into(items)
    assert sum(counting.reads[pack_key(p)] for p in packs) == len(packs) + 1  # the repeat is a run of its own
    assert [bytes(out) for _, out in items] == [bytes(store.read(i)) for i in wanted]


def test_deltas_decode_through_their_base(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 1024, generator=g) * 0.02
    changed = w - 1e-4 * torch.randn(w.shape, generator=g)
    with ckvc.Repo.init(tmp_path, chunk_size=64 << 10, keyframe_interval=4, threads=1) as repo:
        repo.commit({"w": w})
        cid = repo.commit({"w": changed})
        snapshot = repo.read_snapshot(repo.read_commit(cid))
        chunks = [c for blob in snapshot.blobs for c in blob.chunks]
        store = repo.store
        assert any(store.stat(c).codec == DELTA for c in chunks)
        counting = counted(store)
        items = destinations(store, chunks)
        store.read_many_into(items)
        assert b"".join(bytes(out) for _, out in items) == changed.numpy().tobytes()
        chunk_reads = sum(counting.reads[k] for k in runs_of(store, chunks))
        assert chunk_reads >= sum(runs_of(store, chunks).values())  # bases are read on their own


def test_errors_name_the_object(store: ObjectStore) -> None:
    ids, _plain = write_chunks(store, 20)
    missing = b"\x07" * 32
    with pytest.raises(ObjectNotFoundError) as info:
        store.read_many_into([*destinations(store, ids[:3]), (missing, memoryview(bytearray(4)))])
    assert info.value.object_id == missing.hex()
    with pytest.raises(CorruptObjectError) as wrong_size:
        store.read_many_into([(ids[1], memoryview(bytearray(store.stat(ids[1]).raw_size + 1)))])
    assert wrong_size.value.object_id == ids[1].hex()

    # One flipped payload byte: the chunk holding it is named, the others read.
    victim = ids[4]
    e = store.locate(victim)
    key = pack_key(e.pack)
    data = bytearray(store.backend.get(key) or b"")
    data[e.offset + RECORD_HEADER_SIZE] ^= 0xFF
    store.backend.delete(key)
    store.backend.put(key, bytes(data))
    store.reader.forget(e.pack)
    with pytest.raises(CorruptObjectError) as corrupt:
        store.read_many_into(destinations(store, ids))
    assert corrupt.value.object_id == victim.hex()
    ok = destinations(store, [i for i in ids if i != victim])
    store.read_many_into(ok)
