"""The remote operations of :class:`ckvc.Repo` (push, fetch, pull, ls-remote,
fsck and gc of a remote) as functions of a Repository, which the facade binds
with ``OnCore`` like every other operation. Each imports its module on first
use: the transfers load numpy and the codecs, which the CLI's history commands
never need."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckvc.core import ProgressCallback, Repository

if TYPE_CHECKING:
    from ckvc.fsck import FsckReport
    from ckvc.remote.common import FetchResult, PullResult, PushResult
    from ckvc.remote.gc import RemoteGcReport
    from ckvc.remote.location import RemoteList
    from ckvc.remote.push import MirrorResult
    from ckvc.remote.repair import RepairReport
    from ckvc.retention import RetentionPlan
    from ckvc.retention_policy import RetentionPolicy


def remotes(core: Repository) -> RemoteList:
    """The configured remotes: ``add(name, url, endpoint=, region=)``, ``remove``, ``list``, ``get``."""
    from ckvc.remote.common import remotes_of

    return remotes_of(core)


def push(
    core: Repository, remote: str = "origin", refs: Sequence[str] | None = None, *, force: bool = False,
    tags: bool = False, progress: ProgressCallback | None = None,
) -> PushResult:  # fmt: skip
    """Send what ``remote`` lacks of ``refs`` (default: HEAD's branch; ``tags``: every
    tag), then move its refs by compare-and-swap, only forward unless ``force``."""
    from ckvc.remote.push import push

    return push(core, remote, refs, force=force, tags=tags, progress=progress)


def fetch(core: Repository, remote: str = "origin", *, progress: ProgressCallback | None = None) -> FetchResult:
    """Copy what ``remote``'s branches and tags reach, verified, and move ``refs/remotes/<remote>/*``.
    A lazy clone fetches metadata only (its chunks come on first read)."""
    from ckvc.remote.fetch import fetch

    return fetch(core, remote, progress=progress)


def pull(core: Repository, remote: str = "origin", *, progress: ProgressCallback | None = None) -> PullResult:
    """fetch, then fast-forward HEAD's branch to ``remote``'s (NonFastForwardError if diverged).
    A lazy clone fetches metadata only."""
    from ckvc.remote.fetch import pull

    return pull(core, remote, progress=progress)


def ls_remote(core: Repository, remote: str = "origin") -> dict[str, str]:
    """A remote's refs (full name -> id, and HEAD), by configured name or URL."""
    from ckvc.remote.clone import ls_remote

    return ls_remote(core, remote)


def remote_branches(core: Repository) -> dict[str, str]:
    """Remote-tracking branches: "origin/main" -> commit id."""
    from ckvc.remote.common import remote_branches

    return remote_branches(core)


def fsck_remote(
    core: Repository, remote: str = "origin", *, level: str = "full", sample: float | None = None,
    progress: ProgressCallback | None = None,
) -> FsckReport:  # fmt: skip
    """fsck of a remote: its refs, graph and (level "full") every object read back
    through its backend and re-hashed; ``sample``: that fraction of them."""
    from ckvc.remote.clone import fsck_remote

    return fsck_remote(core, remote, level=level, sample=sample, progress=progress)


def repair(
    core: Repository, remotes: Sequence[str] | None = None, *, rebuild_index: bool = False,
    progress: ProgressCallback | None = None,
) -> RepairReport:  # fmt: skip
    """fsck, then fetch what it finds damaged or missing again from ``remotes`` (default:
    every configured one), verified, into new packs, and drop the damaged copies; the
    report ends with a full fsck of the result."""
    from ckvc.remote.repair import repair

    return repair(core, remotes, rebuild_index=rebuild_index, progress=progress)


def gc_remote(
    core: Repository, remote: str = "origin", *, dry_run: bool = False, now: bool = False,
    grace_s: float | None = None,
) -> RemoteGcReport:  # fmt: skip
    """Delete the packs of ``remote`` that nothing live needs, safe against concurrent pushes."""
    from ckvc.remote.gc import gc_remote

    return gc_remote(core, remote, dry_run=dry_run, now=now, grace_s=grace_s)


def retain_remote(
    core: Repository, remote: str = "origin", policy: RetentionPolicy | None = None, *, dry_run: bool = False
) -> RetentionPlan:
    """Apply a retention policy (default: the stored one) to ``remote``'s branches;
    ``gc_remote`` then frees the released commits' data."""
    from ckvc.remote.gc import retain_remote

    return retain_remote(core, remote, policy, dry_run=dry_run)


def mirror(
    source: str, target: str, *, source_endpoint: str | None = None, target_endpoint: str | None = None,
    source_region: str | None = None, target_region: str | None = None, prune: bool = False,
    progress: ProgressCallback | None = None,
) -> MirrorResult:  # fmt: skip
    """``ckvc mirror SOURCE TARGET``: every branch and tag of ``source`` (a remote URL,
    or the path of a local repository) on ``target`` (a URL; created if it holds no
    repository), sending only the objects it lacks, streamed and verified, with no
    local copy; ``prune`` deletes target refs the source lacks. Resumable."""
    from pathlib import Path

    from ckvc.core import REPO_DIR
    from ckvc.remote.location import RemoteSpec, normalize_url
    from ckvc.remote.push import mirror_to
    from ckvc.remote.repository import open_remote

    local = Path(source)
    opened = None
    if "://" not in source and (local / REPO_DIR / "config.json").is_file():
        core = Repository.open_local(local)
    else:
        opened = open_remote(None, RemoteSpec("source", normalize_url(source), source_endpoint, source_region))
        core = opened.core
    try:
        spec = RemoteSpec("target", normalize_url(target), target_endpoint, target_region)
        handle = open_remote(None, spec, create_from=core.config)
        try:
            return mirror_to(core, handle, prune=prune, progress=progress, label=source)
        finally:
            handle.close()
    finally:
        core.close()


def push_mirror(core: Repository, remote: str = "origin", *, progress: ProgressCallback | None = None) -> MirrorResult:
    """``ckvc push --mirror REMOTE``: ``mirror`` from this repository to a configured
    remote (every branch and tag, forced; refs it lacks deleted), its remote-tracking
    refs moved to match."""
    from ckvc.refs import BRANCH_PREFIX
    from ckvc.remote.common import move_tracking, remotes_of
    from ckvc.remote.push import mirror_to
    from ckvc.remote.repository import open_remote

    spec = remotes_of(core).get(remote)
    handle = open_remote(core, spec, create_from=core.config)
    try:
        done = mirror_to(core, handle, prune=True, progress=progress, label=str(core.path))
    finally:
        handle.close()
    for update in done.updated:
        if update.ref.startswith(BRANCH_PREFIX):
            move_tracking(core, spec.name, update.ref[len(BRANCH_PREFIX) :], update.new, "push --mirror")
    return done
