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

import atexit
import copy
import getpass
import os
import shutil
import socket
import sys
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

from ckvc.config import CODECS4_VERSION, CODECS_VERSION, RepoConfig
from ckvc.errors import (
    CkvcError,
    CorruptObjectError,
    DurabilityWarning,
    InvalidInputError,
    NotARepositoryError,
    UnsupportedFormatError,
)
from ckvc.executor import Executor
from ckvc.ids import ObjectType
from ckvc.objects import Commit, Snapshot, Tag
from ckvc.pruned import PruneLog, PruneRecord
from ckvc.refs import RefStore, branch_ref
from ckvc.storage.durable import require_writable
from ckvc.storage.object_store import ObjectStore

if TYPE_CHECKING:
    from ckvc.codecs import Codec

REPO_DIR = ".ckvc"
# flock targets a new repository holds from the start (gc, writer pins, refs, prune log)
LOCK_FILES = ("gc.lock", "gc-intent.lock", "gc-run.lock", "refs.lock", "pruned.lock")

# done bytes, total bytes
ProgressCallback = Callable[[int, int], None]


def default_author() -> str:
    """Who commits: $CKVC_AUTHOR, else user@host."""
    name = os.environ.get("CKVC_AUTHOR")
    if name:
        return name
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def check_utf8(what: str, *values: Any) -> None:
    """Text must encode as UTF-8: a str holding lone surrogates (undecodable bytes
    from a command line or file name) cannot be stored."""
    for value in values:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidInputError(f"{what} is not valid UTF-8 text: {value!r}") from None


def find_repo_root(start: str | os.PathLike[str]) -> Path:
    """The directory holding ``.ckvc``, searching ``start`` and its parents like git."""
    path = Path(start).resolve()
    if path.name == REPO_DIR and (path / "config.json").is_file():
        return path.parent
    for candidate in (path, *path.parents):
        if (candidate / REPO_DIR / "config.json").is_file():
            return candidate
    raise NotARepositoryError(f"not a ckvc repository (or any parent up to /): {path}")


def new_config(
    chunk_size: int | None, codec: Mapping[str, Any] | None, default_branch: str, keyframe_interval: int | None
) -> RepoConfig:
    """The config of a new repository, checked (InvalidInputError for a bad option)."""
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
    return config


# Work a process finishes before it exits, in this order: background commits land
# (ckvc.committer), then auto_push pushes what they queued (ckvc.hybrid.backup).
# Each step returns the exit status the process must end with (a failure nobody
# was told of), or None.
EXIT_ORDER = ("background commits", "auto_push", "hooks")
_exit_steps: dict[str, Callable[[], int | None]] = {}


def at_exit(name: str, step: Callable[[], int | None]) -> None:
    """Run ``step`` at interpreter exit, in its place in EXIT_ORDER."""
    assert name in EXIT_ORDER, name
    _exit_steps[name] = step


@atexit.register
def _finish_at_exit() -> None:
    status = None
    for name in EXIT_ORDER:
        step = _exit_steps.get(name)
        if step is not None:
            status = status or step()
    if status:
        sys.stdout.flush()
        sys.stderr.flush()
        # SystemExit raised in an atexit handler does not change the status; this does.
        os._exit(status)


