"""Repository: a repository's parts composed (config, object store, ref store,
prune log, one executor), reading commits, snapshots and tags.

Everything else (revisions and history in ckvc.graph, writing in ckvc.write,
maintenance in ckvc.fsck / gc / retention, reports in ckvc.inspect) is
functions over a Repository; ``Repo`` (ckvc.repo) is the public facade over
them. A Repository is given its parts, so another backend (an in-memory twin)
is one more constructor; :meth:`Repository.open_local` and
:meth:`Repository.init_local` build today's local directory.
"""

from __future__ import annotations

import copy
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckvc.codecs import Codec, make_codec
from ckvc.config import RepoConfig
from ckvc.errors import CkvcError, CorruptObjectError, DurabilityWarning, InvalidInputError, NotARepositoryError
from ckvc.executor import Executor
from ckvc.ids import ObjectType
from ckvc.objects import Commit, Snapshot, Tag
from ckvc.pruned import PruneLog, PruneRecord
from ckvc.refs import RefStore, branch_ref
from ckvc.storage.files import require_writable
from ckvc.storage.object_store import ObjectStore

REPO_DIR = ".ckvc"
# flock targets a new repository holds from the start (gc, writer pins, refs, prune log)
LOCK_FILES = ("gc.lock", "gc-intent.lock", "gc-run.lock", "refs.lock", "pruned.lock")

# done bytes, total bytes
ProgressCallback = Callable[[int, int], None]


def find_repo_root(start: str | os.PathLike[str]) -> Path:
    """The directory holding ``.ckvc``, searching ``start`` and its parents like git."""
    path = Path(start).resolve()
    if path.name == REPO_DIR and (path / "config.json").is_file():
        return path.parent
    for candidate in (path, *path.parents):
        if (candidate / REPO_DIR / "config.json").is_file():
            return candidate
    raise NotARepositoryError(f"not a ckvc repository (or any parent up to /): {path}")


