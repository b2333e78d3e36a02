"""Hostile input: deep states, crafted objects, huge size claims, a damaged index.

Every case ends in a typed error (or success where success is right), never a
crash: load and fsck apply the same structure checks (state.parse_snapshot), so
each crafted commit that load refuses is reported by fsck, naming commit and path.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zstandard
from helpers import assert_state_equal

import ckvc
from ckvc import state as state_mod
from ckvc.codecs import ZSTD, make_codec
from ckvc.errors import (
    CorruptObjectError,
    DamagedIndexError,
    InsufficientMemoryError,
    ReadOnlyRepositoryError,
    UnsafeContentError,
    UnsupportedTypeError,
)
from ckvc.fsck import BAD_PACK, BAD_STATE
from ckvc.ids import ObjectType, object_id
from ckvc.objects import Blob, Commit, Snapshot
from ckvc.storage.durable import list_packs
from ckvc.storage.index import Index
from ckvc.storage.local import LocalBackend
from ckvc.storage.object_store import ObjectStore
from ckvc.storage.packs import FOOTER, FOOTER_MAGIC, TOC_ENTRY, TOC_HEADER, PackWriter, RecordInfo, read_toc

CHUNK = 4096
W_ELEMS = CHUNK // 4  # "w": one float32 chunk


def nest(depth: int, kind: str, leaf: Any) -> Any:
    """``leaf`` inside ``depth`` containers of one kind."""
    value = leaf
    for _ in range(depth):
        if kind == "tuple":
            value = (value,)
        elif kind == "odict":
            value = collections.OrderedDict(a=value)
        elif kind == "list":
            value = [value]
        else:
            value = {"a": value}
    return value


# ---- deep states at commit ------------------------------------------------------


def test_every_device_type_accepted_without_torch_is_one_torch_accepts() -> None:
    from ckvc.state.parse import _TORCH_DEVICE_TYPES

    for name in sorted(_TORCH_DEVICE_TYPES):
        for device in (name, f"{name}:3"):
            assert torch.device(device).type == name


@pytest.mark.parametrize("kind", ["tuple", "odict", "list", "dict"])
def test_the_deepest_allowed_state_round_trips(tmp_path: Path, kind: str) -> None:
    repo = ckvc.Repo.init(tmp_path)
    state = {"s": nest(state_mod.MAX_DEPTH - 1, kind, torch.arange(3.0))}  # MAX_DEPTH containers with the root
    repo.commit(state)
    assert_state_equal(repo.load(), state)
    assert repo.fsck(level="metadata").ok


@pytest.mark.parametrize("depth", [state_mod.MAX_DEPTH + 1, 195, 500, 10000])
@pytest.mark.parametrize("kind", ["tuple", "odict", "list", "dict"])
def test_a_state_deeper_than_the_limit_is_refused_at_commit(tmp_path: Path, depth: int, kind: str) -> None:
    repo = ckvc.Repo.init(tmp_path)
    repo.commit({"x": 1})
    packs = sorted(os.listdir(repo.dir / "packs"))
    with pytest.raises(UnsupportedTypeError, match=f"deeper than {state_mod.MAX_DEPTH} levels") as info:
        repo.commit({"s": nest(depth - 1, kind, 0)})
    key = "0" if kind in ("tuple", "list") else "a"
    assert info.value.path == "s" + f".{key}" * (state_mod.MAX_DEPTH - 1)
    assert sorted(os.listdir(repo.dir / "packs")) == packs  # nothing written
    assert len(repo.log()) == 1


def test_a_state_that_contains_itself_is_refused(tmp_path: Path) -> None:
    repo = ckvc.Repo.init(tmp_path)
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(UnsupportedTypeError, match="deeper than"):
        repo.commit({"loop": loop})


# ---- crafted objects --------------------------------------------------------------


def node(blob: Any = 0, shape: Any = None, stride: Any = None, offset: Any = 0, kind: Any = 0, **kw: Any) -> Any:
    fields = [
        blob,
        [W_ELEMS] if shape is None else shape,
        stride,
        offset,
        kind,
        kw.get("device", "cpu"),
        kw.get("requires_grad", False),
    ]
    return msgpack.ExtType(state_mod.EXT_TENSOR, msgpack.packb(fields, use_bin_type=True))


def packb(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def deep_ext(depth: int, code: int) -> bytes:
    """A tree of ``depth`` nested tuples (or ordered dicts) around 0, built without recursion."""
    inner = packb(0)
    for _ in range(depth):
        wrapped = [msgpack.ExtType(code, inner)] if code == state_mod.EXT_TUPLE else {"a": msgpack.ExtType(code, inner)}
        inner = packb(wrapped)
    return packb({"s": msgpack.ExtType(code, inner)})


def deep_lists(depth: int) -> bytes:
    return packb({"s": 0}).replace(b"\x00", b"\x91" * depth + b"\x90")


@dataclass
class Case:
    name: str
    tree: bytes
    blobs: str = "w"  # which blob table: "w" (one float32 chunk), or a special one below
    path: str | None = "w"  # the path fsck and load must name (None: the tree as a whole)
    structural: bool = True  # False: only reading the chunks finds it (views and show open fine)


def w_blob(chunk: bytes, **kw: Any) -> Blob:
    fields: dict[str, Any] = {"path": "w", "dtype": "float32", "nbytes": CHUNK, "chunk_size": CHUNK, "chunks": (chunk,)}
    fields.update(kw)
    return Blob(**fields)


CASES = [
    Case("tree-not-msgpack", b"\xc1", path=None),
    Case("tree-truncated", packb({"w": node()})[:-3], path=None),
    Case("tree-too-deep-for-msgpack", deep_lists(2000), path=None),
    Case("unknown-extension", packb({"w": msgpack.ExtType(42, b"")})),
    Case("unknown-torch-dtype-value", packb({"w": msgpack.ExtType(state_mod.EXT_DTYPE, b"float99")})),
    Case("bad-device-value", packb({"w": msgpack.ExtType(state_mod.EXT_DEVICE, b"no such device")})),
    Case("bad-size-value", packb({"w": msgpack.ExtType(state_mod.EXT_SIZE, packb([-1]))})),
    Case("bad-numpy-scalar", packb({"w": msgpack.ExtType(state_mod.EXT_NPSCALAR, packb(["<f8", b"\x00"]))})),
    Case("tuple-holding-a-map", packb({"w": msgpack.ExtType(state_mod.EXT_TUPLE, packb({}))})),
    Case("float-dict-key", packb({1.5: 0}), path=None),
    Case("node-too-short", packb({"w": msgpack.ExtType(state_mod.EXT_TENSOR, packb([0, [W_ELEMS]]))})),
    Case("node-bool-blob-index", packb({"w": node(blob=True)})),
    Case("negative-shape", packb({"w": node(shape=[-1])})),
    Case("shape-over-int64", packb({"w": node(shape=[(1 << 64) - 1], stride=[0])})),
    Case("shape-product-over-int64", packb({"w": node(shape=[1 << 32, 1 << 32], stride=[0, 0])})),
    Case("1e13-elements-contiguous", packb({"w": node(shape=[10**13])})),
    Case("1e13-elements-strided", packb({"w": node(shape=[10**13], stride=[1])})),
    Case("view-past-its-blob", packb({"w": node(shape=[W_ELEMS], stride=[1], offset=1)})),
    Case("contiguous-with-offset", packb({"w": node(offset=1)})),
    Case("blob-index-out-of-range", packb({"w": node(blob=5)})),
    Case("numpy-node-on-torch-blob", packb({"w": node(kind=2)})),
    Case("bad-device-in-node", packb({"w": node(device="no such device")})),
    Case("unknown-device-type-in-node", packb({"w": node(device="nosuchdev:1")})),  # well formed: torch judges
    Case("int-tensor-requires-grad", packb({"w": node(requires_grad=True)}), blobs="int32"),
    Case("unknown-blob-dtype", packb({"w": node()}), blobs="float99"),
    Case("object-numpy-dtype", packb({"w": node(kind=2)}), blobs="numpy-object"),
    Case("nbytes-not-whole-elements", packb({"w": node(shape=[W_ELEMS - 1])}), blobs="odd-nbytes"),
    Case("chunk-size-over-maximum", packb({"w": node()}), blobs="huge-chunk-size"),
    Case("chunk-size-differs-from-span", packb({"w": node(shape=[W_ELEMS // 2])}), "short-span", structural=False),
    Case("1e13-byte-blob", packb({"w": node(shape=[10**13 // 4])}), "1e13", structural=False),
    Case("depth-195-tuples", deep_ext(195, state_mod.EXT_TUPLE), path="s" + ".0" * (state_mod.MAX_DEPTH - 1)),
    Case("depth-500-odicts", deep_ext(500, state_mod.EXT_ODICT), path="s" + ".a" * (state_mod.MAX_DEPTH - 1)),
    Case("depth-10000-tuples", deep_ext(10000, state_mod.EXT_TUPLE), path="s" + ".0" * (state_mod.MAX_DEPTH - 1)),
    Case("depth-1000-lists", deep_lists(1000), path="s" + ".0" * (state_mod.MAX_DEPTH - 1)),
]


def blob_table(kind: str, chunk: bytes) -> list[Blob]:
    return {
        "w": [w_blob(chunk)],
        "int32": [w_blob(chunk, dtype="int32")],
        "float99": [w_blob(chunk, dtype="float99")],
        "numpy-object": [w_blob(chunk, dtype="numpy:|O")],
        "odd-nbytes": [w_blob(chunk, nbytes=CHUNK - 1)],
        "huge-chunk-size": [w_blob(chunk, chunk_size=1 << 40)],
        "short-span": [w_blob(chunk, nbytes=CHUNK // 2)],
        "1e13": [w_blob(chunk, nbytes=10**13, chunk_size=1 << 30, chunks=(chunk,) * -(-(10**13) // (1 << 30)))],
    }[kind]


def craft_commit(repo: ckvc.Repo, name: str, tree: bytes, blobs: list[Blob]) -> str:
    """Write a snapshot and commit straight into the object store and point
    ``refs/heads/<name>`` at the commit: bytes a buggy or hostile writer could leave."""
    snapshot = Snapshot(tuple(blobs), tree)
    with repo.store.pin(), repo.store.writer(make_codec("zstd")) as writer:
        sid = writer.put(ObjectType.SNAPSHOT, snapshot.encode())
        commit = Commit(sid.hex(), (), "crafter", time.time_ns(), name)
        cid = writer.put(ObjectType.COMMIT, commit.encode()).hex()
        writer.commit()
    repo.refs.set_if_equals(f"refs/heads/{name}", None, cid, "crafted")
    return cid


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], dict[str, Any]]:
    root = tmp_path_factory.mktemp("crafted")
    repo = ckvc.Repo.init(root, chunk_size=CHUNK)
    good = {"w": torch.arange(W_ELEMS, dtype=torch.float32)}
    repo.commit(good)
    chunk = repo.read_snapshot(repo.read_commit(repo.resolve("main"))).blobs[0].chunks[0]
    ids = {case.name: craft_commit(repo, case.name, case.tree, blob_table(case.blobs, chunk)) for case in CASES}
    repo.close()
    return root, ids, good


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_load_view_and_show_refuse_a_crafted_commit(
    crafted: tuple[Path, dict[str, str], dict[str, Any]], case: Case
) -> None:
    root, ids, _ = crafted
    repo = ckvc.Repo.open(root)
    try:
        reads = [repo.load, lambda rev: repo.load(rev, keys=["w"]), lambda rev: repo.view(rev)["w"]]
        if case.structural:
            reads += [repo.view, repo.show]
        for read in reads:
            with pytest.raises(CorruptObjectError) as info:
                read(case.name)
            assert info.value.commit == ids[case.name]
            assert case.path is None or repr(case.path) in str(info.value), str(info.value)
    finally:
        repo.close()


def test_fsck_reports_each_crafted_commit_that_load_refuses(
    crafted: tuple[Path, dict[str, str], dict[str, Any]],
) -> None:
    root, ids, good = crafted
    repo = ckvc.Repo.open(root)
    try:
        refused = set()
        for name, cid in ids.items():
            with pytest.raises(CorruptObjectError):
                repo.load(name)
            refused.add(cid)
        assert_state_equal(repo.load("main"), good)  # the honest commit still loads
        for level in ("metadata", "full"):
            report = repo.fsck(level=level)
            errors = [p for p in report.problems if p.severity == "error"]
            assert {p.object_id for p in errors} == refused
            assert len(errors) == len(CASES) == len(refused)
            assert all(p.kind == BAD_STATE for p in errors)
            for case in CASES:
                (problem,) = [p for p in errors if p.object_id == ids[case.name]]
                assert ids[case.name] in problem.detail
                assert case.path is None or repr(case.path) in problem.detail, problem.detail
    finally:
        repo.close()


def test_fsck_reports_pickles_a_commit_does_not_declare(tmp_path: Path) -> None:
    """A tree holding a pickle in a commit that does not say so: load refuses it
    (never unpickled), and fsck calls the commit damaged, as it does whatever load
    refuses (torture: crafted/tree pickle-ext)."""
    repo = ckvc.Repo.init(tmp_path)
    try:
        tree = packb({"w": msgpack.ExtType(state_mod.EXT_PICKLE, b"cos\nsystem\n(S'true'\ntR.")})
        cid = craft_commit(repo, "undeclared", tree, [])
        with pytest.raises(UnsafeContentError):
            repo.load("undeclared")
        for level in ("metadata", "full"):
            (problem,) = repo.fsck(level=level).problems
            assert (problem.kind, problem.object_id, problem.severity) == (BAD_STATE, cid, "error")
            assert problem.detail == f"commit {cid} holds pickled values but does not declare them"
    finally:
        repo.close()


def run_cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in its own process: a crash (segfault, bus error) shows as a signal exit."""
    return subprocess.run(
        [sys.executable, "-m", "ckvc", "-C", str(root), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("depth-195-tuples", marks=pytest.mark.stress),
        pytest.param("depth-500-odicts", marks=pytest.mark.stress),
        "depth-10000-tuples",
        "1e13-byte-blob",
    ],
)
def test_the_cli_refuses_deep_and_huge_crafted_commits_in_one_line(
    crafted: tuple[Path, dict[str, str], dict[str, Any]], name: str, tmp_path: Path
) -> None:
    root, ids, _ = crafted
    commands = [["checkout", name, "-o", str(tmp_path / "out")]]
    if name != "1e13-byte-blob":  # show reads no chunk, so it lists the 9.1 TiB tensor
        commands.append(["show", name])
    for args in commands:
        result = run_cli(root, *args)
        assert result.returncode == CorruptObjectError.exit_code, result.stderr
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("ckvc: error: "), result.stderr
        assert ids[name] in result.stderr
    result = run_cli(root, "fsck", "--level", "metadata")
    assert result.returncode == 1, result.stderr
    assert f"error: {BAD_STATE}: {ids[name]}:" in result.stdout


