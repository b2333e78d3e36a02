"""torch.distributed.checkpoint (DCP) storage backed by a ckvc repository.

``dcp.save(sd, storage_writer=Writer(repo, message=...))`` makes one commit;
``dcp.load(sd, storage_reader=Reader(repo, rev))`` restores it, at any world size
(DCP's planner reshards). Each rank's ``write_data`` stores its items through
``write.write_blobs`` (chunked, deduplicated, delta-coded against the branch's
last commit) into its own packs; the coordinator's ``finish`` checks that the
results cover every chunk DCP's metadata names and writes one commit whose tree
is DCP's ``Metadata`` as canonical data (no pickle)::

    {"format": "ckvc.dcp", "version": 1,
     "dcp_version": str | None, "planner_data": ..., "storage_meta": {...},
     "tensors": {fqn: {"dtype", "size", "layout", "requires_grad", "memory_format",
                       "pin_memory", "shards": [{"offsets": [...], "data": <tensor>}]}},
     "bytes": {fqn: <uint8 tensor>}}

so ``ckvc log/show/diff/du`` work on it like on any commit. Non-tensor items reach
a storage writer as torch.save bytes; they are stored as those bytes, never
unpickled here. DCP's load planner ``torch.load``s them (``weights_only=False``)
on load, as it does for its own file format: load only checkpoints you trust.

The writer holds a path, not open handles, when pickled (``async_save``'s process
mode): it opens the repository once per process on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckvc import read, write
from ckvc import state as state_mod
from ckvc.config import FILES_VERSION
from ckvc.core import Repository
from ckvc.errors import CkvcError, CorruptObjectError, InvalidInputError, ObjectNotFoundError
from ckvc.formats.layout import DIRECTORY_SOURCE, names_in_weight_files
from ckvc.integrations import DCP_METADATA_KEY
from ckvc.objects import Blob, Commit, Snapshot
from ckvc.refs import branch_ref
from ckvc.repo import Repo
from ckvc.state import TensorInfo
from ckvc.trees import BlobNode, pack_tree

if TYPE_CHECKING:
    from ckvc.remote.repository import Remote

FORMAT = "ckvc.dcp"
VERSION = 1
# Commit metadata key of a DCP commit: {"world_size": n}.
METADATA_KEY = DCP_METADATA_KEY
# Items resolved (GPU tensors copied to host) per write_blobs call: bounds host memory.
WRITE_BATCH_BYTES = 256 << 20

_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}

# Repositories this process opened by path: one each (an LMDB environment must not
# be opened twice in one process), reopened after a fork. Opened as a Repo, so a
# save gets the repository's commit observers (auto_push, retention, the cache).
_OPENED: dict[tuple[int, str], Repo] = {}


def _open(path: str) -> Repo:
    key = (os.getpid(), path)
    if key not in _OPENED:
        _OPENED[key] = Repo.open(path)
    return _OPENED[key]


class _RepoHandle:
    """A repository given as a Repo (used as is in its own process) or a path;
    pickles as its path."""

    def __init__(self, repo: Repo | str | os.PathLike[str]) -> None:
        self.path: str | None
        self._pid = os.getpid()
        if isinstance(repo, Repo):
            self.path = str(repo.core.path) if repo.core.path is not None else None  # None: in memory
            self._repo: Repo | None = repo
        elif isinstance(repo, (str, os.PathLike)):
            self.path = str(Path(repo).resolve())
            self._repo = None
        else:
            raise InvalidInputError(f"repo must be a ckvc.Repo or a path, got {type(repo).__name__}")

    @property
    def repo(self) -> Repo:
        if self._repo is None or self._pid != os.getpid():
            if self.path is None:
                raise InvalidInputError("an in-memory repository cannot be used from another process")
            self._repo, self._pid = _open(self.path), os.getpid()
        return self._repo

    @property
    def core(self) -> Repository:
        return self.repo.core

    def __getstate__(self) -> dict[str, Any]:
        if self.path is None:
            raise InvalidInputError("an in-memory repository cannot be pickled (async_save's process mode)")
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self._repo, self._pid = state["path"], None, os.getpid()


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def _item_path(index: MetadataIndex) -> str:
    """A stored item's blob path (and delta-base key across saves): fqn, and the
    shard's offsets for a shard."""
    if index.offset is None or not any(index.offset):
        return index.fqn
    return f"{index.fqn}@{','.join(str(o) for o in index.offset)}"


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B") if flat.numel() else memoryview(b"")


