"""Restoring a commit into live torch objects (``Repo.load_into``): chunks decoded
straight into a model's existing parameters and buffers (through a one-chunk
scratch buffer where they cannot be: GPU, strided, another dtype), the optimizer
and scheduler through their ``load_state_dict``. Everything is checked against
the model before anything changes. The reading is ckvc.read's. ``resume`` (as
``ckvc.resume``) adds the RNG and returns the rest of the state: a plain loop's
restart in one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from ckvc import graph, read
from ckvc import state as state_mod
from ckvc.bulk import pauses_gc
from ckvc.core import HasCore
from ckvc.errors import (
    CorruptObjectError,
    IncompatibleStateError,
    ObjectNotFoundError,
    UnknownKeyError,
)
from ckvc.objects import Blob, Commit, Snapshot
from ckvc.read import BlobLoader, ChunkRead, Progress, ProgressCallback, ReadCore, format_names
from ckvc.runs import run_matches
from ckvc.state import MapLocation, TensorInfo


class IncompatibleKeys(NamedTuple):
    """What ``Repo.load_into(..., strict=False)`` could not match, like torch's
    ``load_state_dict``: model keys the commit lacks, and stored keys the model lacks."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride), strict=True):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def write_range(dst: torch.Tensor, start: int, stop: int, src: torch.Tensor) -> None:
    """Copy the 1-d ``src`` into elements [start, stop) of ``dst`` in row-major
    order, whatever ``dst``'s strides and device: a few rectangular copies."""
    if start >= stop:
        return
    if dst.dim() == 0:
        dst.copy_(src.reshape(()))
        return
    if dst.is_contiguous():
        dst.view(-1)[start:stop].copy_(src)
        return
    inner = dst.numel() // dst.shape[0]
    first, last = start // inner, (stop - 1) // inner
    if first == last:
        write_range(dst[first], start - first * inner, stop - first * inner, src)
        return
    pos = 0
    if start % inner:  # the tail of the first row
        pos = inner - start % inner
        write_range(dst[first], start % inner, inner, src[:pos])
        first += 1
    full_end = stop // inner
    if full_end > first:  # whole rows
        n = (full_end - first) * inner
        dst[first:full_end].copy_(src[pos : pos + n].view(full_end - first, *dst.shape[1:]))
        pos += n
    if stop % inner:  # the head of the last row
        write_range(dst[full_end], 0, stop % inner, src[pos:])


_EXTRA_STATE = "_extra_state"  # torch.nn.Module's state_dict key for get_extra_state()


@dataclass
class _Fill:
    key: str
    target: torch.Tensor  # detached; shares the parameter's memory
    info: TensorInfo
    blob: Blob


def _check_model(
    model: torch.nn.Module, stored: Any, snapshot: Snapshot, commit: Commit, strict: bool
) -> tuple[list[_Fill], list[tuple[str, Any]], IncompatibleKeys]:
    """Match the model's state_dict against the stored one; raise before anything changes."""
    if not isinstance(stored, dict):
        raise IncompatibleStateError(
            f"commit {commit.id[:12]} stores a {type(stored).__name__} where a model state_dict was expected"
        )
    targets = model.state_dict(keep_vars=True)
    missing = [k for k in targets if k not in stored]
    unexpected = [str(k) for k in stored if k not in targets]
    mismatched: list[str] = []
    fills: list[_Fill] = []
    extra: list[tuple[str, Any]] = []
    for key, target in targets.items():
        if key not in stored:
            continue
        source = stored[key]
        if key == _EXTRA_STATE or key.endswith("." + _EXTRA_STATE):
            extra.append((key, source))  # a module's get_extra_state(): given to its set_extra_state
            continue
        if not isinstance(target, torch.Tensor):
            mismatched.append(f"{key}: the model has a {type(target).__name__}, not a tensor")
            continue
        if not isinstance(source, TensorInfo) or source.kind == state_mod.KIND_NUMPY:
            mismatched.append(f"{key}: stored {type(source).__name__}, model has a tensor")
            continue
        if source.blob >= len(snapshot.blobs):
            raise CorruptObjectError(f"tensor refers to blob {source.blob} of {len(snapshot.blobs)}", commit=commit.id)
        blob = snapshot.blobs[source.blob]
        dtype = blob.dtype
        if tuple(source.shape) != tuple(target.shape):
            mismatched.append(f"{key}: stored shape {list(source.shape)}, model has {list(target.shape)}")
        elif dtype != state_mod.dtype_name(target.dtype) and (strict or dtype.startswith(state_mod.NUMPY_DTYPE_PREFIX)):
            mismatched.append(f"{key}: stored dtype {dtype}, model has {state_mod.dtype_name(target.dtype)}")
        else:
            fills.append(_Fill(key, target.detach(), source, blob))
    if mismatched or (strict and (missing or unexpected)):
        parts = []
        if missing:
            parts.append(f"missing keys {format_names(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {format_names(unexpected)}")
        if mismatched:
            parts.append(f"mismatched tensors {format_names(mismatched)}")
        raise IncompatibleStateError(
            f"commit {commit.id[:12]} does not fit the model: {'; '.join(parts)}; nothing was loaded",
            missing=tuple(missing),
            unexpected=tuple(unexpected),
            mismatched=tuple(mismatched),
        )
    return fills, extra, IncompatibleKeys(missing, unexpected)