# ---- sizes claimed by records, tables of contents and the index ---------------------


def commit_with_claimed_size(repo: ckvc.Repo, raw_size: int) -> str:
    """A well-formed commit object stored in a new pack whose record header and
    TOC (checksums and all) claim ``raw_size`` plain bytes; main points at it."""
    parent = repo.resolve("main")
    commit = Commit(repo.read_commit(parent).tree, (parent,), "crafter", time.time_ns(), "claims")
    data = commit.encode()
    oid = object_id(ObjectType.COMMIT, data)
    writer = PackWriter(repo.store.backend)
    writer.append(oid, int(ObjectType.COMMIT), ZSTD, raw_size, zstandard.ZstdCompressor().compress(data))
    writer.seal()
    repo.refs.set_if_equals("refs/heads/main", parent, oid.hex(), "crafted")
    return oid.hex()


@pytest.mark.parametrize("raw_size", [10**13, (1 << 64) - 1, 1 << 40])
def test_a_record_claiming_a_huge_size_is_refused_before_allocating(tmp_path: Path, raw_size: int) -> None:
    repo = ckvc.Repo.init(tmp_path)
    repo.commit({"x": torch.zeros(4)})
    cid = commit_with_claimed_size(repo, raw_size)
    with pytest.raises(CorruptObjectError, match="cannot hold") as info:
        repo.log()
    assert info.value.commit == cid
    report = repo.fsck()
    assert [p.object_id for p in report.problems if p.severity == "error"] == [cid]
    repo.close()
    if raw_size != 10**13:
        return  # the same refusal: the CLI's processes are checked on one size
    for args in (["log"], ["show"], ["checkout", "main", "-o", str(tmp_path / "out")]):
        result = run_cli(tmp_path, *args)
        assert result.returncode == CorruptObjectError.exit_code, result.stderr
        assert result.stderr.startswith("ckvc: error: ") and result.stderr.count("\n") == 1, result.stderr
    result = run_cli(tmp_path, "fsck")
    assert result.returncode == 1 and f"{cid}" in result.stdout, result.stdout + result.stderr