class Writer(StorageWriter):
    """A DCP StorageWriter that commits to ``repo`` (a ckvc.Repo or its path, on a
    filesystem every rank sees). ``message``, ``metrics`` and ``metadata`` go into
    the commit; ``branch``: the branch it lands on (made by the first save if it
    does not exist, as a commit without parent; default where HEAD is). After a
    save the coordinator's ``commit_id`` holds the id, and on every rank the
    Metadata ``dcp.save`` returns has it as ``storage_meta.checkpoint_id``.
    ``on_conflict="retry"``: a branch another writer moved forward during the
    save gets the commit on top (default: RefConflictError, nothing committed)."""

    def __init__(
        self,
        repo: Repo | str | os.PathLike[str],
        *,
        message: str = "",
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        branch: str | None = None,
        remote: str | None = None,
        on_conflict: write.OnConflict = "fail",
    ) -> None:
        super().__init__()
        if metadata is not None and METADATA_KEY in metadata:
            raise InvalidInputError(f"metadata key {METADATA_KEY!r} is ckvc's, for the world size")
        self.request = write.CommitRequest.checked(message, metrics, metadata)
        self.branch = branch_ref(branch) if branch is not None else None  # a bad name fails here
        self.repo = _RepoHandle(repo)
        self.remote = remote
        self.on_conflict = on_conflict
        if remote is not None:
            from ckvc.distributed import hold_parts_on

            hold_parts_on(self.repo.repo, remote)
        self.is_coordinator = False
        self.rank = 0
        self.head: write.Head | None = None  # where the save lands, read while planning
        self.commit_id: str | None = None
        self.save_id = uuid.uuid4().hex

    # ---- setup and planning ---------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            raise InvalidInputError("ckvc.dcp.Writer commits to a branch: pass branch= to Writer, not checkpoint_id")
        self.save_id = uuid.uuid4().hex
        self.commit_id = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            # Without collectives every rank would finish (commit) on its own.
            raise InvalidInputError("ckvc.dcp.Writer makes one commit per save: use_collectives=False is not supported")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=None, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen from a checkpoint_id: pass the writer itself

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Read where the commit lands, once, for every rank: all ranks delta
        against that parent and ``finish`` moves the branch from it (with
        ``remote``: the remote's branch)."""
        core = self.repo.core
        if self.remote is not None:
            target = self.branch or core.refs.head()[0]
            if target is None:
                raise InvalidInputError("HEAD is detached: pass branch= to save to a remote")
            with self._remote(create=True) as handle:
                self.head = write.Head(target, handle.core.refs.read(target))
        elif self.branch is None:
            self.head = write.read_head(core)
        else:
            self.head = write.Head(self.branch, core.refs.read(self.branch))
        return [dataclasses.replace(p, storage_data=self.head) for p in plans]

    @contextlib.contextmanager
    def _remote(self, *, create: bool = False) -> Iterator[Remote]:
        """The remote, open and pinned (a remote gc deletes nothing this step counts on)."""
        from ckvc.remote import publish

        assert self.remote is not None
        opened = publish.open_for_commit(self.repo.core, self.remote, create=create)
        with contextlib.closing(opened) as handle, handle.core.store.pin():
            yield handle

    # ---- writing ----------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        core = self.repo.core
        head = plan.storage_data if isinstance(plan.storage_data, write.Head) else write.Head(None, None)
        policy = write.chunk_policy(core)
        results: list[WriteResult] = []
        if self.remote is not None and head.parent is not None and not core.object_exists(head.parent):
            _fetch_history(core, self.remote)  # this node missed the last save: its deltas need the parent
        with write.batch(core) as writer:
            batch: list[tuple[Any, state_mod.PendingBlob]] = []
            size = 0
            for item in plan.items:
                pending = self._pending(item, planner.resolve_data(item))
                batch.append((item, pending))
                size += len(pending.data)
                if size >= WRITE_BATCH_BYTES:
                    results.extend(self._write(core, batch, head, policy, writer))
                    batch, size = [], 0
            results.extend(self._write(core, batch, head, policy, writer))
            writer.commit()  # durable and indexed before the coordinator names it
        if self.remote is not None:
            from ckvc.remote import publish

            with self._remote() as handle:  # then on the remote, before the coordinator names it
                publish.upload_part(core, handle, [r.storage_data for r in results])
        return _done(results)

    @staticmethod
    def _pending(item: Any, data: Any) -> state_mod.PendingBlob:
        path = _item_path(item.index)
        if item.type == WriteItemType.BYTE_IO:
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            array = np.frombuffer(raw, dtype=np.uint8)
            return state_mod.PendingBlob("uint8", 1, array.data.cast("B") if len(raw) else memoryview(b""), path, raw)
        tensor = data.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        tensor = tensor.contiguous()  # a view or a strided shard: only its elements are stored
        if tensor.is_conj() or tensor.is_neg():
            tensor = tensor.resolve_conj().resolve_neg()
        dtype = state_mod.dtype_name(tensor.dtype)
        return state_mod.PendingBlob(dtype, tensor.dtype.itemsize, _byte_view(tensor), path, tensor)

    @staticmethod
    def _write(
        core: Repository, batch: list[tuple[Any, state_mod.PendingBlob]], head: write.Head, policy: Any, writer: Any
    ) -> list[WriteResult]:
        if not batch:
            return []
        blobs = write.write_blobs(core, [p for _, p in batch], parent=head.parent, policy=policy, writer=writer)
        return [
            WriteResult(index=item.index, size_in_bytes=blob.nbytes, storage_data=blob)
            for (item, _), blob in zip(batch, blobs, strict=True)
        ]

    # ---- the commit -------------------------------------------------------------
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        core = self.repo.core
        head = self.head if self.head is not None else write.read_head(core)
        stored: dict[MetadataIndex, Blob] = {}
        for rank_results in results:
            for result in rank_results:
                if not isinstance(result.storage_data, Blob):
                    raise InvalidInputError(f"a write result for {result.index.fqn!r} was not made by ckvc.dcp.Writer")
                stored[result.index] = result.storage_data
        blobs: list[Blob] = []

        def node(index: MetadataIndex, dtype: str | None, shape: Sequence[int]) -> BlobNode:
            blob = stored.get(index)
            if blob is None:
                raise InvalidInputError(f"no rank wrote {_item_path(index)!r}, which DCP's metadata names")
            itemsize = state_mod.blob_itemsize(blob.dtype)
            if (dtype is not None and blob.dtype != dtype) or blob.nbytes != math.prod(shape) * itemsize:
                raise InvalidInputError(f"{_item_path(index)!r} was written as {blob.nbytes} bytes of {blob.dtype}")
            blobs.append(blob)
            return BlobNode(len(blobs) - 1, tuple(shape))

        tensors: dict[str, Any] = {}
        byte_items: dict[str, Any] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                props = md.properties
                dtype = state_mod.dtype_name(props.dtype)
                shards = [
                    {"offsets": list(c.offsets), "data": node(MetadataIndex(fqn, c.offsets), dtype, c.sizes)}
                    for c in md.chunks
                ]
                tensors[fqn] = {
                    "dtype": dtype, "size": list(md.size), "layout": str(props.layout).removeprefix("torch."),
                    "requires_grad": bool(props.requires_grad),
                    "memory_format": str(props.memory_format).removeprefix("torch."),
                    "pin_memory": bool(props.pin_memory), "shards": shards,
                }  # fmt: skip
            else:
                blob = stored.get(MetadataIndex(fqn))
                byte_items[fqn] = node(MetadataIndex(fqn), "uint8", (blob.nbytes if blob else 0,))
        meta = metadata.storage_meta
        tree = pack_tree(
            {
                "format": FORMAT,
                "version": VERSION,
                "dcp_version": metadata.version,
                "planner_data": metadata.planner_data,
                "storage_meta": None
                if meta is None
                else {
                    "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
                    "save_id": meta.save_id,
                    "load_id": meta.load_id,
                    "modules": list(meta.modules),
                },
                "tensors": tensors,
                "bytes": byte_items,
            }
        )
        request = dataclasses.replace(
            self.request,
            tree=tree,
            metadata={**self.request.metadata, METADATA_KEY: {"world_size": len(results)}},
        )
        core.upgrade_format(FILES_VERSION)  # JSON-like commit metadata
        if self.remote is not None:
            self.commit_id = self._publish(blobs, request, head)
            metadata.storage_meta = StorageMeta(checkpoint_id=self.commit_id, save_id=self.save_id)
            return
        with write.batch(core) as writer:
            # Under this pin gc removes nothing, so a chunk present now stays until
            # the branch names the commit (the other ranks' pins ended with write_data).
            missing = [c for b in blobs for c in b.chunks if not core.store.has(c)]
            if missing:
                raise ObjectNotFoundError(
                    f"{len(missing)} chunks the ranks wrote are gone (a gc with --now?): nothing was committed",
                    object_id=missing[0].hex(),
                )
            self.commit_id = write.finish(core, blobs, request, head=head, writer=writer, on_conflict=self.on_conflict)
        metadata.storage_meta = StorageMeta(checkpoint_id=self.commit_id, save_id=self.save_id)

    def _publish(self, blobs: list[Blob], request: write.CommitRequest, head: write.Head) -> str:
        """The commit on the remote (ckvc.remote.publish), once every chunk DCP's
        metadata names is there; then recorded in the coordinator's repository."""
        from ckvc.remote import publish

        core = self.repo.core
        assert self.remote is not None and head.target is not None
        with self._remote() as handle, write.batch(core) as writer:
            handle.core.store.refresh()  # the other ranks' packs
            missing = [c for b in blobs for c in b.chunks if not handle.core.store.has(c)]
            if missing:
                raise ObjectNotFoundError(
                    f"{len(missing)} chunks the ranks wrote are not on {self.remote}: nothing was committed",
                    object_id=missing[0].hex(),
                )
            step = publish.StepCommit(blobs, request, head.parent, head.target)
            step, commit_id = publish.publish(core, handle, writer, step, self.on_conflict)
            publish.record(core, self.remote, writer, step)
        return commit_id


def _fetch_history(core: Repository, remote: str) -> None:
    """The remote's commits and snapshots (no chunks). Only deltas need them: a
    failure (another rank of this node fetching at once) costs those, nothing else."""
    from ckvc.remote.fetch import fetch

    with contextlib.suppress(CkvcError, OSError):
        fetch(core, remote, chunks=False)


# ---- reading --------------------------------------------------------------------


@dataclass(frozen=True)
class _Stored:
    """Where DCP's metadata finds an item: the commit and the item's blob and shape
    (and, for a tensor of a plain commit, its element offset into a shared blob)."""

    commit: str
    blob: int
    shape: tuple[int, ...]
    offset: int = 0


def _properties(entry: Mapping[str, Any]) -> TensorProperties:
    layout = getattr(torch, str(entry["layout"]), None)
    memory_format = _MEMORY_FORMATS.get(str(entry["memory_format"]))
    if not isinstance(layout, torch.layout) or memory_format is None:
        raise CorruptObjectError(f"unknown layout {entry['layout']!r} or memory format {entry['memory_format']!r}")
    return TensorProperties(
        dtype=state_mod.torch_dtype(str(entry["dtype"])),
        layout=layout,
        requires_grad=bool(entry["requires_grad"]),
        memory_format=memory_format,
        pin_memory=bool(entry["pin_memory"]),
    )


def plain_metadata(commit: Commit, snapshot: Snapshot, root: Any) -> Metadata:
    """DCP's Metadata of a commit ``Writer`` did not make (a state dict, an HF folder's
    tensors): each tensor one whole chunk under its flattened path, so that DCP's
    planner reshards it (``dcp.load`` at any world size, each rank reading its byte
    ranges). Non-tensor leaves are not offered; a tensor that is a strided view of a
    shared buffer cannot be read by ranges and is refused."""
    state_dict_metadata: dict[str, Any] = {}
    storage: dict[MetadataIndex, _Stored] = {}
    leaves = {
        p: leaf
        for p, leaf in state_mod.flatten(root).items()
        if isinstance(leaf, TensorInfo) and leaf.kind != state_mod.KIND_NUMPY  # numpy arrays: not torch tensors
    }
    # A committed model folder (an HF checkpoint): its tensors under their names in the
    # weight files, as the model's state dict names them.
    inner = names_in_weight_files(leaves) if commit.metadata.get("ckvc.source") == DIRECTORY_SOURCE else None
    if inner is not None:
        leaves = {name: leaves[p] for name, p in inner.items()}
    for path, leaf in leaves.items():
        if leaf.stride is not None and tuple(leaf.stride) != _contiguous_strides(leaf.shape):
            raise InvalidInputError(f"{path!r} of commit {commit.id[:12]} is a strided view: DCP cannot read it")
        offsets = torch.Size([0] * len(leaf.shape))
        properties = TensorProperties(
            dtype=state_mod.torch_dtype(snapshot.blobs[leaf.blob].dtype), requires_grad=leaf.requires_grad
        )
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(leaf.shape))
        state_dict_metadata[path] = TensorStorageMetadata(properties, torch.Size(leaf.shape), [chunk])
        storage[MetadataIndex(path, offsets)] = _Stored(commit.id, leaf.blob, leaf.shape, leaf.offset)
    return Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage)


