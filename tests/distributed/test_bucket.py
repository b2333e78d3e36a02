"""Training across machines that share only a bucket: 2 "nodes" (separate
directories, each with its own repository) x 2 gloo ranks, the S3 server on
loopback the only thing they share. A remote commit gives one id on every rank
and moves the bucket's branch; a fresh node (a lazy clone) loads each rank's
part bit-exact, fetching about that part's bytes; a failing or killed rank
leaves the bucket's branch unchanged or naming a complete commit."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import bucket_fns
import pytest
from fault_proxy import FaultProxy, Rule
from helpers import describe_state, tier
from rank_fns import describe, make_state
from ranks import run_world

import ckvc
import ckvc.distributed
from ckvc.remote.repository import Remote, open_remote

pytest.importorskip("obstore")

NODES = 2
WORLD = NODES * bucket_fns.RANKS_PER_NODE
CHUNK = 64 << 10


def _nodes(tmp_path: Path, url: str, endpoint: str) -> Path:
    """Each node's own repository (init + remote add: the first remote commit makes the bucket's)."""
    nodes = tmp_path / "nodes"
    for k in range(NODES):
        with ckvc.Repo.init(nodes / f"node{k}", chunk_size=CHUNK) as repo:
            repo.remotes.add("origin", url, endpoint=endpoint)
    return nodes


def _remote(repo: ckvc.Repo) -> Remote:
    return open_remote(repo.core, repo.remotes.get("origin"))


def _part_closure(remote: Remote, commit_id: str, rank: int) -> set[bytes]:
    """The chunks rank ``rank``'s part needs on the remote, delta bases included."""
    snapshot = remote.core.read_snapshot(remote.core.read_commit(commit_id))
    out: set[bytes] = set()
    for blob in snapshot.blobs:
        if blob.path != f"rank{rank}" and not blob.path.startswith(f"rank{rank}."):
            continue
        for chunk in blob.chunks:
            below: bytes | None = chunk
            while below is not None and below not in out:
                out.add(below)
                below = remote.core.store.delta_base(below)
    return out


def _fresh_node_checks(tmp_path: Path, url: str, proxy: FaultProxy, commit_id: str, step: int, name: str) -> None:
    """A node that has never seen the run clones lazily and loads each rank's part
    bit-exact, fetching at most 1.2x that part's stored bytes (+ metadata)."""
    fresh = ckvc.Repo.clone(url, tmp_path / name, endpoint=proxy.endpoint, lazy=True)
    try:
        assert fresh.head()[1] == commit_id
        remote = _remote(fresh)
        try:
            for rank in range(WORLD):
                closure = _part_closure(remote, commit_id, rank)
                part_bytes = sum(remote.core.store.locate(o).record_size for o in closure)
                proxy.reset_counts()
                loaded = ckvc.distributed.load(fresh, commit_id, rank=rank)
                fetched = proxy.body_bytes
                assert describe(loaded) == describe(make_state(step, rank, rich=True, scale=bucket_fns.SCALE))
                # the first read also opens the remote (config, refs, pack listing): metadata
                opening = 16 << 10 if rank == 0 else 0
                assert 0 < fetched <= 1.2 * part_bytes + opening, (rank, fetched, part_bytes)
                print(f"fresh node: rank {rank} part fetched {fetched} B for {part_bytes} B stored")
        finally:
            remote.close()
        assert fresh.fsck().ok
    finally:
        fresh.close()


