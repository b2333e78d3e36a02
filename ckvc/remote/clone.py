"""clone, ls-remote and fsck of a remote."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ckvc.config import RepoConfig
from ckvc.core import Repository
from ckvc.errors import (
    CkvcError,
    InvalidInputError,
)
from ckvc.hybrid.settings import HybridSettings
from ckvc.ids import is_full_hex_id
from ckvc.refs import BRANCH_PREFIX, HEAD, RefStore, branch_ref
from ckvc.remote.common import Progress, remotes_of, tracking_ref
from ckvc.remote.fetch import fetch
from ckvc.remote.location import RemoteSpec, normalize_url, open_backend
from ckvc.remote.repository import open_remote
from ckvc.signing import TrustSettings
from ckvc.signing import trusted_keys as signing_keys

if TYPE_CHECKING:
    from ckvc.fsck import FsckReport

# ---- clone and listing -----------------------------------------------------------


def remote_head_branch(refs: RefStore, fallback: str) -> str:
    """The branch a remote's HEAD names (short), else ``fallback``."""
    try:
        target = refs.head_branch()
    except CkvcError:
        return fallback
    if target is None or not target.startswith(BRANCH_PREFIX):
        return fallback
    return target[len(BRANCH_PREFIX) :]


def clone(
    url: str,
    path: str | os.PathLike[str],
    *,
    endpoint: str | None = None,
    region: str | None = None,
    threads: int | None = None,
    progress: Progress | None = None,
    lazy: bool = False,
    trusted_keys: str | os.PathLike[str] | None = None,
    require_signatures: bool = False,
) -> Repository:
    """A new repository at ``path`` with the remote as ``origin``, everything
    fetched, and the remote HEAD's branch created and checked out (HEAD on it),
    like git. The remote is checked before anything is created; a clone that
    fails removes what it created. ``lazy``: refs and metadata only; chunks are
    fetched on first read (ckvc.hybrid). ``trusted_keys`` and ``require_signatures``
    are the new repository's trust settings, in force for the clone's own fetch:
    a remote whose refs no trusted key signed is refused before anything is copied."""
    import shutil

    from ckvc.core import REPO_DIR

    target = Path(path).resolve()
    trust = TrustSettings(require_signatures=require_signatures)
    if trusted_keys is not None:
        if not signing_keys(trusted_keys):
            raise InvalidInputError(f"{trusted_keys} holds no public key")
        trust.trusted_keys = str(Path(trusted_keys).expanduser().resolve())
    if require_signatures and trust.trusted_keys is None and not os.environ.get("CKVC_TRUSTED_KEYS"):
        raise InvalidInputError("require_signatures needs trusted keys (--trusted-keys or $CKVC_TRUSTED_KEYS)")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise InvalidInputError(f"cannot clone into {target}: it exists and is not an empty directory")
    normalized = normalize_url(url)
    backend = open_backend(normalized, endpoint=endpoint, region=region)
    try:
        config = RepoConfig.load_if_present(backend)
        if config is None:
            raise InvalidInputError(f"{url} holds no ckvc repository")
        branch = remote_head_branch(RefStore(backend), config.default_branch)
        names = RefStore(backend).list_refs(BRANCH_PREFIX)  # tombstones are not branches
        if BRANCH_PREFIX + branch not in names and names:
            branch = next(iter(names))[len(BRANCH_PREFIX) :]
    finally:
        backend.close()
    created = not target.exists()
    core = Repository.init_local(
        target,
        chunk_size=config.chunk_size,
        codec=config.codec,
        default_branch=branch,
        keyframe_interval=config.keyframe_interval,
        threads=threads,
    )
    try:
        core.upgrade_format(config.format_version)
        if trust != TrustSettings():
            trust.save(core.local_dir)
        remotes_of(core).add("origin", normalized, endpoint=endpoint, region=region)
        if lazy:
            HybridSettings(lazy=True, promisors=["origin"]).save(core)
        fetch(core, "origin", progress=progress)  # metadata only when lazy
        tip = core.refs.read(tracking_ref("origin", branch))
        if tip is not None:
            core.refs.set_if_equals(branch_ref(branch), None, tip, f"clone: from {url}")
    except BaseException:
        core.close()
        shutil.rmtree(target if created else target / REPO_DIR, ignore_errors=True)
        raise
    return core


def ls_remote(local: Repository | None, remote: str) -> dict[str, str]:
    """The remote's refs (full name -> id) and HEAD's commit, from a configured
    remote's name or a URL."""
    if local is not None and remote in remotes_of(local):
        spec = remotes_of(local).get(remote)
    else:
        spec = RemoteSpec("(url)", normalize_url(remote, None if local is None else local.path))
    backend = open_backend(spec.url, endpoint=spec.endpoint, region=spec.region)
    try:
        if RepoConfig.load_if_present(backend) is None:  # an unknown format version is refused here too
            raise InvalidInputError(f"{spec.url} holds no ckvc repository")
        refs = RefStore(backend)
        out: dict[str, str] = {}
        try:
            _, head_id = refs.head()
        except CkvcError:
            head_id = None
        if head_id is not None and is_full_hex_id(head_id):
            out[HEAD] = head_id
        out.update(refs.list_refs("refs/"))
        return out
    finally:
        backend.close()


def fsck_remote(
    local: Repository,
    remote: str = "origin",
    *,
    level: str = "full",
    sample: float | None = None,
    progress: Progress | None = None,
) -> FsckReport:
    """fsck of the remote ``remote`` itself: its refs, its commit graph and (level
    "full") every object re-read through its backend and re-hashed, or a
    ``sample`` fraction of them. Nothing local is read or changed but the catalog."""
    from ckvc.fsck import run_fsck

    handle = open_remote(local, remotes_of(local).get(remote))
    try:
        return run_fsck(handle.core, level=level, sample=sample, progress=progress)
    finally:
        handle.close()
