"""Rank functions for tests/distributed (run by ranks.run_world in spawned processes)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import numpy as np
import torch
from helpers import describe_state

import ckvc
import ckvc.distributed
from ckvc.errors import DistributedCommitError
from ckvc.write import OnConflict

TIME_NS = 1_700_000_000_000_000_000


def make_state(seed: int, rank: int, rich: bool, scale: int = 1) -> dict[str, Any]:
    """Rank ``rank``'s state: tensors only, or (``rich``) with views, numpy, tuples and
    plain values. ``scale`` multiplies the weight's rows (bigger commits take longer)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    weight = torch.randn(48 * scale, 64, generator=g)
    state: dict[str, Any] = {
        "model": {"weight": weight, "bias": torch.randn(64, generator=g).to(torch.bfloat16)},
        "optimizer": {"exp_avg": torch.randn(32, 40, generator=g), "step": torch.tensor(7 + rank)},
    }
    if rich:
        state["model"]["weight_t"] = weight.t()  # a view sharing the weight's storage
        state["table"] = np.arange(10, dtype=np.float64) * (rank + 1)
        state["betas"] = (0.9, 0.999)
        state["name"] = f"rank-{rank}"
        state["epoch"] = 3
    return state


def describe(state: Any) -> dict[str, Any]:
    """JSON-able and exact: numpy arrays by their bytes."""
    if isinstance(state, dict) and isinstance(state.get("table"), np.ndarray):
        state = {**state, "table": (state["table"].dtype.str, state["table"].tobytes().hex())}
    return describe_state(state)


def commit_and_load(rank: int, world: int, repo_dir: str, seed: int, rich: bool, blocking: bool) -> dict[str, Any]:
    """Commit this rank's state, then load this rank's part back."""
    with ckvc.Repo.open(repo_dir) as repo:
        state = make_state(seed, rank, rich)
        if blocking:
            commit_id = ckvc.distributed.commit(repo, state, "step 100", {"loss": 0.5}, time_ns=TIME_NS)
        else:
            pending = ckvc.distributed.commit(repo, state, "step 100", {"loss": 0.5}, time_ns=TIME_NS, blocking=False)
            state["model"]["weight"].add_(1.0)  # training goes on: the commit holds a copy
            state["optimizer"]["exp_avg"].zero_()
            commit_id = pending.result()
        loaded = ckvc.distributed.load(repo, commit_id)
        result = {"id": commit_id, "loaded": describe(loaded), "expected": describe(make_state(seed, rank, rich))}
        if not rich:  # and in place, into a live module of this rank's shapes
            module = torch.nn.Module()
            module.weight = torch.nn.Parameter(torch.zeros(48, 64))
            module.bias = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
            pointer = module.weight.data_ptr()
            ckvc.distributed.load_into(repo, commit_id, model=module)
            assert module.weight.data_ptr() == pointer
            result["load_into"] = describe(dict(module.state_dict()))
            result["expected_model"] = describe(make_state(seed, rank, rich)["model"])
        return result


def commit_expecting_failure(rank: int, world: int, repo_dir: str, failing_rank: int, step_of: str) -> dict[str, Any]:
    """Commit where rank ``failing_rank`` hands in a state ckvc refuses (or, with
    ``step_of="rank"``, every rank reports its own step under consistency_key)."""
    with ckvc.Repo.open(repo_dir) as repo:
        state: dict[str, Any] = make_state(1, rank, False)
        if step_of == "rank":
            state["step"] = rank
        else:
            state["step"] = 5
            if rank == failing_rank:
                state["bad"] = object()  # UnsupportedTypeError on this rank, before it writes
        try:
            commit_id = ckvc.distributed.commit(repo, state, "x", consistency_key="step", timeout=30)
        except DistributedCommitError as exc:
            return {"error": type(exc).__name__, "failures": {str(k): v for k, v in exc.failures.items()}}
        except ckvc.CkvcError as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        return {"id": commit_id}


def commit_with_a_victim(rank: int, world: int, repo_dir: str, victim: int, delay_s: float, timeout: float) -> Any:
    """Rank ``victim`` is SIGKILLed ``delay_s`` after the commit starts; the others
    report what their commit returned or raised, and how long it took."""
    with ckvc.Repo.open(repo_dir) as repo:
        state = make_state(2, rank, False, scale=512)
        started = time.monotonic()
        try:
            # The group is made before the victim's clock starts, but a rank can leave
            # new_group while its peer still connects: a kill at that instant fails the
            # peer's group, which commit_group reports as the typed error.
            ckvc.distributed.commit_group(timeout=timeout)
            if rank == victim:
                threading.Timer(delay_s, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
            commit_id = ckvc.distributed.commit(repo, state, f"victim {victim}", timeout=timeout)
            outcome: dict[str, Any] = {"id": commit_id}
        except DistributedCommitError as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc)}
        outcome["seconds"] = time.monotonic() - started
        if rank == victim:
            time.sleep(60)  # the timer fires: this rank never reports
        return outcome


def random_delays(runs: int, seed: int, longest_s: float) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(0.0, longest_s) for _ in range(runs)]


def distributed_commit_and_wait_backup(rank: int, world: int, repo_dir: str, blocking: bool) -> dict[str, Any]:
    """A distributed commit into a repository with auto_push: the coordinator's
    observers queue it, and it reaches the remote."""
    with ckvc.Repo.open(repo_dir) as repo:
        state = make_state(5, rank, rich=False)
        if blocking:
            commit_id = ckvc.distributed.commit(repo, state, "step 5", time_ns=TIME_NS)
        else:
            commit_id = ckvc.distributed.commit(repo, state, "step 5", time_ns=TIME_NS, blocking=False).result()
        backed_up = repo.wait_for_backup(120) and repo.status().backed_up
        return {"id": commit_id, "backed_up": backed_up}


def commit_with_a_writer_meanwhile(rank: int, world: int, repo_dir: str, on_conflict: OnConflict) -> dict[str, Any]:
    """A distributed commit during which another writer commits to the branch: the
    coordinator's finish first makes that commit (another handle, as another process
    would), so the branch has moved forward when the coordinator swaps it."""
    from ckvc import write

    with ckvc.Repo.open(repo_dir) as repo:
        interloper: list[str] = []
        if rank == 0:
            original = write.finish

            def finish_after_another_writer(*args: Any, **kwargs: Any) -> str:
                write.finish = original  # once: the other writer's own commit goes through it too
                with ckvc.Repo.open(repo_dir) as other:
                    interloper.append(other.commit({"other": torch.ones(3)}, message="another writer"))
                return original(*args, **kwargs)

            write.finish = finish_after_another_writer
        try:
            commit_id = ckvc.distributed.commit(
                repo,
                make_state(2, rank, False),
                "step 2",
                timeout=30,
                on_conflict=on_conflict,
            )
        except DistributedCommitError as exc:
            return {"error": type(exc).__name__, "message": str(exc), "interloper": interloper}
        return {"id": commit_id, "interloper": interloper}


def commit_and_wait_for_hooks(rank: int, world: int, repo_dir: str) -> dict[str, Any]:
    """A distributed commit into a repository with a post_commit hook; the hooks this
    process started finish before it returns (a rank does not run atexit)."""
    from ckvc.hooks import wait_for_hooks

    with ckvc.Repo.open(repo_dir) as repo:
        commit_id = ckvc.distributed.commit(repo, make_state(7, rank, rich=False), "step 7", time_ns=TIME_NS)
    wait_for_hooks()
    return {"id": commit_id}