@pytest.mark.parametrize("blocking", [True, pytest.param(False, marks=pytest.mark.stress)])  # async: test_throughput
def test_remote_commit_one_id_everywhere_and_a_fresh_node_resumes(
    tmp_path: Path, s3_bucket: str, s3_proxy: FaultProxy, s3_server: Any, blocking: bool
) -> None:
    url = f"s3://{s3_bucket}/run"
    nodes = _nodes(tmp_path, url, s3_server.endpoint)
    # parts in slices of 256 KiB: each rank's upload overlaps its writing, in several packs
    results = run_world(WORLD, bucket_fns.commit_steps, (str(nodes), [1, 2], blocking, 256 << 10))
    ids = results[0]["ids"]
    assert all(r["ids"] == ids for r in results), [r["ids"] for r in results]
    for rank, r in enumerate(results):
        assert r["loaded"] == r["expected"], rank
        assert r["head"] == ids[-1] and r["tracking"] == ids[-1], rank  # each node knows the commit
        assert r["status"]["backed_up"] is True, r["status"]
        if not blocking:
            assert r["stages"] == [True, True]
    with ckvc.Repo.open(nodes / "node1") as node:
        remote = _remote(node)
        try:
            assert remote.core.refs.read("refs/heads/main") == ids[-1]
            tip = remote.core.read_commit(ids[-1])
            assert tip.parents == (ids[0],)
            assert ckvc.distributed.world_size(tip) == WORLD
            # per commit, a pack of metadata and more than one a rank: its slices
            assert len(remote.core.store.index.indexed_packs()) >= 2 * (1 + 2 * WORLD)
        finally:
            remote.close()
        assert node.fsck_remote("origin").ok
        assert node.fsck().ok  # a node's clone: its own parts, the others' on the remote (lazy)
    _fresh_node_checks(tmp_path, url, s3_proxy, ids[-1], 2, "fresh")


def test_fresh_nodes_continue_the_run_from_lazy_clones(tmp_path: Path, s3_bucket: str, s3_server: Any) -> None:
    """Nodes that cloned the bucket lazily commit the next step: its parent is the
    bucket's commit, each rank deltas against its own part (fetched on demand)."""
    url = f"s3://{s3_bucket}/run"
    nodes = _nodes(tmp_path, url, s3_server.endpoint)
    (first,) = {r["ids"][0] for r in run_world(WORLD, bucket_fns.commit_steps, (str(nodes), [1], True))}
    later = tmp_path / "later"
    for k in range(NODES):
        ckvc.Repo.clone(url, later / f"node{k}", endpoint=s3_server.endpoint, lazy=True).close()
    results = run_world(WORLD, bucket_fns.commit_steps, (str(later), [2], True))
    (second,) = {r["ids"][0] for r in results}
    assert all(r["loaded"] == r["expected"] for r in results)
    with ckvc.Repo.open(later / "node0") as node:
        assert node.read_commit(second).parents == (first,)
        assert node.ls_remote("origin")["refs/heads/main"] == second


def _through_proxy(nodes: Path, node: int, endpoint: str) -> None:
    """Node ``node`` reaches the bucket through the fault proxy from now on."""
    with ckvc.Repo.open(nodes / f"node{node}") as repo:
        url = repo.remotes.get("origin").url
        repo.remotes.remove("origin")
        repo.remotes.add("origin", url, endpoint=endpoint)


def test_s3_faults_during_a_rank_upload(tmp_path: Path, s3_bucket: str, s3_server: Any, s3_proxy: FaultProxy) -> None:
    """Node 1 reaches the bucket through the fault proxy. Two 503s on its pack
    uploads are retried and the commit lands; uploads refused for good (403) mean
    no commit: DistributedCommitError on every rank naming node 1's ranks, the
    bucket's branch unchanged, and each node's branch too."""
    url = f"s3://{s3_bucket}/run"
    nodes = _nodes(tmp_path, url, s3_server.endpoint)
    (first,) = {r["ids"][0] for r in run_world(WORLD, bucket_fns.commit_steps, (str(nodes), [1], True))}
    _through_proxy(nodes, 1, s3_proxy.endpoint)
    s3_proxy.rules.append(Rule("status", method="PUT", path="/packs/", status=503, count=2))
    results = run_world(WORLD, bucket_fns.commit_steps, (str(nodes), [2], True))
    (second,) = {r["ids"][0] for r in results}
    assert s3_proxy.fired() == 2
    assert all(r["loaded"] == r["expected"] for r in results)
    s3_proxy.rules.append(Rule("status", method="PUT", path="/packs/", status=403, count=None))
    results = run_world(WORLD, bucket_fns.commit_expecting_failure, (str(nodes), 3))
    assert all(r["error"] == "DistributedCommitError" and r["failures"] == [2, 3] for r in results), results
    s3_proxy.rules.clear()
    for k in range(NODES):
        with ckvc.Repo.open(nodes / f"node{k}") as node:
            assert node.ls_remote("origin")["refs/heads/main"] == second
            assert node.head()[1] == second
            if k == 0:  # one bucket: read back whole once (orphan packs of the failed commit allowed)
                assert node.fsck_remote("origin").ok
    assert first != second


