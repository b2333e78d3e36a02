"""Rank functions for tests/distributed/test_bucket.py: "nodes" are directories
``nodes/node<k>`` with ``RANKS_PER_NODE`` ranks each, sharing nothing but the S3
server (run by ranks.run_world in spawned processes)."""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path
from typing import Any

import torch
from rank_fns import TIME_NS, describe, make_state

import ckvc
import ckvc.distributed
from ckvc.errors import DistributedCommitError
from ckvc.write import OnConflict

RANKS_PER_NODE = 2
# Rows of each rank's weight x 48: parts of about 4.3 MB (over the S3 reader's 1 MiB
# coalescing gap), so that a fresh node's fetch of one part is measured against that
# part, not against a gap read to save a request.
SCALE = 350


def node_dir(nodes: str, rank: int) -> Path:
    return Path(nodes) / f"node{rank // RANKS_PER_NODE}"


def commit_steps(
    rank: int, world: int, nodes: str, steps: list[int], blocking: bool, slice_bytes: int | None = None
) -> dict[str, Any]:
    """One remote commit per step; what each node's repository knows afterwards.
    ``slice_bytes``: upload slices this small (several packs a part, each uploaded
    while the next is written)."""
    if slice_bytes is not None:
        ckvc.distributed.MIN_UPLOAD_SLICE = slice_bytes
    with ckvc.Repo.open(node_dir(nodes, rank)) as repo:
        ids: list[str] = []
        stages: list[bool] = []
        for step in steps:
            state = make_state(step, rank, rich=True, scale=SCALE)
            message = f"step {step}"
            if blocking:
                ids.append(ckvc.distributed.commit(repo, state, message, remote="origin", time_ns=TIME_NS + step))
            else:
                pending = ckvc.distributed.commit(
                    repo, state, message, remote="origin", time_ns=TIME_NS + step, blocking=False
                )
                pending.local()
                stages.append(True)
                state["model"]["weight"].add_(1.0)  # training goes on: the commit holds a copy
                ids.append(pending.result())
        loaded = ckvc.distributed.load(repo, ids[-1])
        return {
            "ids": ids,
            "head": repo.head()[1],
            "tracking": repo.remote_branches().get("origin/main"),
            "status": repo.status().to_json(),
            "loaded": describe(loaded),
            "expected": describe(make_state(steps[-1], rank, rich=True, scale=SCALE)),
            "stages": stages,
        }


def commit_expecting_failure(rank: int, world: int, nodes: str, step: int) -> dict[str, Any]:
    """A remote commit that some rank cannot make: every rank raises DistributedCommitError."""
    with ckvc.Repo.open(node_dir(nodes, rank)) as repo:
        state: dict[str, Any] = make_state(step, rank, rich=False)
        try:
            ckvc.distributed.commit(repo, state, f"step {step}", remote="origin", time_ns=TIME_NS + step)
        except DistributedCommitError as exc:
            return {"error": type(exc).__name__, "failures": sorted(exc.failures), "message": str(exc)}
        return {"error": None}


# The object-store calls a remote commit makes; a victim dies at the n-th of them.
KILL_POINTS = ("upload", "put", "put_if_absent", "compare_and_swap", "get", "get_versioned", "list", "read_tail")


def arm_kill(after_calls: int) -> None:
    """SIGKILL this process as it makes its ``after_calls``-th object-store call
    (counted from now): a kill instant chosen by the call, not by a timer."""
    from ckvc.storage.cloud import ObjectStoreBackend

    calls = [0]
    for name in KILL_POINTS:
        original = getattr(ObjectStoreBackend, name)

        def counted(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] >= after_calls:
                os.kill(os.getpid(), signal.SIGKILL)
            return _original(self, *args, **kwargs)

        setattr(ObjectStoreBackend, name, counted)


def kill_after_publish() -> None:
    """SIGKILL the coordinator right after its compare-and-swap on the remote, before it tells anyone."""
    from ckvc.remote import publish

    original = publish.publish

    def then_die(*args: Any, **kwargs: Any) -> tuple[publish.StepCommit, str]:
        original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    publish.publish = then_die


