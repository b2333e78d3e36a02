"""``repo.status()`` / ``ckvc status``: where HEAD is and whether it is backed up.

"Backed up" is said only of a commit that the remote's branch holds, as this
repository last saw it (its remote-tracking ref, moved by every push, fetch and
remote commit), never from a backlog that happens to be empty: a commit made by
a path that queued nothing (a DCP save, a distributed commit) is then reported
as not backed up, with the newest such commit named.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ckvc import graph
from ckvc.core import Repository
from ckvc.hybrid.backup import Backlog
from ckvc.refs import BRANCH_PREFIX
from ckvc.remote.common import remotes_of, tracking_ref


@dataclass
class Status:
    """HEAD and its standing against a remote.

    ``remote``: the remote compared with (auto_push's, else ``origin``, else the
    only remote with a tracking ref for this branch; None: nothing to compare).
    ``remote_commit``: that remote's branch as last seen. ``ahead`` / ``behind``:
    commits only here / only there. ``backed_up``: HEAD's commit is held by the
    remote's branch (None without a remote or a commit). ``not_backed_up``: the
    newest commit the remote lacks (HEAD's), when not backed up. ``backlog``:
    auto_push's queue and its last error."""

    branch: str | None
    commit: str | None
    remote: str | None = None
    remote_commit: str | None = None
    ahead: int = 0
    behind: int = 0
    backed_up: bool | None = None
    not_backed_up: str | None = None
    backlog: Backlog | None = None
    tracking: list[Tracking] = field(default_factory=list)  # every remote that has this branch, as last seen

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "branch": self.branch,
            "commit": self.commit,
            "remote": self.remote,
            "remote_commit": self.remote_commit,
            "ahead": self.ahead,
            "behind": self.behind,
            "backed_up": self.backed_up,
            "not_backed_up": self.not_backed_up,
        }
        if self.backlog is not None:
            out["backup"] = self.backlog.to_json()
        out["tracking"] = [asdict(t) for t in self.tracking]
        return out


@dataclass(frozen=True)
class Tracking:
    """HEAD's branch against one remote's copy of it (``refs/remotes/<remote>/<branch>``),
    as git status says "ahead of 'origin/main' by 2 commits"."""

    remote: str
    commit: str
    ahead: int
    behind: int


def _compared_remote(core: Repository, branch: str | None, auto_push: str | None) -> str | None:
    if auto_push is not None:
        return auto_push
    names = [spec.name for spec in remotes_of(core).list()]
    if not names:
        return None
    if "origin" in names:
        return "origin"
    if branch is not None:
        tracked = [n for n in names if core.refs.read(tracking_ref(n, branch)) is not None]
        if len(tracked) == 1:
            return tracked[0]
    return names[0] if len(names) == 1 else None


def count_only_in(core: Repository, tip: str, other: str) -> int:
    """Commits reachable from ``tip`` and not from ``other``."""
    seen: set[str] = set()
    for _ in graph.walk(core, [other], seen):
        pass
    return sum(1 for reached in graph.walk(core, [tip], seen) if reached.commit is not None)


def status(core: Repository, backlog: Backlog | None = None, auto_push: str | None = None) -> Status:
    """HEAD's branch and commit, and how they stand against the compared remote."""
    target, commit = core.refs.head()
    branch = target[len(BRANCH_PREFIX) :] if target is not None and target.startswith(BRANCH_PREFIX) else None
    result = Status(branch, commit, backlog=backlog)
    result.remote = _compared_remote(core, branch, auto_push)
    if branch is not None and commit is not None:
        for spec in remotes_of(core).list():
            theirs = core.refs.read(tracking_ref(spec.name, branch))
            if theirs is not None:
                ahead = 0 if theirs == commit else count_only_in(core, commit, theirs)
                behind = 0 if theirs == commit else count_only_in(core, theirs, commit)
                result.tracking.append(Tracking(spec.name, theirs, ahead, behind))
    if result.remote is None or branch is None:
        return result
    there = core.refs.read(tracking_ref(result.remote, branch))
    result.remote_commit = there
    if commit is None:
        return result
    if there is None:
        result.ahead = sum(1 for reached in graph.walk(core, [commit]) if reached.commit is not None)
    else:  # counted above, with every remote that has the branch
        (compared,) = (t for t in result.tracking if t.remote == result.remote)
        result.ahead, result.behind = compared.ahead, compared.behind
    result.backed_up = result.ahead == 0
    result.not_backed_up = None if result.backed_up else commit
    return result