def reindex(repo: ckvc.Repo, change: Any) -> None:
    """Rebuild the index with every entry passed through ``change`` (an index
    that lies: hand-edited, or damaged in a way LMDB cannot see)."""
    by_pack: dict[str, list[RecordInfo]] = collections.defaultdict(list)
    for stored in repo.store.iter_stored():
        entry = repo.store.index.get(stored.oid)
        assert entry is not None
        info = RecordInfo(stored.oid, entry.kind, entry.codec, entry.offset, entry.record_size, entry.raw_size)
        by_pack[entry.pack].append(change(info))
    repo.store.index.clear()
    for name, entries in by_pack.items():
        repo.store.index.add_pack(name, entries)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda e: dataclasses.replace(e, record_size=10**13), CorruptObjectError),
        (lambda e: dataclasses.replace(e, offset=(1 << 64) - 1), CorruptObjectError),
        (lambda e: dataclasses.replace(e, raw_size=10**13), CorruptObjectError),
        (lambda e: dataclasses.replace(e, kind=9), DamagedIndexError),
    ],
    ids=["record-size", "offset", "raw-size", "type"],
)
def test_an_index_entry_claiming_impossible_sizes_is_refused(tmp_path: Path, change: Any, error: type) -> None:
    repo = ckvc.Repo.init(tmp_path)
    repo.commit({"x": torch.zeros(4)})
    reindex(repo, change)
    with pytest.raises(error):
        repo.load()
    if error is CorruptObjectError:
        assert not repo.fsck().ok
    else:
        with pytest.raises(DamagedIndexError, match="ckvc fsck --rebuild-index"):
            repo.fsck()
    assert repo.fsck(rebuild_index=True).ok  # the packs are fine: the documented repair
    assert_state_equal(repo.load(), {"x": torch.zeros(4)})
    repo.close()


