"""A commit as a Hugging Face model folder: ``ckvc export REV DIR --format hf``.

Sharded safetensors (``model-00001-of-0000N.safetensors``, each at most
``max_shard_bytes``, plus ``model.safetensors.index.json``; one
``model.safetensors`` when everything fits in one shard), from a plain commit of a
state dict or a DCP commit (``ckvc.dcp.Writer``: each tensor reassembled whole from
its shards by DCP's own planner, reading only the shard's tensors). Streaming: one
output shard's tensors are in memory at a time. Names: a state holding a "model"
entry beside others (optimizer, step) exports the model's tensors with the "model."
prefix removed (a state dict of the model itself keeps its names, and a committed
model folder its tensors' names inside the weight files); ``fqn_map`` renames (or
drops, returning None) any name. Config
files come from ``config_from`` (a folder: its ``*.json`` and tokenizer files, or a
file), as a training run keeps them beside its checkpoints. The same commit exported
twice gives the same bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckvc.errors import InvalidInputError
from ckvc.formats.layout import OutputPathError

if TYPE_CHECKING:
    import torch

    from ckvc.repo import Repo

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 << 30  # what transformers' save_pretrained uses
CARRIED_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")  # configs and tokenizers


@dataclass(frozen=True)
class Planned:
    source: str  # the name in the commit (a state path, or a DCP fully qualified name)
    name: str  # the name in the HF folder
    nbytes: int


def _under_model(nested: bool) -> Callable[[str], str | None]:
    """The standard mapping: a state holding its model as a "model" entry (beside an
    optimizer, a step) exports the model's tensors without the "model." prefix, the
    rest dropped; a state dict of the model itself keeps its names."""
    if not nested:
        return lambda p: p
    return lambda p: p[len("model.") :] if p.startswith("model.") else None


def _tensors_of(repo: Repo, commit_id: str) -> tuple[list[tuple[str, int]], bool, Callable[[str], str | None]]:
    """(source name, byte size) of every tensor, whether the commit is a DCP save, and
    the names they take by default."""
    from ckvc import state as state_mod
    from ckvc.formats.layout import DIRECTORY_SOURCE, names_in_weight_files
    from ckvc.integrations import DCP_METADATA_KEY

    commit = repo.read_commit(commit_id)
    if DCP_METADATA_KEY in commit.metadata:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from ckvc.integrations.dcp import read_dcp_metadata

        metadata = read_dcp_metadata(repo.core, commit)
        out = []
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                numel = 1
                for d in md.size:
                    numel *= int(d)
                out.append((fqn, numel * md.properties.dtype.itemsize))
        paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        nested = any(len(path) > 1 and path[0] == "model" for path in paths.values())  # DCP's fqn -> object path
        return sorted(out), True, _under_model(nested)
    view = repo.view(commit_id)
    tensors = sorted((p, view.info(p).nbytes) for p in view)
    if commit.metadata.get("ckvc.source") == DIRECTORY_SOURCE:  # a committed model folder
        inner = names_in_weight_files(p for p, _ in tensors)
        if inner is not None:
            back = {path: name for name, path in inner.items()}
            return tensors, False, back.get
    root = state_mod.parse_snapshot(repo.read_snapshot(commit), commit.id, allow_pickle=False).build()
    return tensors, False, _under_model(isinstance(root, dict) and isinstance(root.get("model"), dict))


def plan_shards(
    tensors: list[tuple[str, int]], rename: Callable[[str], str | None], max_shard_bytes: int
) -> list[list[Planned]]:
    """The tensors kept by ``rename``, in name order, cut into shards of at most
    ``max_shard_bytes`` (a tensor larger than that is a shard of its own)."""
    if max_shard_bytes <= 0:
        raise InvalidInputError(f"the shard size must be positive, got {max_shard_bytes}")
    planned = []
    seen: dict[str, str] = {}
    for source, nbytes in tensors:
        name = rename(source)
        if name is None:
            continue
        if name in seen:
            raise InvalidInputError(f"{source!r} and {seen[name]!r} both become {name!r}")
        seen[name] = source
        planned.append(Planned(source, name, nbytes))
    if not planned:
        raise InvalidInputError("no tensor to export (did the name mapping drop them all?)")
    planned.sort(key=lambda p: p.name)
    shards: list[list[Planned]] = [[]]
    size = 0
    for item in planned:
        if shards[-1] and size + item.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.nbytes
    return shards


def _load_shard(repo: Repo, commit_id: str, shard: list[Planned], dcp: bool) -> dict[str, torch.Tensor]:
    if not dcp:
        flat = repo.load(commit_id, "cpu", keys=[p.source for p in shard])
        out: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for p in shard:
            tensor = flat[p.source].contiguous()
            where = tensor.untyped_storage().data_ptr()
            # tied weights share storage, which safetensors refuses: each gets its own copy
            out[p.name] = tensor.clone() if where in storages and tensor.numel() else tensor
            storages.add(where)
        return out
    import torch
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ckvc.integrations.dcp import Reader, read_dcp_metadata

    metadata = read_dcp_metadata(repo.core, repo.read_commit(commit_id))
    targets = {}
    for p in shard:
        md = metadata.state_dict_metadata[p.source]
        assert isinstance(md, TensorStorageMetadata)
        targets[p.source] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    dcp_load(targets, storage_reader=Reader(repo, commit_id), no_dist=True)
    return {p.name: targets[p.source] for p in shard}


def _carried_files(config_from: Path | None) -> Iterator[Path]:
    if config_from is None:
        return
    if config_from.is_file():
        yield config_from
        return
    if not config_from.is_dir():
        raise InvalidInputError(f"{config_from}: no such file or folder to take the config from")
    for item in sorted(config_from.iterdir()):
        if item.is_file() and item.suffix in CARRIED_SUFFIXES and item.name != INDEX_NAME:
            yield item


def export_hf(
    repo: Repo,
    rev: str,
    out: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    fqn_map: Callable[[str], str | None] | None = None,
    config_from: str | os.PathLike[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[Path]:
    """Write ``rev`` to the folder ``out`` (new or empty; it appears whole) as a
    Hugging Face model folder; returns the files written."""
    from safetensors.torch import save_file

    commit = repo.readable_commit(rev)
    target = Path(out).absolute()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise OutputPathError(f"{target} exists and is not an empty folder")
    if not target.parent.is_dir():
        raise OutputPathError(f"{target.parent} is not a folder")
    tensors, dcp, default = _tensors_of(repo, commit.id)
    rename = fqn_map or default
    shards = plan_shards(tensors, rename, max_shard_bytes)
    carried = list(_carried_files(Path(config_from) if config_from is not None else None))
    total = sum(p.nbytes for shard in shards for p in shard)
    staging = target.parent / f".{target.name}.ckvc-tmp-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        names = (
            [SINGLE_NAME]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        weight_map: dict[str, str] = {}
        done = 0
        for shard, name in zip(shards, names, strict=True):
            tensors_now = _load_shard(repo, commit.id, shard, dcp)
            save_file(tensors_now, str(staging / name), metadata={"format": "pt"})
            del tensors_now
            weight_map.update((p.name, name) for p in shard)
            done += sum(p.nbytes for p in shard)
            if progress is not None:
                progress(done, total)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (staging / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        for item in carried:
            shutil.copyfile(item, staging / item.name)
        for item in staging.iterdir():
            with open(item, "rb") as f:
                os.fsync(f.fileno())
        if target.exists():
            target.rmdir()  # empty, checked above
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return sorted(target.iterdir())
