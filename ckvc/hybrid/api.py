"""The hybrid cache's operations of :class:`ckvc.Repo` (status, auto_push's
backlog, the cache, its settings, a push that lets the cache drop what the
remote now holds) as functions of a Repository, which the facade binds with
``OnCore``. The cache itself hangs on the Repository (``core.hybrid``); each
function imports its module on first use, so a plain repository imports none."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckvc.core import ProgressCallback, Repository
from ckvc.remote import api as remote_api

if TYPE_CHECKING:
    from ckvc.config import RepoConfig
    from ckvc.hybrid.backup import Backlog
    from ckvc.hybrid.cache import Hybrid
    from ckvc.hybrid.status import Status
    from ckvc.remote.common import PushResult

HYBRID_SETTINGS = ("cache_size", "auto_push", "promisors")


def attached(core: Repository) -> Hybrid | None:
    """The cache attached to ``core``, if any."""
    if core.hybrid is None:
        return None
    from ckvc.hybrid.cache import Hybrid

    assert isinstance(core.hybrid, Hybrid)  # the only Attachment there is
    return core.hybrid


def attach(core: Repository) -> None:
    """Attach the cache of a repository opened from a directory, when it has one
    (a lazy clone, a cache budget or auto_push); a plain repository imports nothing more."""
    if core.hybrid is None and core.dir is not None and (core.dir / "hybrid.json").is_file():
        from ckvc.hybrid.cache import attach as attach_cache

        attach_cache(core)


def cache(core: Repository) -> Hybrid:
    """The local chunk cache: ``report()``, ``pin(rev)``, ``unpin(rev)``, ``prune()``
    (docs/GUIDE.md, "Three setups"). A plain repository gets one on first use,
    with no budget: everything stays local until ``cache_size`` is set."""
    hybrid = attached(core)
    if hybrid is None:
        from ckvc.hybrid.cache import Hybrid
        from ckvc.hybrid.settings import HybridSettings

        hybrid = Hybrid(core, HybridSettings.load(core))
    return hybrid


def set_config(core: Repository, **values: Any) -> RepoConfig:
    """As ``Repository.set_config``, plus the hybrid settings of this clone
    (``.ckvc/hybrid.json``): ``cache_size`` (bytes of local packs to keep,
    None: no limit), ``auto_push`` (a remote name, None: off) and
    ``promisors`` (remotes asked for chunks absent here)."""
    hybrid = {k: values.pop(k) for k in HYBRID_SETTINGS if k in values}
    if hybrid:
        from ckvc.hybrid.cache import configure

        configure(core, attached(core), **hybrid)
    return core.set_config(**values) if values else core.config


def status(core: Repository) -> Status:
    """HEAD and its standing against the remote (auto_push's, else origin): ahead
    and behind counts, and ``backed_up`` only when the remote's branch, as last
    seen, holds HEAD's commit (ckvc.hybrid.status)."""
    from ckvc.hybrid.status import status

    hybrid = attached(core)
    return status(core, backup_status(core), hybrid.settings.auto_push if hybrid is not None else None)


def backup_status(core: Repository) -> Backlog | None:
    """auto_push's backlog: commits not yet on the remote and how the last
    attempt went; None when auto_push is off."""
    hybrid = attached(core)
    return hybrid.backup.status() if hybrid is not None and hybrid.backup is not None else None


def wait_for_backup(core: Repository, timeout: float | None = None, *, while_reachable: bool = False) -> bool:
    """Wait until auto_push has pushed every queued commit (True), or ``timeout``
    passed (False); ``while_reachable``: or a push attempt failed (False at once,
    rather than waiting through the retries of a remote that is down)."""
    hybrid = attached(core)
    if hybrid is None or hybrid.backup is None:
        return True
    return hybrid.backup.wait(timeout, while_reachable=while_reachable)


def push(
    core: Repository, remote: str = "origin", refs: Sequence[str] | None = None, *, force: bool = False,
    tags: bool = False, progress: ProgressCallback | None = None,
) -> PushResult:  # fmt: skip
    """Send what ``remote`` lacks of ``refs`` (default: HEAD's branch; ``tags``: every
    tag), then move its refs by compare-and-swap, only forward unless ``force``.
    Then the cache may drop what the remote now holds."""
    result = remote_api.push(core, remote, refs, force=force, tags=tags, progress=progress)
    hybrid = attached(core)
    if hybrid is not None:
        hybrid.prune()
    if core.hooks is not None:
        moved = " ".join(f"{u.ref}={u.new}" for u in result.updated)
        core.hooks.run("post_push", {"CKVC_REMOTE": remote, "CKVC_REFS": moved})
    return result
