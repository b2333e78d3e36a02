"""Repo API: init/open, commits and stored sizes, revisions, checkout, branches, tags, diff."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckvc
from ckvc import graph
from ckvc.codecs import DeltaBase, TensorCodec, ZstdCodec, layout_for
from ckvc.core import Repository
from ckvc.executor import Executor
from ckvc.ids import ObjectType, object_id
from ckvc.objects import Commit
from ckvc.storage.packs import RECORD_HEADER_SIZE


def tree_listing(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes: to show an operation changed nothing."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def ckvc_files(repo: ckvc.Repo) -> dict[str, bytes]:
    # The LMDB lock file changes on every open; it is not repository content.
    return {k: v for k, v in tree_listing(repo.dir).items() if not k.endswith("lock.mdb")}


def small_state(seed: int, n: int = 3) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(100, 100, generator=g) for i in range(n)}, "step": seed}


def test_init_layout_and_open_from_subdirectory(tmp_path: Path) -> None:
    repo = ckvc.Repo.init(tmp_path / "proj")
    repo.close()
    assert (tmp_path / "proj/.ckvc/config.json").is_file()
    assert (tmp_path / "proj/.ckvc/HEAD").read_text() == "ref: refs/heads/main\n"
    config = json.loads((tmp_path / "proj/.ckvc/config.json").read_text())
    assert config["format_version"] == 4 and config["chunk_size"] == 4 << 20
    assert config["codec"] == {"name": "auto", "level": 1} and config["keyframe_interval"] == 16
    sub = tmp_path / "proj/a/b"
    sub.mkdir(parents=True)
    with ckvc.Repo.open(sub) as again:
        assert again.path == (tmp_path / "proj").resolve()
        assert again.head() == ("main", None)
    with pytest.raises(ckvc.InvalidInputError):
        ckvc.Repo.init(tmp_path / "proj")


def test_open_outside_a_repository(tmp_path: Path) -> None:
    with pytest.raises(ckvc.NotARepositoryError):
        ckvc.Repo.open(tmp_path)


def test_unknown_format_version_is_refused(tmp_path: Path) -> None:
    ckvc.Repo.init(tmp_path).close()
    cfg = tmp_path / ".ckvc/config.json"
    data = json.loads(cfg.read_text())
    data["format_version"] = 99
    cfg.write_text(json.dumps(data))
    with pytest.raises(ckvc.UnsupportedFormatError, match="99"):
        ckvc.Repo.open(tmp_path)


def test_bad_chunk_size_is_refused_and_nothing_created(tmp_path: Path) -> None:
    with pytest.raises(ckvc.InvalidInputError):
        ckvc.Repo.init(tmp_path / "x", chunk_size=1000)
    assert not (tmp_path / "x/.ckvc").exists()


def test_commit_load_round_trip_and_log(repo: ckvc.Repo) -> None:
    ids = [repo.commit(small_state(i), message=f"e{i}", metrics={"val_loss": 1.0 / (i + 1)}) for i in range(3)]
    log = repo.log()
    assert [c.id for c in log] == ids[::-1]
    assert [c.message for c in log] == ["e2", "e1", "e0"]
    assert log[0].metrics == {"val_loss": pytest.approx(1 / 3)}
    assert log[0].parents == (ids[1],) and log[-1].parents == ()
    loaded = repo.load(ids[1])
    expected = small_state(1)
    assert loaded["step"] == 1
    for k, v in expected["model"].items():
        assert torch.equal(loaded["model"][k], v)


def test_unchanged_recommit_adds_no_chunk_bytes(repo: ckvc.Repo) -> None:
    state = small_state(0)
    repo.commit(state, message="a")
    chunks_before = sum(1 for s in repo.store.iter_stored() if s.kind == ObjectType.CHUNK)
    repo.commit(state, message="b")
    stats = repo.last_commit_stats
    assert stats is not None
    assert stats.new_chunks == 0 and stats.new_chunk_raw_bytes == 0 and stats.new_chunk_stored_bytes == 0
    assert stats.chunks > 0
    assert sum(1 for s in repo.store.iter_stored() if s.kind == ObjectType.CHUNK) == chunks_before
    # Only the commit object is new (the snapshot is identical and deduplicated).
    assert stats.stored_bytes < 1024


def test_changing_one_tensor_adds_exactly_its_compressed_size(repo: ckvc.Repo) -> None:
    state = small_state(0)
    repo.commit(state, message="a")
    old = state["model"]["w1"].numpy().tobytes()
    state["model"]["w1"] = torch.randn(100, 100, generator=torch.Generator().manual_seed(99))
    repo.commit(state, message="b")
    stats = repo.last_commit_stats
    assert stats is not None
    data = state["model"]["w1"].numpy().tobytes()
    expected_stored = 0
    # Each chunk is encoded alone or as a delta against the old tensor's chunk, whichever is smaller.
    codec = TensorCodec(1)
    for start in range(0, len(data), 64 << 10):
        base_bytes = old[start : start + (64 << 10)]
        base = DeltaBase(object_id(ObjectType.CHUNK, base_bytes), base_bytes, 0)
        _, payload = codec.encode_chunk(data[start : start + (64 << 10)], layout_for("float32"), base)
        expected_stored += RECORD_HEADER_SIZE + len(payload)
    assert stats.new_chunk_raw_bytes == len(data)
    assert stats.new_chunk_stored_bytes == expected_stored
    assert stats.new_chunks == -(-len(data) // (64 << 10))


def test_revisions(repo: ckvc.Repo) -> None:
    c0 = repo.commit(small_state(0), message="c0")
    c1 = repo.commit(small_state(1), message="c1")
    c2 = repo.commit(small_state(2), message="c2")
    repo.branch("side", c0)
    repo.checkout("side")
    s1 = repo.commit(small_state(10), message="s1")
    repo.checkout("main")
    m = repo.commit(small_state(3), message="merge", merge=["side"])
    assert repo.read_commit(m).parents == (c2, s1)
    assert repo.resolve("HEAD") == m
    assert repo.resolve("main") == m
    assert repo.resolve("refs/heads/main") == m
    assert repo.resolve("HEAD^") == c2
    assert repo.resolve("HEAD^1") == c2
    assert repo.resolve("HEAD^2") == s1
    assert repo.resolve("HEAD^2^") == c0
    assert repo.resolve("HEAD~2") == c1
    assert repo.resolve("main~3") == c0
    assert repo.resolve("HEAD~0") == m
    assert repo.resolve("HEAD^0") == m
    assert repo.resolve("HEAD^^") == c1
    assert repo.resolve(c1) == c1
    assert repo.resolve(c1[:10]) == c1
    assert repo.resolve("side") == s1
    for bad in ["nope", "HEAD~9", "HEAD^3", "main~x", "abc", "", c1[:3], "HEAD@{1}", "main:x"]:
        with pytest.raises(ckvc.InvalidRevisionError):
            repo.resolve(bad)
    with pytest.raises(ckvc.InvalidRevisionError, match="nope"):
        repo.resolve("nope~2")


def test_ambiguous_prefix(repo: ckvc.Repo) -> None:
    # Write many commit objects directly to find two whose ids share 4 hex digits.
    snapshot = repo.read_commit(repo.commit(small_state(0))).tree
    seen: dict[str, str] = {}
    pair = None
    with repo.store.writer(ZstdCodec(1)) as writer:
        for i in range(3000):
            c = Commit(tree=snapshot, parents=(), author="t", time_ns=i, message=str(i))
            oid = writer.put(ObjectType.COMMIT, c.encode()).hex()
            if oid[:4] in seen:
                pair = (seen[oid[:4]], oid)
                break
            seen[oid[:4]] = oid
        writer.commit()
    assert pair is not None
    with pytest.raises(ckvc.InvalidRevisionError, match="ambiguous"):
        repo.resolve(pair[0][:4])
    assert repo.resolve(pair[0]) == pair[0]


def test_empty_repository_has_no_head_revision(repo: ckvc.Repo) -> None:
    with pytest.raises(ckvc.InvalidRevisionError, match="HEAD"):
        repo.resolve("HEAD")
    with pytest.raises(ckvc.InvalidRevisionError):
        repo.load()


def test_checkout_branch_vs_detached_and_commit_on_detached_head(repo: ckvc.Repo) -> None:
    c0 = repo.commit(small_state(0), message="c0")
    c1 = repo.commit(small_state(1), message="c1")
    state = repo.checkout(c0)
    assert state["step"] == 0
    assert repo.head() == (None, c0)
    d = repo.commit(small_state(5), message="on detached head")
    assert repo.head() == (None, d)
    assert repo.resolve("main") == c1  # the branch did not move
    repo.checkout("main")
    assert repo.head() == ("main", c1)
    reflog = repo.reflog("HEAD")
    assert reflog[0].message == "checkout: moving to main" and reflog[0].new == c1
    assert [e.new for e in repo.reflog("main")] == [c1, c0]


def test_branches_and_tags(repo: ckvc.Repo) -> None:
    c0 = repo.commit(small_state(0), message="c0")
    c1 = repo.commit(small_state(1), message="c1")
    repo.branch("exp/lr-1e-4", c0)
    assert repo.branches() == {"exp/lr-1e-4": c0, "main": c1}
    with pytest.raises(ckvc.RefConflictError):
        repo.branch("exp/lr-1e-4")
    with pytest.raises(ckvc.RefConflictError):
        repo.branch("exp")  # a directory of refs exists there
    light = repo.tag("v0", c0)
    annotated = repo.tag("v1", c1, message="release one")
    assert light == c0 and annotated != c1
    assert repo.tags() == {"v0": c0, "v1": c1}
    assert repo.resolve("v1") == c1 and repo.resolve("v1~1") == c0
    assert repo.read_tag(annotated).message == "release one"
    assert repo.delete_tag("v0") == c0
    with pytest.raises(ckvc.RefNotFoundError):
        repo.delete_tag("v0")
    with pytest.raises(ckvc.InvalidInputError):
        repo.delete_branch("main")  # HEAD is on it
    assert repo.delete_branch("exp/lr-1e-4") == c0
    assert repo.branches() == {"main": c1}
    assert not (repo.dir / "refs/heads/exp").exists()  # emptied directories are removed
    with pytest.raises(ckvc.RefNotFoundError):
        repo.delete_branch("nope")


@pytest.mark.parametrize(
    "name",
    ["..", "a/../../b", "/abs", "a//b", "x.lock", "x.tmp", ".hidden", "a b", "a\x00b", "a\\b", "a~1", "a^", "a:b", "a?",
     "a*", "a[", "@", "a@{1}", "end.", "trail/", "", "HEAD", "-rf", "tab\tname", "\x7f"],
)  # fmt: skip
def test_invalid_ref_names_raise_and_write_nothing(repo: ckvc.Repo, name: str) -> None:
    repo.commit(small_state(0))
    before = ckvc_files(repo)
    parent_before = sorted(os.listdir(repo.path.parent))
    with pytest.raises(ckvc.InvalidRefNameError):
        repo.branch(name)
    with pytest.raises(ckvc.InvalidRefNameError):
        repo.tag(name)
    assert ckvc_files(repo) == before
    assert sorted(os.listdir(repo.path.parent)) == parent_before


def test_bad_input_leaves_repository_unchanged(repo: ckvc.Repo) -> None:
    repo.commit(small_state(0))
    before = ckvc_files(repo)
    with pytest.raises(ckvc.UnsupportedTypeError, match=r"optimizer\.state\.3\.foo"):
        repo.commit({"optimizer": {"state": {3: {"foo": object()}}}})
    with pytest.raises(ckvc.InvalidInputError):
        repo.commit(small_state(1), metrics={"val_loss": "low"})
    with pytest.raises(ckvc.InvalidInputError):
        repo.commit(small_state(1), metadata={"k": object()})  # JSON-like values only
    with pytest.raises(ckvc.InvalidRevisionError):
        repo.commit(small_state(1), merge=["nope"])
    assert ckvc_files(repo) == before


def test_diff_reports_changes_with_norms(repo: ckvc.Repo) -> None:
    a = small_state(0)
    b: dict[str, Any] = {"model": dict(a["model"]), "step": 7}
    b["model"]["w0"] = a["model"]["w0"] * 1.5
    del b["model"]["w2"]
    b["model"]["new"] = torch.zeros(3)
    ca = repo.commit(a)
    cb = repo.commit(b)
    d = repo.diff(ca, cb)
    assert d.added == ["model.new"] and d.removed == ["model.w2"]
    assert [c.path for c in d.changed] == ["model.w0"]
    change = d.changed[0]
    w0 = a["model"]["w0"].double()
    assert change.rel_l2 == pytest.approx(float((w0 * 0.5).norm() / w0.norm()))
    assert change.max_abs == pytest.approx(float((w0 * 0.5).abs().max()))
    assert d.values_changed == [("step", 0, 7)]


def test_show_lists_tensors(repo: ckvc.Repo) -> None:
    cid = repo.commit({"w": torch.zeros(2, 3, dtype=torch.bfloat16), "p": torch.nn.Parameter(torch.ones(4)), "e": 3})
    info = repo.show(cid)
    assert [(t.path, t.dtype, t.shape, t.nbytes, t.kind) for t in info.tensors] == [
        ("w", "bfloat16", (2, 3), 12, "tensor"),
        ("p", "float32", (4,), 16, "parameter"),
    ]
    assert info.values == {"e": 3}
    assert info.logical_bytes == 28


def test_map_location_forms(repo: ckvc.Repo) -> None:
    cid = repo.commit({"w": torch.arange(4.0)})
    assert repo.load(cid, map_location="cpu")["w"].device.type == "cpu"
    assert repo.load(cid, map_location=torch.device("cpu"))["w"].device.type == "cpu"
    assert repo.load(cid, map_location={"cpu": "cpu"})["w"].device.type == "cpu"
    seen = []

    def where(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        seen.append(location)
        return storage

    out = repo.load(cid, map_location=where)
    assert seen == ["cpu"] and torch.equal(out["w"], torch.arange(4.0))


def test_log_orders_by_time_and_limits(repo: ckvc.Repo) -> None:
    ids = [repo.commit({"i": i}) for i in range(5)]
    assert [c.id for c in repo.log(limit=2)] == ids[:-3:-1]
    assert [c.id for c in repo.log("HEAD~2")] == ids[2::-1]


def test_du_counts_logical_and_unique_bytes(repo: ckvc.Repo) -> None:
    state = small_state(0)
    c0 = repo.commit(state)
    state["model"]["w0"] = torch.randn(100, 100)
    c1 = repo.commit(state)
    usage = repo.du()
    assert usage.commits == 2
    assert usage.logical_bytes == 2 * 3 * 40000
    assert usage.unique_raw_bytes == 4 * 40000
    assert usage.dedup_ratio == pytest.approx(1.5)
    per = {c.commit: c.unique_stored_bytes for c in usage.per_commit}
    stored_w0 = {c0: 0, c1: 0}
    for cid in (c0, c1):
        snap = repo.read_snapshot(repo.read_commit(cid))
        blob = next(b for b in snap.blobs if b.path == "model.w0")
        stored_w0[cid] = sum(repo.store.stat(o).stored_size for o in blob.chunks)
    assert per == stored_w0


def test_recreating_refs_across_file_directory_boundaries(repo: ckvc.Repo) -> None:
    cid = repo.commit(small_state(0))
    repo.branch("a")
    repo.delete_branch("a")
    repo.branch("a/b")
    assert [e.new for e in repo.reflog("a/b")] == [cid]
    repo.delete_branch("a/b")
    repo.branch("a")
    assert repo.branches() == {"a": cid, "main": cid}
    assert [e.message for e in repo.reflog("a")] == ["branch: created from HEAD"]


def test_element_larger_than_chunk_size(tmp_path: Path) -> None:
    import numpy as np

    with ckvc.Repo.init(tmp_path, chunk_size=4096) as repo:
        arr = np.array(["x" * 2000, "y" * 1999, "z"])  # itemsize 8000 > chunk size
        repo.commit({"a": arr})
        assert (repo.load()["a"] == arr).all()
        snap = repo.read_snapshot(repo.read_commit(repo.resolve("HEAD")))
        assert snap.blobs[0].chunk_size == 8000 and len(snap.blobs[0].chunks) == 3


def test_metric_and_metadata_order_do_not_change_the_id() -> None:
    common = {"tree": "ab" * 32, "parents": (), "author": "a", "time_ns": 1, "message": "m"}
    one = Commit(**common, metrics={"a": 1.0, "b": 2.0}, metadata={"x": "1", "y": "2"})  # type: ignore[arg-type]
    two = Commit(**common, metrics={"b": 2.0, "a": 1.0}, metadata={"y": "2", "x": "1"})  # type: ignore[arg-type]
    assert one.encode() == two.encode()
    assert Commit.decode(one.encode()).metrics == {"a": 1.0, "b": 2.0}


@pytest.mark.parametrize(
    ("what", "version_after"),
    [("tensors, str metadata", 2), ("int metadata", 3), ("a file", 3)],
)
def test_format_version_rises_only_for_what_needs_it(tmp_path: Path, what: str, version_after: int) -> None:
    """A version 2 repository stays version 2 until a commit holds a file node or
    non-str metadata (docs/FORMAT.md section 15); then it is version 3 before
    anything is written, so an older ckvc refuses it instead of calling it corrupt."""
    from ckvc.formats import read_checkpoint

    ckvc.Repo.init(tmp_path).close()
    config_path = tmp_path / ".ckvc" / "config.json"
    config = json.loads(config_path.read_text())
    config["format_version"] = 2
    config_path.write_text(json.dumps(config))
    (tmp_path / "note.txt").write_bytes(b"hello")
    with ckvc.Repo.open(tmp_path) as repo:
        assert repo.config.format_version == 2
        if what == "a file":
            state, meta = read_checkpoint(tmp_path / "note.txt")
            repo.commit(state, metadata=meta)
        else:
            repo.commit({"w": torch.ones(3)}, metadata={"k": 3} if what == "int metadata" else {"k": "3"})
    assert json.loads(config_path.read_text())["format_version"] == version_after
    with ckvc.Repo.open(tmp_path) as repo:
        assert repo.fsck().ok


# ---- the facade over a composed core (issue 14) --------------------------------


def test_instance_open_is_the_view_with_a_deprecation_warning(repo: ckvc.Repo) -> None:
    first = repo.commit({"w": torch.arange(4.0)})
    repo.commit({"w": torch.zeros(4)})
    with pytest.warns(DeprecationWarning, match=r"repo\.view\(rev\)"):
        view = repo.open(first)
    assert isinstance(view, ckvc.CommitView) and view.commit.id == first
    assert view.load(["w"])["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither the class's open nor view warns
        assert repo.view().load(["w"])["w"].tolist() == [0.0] * 4
        with ckvc.Repo.open(repo.path) as again:
            assert again.resolve("HEAD~1") == first


def test_a_repo_is_a_facade_over_the_parts_it_is_given(repo: ckvc.Repo) -> None:
    first = repo.commit(small_state(1), message="one")
    repo.close()
    opened = Repository.open_local(repo.path, threads=1)
    core = Repository(
        config=opened.config, store=opened.store, refs=opened.refs, prune_log=opened.prune_log,
        executor=Executor(1), path=opened.path, dir=opened.dir,
    )  # fmt: skip
    with ckvc.Repo(core) as facade:
        assert facade.store is core.store and facade.refs is core.refs and facade.threads == 1
        assert (facade.path, facade.dir) == (repo.path, repo.dir)
        second = facade.commit(small_state(2), message="two")
        assert [c.id for c in facade.log()] == [second, first] == [c.id for c in graph.log(core)]
        assert facade.read_commit(second).parents == (first,)
        assert not facade.executor.started  # threads=1: every chunk was hashed and encoded inline
        loaded = facade.load(first)
        assert loaded["step"] == 1 and torch.equal(loaded["model"]["w0"], small_state(1)["model"]["w0"])
        assert ckvc.Repo.log.__doc__ == graph.log.__doc__  # the bound functions keep their docs
