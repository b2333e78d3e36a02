"""The cache budget: a scripted training trace on a lazy clone of a bucket on the
loopback S3 server keeps the local packs under ``cache_size`` after every step and
reports its hit rate; unpushed data is never dropped (it loads with the network
gone); pins hold; packs holding metadata are rewritten, not lost; the CLI."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from fault_proxy import FaultProxy, Rule
from helpers import assert_state_equal, run
from hybrid_util import make_history, pack_bytes, source_repo, train_state

import ckvc
from ckvc.errors import InvalidInputError, RemoteUnavailableError
from ckvc.ids import ObjectType


def remote_chunk_bytes(repo: ckvc.Repo) -> int:
    """Stored chunk bytes of the whole history, as the remote holds them."""
    from hybrid_util import remote_of

    remote = remote_of(repo)
    try:
        return sum(e.record_size for _, e in remote.core.store.index.iter_entries() if e.kind == ObjectType.CHUNK)
    finally:
        remote.close()


@pytest.mark.parametrize("where", ["dir", pytest.param("s3", marks=pytest.mark.slow)])
def test_budget_holds_through_a_training_trace_and_unpushed_data_stays(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    """50 operations; on a directory remote by default (2 s), on the S3 server
    through the fault proxy with CKVC_SOAK=1 (about 35 s: 30-odd pushes to moto)."""
    src = source_repo(tmp_path)
    ids = make_history(src, 12)
    proxy: FaultProxy | None = None
    endpoint = None
    if where == "s3":
        pytest.importorskip("obstore")
        url = f"s3://{request.getfixturevalue('s3_bucket')}/run"
        proxy = request.getfixturevalue("s3_proxy")
        endpoint = proxy.endpoint
    else:
        url = str(tmp_path / "bucket")
    src.remotes.add("origin", url, endpoint=endpoint)
    src.push()
    history = remote_chunk_bytes(src)
    budget = int(0.3 * history)
    lazy = ckvc.Repo.clone(url, tmp_path / "lazy", endpoint=endpoint, lazy=True)
    lazy.set_config(cache_size=budget)
    rng = random.Random(7)
    main = list(ids)
    step = len(ids)
    for op in range(50):
        kind = rng.choices(["resume", "eval", "branch"], [0.5, 0.35, 0.15])[0]
        if kind == "resume":  # load the latest, train one more epoch, back it up
            assert_state_equal(lazy.load(main[-1]), train_state(step - 1))
            main.append(lazy.commit(train_state(step), message=f"epoch {step}"))
            lazy.push()
            step += 1
        elif kind == "eval":  # evaluate an older checkpoint (its model only)
            old = rng.randrange(len(ids))
            model = train_state(old)["model"]
            assert_state_equal(lazy.load(ids[old], prefix="model."), {"model.w": model["w"], "model.b": model["b"]})
        else:  # branch from a past epoch: load it, train a step there, push the branch
            past = rng.randrange(len(ids))
            name = f"try{op}"
            lazy.switch(ids[past], new_branch=name)
            assert_state_equal(lazy.load(ids[past]), train_state(past))
            lazy.commit(train_state(past + 1, branch=op), message=f"{name}: from epoch {past}")
            lazy.push("origin", [name])
            lazy.switch("main")
        used = pack_bytes(lazy)
        assert used <= budget, (op, kind, used, budget)
    report = lazy.cache.report()
    assert report.used_bytes <= budget and report.evicted_packs > 0 and report.reads > 0
    assert report.hit_rate is not None and 0 < report.hit_rate < 1
    print(f"\ntrace: 50 ops, budget {budget} B (30% of {history} B), hit rate {report.hit_rate:.3f}, "
          f"evicted {report.evicted_packs} packs")  # fmt: skip

    # Local-only commits (auto_push is off, no push), then fill the cache with old epochs.
    local_only = []
    for i in range(3):
        local_only.append(lazy.commit(train_state(100 + i), message=f"unpushed {i}"))
    for old in range(len(ids)):
        lazy.load(ids[old])
    report = lazy.cache.report()
    assert report.unpushed_bytes > 0
    assert report.used_bytes - budget <= report.unpushed_bytes + 64 << 10  # only local-only data is over
    if proxy is not None:
        proxy.rules.append(Rule("status", status=403, count=None))  # the network is gone
    else:
        shutil.move(tmp_path / "bucket", tmp_path / "away")  # the mount is gone
    lazy.close()
    lazy = ckvc.Repo.open(tmp_path / "lazy")
    for i, cid in enumerate(local_only):
        assert_state_equal(lazy.load(cid), train_state(100 + i))
    with pytest.raises(RemoteUnavailableError):
        lazy.load(ids[0])  # dropped since: the remote is needed, and gone
    assert lazy.fsck().ok
    lazy.close()
    src.close()


def dir_setup(tmp_path: Path, n: int = 6) -> tuple[ckvc.Repo, list[str]]:
    """A plain repository with its history pushed to a directory remote."""
    repo = source_repo(tmp_path, "work")
    ids = make_history(repo, n)
    repo.remotes.add("origin", str(tmp_path / "bucket"))
    repo.push()
    return repo, ids


def test_prune_rewrites_packs_keeping_metadata_and_pins(tmp_path: Path) -> None:
    repo, ids = dir_setup(tmp_path)
    before = pack_bytes(repo)
    pinned = repo.cache.pin(ids[2])
    assert pinned == ids[2]
    repo.set_config(cache_size=0)  # drop everything a remote holds
    after = pack_bytes(repo)
    assert after < before / 3
    report = repo.cache.report()
    assert report.pins == {ids[2]: ids[2]} and report.used_bytes == after
    # Metadata stayed: history commands work without the remote.
    shutil.move(tmp_path / "bucket", tmp_path / "away")
    assert [c.id for c in repo.log()] == ids[::-1]
    assert_state_equal(repo.load(ids[2]), train_state(2))  # pinned: local
    with pytest.raises(RemoteUnavailableError) as caught:
        repo.load(ids[4])
    assert caught.value.missing_bytes > 0
    assert repo.fsck(level="metadata").ok
    shutil.move(tmp_path / "away", tmp_path / "bucket")
    assert_state_equal(repo.load(ids[4]), train_state(4))  # fetched back, verified
    checked = repo.fsck()
    assert checked.ok and checked.remote_chunks > 0
    repo.cache.unpin(ids[2])
    with pytest.raises(InvalidInputError):
        repo.cache.unpin(ids[2])
    assert repo.cache.prune().over_budget_bytes < 64 << 10  # only metadata is left
    # gc on a repository with remote-held chunks keeps what it holds and runs.
    repo.gc(now=True)
    assert_state_equal(repo.load(ids[5]), train_state(5))
    repo.close()


def test_eviction_waits_for_the_read_in_flight(tmp_path: Path) -> None:
    """A read over the budget fetches, and the cache evicts only once the read has
    returned: every eviction pass runs with no read in flight, and the load is whole."""
    repo, ids = dir_setup(tmp_path)
    repo.set_config(cache_size=0)  # everything a remote holds goes
    hybrid = repo.cache
    reads_at_eviction: list[int] = []
    hybrid.on_evict = lambda report: reads_at_eviction.append(repo.store._reads)
    fetched_in_load: list[int] = []
    real_ensure = repo.store.ensure

    fail: list[bool] = []

    def ensure(oids, landing=None):  # type: ignore[no-untyped-def]
        if fail:
            raise OSError("injected: the remote went away")
        landed = real_ensure(oids, landing)
        fetched_in_load.append(len(reads_at_eviction))  # no pass yet while the read runs
        return landed

    repo.store.ensure = ensure  # type: ignore[method-assign]
    assert_state_equal(repo.load(ids[4]), train_state(4))
    assert fetched_in_load == [0]
    assert reads_at_eviction and set(reads_at_eviction) == {0}
    fail.append(True)
    with pytest.raises(OSError, match="injected"):
        repo.load(ids[1])  # fails inside the read: the read still ends
    assert repo.store._reads == 0
    repo.close()


def test_cache_cli(tmp_path: Path) -> None:
    repo, ids = dir_setup(tmp_path, 4)
    repo.close()
    work = tmp_path / "work"
    assert run(work, "config", "cache_size", "100KiB").exit_code == 0
    shown = json.loads(run(work, "config", "--json").stdout)
    assert shown["cache_size"] == 100 << 10 and shown["auto_push"] is None
    status = json.loads(run(work, "cache", "--json").stdout)
    assert status["budget"] == 100 << 10 and status["used_bytes"] <= 100 << 10 + status["unpushed_bytes"]
    assert run(work, "cache", "pin", "HEAD").exit_code == 0
    assert json.loads(run(work, "cache", "--json").stdout)["pins"] == {ids[-1]: "HEAD"}
    pruned = json.loads(run(work, "cache", "prune", "--json").stdout)
    assert pruned["after_bytes"] <= pruned["before_bytes"]
    text = run(work, "cache").output
    assert "budget 100.0 KiB" in text and "pinned" in text
    assert run(work, "cache", "unpin", "HEAD").exit_code == 0
    bad = run(work, "config", "cache_size", "lots")
    assert bad.exit_code == InvalidInputError.exit_code and "not a size" in bad.output
    assert run(work, "config", "cache_size", "unlimited").exit_code == 0
    assert json.loads(run(work, "config", "--json").stdout)["cache_size"] is None


def test_fetch_and_pull_on_a_lazy_clone_move_metadata_only(tmp_path: Path) -> None:
    repo, _ = dir_setup(tmp_path, 3)
    lazy = ckvc.Repo.clone(str(tmp_path / "bucket"), tmp_path / "lazy", lazy=True)
    new = repo.commit(train_state(3), message="epoch 3")
    repo.push()
    pulled = lazy.pull()
    assert pulled.fast_forward and pulled.new == new
    assert pulled.fetch.stats.objects == 2  # its commit and snapshot
    assert not any(e.kind == ObjectType.CHUNK for _, e in lazy.store.index.iter_entries())
    assert_state_equal(lazy.load("main"), train_state(3))
    assert lazy.fetch().stats.objects == 0
    lazy.close()
    repo.close()


def test_offline_load_into_leaves_the_model_untouched(tmp_path: Path) -> None:
    import torch

    repo, ids = dir_setup(tmp_path, 3)
    repo.set_config(cache_size=0)  # every chunk is the remote's now
    shutil.move(tmp_path / "bucket", tmp_path / "away")
    module = torch.nn.Module()
    module.register_buffer("w", torch.full((128, 256), 7.0))
    module.register_buffer("b", torch.full((512,), 7.0))
    with pytest.raises(RemoteUnavailableError) as caught:
        repo.load_into(ids[1], model=module)
    assert "origin" in str(caught.value) and caught.value.missing_bytes > 0
    assert_state_equal({"w": module.w, "b": module.b}, {"w": torch.full((128, 256), 7.0), "b": torch.full((512,), 7.0)})
    shutil.move(tmp_path / "away", tmp_path / "bucket")
    repo.load_into(ids[1], model=module)
    assert_state_equal({"w": module.w, "b": module.b}, train_state(1)["model"])
    repo.close()