def _check_optimizer(optimizer: torch.optim.Optimizer, stored: Any, commit: Commit) -> None:
    """The checks Optimizer.load_state_dict makes, made before anything changes."""
    where = f"commit {commit.id[:12]}"
    if not (isinstance(stored, dict) and isinstance(stored.get("param_groups"), list) and "state" in stored):
        raise IncompatibleStateError(f"{where} does not store an optimizer state_dict there")
    saved = stored["param_groups"]
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved):
        raise IncompatibleStateError(f"{where}: malformed optimizer param_groups")
    if len(saved) != len(optimizer.param_groups):
        raise IncompatibleStateError(
            f"{where} has {len(saved)} optimizer parameter groups, the optimizer {len(optimizer.param_groups)}"
        )
    for i, (s, g) in enumerate(zip(saved, optimizer.param_groups, strict=True)):
        if len(s["params"]) != len(g["params"]):
            raise IncompatibleStateError(
                f"{where}: optimizer parameter group {i} has {len(s['params'])} parameters stored, "
                f"{len(g['params'])} in the optimizer"
            )


def _plan_fills(fills: Sequence[_Fill], commit: Commit) -> list[list[tuple[ChunkRead | None, _Fill]]]:
    """Reads that decode each fill's chunks straight into the target's memory where
    they can (CPU, contiguous, same dtype, whole chunks) and through a one-chunk
    scratch buffer otherwise. A fill whose source is a strided view (rare: views
    of a shared storage) gets one entry with no read; it is loaded on its own.

    Grouped in passes: a target met again with another source (the model ties
    what the commit stores apart) is written in a later pass, so the last key
    wins as with load_state_dict and no two reads write one memory at once."""
    passes: list[list[tuple[ChunkRead | None, _Fill]]] = []
    seen: dict[tuple[Any, ...], list[TensorInfo]] = {}
    for fill in fills:
        t = fill.target
        if t.numel() == 0:
            continue
        where = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        sources = seen.setdefault(where, [])
        if fill.info in sources:
            continue  # tied in the model and in the commit: written once
        sources.append(fill.info)
        while len(passes) < len(sources):
            passes.append([])
        passes[len(sources) - 1].extend(_fill_reads(fill, commit))
    return passes