def commit_with_a_kill(rank: int, world: int, nodes: str, step: int, victim: int, after_calls: int) -> dict[str, Any]:
    """A remote commit during which rank ``victim`` is SIGKILLed at its
    ``after_calls``-th object-store call (0: right after the coordinator's swap)."""
    with ckvc.Repo.open(node_dir(nodes, rank)) as repo:
        if rank == victim:
            if after_calls == 0:
                kill_after_publish()
            else:
                arm_kill(after_calls)
        try:
            commit_id = ckvc.distributed.commit(
                repo, make_state(step, rank, rich=False), f"step {step}", remote="origin", time_ns=TIME_NS + step,
                timeout=60,
            )  # fmt: skip
            return {"id": commit_id}
        except DistributedCommitError as exc:
            return {"error": type(exc).__name__, "message": str(exc)}


def dcp_save(rank: int, world: int, nodes: str, seed: int) -> dict[str, Any]:
    """dcp.save of DTensors sharded over the world, through each node's repository to the bucket."""
    import torch.distributed.checkpoint as dcp
    from dcp_fns import dtensor_state

    import ckvc.dcp

    state = dtensor_state(world, seed, empty=False)
    with ckvc.Repo.open(node_dir(nodes, rank)) as repo:
        writer = ckvc.dcp.Writer(repo, message=f"dcp world {world}", remote="origin")
        metadata = dcp.save(state, storage_writer=writer)
        assert metadata.storage_meta is not None
        return {"id": metadata.storage_meta.checkpoint_id}


def dcp_load_fresh(rank: int, world: int, url: str, endpoint: str, fresh: str, rev: str, seed: int) -> dict[str, Any]:
    """A node that never saw the run: its own lazy clone, then dcp.load at this world size."""
    from dcp_fns import load_dtensors

    path = Path(fresh) / f"rank{rank}"
    ckvc.Repo.clone(url, path, endpoint=endpoint, lazy=True).close()
    return load_dtensors(rank, world, str(path), rev, seed)


def commit_with_a_writer_meanwhile(
    rank: int, world: int, nodes: str, scratch: str, on_conflict: OnConflict
) -> dict[str, Any]:
    """Step 1, then step 2 during which another writer (a clone of the bucket of its
    own) pushes a commit onto the bucket's branch: right before the coordinator
    publishes, so the branch has moved forward when it swaps."""
    from ckvc.remote import publish

    with ckvc.Repo.open(node_dir(nodes, rank)) as repo:
        first = ckvc.distributed.commit(repo, make_state(1, rank, rich=False), "step 1", remote="origin", timeout=60)
        interloper: list[str] = []
        if rank == 0:
            original = publish.publish
            spec = repo.remotes.get("origin")

            def publish_after_another_writer(*args: Any, **kwargs: Any) -> tuple[publish.StepCommit, str]:
                with ckvc.Repo.clone(spec.url, scratch, endpoint=spec.endpoint, lazy=True) as other:
                    interloper.append(other.commit({"other": torch.ones(3)}, message="another writer"))
                    other.push("origin")
                return original(*args, **kwargs)

            publish.publish = publish_after_another_writer
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                commit_id = ckvc.distributed.commit(
                    repo, make_state(2, rank, rich=False), "step 2", remote="origin", timeout=60,
                    on_conflict=on_conflict,
                )  # fmt: skip
        except DistributedCommitError as exc:
            return {"first": first, "error": type(exc).__name__, "message": str(exc), "interloper": interloper}
        loaded = ckvc.distributed.load(repo, commit_id)
        return {
            "first": first,
            "id": commit_id,
            "interloper": interloper,
            "head": repo.head()[1],
            "loaded": describe(loaded),
            "expected": describe(make_state(2, rank, rich=False)),
            "warnings": [str(w.message) for w in caught],
        }
