"""A remote as a bare ckvc repository on a Backend (docs/FORMAT.md section 18),
opened as a :class:`ckvc.core.Repository`, so refs (compare-and-swap), packs,
reads with verification, fsck and gc are the local code over another backend.

Its index is a local cache, the *catalog*: what the remote's packs hold, read
from their tables of contents (three small ranged reads per pack) and kept in
``.ckvc/remotes/<name>/catalog`` (an LMDB index like the repository's own). It
is refreshed by listing ``packs/``: only new pack names are read; packs gone
from the listing (a remote gc) are dropped. A catalog of another repository
that took the same URL (its ``repo_id`` differs) is cleared first.
"""

from __future__ import annotations

import collections
import concurrent.futures
import shutil
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckvc.config import CONFIG_NAME, RepoConfig
from ckvc.core import Repository
from ckvc.errors import CorruptObjectError, ObjectNotFoundError, UnknownRemoteError
from ckvc.executor import Executor
from ckvc.ids import Buffer
from ckvc.pruned import PruneLog
from ckvc.refs import RefStore, branch_ref
from ckvc.remote.location import REMOTES_DIR, RemoteSpec, open_backend
from ckvc.storage.backend import STREAM_PIECE, Backend, ForwardingBackend, KeyInfo, Sink, Version
from ckvc.storage.index import AnyIndex, Index, MemoryIndex
from ckvc.storage.local import LocalBackend
from ckvc.storage.object_store import ObjectStore
from ckvc.storage.packs import RecordInfo

CATALOG_DIR = "catalog"
CATALOG_READERS = 8  # TOCs read at once when a catalog learns of new packs
REPO_ID_FILE = "repo_id"


class RequestCounter(ForwardingBackend):
    """Counts the calls made through the Backend interface (each one request of a
    remote backend; a multipart upload counts as its sink's publish, a coalesced
    ``read_ranges`` as one)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1

    @property
    def requests(self) -> int:
        return sum(self.calls.values())

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self._count("read")
        super().read_into(key, offset, out)

    def readv_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self._count("read")
        super().readv_into(key, offset, buffers)

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[int, memoryview]]:
        self._count("read_ranges")
        return super().read_ranges(key, ranges)

    def read_tail(self, key: str, size: int) -> tuple[int, memoryview]:
        self._count("read")
        return super().read_tail(key, size)

    def read_stream(self, key: str, offset: int, size: int, piece: int = STREAM_PIECE) -> Iterator[memoryview]:
        self._count("read_stream")
        return super().read_stream(key, offset, size, piece)

    def size(self, key: str) -> int:
        self._count("stat")
        return super().size(key)

    def stat(self, key: str) -> KeyInfo | None:
        self._count("stat")
        return super().stat(key)

    def get(self, key: str) -> bytes | None:
        self._count("get")
        return super().get(key)

    def get_versioned(self, key: str) -> tuple[bytes, Version] | None:
        self._count("get")
        return super().get_versioned(key)

    def open_sink(self, key: str) -> Sink:
        self._count("upload")
        return super().open_sink(key)

    def put(self, key: str, data: Buffer) -> None:
        self._count("put")
        super().put(key, data)

    def replace(self, key: str, data: Buffer) -> None:
        self._count("put")
        super().replace(key, data)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        self._count("put")
        return super().put_if_absent(key, data)

    def compare_and_swap(self, key: str, expected: Version | None, data: Buffer) -> Version:
        self._count("put")
        return super().compare_and_swap(key, expected, data)

    def delete(self, key: str) -> None:
        self._count("delete")
        super().delete(key)

    def list(self, prefix: str = "", *, recursive: bool = True) -> Iterator[str]:
        self._count("list")
        return super().list(prefix, recursive=recursive)

    def list_sizes(self, prefix: str = "", *, recursive: bool = True) -> dict[str, int]:
        self._count("list")
        return super().list_sizes(prefix, recursive=recursive)


@dataclass
class Remote:
    """An opened remote: its spec, its (counting) backend and the bare repository on it."""

    spec: RemoteSpec
    backend: RequestCounter
    core: Repository
    damaged: list[str]  # packs whose table of contents could not be read

    @property
    def name(self) -> str:
        return self.spec.name

    def describe(self, key: str) -> str:
        return f"remote {self.spec.name} ({self.spec.url}) key {key}"

    def close(self) -> None:
        self.core.close()


def catalog_dir(local: Repository, name: str) -> Path | None:
    return None if local.dir is None else local.dir / REMOTES_DIR / name


def drop_catalog(local: Repository, name: str) -> None:
    """Remove a remote's catalog (``remote remove``); nothing else depends on it."""
    where = catalog_dir(local, name)
    if where is not None:
        shutil.rmtree(where, ignore_errors=True)


def _catalog(local: Repository, name: str, repo_id: str) -> AnyIndex:
    where = catalog_dir(local, name)
    if where is None:
        return MemoryIndex()  # a repository without a directory keeps no cache
    where.mkdir(parents=True, exist_ok=True)
    id_file = where / REPO_ID_FILE
    if id_file.is_file() and id_file.read_text().strip() != repo_id:
        shutil.rmtree(where / CATALOG_DIR, ignore_errors=True)  # another repository took this URL
    index = Index(where / CATALOG_DIR)
    id_file.write_text(repo_id + "\n")
    return index


