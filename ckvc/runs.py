"""The run a commit comes from (issue 28): its id, world size and device mesh shape,
recorded in the commit's metadata when there is a run to name, and checked when a
resume loads it. Imports no torch until asked for the world size."""

from __future__ import annotations

import os
from typing import Any

from ckvc.errors import InvalidInputError, RunMismatchError
from ckvc.objects import Commit

# Commit metadata naming the run a commit came from:
# {"id": run id, "world_size": n, "mesh": "dp=2,tp=4", "step": n}, each where known.
RUN_KEY = "ckvc.run"
_mesh: str | None = None


def mesh_text(mesh: Any) -> str:
    """A mesh shape as commits record it, "dp=2,tp=4" (dimension names in order): from a
    torch DeviceMesh (its dimension names and shape), a mapping name -> size, or
    such a text."""
    if isinstance(mesh, str):
        pairs = [part.partition("=") for part in mesh.split(",") if part.strip()]
        named = {name.strip(): size.strip() for name, _, size in pairs}
    elif isinstance(mesh, dict):
        named = {str(k): str(v) for k, v in mesh.items()}
    elif hasattr(mesh, "mesh") and hasattr(mesh.mesh, "shape"):
        names = getattr(mesh, "mesh_dim_names", None) or [f"dim{i}" for i in range(len(mesh.mesh.shape))]
        named = {str(n): str(int(d)) for n, d in zip(names, mesh.mesh.shape, strict=True)}
    else:
        raise InvalidInputError(f"a mesh is a DeviceMesh, a dict of sizes or 'dp=2,tp=4', got {mesh!r:.80}")
    if not named or any(not n or not v.isdigit() or int(v) < 1 for n, v in named.items()):
        raise InvalidInputError(f"a mesh shape is names with positive sizes, e.g. 'dp=2,tp=4'; got {mesh!r:.80}")
    return ",".join(f"{n}={int(v)}" for n, v in named.items())


def set_mesh(mesh: Any) -> None:
    """Tell ckvc this process's device mesh (``ckvc.set_mesh(device_mesh)``, a dict of
    sizes, or "dp=2,tp=4"; None forgets it), recorded by its commits and checked on
    resume. $CKVC_MESH says the same for a process that cannot call it."""
    global _mesh
    _mesh = None if mesh is None else mesh_text(mesh)


def mesh_now() -> str | None:
    if _mesh is not None:
        return _mesh
    text = os.environ.get("CKVC_MESH", "").strip()
    return mesh_text(text) if text else None


def world_size_now() -> int | None:
    """This process's world: its process group's size, else torchrun's WORLD_SIZE."""
    import torch.distributed as dist  # only now: the CLI's history commands import no torch

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    text = os.environ.get("WORLD_SIZE", "")
    return int(text) if text.isdigit() and int(text) > 0 else None


def step_of(state: Any) -> int | None:
    """The training step a state says it is at: its top-level "global_step" or "step"
    (an int), as the Trainer, Lightning and plain loops save it."""
    if isinstance(state, dict):
        for key in ("global_step", "step"):
            value = state.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def current_run(step: int | None = None) -> dict[str, Any] | None:
    """What a commit records of its run (RUN_KEY): the run id (CKVC_RUN_ID, else
    torchrun's TORCHELASTIC_RUN_ID) and the world size; None for a single process
    outside any run, whose commits stay as they were."""
    run_id = os.environ.get("CKVC_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    world = world_size_now()
    mesh = mesh_now()
    if not run_id and (world is None or world == 1) and mesh is None:
        return None
    return {
        **({"id": run_id} if run_id else {}),
        **({"world_size": world} if world is not None else {}),
        **({"mesh": mesh} if mesh is not None else {}),
        **({"step": step} if step is not None else {}),
    }


def run_matches(commit: Commit) -> None:
    """RunMismatchError when ``commit`` was made at another world size or device mesh
    shape than this process's (both known): a resume that silently changes the global
    batch, the data order, each rank's RNG or which shard a rank holds is not the run
    it continues."""
    run = commit.metadata.get(RUN_KEY)
    if not isinstance(run, dict):
        return
    named = f" (run {run['id']})" if isinstance(run.get("id"), str) else ""
    advice = "reshard through ckvc.dcp, or pass check_run=False to load it anyway"
    recorded = run.get("world_size")
    now = world_size_now()
    if type(recorded) is int and now is not None and recorded != now:
        raise RunMismatchError(
            f"commit {commit.id[:12]} was made at world size {recorded}{named}; this process runs at world size "
            f"{now}: resume at {recorded}, {advice}"
        )
    recorded_mesh, mesh = run.get("mesh"), mesh_now()
    if isinstance(recorded_mesh, str) and mesh is not None and recorded_mesh != mesh:
        raise RunMismatchError(
            f"commit {commit.id[:12]} was made on device mesh {recorded_mesh}{named}; this process's mesh is "
            f"{mesh}: resume on {recorded_mesh}, {advice}"
        )
