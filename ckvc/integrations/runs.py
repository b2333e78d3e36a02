"""What the framework integrations (transformers, lightning, accelerate) share: the
repository a training run commits to, the branch it commits on, and its commits
in flight, each with what to do once it has landed (delete a local folder, release
a commit) so that nothing is removed before the commit that replaces it is durable.

Background commits (``blocking=False``) land in order on one thread
(ckvc.committer.BackgroundCommits); :class:`Landings` only looks at their futures from
the training thread, so a follow-up never races the commit it waits for, and a
failed commit raises in the training process at the next save or at the end.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckvc.core import REPO_DIR
from ckvc.refs import branch_ref

if TYPE_CHECKING:
    from ckvc.committer import PendingCommit
    from ckvc.repo import Repo


def open_repo(repo_or_path: Repo | str | os.PathLike[str]) -> Repo:
    """``repo_or_path`` itself when it is a Repo; else the repository at that path,
    created there when there is none (a run's first save makes its repository)."""
    from ckvc.repo import Repo

    if isinstance(repo_or_path, Repo):
        return repo_or_path
    path = Path(repo_or_path)
    if (path / REPO_DIR / "config.json").is_file():
        return Repo.open(path)
    return Repo.init(path)


def finish_backups(repo: Repo) -> None:
    """At the end of training: auto_push's backlog goes to a reachable remote (as
    at interpreter exit, up to ckvc.hybrid.backup's exit wait), so a job that is
    torn down right after the trainer returns loses no backup; a remote that is
    down is not waited for (``ckvc status`` and the next open still have it)."""
    if repo.backup_status() is None:
        return
    from ckvc.hybrid.backup import exit_wait_s

    repo.wait_for_backup(exit_wait_s(), while_reachable=True)


def use_branch(repo: Repo, branch: str | None, start: str | None = None) -> None:
    """Make the next commits land on ``branch`` (None: wherever HEAD is): HEAD moves
    onto it, and a branch that does not exist yet starts at ``start`` (a revision;
    default HEAD's commit)."""
    if branch is None:
        return
    name, commit_id = repo.head()
    if name == branch:
        return
    if branch in repo.branches():
        repo.switch(branch)
    elif commit_id is not None:
        repo.switch(start or "HEAD", new_branch=branch)
    else:  # an empty repository: the branch is born with the first commit
        repo.refs.set_head(branch=branch_ref(branch), message=f"checkout: moving to {branch}")


def commit(
    repo: Repo, state: Any, message: str, metrics: Mapping[str, float], metadata: Mapping[str, Any], *,
    blocking: bool, allow_pickle: bool = False,
) -> str | PendingCommit:  # fmt: skip
    """``repo.commit`` of one save, in the foreground or the background; on top of
    another writer's commit made meanwhile (on_conflict="retry")."""
    if blocking:
        return repo.commit(state, message, metrics, metadata, allow_pickle=allow_pickle, on_conflict="retry")
    return repo.commit(
        state, message, metrics, metadata, allow_pickle=allow_pickle, blocking=False, on_conflict="retry"
    )


@dataclass
class Landings:
    """Commits made by one integration, blocking or not, with the follow-up of each
    (called with the commit id once it is durable), run in commit order."""

    pending: list[tuple[str | PendingCommit, Callable[[str], None]]] = field(default_factory=list)

    def add(self, commit: str | PendingCommit, then: Callable[[str], None]) -> None:
        self.pending.append((commit, then))
        self.settle()

    def settle(self, *, wait: bool = False) -> None:
        """Run the follow-ups of the commits that have landed (all, waiting for them,
        with ``wait``); a failed commit raises here, its follow-ups never run."""
        while self.pending:
            commit, then = self.pending[0]
            if not isinstance(commit, str) and not (wait or commit.done()):
                return
            self.pending.pop(0)
            then(commit if isinstance(commit, str) else commit.result())