def read_dcp_metadata(core: Repository, commit: Commit) -> Metadata:
    """DCP's Metadata rebuilt from a commit ``Writer`` made (or, for any other commit,
    :func:`plain_metadata`); its ``storage_data`` maps each item to its blob."""
    snapshot = core.read_snapshot(commit)
    root = state_mod.parse_snapshot(snapshot, commit.id, allow_pickle=False).build()
    if not isinstance(root, dict) or root.get("format") != FORMAT or root.get("version") != VERSION:
        return plain_metadata(commit, snapshot, root)
    try:
        state_dict_metadata: dict[str, Any] = {}
        storage: dict[MetadataIndex, _Stored] = {}
        for fqn, entry in root["tensors"].items():
            chunks = []
            for shard in entry["shards"]:
                info: TensorInfo = shard["data"]
                offsets = torch.Size(shard["offsets"])
                chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(info.shape)))
                storage[MetadataIndex(fqn, offsets)] = _Stored(commit.id, info.blob, info.shape)
            state_dict_metadata[fqn] = TensorStorageMetadata(_properties(entry), torch.Size(entry["size"]), chunks)
        for fqn, info in root["bytes"].items():
            state_dict_metadata[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = _Stored(commit.id, info.blob, info.shape)
        meta = root["storage_meta"]
        storage_meta = None if meta is None else StorageMeta(**meta)
    except (KeyError, TypeError, AttributeError) as exc:
        raise CorruptObjectError(f"malformed DCP tree: {exc}", commit=commit.id) from None
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=root["planner_data"],
        storage_data=storage,
        storage_meta=storage_meta,
        version=root["dcp_version"],
    )


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class Reader(StorageReader):
    """A DCP StorageReader over the commit ``rev`` of ``repo`` (a ckvc.Repo or its
    path). ``dcp.load(sd, checkpoint_id=REV, storage_reader=Reader(repo))`` reads
    REV instead. Every byte is verified as in ``Repo.load``; tensors decode
    straight into DCP's destination when a whole stored shard lands in a
    contiguous CPU tensor of its dtype, else through the read engine's buffers
    (only the chunks the requested region covers)."""

    def __init__(
        self, repo: Repo | str | os.PathLike[str], rev: str = "HEAD", *, verify_signatures: bool | None = None
    ) -> None:
        super().__init__()
        self.repo = _RepoHandle(repo)
        self.rev = rev
        self.verify_signatures = verify_signatures
        self.storage_data: dict[MetadataIndex, _Stored] = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.rev = str(checkpoint_id)
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        core = self.repo.core
        from ckvc import graph

        commit = graph.readable_commit(core, self.rev, verify_signatures=self.verify_signatures)
        metadata = read_dcp_metadata(core, commit)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise InvalidInputError("this Metadata was not read by ckvc.dcp.Reader")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        core = self.repo.core
        commits = {s.commit for s in self.storage_data.values()}
        if not plan.items:
            return _done(None)
        if len(commits) != 1:
            raise CorruptObjectError("DCP metadata names items of several commits")
        commit = core.read_commit(commits.pop())
        snapshot = core.read_snapshot(commit)
        loader = read.BlobLoader(core, commit, snapshot, None)
        direct: list[read.ChunkRead] = []
        staged: list[tuple[Any, TensorInfo, torch.Tensor | None]] = []  # (request, what to read, destination)
        targets: list[tuple[Any, torch.Tensor]] = []
        for req in plan.items:
            stored = self.storage_data[req.storage_index]
            blob = snapshot.blobs[stored.blob]
            if req.type == LoadItemType.BYTE_IO:
                staged.append(
                    (req, TensorInfo(stored.blob, stored.shape, None, 0, state_mod.KIND_TENSOR, "cpu", False), None)
                )
                continue
            target = planner.resolve_tensor(req).detach()
            targets.append((req, target))
            whole = not any(req.storage_offsets) and tuple(req.lengths) == stored.shape
            exact = stored.offset == 0 and blob.nbytes == math.prod(stored.shape) * target.element_size()
            if (
                whole
                and exact
                and target.device.type == "cpu"
                and target.is_contiguous()
                and state_mod.dtype_name(target.dtype) == blob.dtype
                and tuple(target.shape) == stored.shape
            ):
                read.check_chunk_sizes(core.store, commit, blob)
                view = _byte_view(target)
                direct.extend(
                    read.ChunkRead(blob, oid, b - a, into=view[a:b])
                    for oid, (a, b) in zip(blob.chunks, read.blob_spans(blob, commit), strict=True)
                )
                continue
            strides = _contiguous_strides(stored.shape)
            offset = stored.offset + sum(o * s for o, s in zip(req.storage_offsets, strides, strict=True))
            region = TensorInfo(stored.blob, tuple(req.lengths), strides, offset, state_mod.KIND_TENSOR, "cpu", False)
            staged.append((req, region, target))
        reads = direct + loader.plan(info for _, info, _ in staged)
        read.run_reads(core, commit, reads, read.Progress(None, sum(r.size for r in reads)))
        for req, info, destination in staged:
            value = loader.tensor(info)
            if destination is None:
                planner.load_bytes(req, io.BytesIO(value.numpy().tobytes()))
            else:
                destination.copy_(value)
        for req, target in targets:
            planner.commit_tensor(req, target)
        return _done(None)