class Attachment(Protocol):
    """What a layer above hangs on a Repository (the hybrid cache): closed with it."""

    def close(self) -> None: ...


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
        # Called with each ckvc.write.Committed once a commit has landed on this
        # repository, by every commit path (ckvc.write fires them): stats,
        # retention, the hybrid cache and auto_push hang here, not in the facade.
        self.commit_observers: list[Callable[[Any], None]] = []
        # The hybrid cache in front of this repository's remotes, when one is
        # attached (ckvc.hybrid.api); closed first by close().
        self.hybrid: Attachment | None = None
        # Other things layers above keep open on this repository (remotes kept
        # between commits to them: ckvc.remote.publish), by name; closed with it.
        self.attachments: dict[str, Attachment] = {}
        # hooks.json's commands (ckvc.hooks.HookRunner), attached by the facade when the
        # repository sets any.
        self.hooks: Any = None
        self._codec: Codec | None = None
        if self.refs.repair_pending(self.object_exists):
            self._repair_on_open()

    @property
    def codec(self) -> Codec:
        """The configured encoder, made on first use: reading needs none (nor numpy)."""
        if self._codec is None:
            from ckvc.codecs import make_codec

            config = self.config
            format4 = config.format_version >= CODECS4_VERSION
            self._codec = make_codec(str(config.codec["name"]), config.codec.get("level"), format4)
        return self._codec

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
        config = new_config(chunk_size, codec, default_branch, keyframe_interval)
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

    @classmethod
    def in_memory(
        cls,
        *,
        chunk_size: int | None = None,
        codec: Mapping[str, Any] | None = None,
        default_branch: str = "main",
        keyframe_interval: int | None = None,
        threads: int | None = None,
        object_store_semantics: bool = False,
    ) -> Repository:
        """A new repository on a MemoryBackend, gone when dropped: the twin the fast
        tests run on (``ckvc.Repo(Repository.in_memory())``). ``object_store_semantics``:
        a backend without rename, appends or OS locks, as an object store is."""
        executor = Executor(threads)
        config = new_config(chunk_size, codec, default_branch, keyframe_interval)
        from ckvc.storage.memory import MemoryBackend

        backend = MemoryBackend(object_store_semantics=object_store_semantics)
        config.save(backend)
        refs = RefStore(backend)
        refs.init_head(branch_ref(default_branch))
        return cls(config=config, store=ObjectStore(backend), refs=refs, prune_log=PruneLog(backend), executor=executor)

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

    @property
    def local_path(self) -> Path:
        """``path``, where only a local repository will do (InvalidInputError otherwise)."""
        if self.path is None:
            raise InvalidInputError("this repository has no local directory")
        return self.path

    @property
    def local_dir(self) -> Path:
        """``dir``, where only a local repository will do (InvalidInputError otherwise)."""
        if self.dir is None:
            raise InvalidInputError("this repository has no local directory")
        return self.dir

    @property
    def threads(self) -> int:
        return self.executor.threads

    def close(self) -> None:
        try:
            if self.hybrid is not None:
                self.hybrid.close()
            for attachment in self.attachments.values():
                attachment.close()
        finally:
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
        if config.codec != self.config.codec:
            self._codec = None
        self.config = config

    def set_config(self, **values: Any) -> RepoConfig:
        """Change settings: reflog_expiry_s, gc_grace_s, repack_threshold (lifecycle),
        keyframe_interval (int) and codec ({"name": "auto"|"zstd"|"raw", "level": n}).
        Choosing a version-2 codec upgrades a version 1 repository's format (older
        ckvc then refuses it, rather than misreading it)."""
        numbers = {"reflog_expiry_s", "gc_grace_s", "repack_threshold"}
        unknown = set(values) - numbers - {"keyframe_interval", "codec"}
        if unknown:
            settable = sorted(numbers | {"keyframe_interval", "codec"})
            raise InvalidInputError(f"unknown or read-only setting(s): {sorted(unknown)}; settable: {settable}")
        self.require_writable("changing the config")
        config = self.stored_config()
        for key, value in values.items():
            if key == "codec":
                if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
                    raise InvalidInputError(f"codec must be a mapping with a name, got {value!r}")
                config.codec = dict(value)
                if config.codec["name"] not in ("raw", "zstd"):
                    config.format_version = max(config.format_version, CODECS_VERSION)
            elif key == "keyframe_interval":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise InvalidInputError(f"keyframe_interval must be an integer, got {value!r}")
                config.keyframe_interval = value
            else:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise InvalidInputError(f"{key} must be a number, got {value!r}")
                setattr(config, key, float(value))
        try:
            config.validate()
        except (ValueError, UnsupportedFormatError) as exc:
            raise InvalidInputError(str(exc)) from None
        self.save_config(config)
        return config

    def upgrade_format(self, version: int) -> None:
        """Raise the repository's format version to ``version`` before writing what
        older versions lack, so an older ckvc refuses the repository up front instead
        of failing on (or calling corrupt) that object. Nothing to do if it is there."""
        if self.config.format_version >= version:
            return
        config = self.stored_config()
        config.format_version = max(config.format_version, version)
        self.save_config(config)


# ---- binding the core's functions to a facade -----------------------------------

P = ParamSpec("P")
R = TypeVar("R")


class HasCore(Protocol):
    core: Repository


class OnCore(Generic[P, R]):
    """A function of a Repository as a method of a facade holding one (``.core``),
    docstring and types included: ``repo.log(...)`` is ``graph.log(repo.core, ...)``."""

    def __init__(self, fn: Callable[Concatenate[Repository, P], R]) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> OnCore[P, R]: ...

    @overload
    def __get__(self, instance: HasCore, owner: type[Any] | None = None) -> Callable[P, R]: ...

    def __get__(self, instance: HasCore | None, owner: type[Any] | None = None) -> OnCore[P, R] | Callable[P, R]:
        if instance is None:
            return self
        fn, core = self.fn, instance.core

        def bound(*args: P.args, **kwargs: P.kwargs) -> R:
            return fn(core, *args, **kwargs)

        bound.__doc__ = fn.__doc__
        return bound


class Part(Generic[R]):
    """One of the parts of a facade's Repository (``.core``), as an attribute;
    assigning it replaces the core's part (a test swapping in another store)."""

    def __init__(self, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> Part[R]: ...

    @overload
    def __get__(self, instance: HasCore, owner: type[Any] | None = None) -> R: ...

    def __get__(self, instance: HasCore | None, owner: type[Any] | None = None) -> Part[R] | R:
        if instance is None:
            return self
        value: R = getattr(instance.core, self.name)
        return value

    def __set__(self, instance: HasCore, value: R) -> None:
        setattr(instance.core, self.name, value)