def test_an_index_naming_a_pack_outside_the_pack_directory_is_refused(tmp_path: Path) -> None:
    repo = ckvc.Repo.init(tmp_path / "repo")
    repo.commit({"x": torch.zeros(4)})
    (tmp_path / "outside.pack").write_bytes(b"")
    by_pack: dict[str, list[RecordInfo]] = {}
    for stored in repo.store.iter_stored():
        entry = repo.store.index.get(stored.oid)
        assert entry is not None
        info = RecordInfo(stored.oid, entry.kind, entry.codec, entry.offset, entry.record_size, entry.raw_size)
        by_pack.setdefault(entry.pack, []).append(info)
    repo.store.index.clear()
    for entries in by_pack.values():
        repo.store.index.add_pack("../../outside.pack", entries)
    with pytest.raises(CorruptObjectError, match="cannot exist"):
        repo.load()
    repo.close()


def test_a_toc_entry_outside_its_pack_makes_the_toc_damaged(tmp_path: Path) -> None:
    """A TOC with a valid checksum but an entry past the TOC is not trusted: the
    records are found by scanning instead, and everything still reads."""
    repo = ckvc.Repo.init(tmp_path)
    state = {"x": torch.arange(8.0)}
    repo.commit(state)
    (name,) = list_packs(repo.dir / "packs")
    path = repo.dir / "packs" / name
    data = bytearray(path.read_bytes())
    _, toc_offset, count, _, _ = FOOTER.unpack_from(data, len(data) - FOOTER.size)
    first = toc_offset + TOC_HEADER.size
    oid, kind, codec, r, offset, _size, raw = TOC_ENTRY.unpack_from(data, first)
    TOC_ENTRY.pack_into(data, first, oid, kind, codec, r, offset, 10**13, raw)
    toc = bytes(data[toc_offset : toc_offset + TOC_HEADER.size + count * TOC_ENTRY.size])
    FOOTER.pack_into(data, len(data) - FOOTER.size, FOOTER_MAGIC, toc_offset, count, zlib.crc32(toc), 0)
    path.write_bytes(bytes(data))
    assert read_toc(LocalBackend(path.parent), name) is None
    repo.fsck(rebuild_index=True)
    assert_state_equal(repo.load(), state)
    repo.close()