def _check_bucket_after_kill(tmp_path: Path, url: str, endpoint: str, before: str, case: str, *, whole: bool) -> str:
    """The bucket's branch is unchanged or names a complete commit; fsck of the
    remote is clean (``whole``: every object read back, else its refs and graph,
    the load below verifying every chunk the tip needs); a fresh node loads
    whatever it names bit-exact."""
    fresh = ckvc.Repo.clone(url, tmp_path / f"fresh-{case}", endpoint=endpoint, lazy=True)
    try:
        tip = fresh.head()[1]
        assert tip is not None
        report = fresh.fsck_remote("origin", level="full" if whole else "metadata")
        assert report.ok, (case, report)
        commit = fresh.read_commit(tip)
        step = int(commit.message.split()[1])
        assert tip == before or commit.parents == (before,), case
        for rank in range(WORLD):
            loaded = ckvc.distributed.load(fresh, tip, rank=rank)
            if step == 1:  # the first commit, made by commit_steps
                expected = make_state(step, rank, rich=True, scale=bucket_fns.SCALE)
            else:
                expected = make_state(step, rank, rich=False)
            assert describe(loaded) == describe(expected), (case, rank)
        return tip
    finally:
        fresh.close()


@pytest.mark.parametrize("kills", tier(4, 40, 150))
def test_sigkill_of_one_rank_during_remote_commits(tmp_path: Path, s3_bucket: str, s3_server: Any, kills: int) -> None:
    """Ranks SIGKILLed at chosen object-store calls of a remote commit (the
    coordinator and the others, early and late, and the coordinator right after its
    swap): the bucket's branch never names an incomplete commit."""
    url = f"s3://{s3_bucket}/run"
    nodes = _nodes(tmp_path, url, s3_server.endpoint)
    (before,) = {r["ids"][0] for r in run_world(WORLD, bucket_fns.commit_steps, (str(nodes), [1], True))}
    rng = random.Random(26 + kills)
    cases = [(0, 0)] + [(rng.randrange(WORLD), rng.randint(1, 14)) for _ in range(kills - 1)]
    landed = 0
    for i, (victim, after_calls) in enumerate(cases):
        step = 10 + i
        results = run_world(WORLD, bucket_fns.commit_with_a_kill, (str(nodes), step, victim, after_calls))
        assert results[victim] is None, (victim, after_calls, results[victim])  # it died
        survivors = [r for k, r in enumerate(results) if k != victim]
        ids = {r.get("id") for r in survivors}
        with ckvc.Repo.open(nodes / "node0") as node:  # what the kill could have touched: the bucket
            tip = node.ls_remote("origin")["refs/heads/main"]
            assert node.fsck_remote("origin", level="metadata").ok
        last = i == len(cases) - 1
        if tip != before or last:  # a new tip, and at the end: a fresh node resumes from it
            assert tip == _check_bucket_after_kill(
                tmp_path, url, s3_server.endpoint, before, f"{i}-{victim}", whole=last
            )
        if tip != before:  # landed: whoever answers says so; never a failure for a commit that landed
            landed += 1
            assert ids <= {tip}, (ids, tip)
            before = tip
        else:
            assert all("error" in r for r in survivors), survivors
        for k in range(NODES):  # each node knows what the bucket names, even when its first rank died
            with ckvc.Repo.open(nodes / f"node{k}") as node:
                assert node.head()[1] == before, (k, victim, after_calls)
    print(f"remote commit kills: {len(cases)} cases, {landed} landed")
    assert landed >= 1  # the kill after the coordinator's swap always lands