def refresh_catalog(store: ObjectStore, damaged: list[str] | None = None) -> int:
    """Index the remote's packs the catalog does not know (their TOCs only, from
    the TOC copies where there are, else from each pack's end) and forget those
    the listing no longer has. Returns the packs added. A pack
    whose TOC cannot be read is left out (and named in ``damaged``): its objects
    count as absent (a push sends them again; a fetch needing them fails naming it)."""
    index = store.index
    listing = store.pack_listing(sizes=True)
    listed, copied = listing.packs, listing.copied
    store.know_pack_sizes(listing.sizes)
    known = index.indexed_packs()
    added = 0

    def read(name: str) -> tuple[list[RecordInfo], bool]:
        if name in copied:  # one small GET rather than ranged reads of the pack
            entries = store.pack_entries_from_copy(name)
            if entries is not None:
                return entries, True
        try:
            # a large pack's header is checked by the first read of its records:
            # a clone streams them from the pack's start, so that costs no request
            return store.pack_entries(name, header=False)
        except (CorruptObjectError, ObjectNotFoundError):
            return [], False

    new = [name for name in listed if name not in known]
    if len(new) <= 1:
        tocs = [read(name) for name in new]
    else:  # the TOCs in parallel: each is a request or two, latency bound
        with concurrent.futures.ThreadPoolExecutor(min(CATALOG_READERS, len(new))) as pool:
            tocs = list(pool.map(read, new))
    for name, (entries, from_toc) in zip(new, tocs, strict=True):
        if not from_toc:  # a published pack always has its TOC: this one is cut short or damaged
            if damaged is not None:
                damaged.append(name)
            continue
        index.add_pack(name, entries)
        added += 1
    forget_packs(store, known - set(listed))
    return added


def forget_packs(store: ObjectStore, names: set[str]) -> None:
    """Drop packs from a catalog: gone from the remote, or found not to hold what
    the catalog said (the next refresh reads their TOCs again)."""
    if not names:
        return
    removed = store.indexed_records(names & store.index.indexed_packs())
    if removed:
        store.index.swap_packs([], list(removed.items()))


class CatalogStore(ObjectStore):
    """The object store of a remote: its index is the catalog, refreshed by
    listing (:func:`refresh_catalog`) without the writer pins a local refresh
    takes, which on an object store would be lease objects on every lookup miss."""

    def refresh(self) -> int:
        return refresh_catalog(self)


def create_layout(backend: Backend, template: RepoConfig) -> None:
    """A new bare repository on ``backend``: the config (``template``'s settings,
    a repository id of its own) and HEAD on the default branch, the config last. Packs and refs
    are keys, so nothing else is needed (a directory gets its folders on first write)."""
    config = RepoConfig(
        format_version=template.format_version,
        chunk_size=template.chunk_size,
        codec=dict(template.codec),
        max_pack_size=template.max_pack_size,
        default_branch=template.default_branch,
        keyframe_interval=template.keyframe_interval,
    )
    # HEAD first: the config is what makes the remote exist (open_remote), so a
    # creation killed in between is simply done again. Created only if absent: of
    # two first pushes racing, one repository id stands and both use it.
    RefStore(backend).init_head(branch_ref(template.default_branch))
    backend.put_if_absent(CONFIG_NAME, config.encoded())


def open_remote(local: Repository | None, spec: RemoteSpec, *, create_from: RepoConfig | None = None) -> Remote:
    """Open the remote ``spec`` names, its catalog refreshed (kept under ``local``'s
    directory; in memory without one: ``ckvc mirror`` between two URLs). ``create_from``:
    create the remote repository with these settings if there is none (push). A remote
    of an unknown format version is refused (UnsupportedFormatError, from the
    config's version rule)."""
    raw = open_backend(spec.url, endpoint=spec.endpoint, region=spec.region)
    backend = RequestCounter(raw)
    try:
        found = RepoConfig.load_if_present(backend)  # a remote exists when its config does
        if found is None:
            if create_from is None:
                raise UnknownRemoteError(f"remote {spec.name} ({spec.url}) holds no ckvc repository")
            if isinstance(raw, LocalBackend):
                raw.root.mkdir(parents=True, exist_ok=True)
            create_layout(backend, create_from)
        config = found or RepoConfig.load(backend)
        catalog = MemoryIndex() if local is None else _catalog(local, spec.name, config.repo_id)
        store = CatalogStore(backend, index=catalog)
    except BaseException:
        backend.close()  # its connections and threads, not left to the garbage collector
        raise
    core = Repository(
        config=config,
        store=store,
        refs=RefStore(backend),
        prune_log=PruneLog(backend),
        executor=Executor(min(backend.capabilities.max_connections, 8)),
    )
    damaged: list[str] = []
    try:
        refresh_catalog(store, damaged)
    except BaseException:
        core.close()
        raise
    return Remote(spec, backend, core, damaged)
