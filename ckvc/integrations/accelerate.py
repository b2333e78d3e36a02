"""Accelerate through ckvc: the folder ``accelerator.save_state`` writes becomes a
commit (every file as it is: model.safetensors, optimizer.bin, random_states_K.pkl,
...), and ``load_state`` puts a commit back as that folder, byte for byte, and
loads it.

    commit_id = save_state(accelerator, repo)         # after accelerator.save_state's own work
    load_state(accelerator, repo, "main~2")           # resume from any commit

Accelerate has no end-of-training hook: with ``blocking=False`` call ``repo.wait()``
(or ``repo.close()``) when training ends; the next ``save_state`` raises an
earlier background failure.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckvc.errors import InvalidInputError
from ckvc.formats import export_commit, read_checkpoint
from ckvc.integrations.runs import commit, open_repo

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ckvc.committer import PendingCommit
    from ckvc.repo import Repo

__all__ = ["DIR_KEY", "STEP_KEY", "load_state", "save_state"]

DIR_KEY = "accelerate.dir"  # the folder's name, "checkpoint_3" with automatic naming
STEP_KEY = "accelerate.step"
LOAD_DIR = ".ckvc-load"  # where load_state puts a commit back, under the project dir (or cwd)


def save_state(
    accelerator: Accelerator,
    repo: Repo | str | os.PathLike[str],
    output_dir: str | os.PathLike[str] | None = None,
    *,
    message: str | None = None,
    metrics: Mapping[str, float] | None = None,
    blocking: bool = True,
    **save_kwargs: Any,
) -> str | PendingCommit | None:
    """``accelerator.save_state(output_dir, **save_kwargs)``, then, once every process
    has written, commit the folder on the main process. Returns the commit id (a
    PendingCommit with ``blocking=False``, which needs a Repo to wait on); None on
    the other processes. ``message``: default the folder's name."""
    from ckvc.repo import Repo

    if not blocking and not isinstance(repo, Repo):
        raise InvalidInputError("save_state(blocking=False) needs a Repo: its wait() finishes the background commits")
    folder = Path(accelerator.save_state(None if output_dir is None else os.fspath(output_dir), **save_kwargs))
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return None
    target = open_repo(repo)
    tree, source = read_checkpoint(folder)
    metadata = {**source, DIR_KEY: folder.name, STEP_KEY: int(accelerator.step)}
    return commit(target, tree, message or folder.name, metrics or {}, metadata, blocking=blocking)


def load_state(
    accelerator: Accelerator, repo: Repo | str | os.PathLike[str], rev: str = "HEAD", **load_kwargs: Any
) -> str:
    """Write commit ``rev`` (a save_state folder) back under the project directory
    (``.ckvc-load/<commit>``; the current directory without one), byte for byte,
    ``accelerator.load_state`` it on every process, then remove it. HEAD does not
    move. Returns the commit id."""
    from ckvc.repo import Repo

    source = repo if isinstance(repo, Repo) else Repo.open(repo)
    commit_id = source.resolve(rev)
    folder = Path(accelerator.project_dir or os.getcwd()) / LOAD_DIR / commit_id[:16]
    if DIR_KEY not in source.readable_commit(commit_id).metadata:  # every process checks: none waits alone
        raise InvalidInputError(f"{rev!r} ({commit_id[:12]}) was not made by ckvc's save_state")
    if accelerator.is_main_process:
        folder.parent.mkdir(parents=True, exist_ok=True)
        export_commit(source, commit_id, folder)
    accelerator.wait_for_everyone()
    try:
        accelerator.load_state(str(folder), **load_kwargs)
    finally:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)
    return commit_id