def test_dcp_saved_at_4_through_the_bucket_loads_at_2_and_1_on_fresh_nodes(
    tmp_path: Path, s3_bucket: str, s3_server: Any
) -> None:
    """DCP plans and reshards, ckvc stores: a save at world 4 (2 nodes x 2 ranks,
    each node its own repository) lands on the bucket; nodes that never saw the run
    load it bit-exact at world 2 and 1 from their own lazy clones."""
    from dcp_fns import full_tensors

    url = f"s3://{s3_bucket}/run"
    nodes = _nodes(tmp_path, url, s3_server.endpoint)
    (saved,) = {r["id"] for r in run_world(WORLD, bucket_fns.dcp_save, (str(nodes), 7))}
    with ckvc.Repo.open(nodes / "node1") as node:
        assert node.ls_remote("origin")["refs/heads/main"] == saved
        assert node.fsck_remote("origin").ok
    expected = describe_state(full_tensors(7))
    for world in (2, 1):
        fresh = tmp_path / f"fresh{world}"
        results = run_world(world, bucket_fns.dcp_load_fresh, (url, s3_server.endpoint, str(fresh), saved, 7))
        assert all(r["model"] == expected and r["step"] == 41 for r in results), world


@pytest.mark.parametrize("on_conflict", ["retry", "fail"])
def test_another_writer_moving_the_bucket_branch_meanwhile(
    tmp_path: Path, s3_bucket: str, s3_server: Any, on_conflict: str
) -> None:
    """retry: the step commit lands on top of the other writer's, one id on every rank,
    every node's branch there; fail: DistributedCommitError with advice, the bucket's
    branch naming the other writer's commit."""
    url = f"s3://{s3_bucket}/run"
    nodes = _nodes(tmp_path, url, s3_server.endpoint)
    scratch = tmp_path / "other-writer"
    results = run_world(WORLD, bucket_fns.commit_with_a_writer_meanwhile, (str(nodes), str(scratch), on_conflict))
    assert len(results[0]["interloper"]) == 1, results
    (interloper,) = results[0]["interloper"]
    first = results[0]["first"]
    with ckvc.Repo.open(nodes / "node1") as node:
        remote = _remote(node)
        try:
            tip = remote.core.refs.read("refs/heads/main")
            if on_conflict == "retry":
                landed = results[0]["id"]
                assert all(r["id"] == landed for r in results), results
                assert tip == landed and remote.core.read_commit(landed).parents == (interloper,)
                assert remote.core.read_commit(interloper).parents == (first,)
                for rank, r in enumerate(results):
                    assert r["loaded"] == r["expected"], rank
                    assert r["head"] == landed, (rank, r["warnings"], interloper, first)
                    assert r["warnings"] == [], rank
            else:
                assert {r["error"] for r in results} == {"DistributedCommitError"}
                assert "another writer moved main" in results[0]["message"]
                assert "on_conflict='retry'" in results[0]["message"]
                assert tip == interloper
        finally:
            remote.close()


def test_signed_remote_commits_under_require_signatures(
    tmp_path: Path, s3_bucket: str, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sign_commits and require_signatures on every node (the environment, as a cluster
    sets them): the coordinator signs the step commit before the bucket's branch moves,
    every node records the signature with the commit (each rank's load passes the
    policy), and a fresh node under the policy clones and verifies it."""
    from ckvc.signing import generate_key

    key = generate_key(tmp_path / "cluster")
    monkeypatch.setenv("CKVC_SIGN_KEY", str(key.path))
    monkeypatch.setenv("CKVC_SIGN_COMMITS", "1")
    monkeypatch.setenv("CKVC_TRUSTED_KEYS", str(key.path) + ".pub")
    monkeypatch.setenv("CKVC_REQUIRE_SIGNATURES", "1")
    url = f"s3://{s3_bucket}/signed-run"
    nodes = _nodes(tmp_path, url, s3_server.endpoint)
    results = run_world(WORLD, bucket_fns.commit_steps, (str(nodes), [1], True))
    commit_id = results[0]["ids"][-1]
    assert all(r["loaded"] == r["expected"] for r in results)  # each rank's load passed the policy
    for k in range(NODES):
        with ckvc.Repo.open(nodes / f"node{k}") as node:
            assert node.verify_commit(commit_id).signer == "cluster"
    fresh = ckvc.Repo.clone(url, tmp_path / "fresh", endpoint=s3_server.endpoint, lazy=True)
    try:
        assert fresh.verify_commit("HEAD").good
        assert describe(ckvc.distributed.load(fresh, commit_id, rank=1)) == results[1]["expected"]
    finally:
        fresh.close()
