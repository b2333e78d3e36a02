"""The run a commit comes from (issue 28): its id and world size, recorded in the
commit's metadata when there is a run to name, and checked when a resume loads it.
Imports no torch until asked for the world size."""

from __future__ import annotations

import os
from typing import Any

from ckvc.errors import RunMismatchError
from ckvc.objects import Commit

# Commit metadata naming the run a commit came from: {"id": run id, "world_size": n}.
RUN_KEY = "ckvc.run"


def world_size_now() -> int | None:
    """This process's world: its process group's size, else torchrun's WORLD_SIZE."""
    import torch.distributed as dist  # only now: the CLI's history commands import no torch

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    text = os.environ.get("WORLD_SIZE", "")
    return int(text) if text.isdigit() and int(text) > 0 else None


def current_run() -> dict[str, Any] | None:
    """What a commit records of its run (RUN_KEY): the run id (CKVC_RUN_ID, else
    torchrun's TORCHELASTIC_RUN_ID) and the world size; None for a single process
    outside any run, whose commits stay as they were."""
    run_id = os.environ.get("CKVC_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    world = world_size_now()
    if not run_id and (world is None or world == 1):
        return None
    return {**({"id": run_id} if run_id else {}), **({"world_size": world} if world is not None else {})}


def run_matches(commit: Commit) -> None:
    """RunMismatchError when ``commit`` was made at another world size than this
    process's (both known): a resume that silently changes the global batch, the data
    order and each rank's RNG is not the run it continues."""
    run = commit.metadata.get(RUN_KEY)
    if not isinstance(run, dict):
        return
    recorded = run.get("world_size")
    now = world_size_now()
    if type(recorded) is int and now is not None and recorded != now:
        named = f" (run {run['id']})" if isinstance(run.get("id"), str) else ""
        raise RunMismatchError(
            f"commit {commit.id[:12]} was made at world size {recorded}{named}; this process runs at world size "
            f"{now}: resume at {recorded}, reshard through ckvc.dcp, or pass check_run=False to load it anyway"
        )