class Repository:
    """The parts of one repository. ``path`` is the working directory holding
    ``.ckvc`` and ``dir`` that ``.ckvc`` (both None for a repository with no
    local directory)."""

    def __init__(
        self,
        *,
        config: RepoConfig,
        store: ObjectStore,
        refs: RefStore,
        prune_log: PruneLog,
        executor: Executor,
        path: Path | None = None,
        dir: Path | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.refs = refs
        self.prune_log = prune_log
        self.executor = executor
        self.path = path
        self.dir = dir
        self.codec: Codec = make_codec(str(config.codec["name"]), config.codec.get("level"))
        if self.refs.repair_pending(self.object_exists):
            self._repair_on_open()

    # ---- construction -------------------------------------------------------
    @classmethod
    def open_local(cls, path: str | os.PathLike[str] = ".", threads: int | None = None) -> Repository:
        """The repository at ``path`` or in one of its parents (like git)."""
        executor = Executor(threads)  # a bad ``threads`` fails before anything is opened
        root = find_repo_root(path)
        repo_dir = root / REPO_DIR
        config = RepoConfig.load(repo_dir)
        return cls(
            config=config,
            store=ObjectStore(repo_dir),
            refs=RefStore(repo_dir),
            prune_log=PruneLog(repo_dir),
            executor=executor,
            path=root,
            dir=repo_dir,
        )

    @classmethod
    def init_local(
        cls,
        path: str | os.PathLike[str] = ".",
        *,
        chunk_size: int | None = None,
        codec: Mapping[str, Any] | None = None,
        default_branch: str = "main",
        keyframe_interval: int | None = None,
        threads: int | None = None,
    ) -> Repository:
        """Create ``path/.ckvc`` (and ``path`` if needed), built in a temporary
        directory and renamed into place, so a crash leaves no half repository."""
        root = Path(path).resolve()
        target = root / REPO_DIR
        if target.exists():
            raise InvalidInputError(f"{target} already exists")
        if root.exists() and not root.is_dir():
            raise InvalidInputError(f"{root} is not a directory")
        config = RepoConfig(default_branch=default_branch)
        if chunk_size is not None:
            config.chunk_size = chunk_size
        if codec is not None:
            config.codec = dict(codec)
        if keyframe_interval is not None:
            config.keyframe_interval = keyframe_interval
        try:
            config.validate()
            branch_ref(default_branch)
        except ValueError as exc:
            if isinstance(exc, CkvcError):
                raise
            raise InvalidInputError(str(exc)) from None
        root.mkdir(parents=True, exist_ok=True)
        staging = root / f".ckvc-init-{uuid.uuid4().hex}"
        try:
            staging.mkdir()
            for sub in ("packs", "refs/heads", "refs/tags", "logs"):
                (staging / sub).mkdir(parents=True)
            config.save(staging)
            for lock in LOCK_FILES:
                (staging / lock).touch()
            RefStore(staging).init_head(branch_ref(default_branch))
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return cls.open_local(root, threads=threads)

    def _repair_on_open(self) -> None:
        """Finish what an update left undone after it took effect (a reflog entry
        or directory fsync that failed; docs/DESIGN.md, "Exact outcomes"). A
        repository that still cannot be written keeps the marker for later."""
        try:
            restored = self.refs.repair()
        except (OSError, CkvcError):
            return
        if restored:
            warnings.warn(DurabilityWarning(f"restored {restored} reflog entries lost to failed writes"), stacklevel=4)

    def close(self) -> None:
        self.executor.close()
        self.store.close()

    def __repr__(self) -> str:
        return f"Repository({str(self.path)!r})"

    # ---- reading ------------------------------------------------------------
    def object_exists(self, oid: str) -> bool:
        try:
            return self.store.has(bytes.fromhex(oid))
        except (ValueError, CkvcError):
            return False

    def read_commit(self, commit_id: str) -> Commit:
        try:
            raw = self.store.read(bytes.fromhex(commit_id), ObjectType.COMMIT)
        except CorruptObjectError as exc:
            raise exc.with_context(commit=commit_id) from None
        return Commit.decode(raw, commit_id)

    def read_tag(self, tag_id: str) -> Tag:
        return Tag.decode(self.store.read(bytes.fromhex(tag_id), ObjectType.TAG), tag_id)

    def read_snapshot(self, commit: Commit) -> Snapshot:
        try:
            return Snapshot.decode(self.store.read(bytes.fromhex(commit.tree), ObjectType.SNAPSHOT))
        except CorruptObjectError as exc:
            raise exc.with_context(commit=commit.id) from None

    def pruned(self) -> dict[str, PruneRecord]:
        """Commits whose data a retention policy released: id -> when and by which policy."""
        return self.prune_log.records()

    # ---- writing ------------------------------------------------------------
    def require_writable(self, action: str) -> None:
        """Refuse a write up front in a repository this process cannot write (a
        read-only mount, no write permission), even one that would change nothing."""
        if self.dir is not None:
            require_writable(self.dir, action)

    def stored_config(self) -> RepoConfig:
        """The config as stored now (another process may have changed it)."""
        return RepoConfig.load(self.dir) if self.dir is not None else copy.deepcopy(self.config)

    def save_config(self, config: RepoConfig) -> None:
        """Store ``config`` and use it from now on (its codec too)."""
        if self.dir is not None:
            config.save(self.dir)
        codec_changed = config.codec != self.config.codec
        self.config = config
        if codec_changed:
            self.codec = make_codec(str(config.codec["name"]), config.codec.get("level"))

    def upgrade_format(self, version: int) -> None:
        """Raise the repository's format version to ``version`` before writing what
        older versions lack, so an older ckvc refuses the repository up front instead
        of failing on (or calling corrupt) that object. Nothing to do if it is there."""
        if self.config.format_version >= version:
            return
        config = self.stored_config()
        config.format_version = max(config.format_version, version)
        self.save_config(config)