# ---- leaving ckvc: a plain DCP directory ------------------------------------------


class _CommitItems:
    """The ``resolve_data`` side of a SavePlanner, over a DCP commit: what
    FileSystemWriter asks for when it writes the commit out."""

    def __init__(self, core: Repository, commit: Commit, storage: Mapping[MetadataIndex, _Stored]) -> None:
        self.core = core
        self.commit = commit
        self.snapshot = core.read_snapshot(commit)
        self.storage = storage

    def resolve_data(self, item: Any) -> torch.Tensor | io.BytesIO:
        stored = self.storage[item.index]
        info = TensorInfo(stored.blob, stored.shape, None, 0, state_mod.KIND_TENSOR, "cpu", False)
        (value,) = read.load_tensors(self.core, self.commit, self.snapshot, [info]).values()
        if item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(value.numpy().tobytes())  # the torch.save bytes as stored, not unpickled
        return value


def export_dcp(repo: Repo | str | os.PathLike[str], rev: str, directory: str | os.PathLike[str]) -> Metadata:
    """Write the DCP commit ``rev`` as a plain DCP checkpoint directory (DCP's own
    FileSystemWriter layout: ``.distcp`` files and ``.metadata``), for
    ``FileSystemReader`` and tools that know only that format. One process
    writes it all; ``directory`` must be empty or missing."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.planner import BytesIOWriteData, TensorWriteData, WriteItem

    from ckvc import graph

    target = Path(directory)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise InvalidInputError(f"{target} exists and is not an empty directory")
    core = _RepoHandle(repo).core
    commit = graph.readable_commit(core, rev)
    if METADATA_KEY not in commit.metadata:  # a plain commit's tensors may be views a DCP directory cannot hold
        raise InvalidInputError(f"commit {commit.id[:12]} was not written by ckvc.dcp.Writer: export it otherwise")
    metadata = read_dcp_metadata(core, commit)
    items: list[WriteItem] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for chunk in md.chunks:
                data = TensorWriteData(chunk=chunk, properties=md.properties, size=md.size)
                items.append(WriteItem(MetadataIndex(fqn, chunk.offsets), WriteItemType.SHARD, tensor_data=data))
        else:
            nbytes = math.prod(metadata.storage_data[MetadataIndex(fqn)].shape)
            items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(nbytes)))
    writer = FileSystemWriter(str(target))
    writer.set_up_storage_writer(True, rank=0)
    (plan,) = writer.prepare_global_plan([writer.prepare_local_plan(SavePlan(items))])
    planner: Any = _CommitItems(core, commit, metadata.storage_data)
    results = writer.write_data(plan, planner).wait()
    writer.finish(metadata, [results])
    return metadata
