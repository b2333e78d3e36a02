"""Lazy clones against the S3 server on loopback (through the fault proxy, which
counts the bytes it sends): metadata at once, each read fetching only what it
needs, verified; fsck tells remote-held chunks from missing ones; offline, a
cached commit loads and an uncached one raises RemoteUnavailableError with
nothing changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ckvc.storage.cloud")
pytest.importorskip("obstore")
pytest.importorskip("moto")

import torch
from fault_proxy import FaultProxy, Rule
from helpers import assert_state_equal, run
from hybrid_util import (
    chunk_closure,
    local_chunk_bytes,
    make_history,
    metadata_bytes,
    remote_of,
    source_repo,
    stored,
    train_state,
)

import ckvc
from ckvc.errors import RemoteUnavailableError
from ckvc.remote.common import pack_framing


@pytest.fixture
def pushed(tmp_path: Path, s3_bucket: str, s3_proxy: FaultProxy) -> tuple[ckvc.Repo, list[str], str, str]:
    """A 10-commit history pushed to a fresh bucket through the proxy: (source, ids, url, endpoint)."""
    src = source_repo(tmp_path)
    ids = make_history(src)
    url = f"s3://{s3_bucket}/run"
    src.remotes.add("origin", url, endpoint=s3_proxy.endpoint)
    src.push()
    return src, ids, url, s3_proxy.endpoint


def test_lazy_clone_fetches_metadata_then_only_what_each_read_needs(
    tmp_path: Path, pushed: tuple[ckvc.Repo, list[str], str, str], s3_proxy: FaultProxy
) -> None:
    src, ids, url, endpoint = pushed
    remote = remote_of(src)
    meta = metadata_bytes(remote)
    s3_proxy.reset_counts()
    lazy = ckvc.Repo.clone(url, tmp_path / "lazy", endpoint=endpoint, lazy=True)
    clone_wire = s3_proxy.body_bytes
    # Nothing but metadata came: every local record is a commit or snapshot, all of them.
    assert local_chunk_bytes(lazy) == 0
    received = sum(e.record_size for _, e in lazy.store.index.iter_entries())
    assert received == meta
    # On the wire besides: the catalog (each pack's table of contents, which says
    # where a chunk lies for the range reads later), the listing, refs and config.
    tocs = sum(pack_framing(len(remote.core.store.pack_entries(name)[0])) for name in remote.core.store.packs())
    assert clone_wire <= 1.02 * meta + tocs + 8192, (clone_wire, meta, tocs)  # listings are XML
    print(
        f"\nlazy clone: metadata records {meta} B received {received} B (1.000x); on the wire {clone_wire} B "
        f"({clone_wire / meta:.3f}x; catalog TOCs {tocs} B, rest {clone_wire - meta - tocs} B)"
    )
    # log, show, du work at once (no fetch).
    assert [c.id for c in lazy.log()] == ids[::-1]
    assert lazy.show(ids[3]).logical_bytes == src.show(ids[3]).logical_bytes
    assert lazy.du().commits == 10
    n = len(s3_proxy.requests)
    assert [c.id for c in lazy.log()] == ids[::-1]
    assert len(s3_proxy.requests) == n, s3_proxy.requests[n:]
    report = lazy.fsck(level="metadata")
    assert report.ok and report.remote_chunks > 0

    # One tensor: its chunks (and the keyframes they decode through) only.
    s3_proxy.reset_counts()
    before = lazy.cache.promisor.totals.record_bytes
    view = lazy.view(ids[6])
    w = view["model.w"]
    assert_state_equal(w, src.load(ids[6])["model"]["w"])
    want = stored(remote, chunk_closure(src, ids[6], ["model.w"]))
    got = lazy.cache.promisor.totals.record_bytes - before
    assert got <= 1.05 * want, (got, want)
    print(f"single-tensor view: fetched {got} B of records for {want} B of chunks ({got / want:.3f}x)")

    # A checkout: that commit's chunks and keyframes, no more; byte-exact; HEAD moves.
    before = lazy.cache.promisor.totals.record_bytes
    state = lazy.checkout(ids[8])
    assert_state_equal(state, src.load(ids[8]))
    want = stored(remote, chunk_closure(src, ids[8]) - chunk_closure(src, ids[6], ["model.w"]))
    got = lazy.cache.promisor.totals.record_bytes - before
    assert got <= 1.05 * want, (got, want)
    print(f"checkout: fetched {got} B of records for {want} B of chunks + keyframes ({got / want:.3f}x)")
    assert lazy.head()[1] == ids[8]
    # Read again: all from the local store.
    before = lazy.cache.promisor.totals.record_bytes
    assert_state_equal(lazy.load(ids[8]), src.load(ids[8]))
    assert lazy.cache.promisor.totals.record_bytes == before
    assert lazy.fsck().ok
    lazy.close()
    remote.close()
    src.close()


def test_load_into_and_export_on_a_lazy_clone(tmp_path: Path, pushed: tuple[ckvc.Repo, list[str], str, str]) -> None:
    src, ids, url, endpoint = pushed
    run(tmp_path, "clone", "--lazy", "--endpoint", endpoint, url, "lz")
    lazy = ckvc.Repo.open(tmp_path / "lz")
    module = torch.nn.Module()
    module.register_buffer("w", torch.zeros(128, 256))
    module.register_buffer("b", torch.zeros(512))
    lazy.load_into(ids[4], model=module)
    assert_state_equal({"w": module.w, "b": module.b}, train_state(4)["model"])
    out = tmp_path / "e5.pt"
    result = run(tmp_path / "lz", "checkout", ids[5], "-o", str(out))
    assert result.exit_code == 0, result.output
    assert_state_equal(torch.load(out, weights_only=True), train_state(5))
    lazy.close()
    src.close()


def test_offline_cached_loads_uncached_raises_and_nothing_changes(
    tmp_path: Path, pushed: tuple[ckvc.Repo, list[str], str, str], s3_proxy: FaultProxy
) -> None:
    src, ids, url, endpoint = pushed
    lazy = ckvc.Repo.clone(url, tmp_path / "lazy", endpoint=endpoint, lazy=True)
    cached = lazy.checkout(ids[9])
    lazy.close()
    remote = remote_of(src)  # opened while the network is up (the source's view, to compare)
    s3_proxy.rules.append(Rule("status", status=403, count=None))  # the network is gone
    lazy = ckvc.Repo.open(tmp_path / "lazy")
    packs, head = sorted(lazy.store.packs()), lazy.head()
    assert_state_equal(lazy.load(ids[9]), cached)
    with pytest.raises(RemoteUnavailableError) as caught:
        lazy.checkout(ids[2])
    err = caught.value
    assert err.remote == "origin" and "origin" in str(err)
    # Missing: what ids[2] needs beyond what the cache holds.
    need = {oid for oid in chunk_closure(src, ids[2]) if not lazy.store.has(oid)}
    direct = {c for b in src.read_snapshot(src.read_commit(ids[2])).blobs for c in b.chunks}
    assert stored(remote, need & direct) <= err.missing_bytes <= stored(remote, need)
    assert f"{err.missing_bytes} bytes" in str(err)
    assert sorted(lazy.store.packs()) == packs and lazy.head() == head
    result = run(tmp_path / "lazy", "checkout", ids[2], "-o", str(tmp_path / "e2.pt"))
    assert result.exit_code == RemoteUnavailableError.exit_code == 34
    assert "cannot be reached" in result.output and not (tmp_path / "e2.pt").exists()
    assert sorted(lazy.store.packs()) == packs and lazy.head() == head
    lazy.close()
    remote.close()
    src.close()


def test_flaky_network_mid_checkout_retries_and_stays_exact(
    tmp_path: Path, pushed: tuple[ckvc.Repo, list[str], str, str], s3_proxy: FaultProxy
) -> None:
    src, ids, url, endpoint = pushed
    lazy = ckvc.Repo.clone(url, tmp_path / "lazy", endpoint=endpoint, lazy=True)
    s3_proxy.rules += [
        Rule("reset", method="GET", path="/packs/", count=2),
        Rule("truncate", method="GET", path="/packs/", count=2),
        Rule("slow", method="GET", path="/packs/", count=1, delay=0.3),
    ]
    state: Any = lazy.checkout(ids[7])
    assert s3_proxy.fired() >= 3
    assert_state_equal(state, src.load(ids[7]))
    assert lazy.fsck().ok
    lazy.close()
    src.close()


def test_a_lazy_read_decodes_each_fetched_chunk_once(
    tmp_path: Path, pushed: tuple[ckvc.Repo, list[str], str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode-once: a cold read's chunks are decoded and verified by the fetch
    straight into the read's tensors, and not read back from the local pack they
    were also written to; the next (warm) read reads every chunk from the local packs."""
    from ckvc import read as read_module

    src, ids, url, endpoint = pushed
    expected = src.load(ids[-1])
    lazy = ckvc.Repo.clone(url, tmp_path / "lazy", endpoint=endpoint, lazy=True)
    read_locally: list[bytes] = []
    original = read_module._read_batch

    def recording(store: Any, commit: Any, targets: Any) -> Any:
        read_locally.extend(read.oid for read, _ in targets)
        return original(store, commit, targets)

    monkeypatch.setattr(read_module, "_read_batch", recording)
    chunks = {c for blob in lazy.read_snapshot(lazy.read_commit(ids[-1])).blobs for c in blob.chunks}
    cold = lazy.load(ids[-1])
    assert_state_equal(cold, expected)
    assert read_locally == []  # every chunk landed in its tensor from the wire
    assert chunks <= {oid for oid, _ in lazy.store.index.iter_entries()}  # and is stored locally too
    warm = lazy.load(ids[-1])
    assert_state_equal(warm, expected)
    assert set(read_locally) == chunks
    assert lazy.fsck().ok
    lazy.close()