# ---- a damaged index ------------------------------------------------------------------


def damage_truncate(data: Path) -> None:
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)


def damage_garbage(data: Path) -> None:
    data.write_bytes(bytes(range(256)) * 64)


def damage_short(data: Path) -> None:
    data.write_bytes(b"\x00" * 100)


@pytest.fixture
def indexed_repo(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    repo = ckvc.Repo.init(tmp_path / "repo")
    state = {"w": torch.arange(4096.0), "step": 3}
    for i in range(30):  # enough packs for the index to span several pages
        repo.commit({**state, "step": i}, message=f"c{i}")
    repo.commit(state)
    repo.close()
    return tmp_path / "repo", state


@pytest.mark.parametrize(
    "damage", [damage_truncate, damage_garbage, damage_short], ids=["truncated", "garbage", "short"]
)
def test_a_damaged_index_names_its_repair_and_the_repair_never_opens_it(
    indexed_repo: tuple[Path, dict[str, Any]], damage: Any
) -> None:
    root, state = indexed_repo
    damage(root / ".ckvc" / "index" / "data.mdb")
    commands = [["log"], ["show"], ["fsck"], ["checkout", "main", "-o", str(root.parent / "out")]]
    # Every command meets the truncated index; the other damages, the first and the last.
    for args in commands if damage is damage_truncate else commands[::3]:
        result = run_cli(root, *args)  # a crash (SIGBUS) would be a negative return code
        assert result.returncode == DamagedIndexError.exit_code, (args, result.stderr)
        assert result.stderr.count("\n") == 1 and "ckvc fsck --rebuild-index" in result.stderr, result.stderr
    result = run_cli(root, "fsck", "--rebuild-index")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "index rebuilt from packs" in result.stdout
    assert not [n for n in os.listdir(root / ".ckvc") if n.startswith("index.")]  # nothing left beside it
    repo = ckvc.Repo.open(root)
    try:
        assert_state_equal(repo.load(), state)
        assert len(repo.log()) == 31
    finally:
        repo.close()


def test_a_garbage_lock_file_is_reset(indexed_repo: tuple[Path, dict[str, Any]]) -> None:
    root, state = indexed_repo
    (root / ".ckvc" / "index" / "lock.mdb").write_bytes(b"\xff" * 8192)
    repo = ckvc.Repo.open(root)
    try:
        assert_state_equal(repo.load(), state)
    finally:
        repo.close()


def test_an_index_rebuilt_by_another_process_is_picked_up_before_writing(
    indexed_repo: tuple[Path, dict[str, Any]],
) -> None:
    root, state = indexed_repo
    repo = ckvc.Repo.open(root)
    try:
        old = repo.store.index
        result = run_cli(root, "fsck", "--rebuild-index", "--level", "refs")
        assert result.returncode == 0, result.stderr
        repo.commit({**state, "step": 99})  # registers its pack in the new index, not the unlinked one
        assert repo.store.index is old and old.reopen_if_replaced() is False
    finally:
        repo.close()
    repo = ckvc.Repo.open(root)
    try:
        assert repo.store.index.indexed_packs() == set(list_packs(root / ".ckvc" / "packs"))
        assert repo.load()["step"] == 99
    finally:
        repo.close()


def test_a_read_only_index_reads_and_refuses_writes(indexed_repo: tuple[Path, dict[str, Any]]) -> None:
    root, _ = indexed_repo
    index = Index.open(root / ".ckvc" / "index", readonly=True)
    try:
        assert index.count() > 0
        with pytest.raises(ReadOnlyRepositoryError):
            index.clear()
    finally:
        index.close()
    store = ObjectStore(root / ".ckvc", readonly=True)
    try:
        assert store.readonly and store.index.readonly
        with pytest.raises(ReadOnlyRepositoryError):
            store.rebuild_index()
        assert store.index.count() == index_count(root)
    finally:
        store.close()


def index_count(root: Path) -> int:
    index = Index(root / ".ckvc" / "index")
    try:
        return index.count()
    finally:
        index.close()


def test_a_directory_named_like_a_pack_is_reported_not_read(tmp_path: Path) -> None:
    repo = ckvc.Repo.init(tmp_path)
    state = {"x": torch.arange(4.0)}
    repo.commit(state)
    (repo.dir / "packs" / f"pack-{'0' * 32}.pack").mkdir()
    repo.store.rebuild_index()
    assert_state_equal(repo.load(), state)
    report = repo.fsck()
    assert [p.kind for p in report.problems if p.severity == "error"] == [BAD_PACK]
    assert "not a regular file" in report.problems[0].detail
    repo.close()


@pytest.mark.parametrize("dtype", ["float32", "numpy:<f4"])
def test_a_blob_the_machine_cannot_hold_is_a_typed_error(dtype: str) -> None:
    with pytest.raises(InsufficientMemoryError, match=f"cannot allocate {4 * 10**15} bytes"):
        state_mod.allocate_blob(dtype, 4 * 10**15)