def _fill_reads(fill: _Fill, commit: Commit) -> list[tuple[ChunkRead | None, _Fill]]:
    info, blob, target = fill.info, fill.blob, fill.target
    if info.stride is not None and not _contiguous(info.shape, info.stride):
        return [(None, fill)]
    itemsize = read.blob_itemsize(blob, commit)
    src_dtype = state_mod.torch_dtype(blob.dtype)
    lo = (0 if info.stride is None else info.offset) * itemsize
    hi = lo + info.numel * itemsize
    if hi > blob.nbytes or (info.stride is None and hi != blob.nbytes):
        raise CorruptObjectError("tensor does not match its blob", commit=commit.id, tensor=blob.path)
    if blob.chunk_size % itemsize:
        raise CorruptObjectError("chunks are not aligned to elements", commit=commit.id, tensor=blob.path)
    direct = target.device.type == "cpu" and target.is_contiguous() and src_dtype == target.dtype
    target_bytes = target.reshape(-1).view(torch.uint8).numpy().data.cast("B") if direct else None
    spans = read.blob_spans(blob, commit)
    first, last = lo // blob.chunk_size, -(-hi // blob.chunk_size)
    out: list[tuple[ChunkRead | None, _Fill]] = []
    for i in range(first, last):
        a, b = spans[i]
        if target_bytes is not None and lo <= a and b <= hi:
            out.append((ChunkRead(blob, blob.chunks[i], b - a, into=target_bytes[a - lo : b - lo]), fill))
            continue

        def then(scratch: np.ndarray, a: int = a, b: int = b) -> None:
            x, y = max(a, lo), min(b, hi)
            piece = torch.from_numpy(scratch[x - a : y - a]).view(src_dtype)
            write_range(target, (x - lo) // itemsize, (y - lo) // itemsize, piece)

        out.append((ChunkRead(blob, blob.chunks[i], b - a, then=then, pinned=target.device.type == "cuda"), fill))
    return out


@pauses_gc
def load_into(
    core: ReadCore,
    commit: Commit,
    *,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    strict: bool,
    model_key: str | None,
    optimizer_key: str | None,
    scheduler_key: str | None,
    map_location: MapLocation,
    allow_pickle: bool,
    progress: ProgressCallback | None,
    rng_key: str | None = None,
    check_run: bool = True,
) -> IncompatibleKeys:
    """See ``Repo.load_into``. ``commit``: resolved and readable, as ``Repo.load_into`` checks."""
    if check_run:
        run_matches(commit)
    return restore_state(
        core, commit, model=model, optimizer=optimizer, scheduler=scheduler, strict=strict, model_key=model_key,
        optimizer_key=optimizer_key, scheduler_key=scheduler_key, map_location=map_location,
        allow_pickle=allow_pickle, progress=progress, rng_key=rng_key, rng_optional=False,
    )[0]  # fmt: skip


def restore_state(
    core: ReadCore, commit: Commit, *, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
    scheduler: Any, strict: bool, model_key: str | None, optimizer_key: str | None, scheduler_key: str | None,
    map_location: MapLocation, allow_pickle: bool, progress: ProgressCallback | None, rng_key: str | None = None,
    rng_optional: bool = True, rest: bool = False,
) -> tuple[IncompatibleKeys, dict[str, Any]]:  # fmt: skip
    """``load_into``, and with ``rng_key`` the RNG state stored there restored
    (ckvc.set_rng_state; ``rng_optional``: a state saved without one restores none);
    with ``rest`` the state's other top-level entries (those not loaded into an
    object) returned as a dict. Every blob is read once."""
    snapshot = core.read_snapshot(commit)
    root = state_mod.parse_snapshot(snapshot, commit.id, allow_pickle=allow_pickle).build()
    model_node = read.node_at(root, model_key, commit) if model is not None else None
    optim_node = read.node_at(root, optimizer_key, commit) if optimizer is not None else None
    sched_node = read.node_at(root, scheduler_key, commit) if scheduler is not None else None
    rng_node = None
    if rng_key is not None:
        try:
            rng_node = read.node_at(root, rng_key, commit)
        except UnknownKeyError:
            if not rng_optional:
                raise
            # a state saved without RNG: nothing to restore
    loaded_keys = {
        k for k, obj in ((model_key, model), (optimizer_key, optimizer), (scheduler_key, scheduler)) if obj is not None
    }
    rest_nodes = {k: v for k, v in root.items() if k not in loaded_keys} if rest and isinstance(root, dict) else {}

    # 1. Check everything before anything changes.
    fills: list[_Fill] = []
    extra: list[tuple[str, Any]] = []
    result = IncompatibleKeys([], [])
    if model is not None:
        fills, extra, result = _check_model(model, model_node, snapshot, commit, strict)
    if optimizer is not None:
        _check_optimizer(optimizer, optim_node, commit)
    passes = _plan_fills(fills, commit)
    # One read for the cache: nothing it fetched is evicted before the load returns.
    with core.store.reading():
        # A lazy clone fetches everything the model needs first: offline, it fails before anything changes.
        core.store.ensure([chunk.oid for entries in passes for chunk, _ in entries if chunk is not None])
        for entries in passes:
            for chunk, fill in entries:
                if chunk is not None and not core.store.has(chunk.oid):
                    try:
                        core.store.locate(chunk.oid)  # indexes packs it does not know yet, else raises
                    except ObjectNotFoundError as exc:
                        raise read.not_found(exc, commit, fill.key) from None

        # 2. Read what is loaded whole (optimizer, scheduler, extra states) before the
        # model changes, so a damaged chunk there leaves the model as it was.
        loader = BlobLoader(core, commit, snapshot, map_location)
        others = [
            node for node in (optim_node, sched_node, rng_node, *(v for _, v in extra), *rest_nodes.values())
            if node is not None
        ]  # fmt: skip
        other_reads = loader.plan(info for node in others for info in read.infos_in(node))
        total = sum(r.size for r in other_reads)
        total += sum(r.size for entries in passes for r, _ in entries if r is not None)
        total += sum(
            f.info.numel * read.blob_itemsize(f.blob, commit) for entries in passes for r, f in entries if r is None
        )
        tracker = Progress(progress, total)
        read.run_reads(core, commit, other_reads, tracker)

        # 3. The model: chunks straight into its parameters and buffers.
        for entries in passes:
            read.run_reads(core, commit, [r for r, _ in entries if r is not None], tracker)
            for chunk, fill in entries:
                if chunk is None:  # a strided view of a shared storage: its span on its own
                    alone = BlobLoader(core, commit, snapshot, None)
                    read.run_reads(core, commit, alone.plan([fill.info]), Progress(None))
                    with torch.no_grad():
                        fill.target.copy_(alone.tensor(fill.info))
                    tracker.add(fill.info.numel * read.blob_itemsize(fill.blob, commit))
        if fills:
            increment = getattr(torch.autograd.graph, "increment_version", None)
            if increment is not None:  # written behind autograd's back: tell it
                increment([f.target for f in fills if f.target.numel()])
        if model is not None:
            for key, node in extra:
                owner = key[: -len(_EXTRA_STATE)].rstrip(".")
                model.get_submodule(owner).set_extra_state(read.fill_tree(node, loader))
        if optimizer is not None:
            optimizer.load_state_dict(read.fill_tree(optim_node, loader))
        if scheduler is not None:
            scheduler.load_state_dict(read.fill_tree(sched_node, loader))
        if rng_node is not None:
            state_mod.set_rng_state(read.fill_tree(rng_node, loader))
        remaining = {k: read.fill_tree(v, loader) for k, v in rest_nodes.items()}
    return result, remaining


def resume(
    repo: HasCore, rev: str = "HEAD", *, model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None, strict: bool = True,
    map_location: MapLocation = None, model_key: str = "model", optimizer_key: str = "optimizer",
    scheduler_key: str = "scheduler", rng_key: str = "rng", progress: ProgressCallback | None = None,
    check_run: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """A plain training loop's restart in one call (``ckvc.resume``): ``rev``'s
    model, optimizer and scheduler restored in place (as ``Repo.load_into``), the
    RNG state stored under ``rng_key`` restored (``ckvc.rng_state()`` saved it),
    and the rest of the state's top-level entries returned (``{"epoch": 3,
    "step": 1200, "rng": ...}``). Each chunk is read once; a state that does not
    fit the objects raises IncompatibleStateError before anything changes; one made
    at another world size, RunMismatchError (``check_run=False`` loads it anyway)."""
    core = repo.core
    commit = graph.readable_commit(core, rev)
    if check_run:
        run_matches(commit)
    return restore_state(
        core, commit, model=model, optimizer=optimizer, scheduler=scheduler, strict=strict, model_key=model_key,
        optimizer_key=optimizer_key, scheduler_key=scheduler_key, map_location=map_location, allow_pickle=False,
        progress=progress, rng_key=rng_key, rest=True,
    )[1]  # fmt: skip
