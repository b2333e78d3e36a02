"""The remote operations of :class:`ckvc.Repo` (push, fetch, pull, clone, ls-remote,
fsck of a remote), kept beside the code they call so that the facade stays thin.
Each imports its module on first use: the transfers load numpy and the codecs,
which the CLI's history commands never need."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from ckvc.core import ProgressCallback, Repository

if TYPE_CHECKING:
    from ckvc.fsck import FsckReport
    from ckvc.remote.common import FetchResult, PullResult, PushResult
    from ckvc.remote.gc import RemoteGcReport
    from ckvc.remote.location import RemoteList

Facade = TypeVar("Facade", bound="RemoteOps")


class RemoteOps:
    """Mixed into the facade (ckvc.Repo), which holds the ``core`` and is made from one."""

    core: Repository

    def __init__(self, core: Repository) -> None:  # the facade's own __init__ runs instead
        self.core = core

    @property
    def remotes(self) -> RemoteList:
        """The configured remotes: ``add(name, url, endpoint=, region=)``, ``remove``, ``list``, ``get``."""
        from ckvc.remote.common import remotes_of

        return remotes_of(self.core)

    def push(
        self, remote: str = "origin", refs: Sequence[str] | None = None, *, force: bool = False, tags: bool = False,
        progress: ProgressCallback | None = None,
    ) -> PushResult:  # fmt: skip
        """Send what ``remote`` lacks of ``refs`` (default: HEAD's branch; ``tags``: every
        tag), then move its refs by compare-and-swap, only forward unless ``force``."""
        from ckvc.remote.push import push

        return push(self.core, remote, refs, force=force, tags=tags, progress=progress)

    def fetch(self, remote: str = "origin", *, progress: ProgressCallback | None = None) -> FetchResult:
        """Copy what ``remote``'s branches and tags reach, verified, and move ``refs/remotes/<remote>/*``.
        A lazy clone fetches metadata only (its chunks come on first read)."""
        from ckvc.remote.fetch import fetch

        return fetch(self.core, remote, progress=progress)

    def pull(self, remote: str = "origin", *, progress: ProgressCallback | None = None) -> PullResult:
        """fetch, then fast-forward HEAD's branch to ``remote``'s (NonFastForwardError if diverged).
        A lazy clone fetches metadata only."""
        from ckvc.remote.fetch import pull

        return pull(self.core, remote, progress=progress)

    def ls_remote(self, remote: str = "origin") -> dict[str, str]:
        """A remote's refs (full name -> id, and HEAD), by configured name or URL."""
        from ckvc.remote.clone import ls_remote

        return ls_remote(self.core, remote)

    def remote_branches(self) -> dict[str, str]:
        """Remote-tracking branches: "origin/main" -> commit id."""
        from ckvc.remote.common import remote_branches

        return remote_branches(self.core)

    def fsck_remote(
        self, remote: str = "origin", *, level: str = "full", sample: float | None = None,
        progress: ProgressCallback | None = None,
    ) -> FsckReport:  # fmt: skip
        """fsck of a remote: its refs, graph and (level "full") every object read back
        through its backend and re-hashed; ``sample``: that fraction of them."""
        from ckvc.remote.clone import fsck_remote

        return fsck_remote(self.core, remote, level=level, sample=sample, progress=progress)

    def gc_remote(
        self, remote: str = "origin", *, dry_run: bool = False, now: bool = False, grace_s: float | None = None
    ) -> RemoteGcReport:
        """Delete the packs of ``remote`` that nothing live needs, safe against concurrent pushes."""
        from ckvc.remote.gc import gc_remote

        return gc_remote(self.core, remote, dry_run=dry_run, now=now, grace_s=grace_s)

    @classmethod
    def clone(
        cls: type[Facade], url: str, path: str | os.PathLike[str], *, endpoint: str | None = None,
        region: str | None = None, threads: int | None = None, progress: ProgressCallback | None = None,
        lazy: bool = False,
    ) -> Facade:  # fmt: skip
        """A new repository at ``path`` from the remote at ``url`` (as ``origin``), with
        the remote HEAD's branch checked out, like git clone. ``lazy``: refs and
        metadata only, tensor data fetched (verified) on first read."""
        from ckvc.remote.clone import clone

        core = clone(url, path, endpoint=endpoint, region=region, threads=threads, progress=progress, lazy=lazy)
        return cls(core)
