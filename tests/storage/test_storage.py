"""Packs, index, object store and codecs: layout, recovery by scanning, refresh, typed errors."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

import ckvc
from ckvc.codecs import RawCodec, ZstdCodec, decoder_for, encode_smallest
from ckvc.errors import CorruptObjectError, ObjectNotFoundError, UnsupportedFormatError
from ckvc.ids import ObjectType, object_id
from ckvc.storage.durable import list_packs
from ckvc.storage.local import LocalBackend, LocalSink
from ckvc.storage.object_store import ObjectStore
from ckvc.storage.packs import (
    FOOTER,
    PACK_HEADER,
    RECORD_HEADER_SIZE,
    TMP_SUFFIX,
    PackWriter,
    pack_entries,
    read_toc,
    scan_records,
)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ObjectStore]:
    (tmp_path / "packs").mkdir()
    s = ObjectStore(tmp_path)
    yield s
    s.close()


def put_many(store: ObjectStore, blobs: list[bytes]) -> list[bytes]:
    with store.writer(ZstdCodec(1)) as w:
        ids = [w.put(ObjectType.CHUNK, b) for b in blobs]
        w.commit()
    return ids


def test_put_get_round_trip_and_dedup(store: ObjectStore) -> None:
    blobs = [os.urandom(1000), b"\x00" * 50000, b"abc" * 1000, b""]
    ids = put_many(store, blobs)
    for oid, data in zip(ids, blobs, strict=True):
        assert bytes(store.read(oid)) == data
        assert oid == object_id(ObjectType.CHUNK, data)
    packs = list_packs(store.pack_dir)
    assert put_many(store, blobs) == ids  # all known: no new pack
    assert list_packs(store.pack_dir) == packs
    # Compressible data was compressed; random data fell back to raw.
    assert store.stat(ids[1]).codec == ZstdCodec.codec_id
    assert store.stat(ids[0]).codec == RawCodec.codec_id
    assert store.stat(ids[0]).stored_size == RECORD_HEADER_SIZE + 1000


def test_read_with_wrong_type_is_corrupt(store: ObjectStore) -> None:
    (oid,) = put_many(store, [b"hello"])
    with pytest.raises(CorruptObjectError, match=oid.hex()):
        store.read(oid, ObjectType.COMMIT)


def test_missing_object_is_typed_and_a_keyerror(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFoundError) as info:
        store.read(b"\x01" * 32)
    assert isinstance(info.value, KeyError)


def test_toc_matches_scan_and_scan_recovers_damaged_footer(store: ObjectStore) -> None:
    put_many(store, [os.urandom(100 + i) for i in range(20)])
    (name,) = list_packs(store.pack_dir)
    path = store.pack_dir / name
    packs = LocalBackend(store.pack_dir)
    toc = read_toc(packs, name)
    scanned = list(scan_records(packs, name))
    assert toc is not None and len(toc) == 20
    assert scanned == toc
    data = bytearray(path.read_bytes())
    data[-FOOTER.size] ^= 0xFF  # break the footer magic
    path.write_bytes(bytes(data))
    entries, from_toc = pack_entries(LocalBackend(store.pack_dir), name)
    assert not from_toc and entries == toc


def test_truncated_pack_scan_recovers_whole_records_only(tmp_path: Path) -> None:
    writer = PackWriter(LocalBackend(tmp_path), "")
    infos = [writer.append(os.urandom(32), 1, 0, 100, os.urandom(100)) for _ in range(5)]
    path = tmp_path / writer.seal()
    data = path.read_bytes()
    cut = infos[3].offset + 50  # inside the fourth record
    path.write_bytes(data[:cut])
    assert read_toc(LocalBackend(tmp_path), path.name) is None
    assert list(scan_records(LocalBackend(tmp_path), path.name)) == infos[:3]


def test_pack_with_unknown_version_is_refused(tmp_path: Path) -> None:
    writer = PackWriter(LocalBackend(tmp_path), "")
    writer.append(os.urandom(32), 1, 0, 3, b"abc")
    path = tmp_path / writer.seal()
    data = bytearray(path.read_bytes())
    data[8:12] = (7).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(UnsupportedFormatError):
        pack_entries(LocalBackend(tmp_path), path.name)
    assert PACK_HEADER.size == 32


def test_unindexed_pack_is_found_on_miss(store: ObjectStore) -> None:
    """A writer that died after sealing its pack but before indexing it."""
    w = store.writer(ZstdCodec(1))
    oid = w.put(ObjectType.CHUNK, b"orphan" * 100)
    w._seal_current()
    w._wait_for_seals()  # sealed and durable, never indexed
    assert not store.has(oid)
    assert bytes(store.read(oid)) == b"orphan" * 100  # the miss triggers a refresh
    assert store.has(oid)


def test_unfinished_pack_is_invisible(store: ObjectStore) -> None:
    w = store.writer(ZstdCodec(1))
    oid = w.put(ObjectType.CHUNK, b"never sealed")
    assert any(p.name.endswith(TMP_SUFFIX) for p in store.pack_dir.iterdir())
    assert store.refresh() == 0
    with pytest.raises(ObjectNotFoundError):
        store.read(oid)
    w.abort()
    assert not any(p.name.endswith(TMP_SUFFIX) for p in store.pack_dir.iterdir())


def test_rebuild_index_from_packs(store: ObjectStore) -> None:
    blobs = [os.urandom(64) for _ in range(10)]
    ids = put_many(store, blobs)
    store.index.clear()
    assert not store.has(ids[0])
    assert store.rebuild_index() == 10
    assert [bytes(store.read(i)) for i in ids] == blobs


def test_packs_rotate_at_max_size(store: ObjectStore) -> None:
    with store.writer(RawCodec(), max_pack_size=1 << 20) as w:
        ids = [w.put(ObjectType.CHUNK, os.urandom(300_000)) for _ in range(8)]
        w.commit()
    assert len(list_packs(store.pack_dir)) >= 2
    assert all(store.has(i) for i in ids)


@given(st.binary(max_size=5000))
def test_zstd_round_trip(data: bytes) -> None:
    codec = ZstdCodec(3)
    codec_id, payload = encode_smallest(codec, data)
    assert bytes(decoder_for(codec_id).decode(payload, len(data))) == data


def test_zstd_decode_refuses_wrong_size_and_garbage() -> None:
    codec = ZstdCodec(1)
    data = b"x" * 10000
    payload = codec.encode(data)
    with pytest.raises(CorruptObjectError):
        codec.decode(payload, 9999)
    with pytest.raises(CorruptObjectError):
        codec.decode(payload[:-5], 10000)
    with pytest.raises(CorruptObjectError):
        codec.decode(b"not a zstd frame at all", 10000)
    # A frame that lies about nothing but would expand past the declared size.
    big = zstandard.ZstdCompressor(write_content_size=False).compress(b"\x00" * 100000)
    with pytest.raises(CorruptObjectError):
        codec.decode(big, 10)
    with pytest.raises(CorruptObjectError):
        RawCodec().decode(b"abc", 4)


def test_unknown_codec_id_is_unsupported() -> None:
    with pytest.raises(UnsupportedFormatError):
        decoder_for(200)


def test_repo_works_after_index_directory_is_deleted(tmp_path: Path) -> None:
    import shutil

    import torch

    repo = ckvc.Repo.init(tmp_path)
    cid = repo.commit({"w": torch.arange(1000.0)})
    repo.close()
    shutil.rmtree(tmp_path / ".ckvc/index")
    with ckvc.Repo.open(tmp_path) as again:
        assert torch.equal(again.load(cid[:8])["w"], torch.arange(1000.0))


def test_temporary_packs_of_dead_writers_are_swept_live_ones_kept(tmp_path: Path) -> None:
    pack_dir = tmp_path / "packs"
    pack_dir.mkdir()
    backend = LocalBackend(tmp_path)
    live = PackWriter(backend)  # holds its lock
    dead = PackWriter(backend)
    assert isinstance(dead.sink, LocalSink)
    dead.sink.release()  # as a killed process's lock goes with its descriptor
    (pack_dir / f"pack-{'0' * 32}{TMP_SUFFIX}").write_bytes(b"")  # created, never locked: a dead writer's
    removed = backend.sweep("packs/")
    assert sorted(removed) == sorted([f"packs/{dead.name}.tmp", f"packs/pack-{'0' * 32}{TMP_SUFFIX}"])
    assert (pack_dir / f"{live.name}.tmp").exists() and not (pack_dir / f"{dead.name}.tmp").exists()
    assert not (pack_dir / f"pack-{'0' * 32}{TMP_SUFFIX}").exists()
    live.append(b"\x01" * 32, 1, 0, 3, b"abc")
    assert (pack_dir / live.seal()).exists()


_OPEN_WHILE_WRITING = """
import sys, threading
from pathlib import Path
from ckvc.storage.index import Index

path = Path(sys.argv[1])
Index(path).close()


def opener_and_writer() -> None:
    for _ in range(200):
        index = Index(path)
        index.clear()  # a write transaction while other threads open the index
        index.close()


threads = [threading.Thread(target=opener_and_writer) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("done")
"""


def test_threads_open_and_write_one_index_at_once(tmp_path: Path) -> None:
    """py-lmdb's open_db holds the GIL while it waits for LMDB's write lock: the
    named databases are opened once per environment, so threads that open the
    same index while others write never deadlock (auto_push workers of two
    Repo objects over one remote did). In a child, so a regression fails on
    the timeout instead of hanging the suite."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _OPEN_WHILE_WRITING, str(tmp_path / "index")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
