"""Reading checkpoints from files for ``ckvc commit`` and writing them for ``ckvc checkout -o``.

Supported: torch.save files (read with weights_only=True: never unpickles code),
.safetensors files, and directories of them (e.g. a Hugging Face model folder),
whose other small files (config.json, tokenizer files) are kept as bytes.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import safetensors
import safetensors.torch
import torch

from ckvc.errors import InvalidInputError, UnsupportedTypeError
from ckvc.state import flatten
from ckvc.storage.files import fsync_dir

if TYPE_CHECKING:
    from ckvc.repo import Repo

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SAFETENSORS_SUFFIX = ".safetensors"
DIRECTORY_SOURCE = "directory"
# Other files in a model directory are kept verbatim up to this size.
MAX_SIDE_FILE = 256 << 20


def read_checkpoint(path: Path) -> tuple[Any, dict[str, str]]:
    """(state, commit metadata describing the source)."""
    if not path.exists():
        raise InvalidInputError(f"no such file or directory: {path}")
    if path.is_dir():
        state: dict[str, Any] = {}
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            rel = file.relative_to(path).as_posix()
            if any(part.startswith(".") for part in Path(rel).parts):
                continue  # .git, .cache and friends
            if _is_tensor_file(file):
                state[rel] = _read_file(file)
            elif file.stat().st_size <= MAX_SIDE_FILE:
                state[rel] = file.read_bytes()
            else:
                raise InvalidInputError(f"{file} is neither a checkpoint nor a small side file")
        if not any(_is_tensor_file(Path(k)) for k in state):
            raise InvalidInputError(f"{path} holds no .safetensors or torch checkpoint files")
        return state, {"ckvc.source": DIRECTORY_SOURCE}
    return _read_file(path), {"ckvc.source": path.suffix.lstrip(".") or "file"}


def _is_tensor_file(path: Path) -> bool:
    return path.suffix in TORCH_SUFFIXES or path.suffix == SAFETENSORS_SUFFIX


def _read_file(path: Path) -> Any:
    if path.suffix == SAFETENSORS_SUFFIX:
        try:
            return safetensors.torch.load_file(str(path))
        except Exception as exc:
            raise InvalidInputError(f"cannot read {path} as safetensors: {exc}") from None
    if path.suffix in TORCH_SUFFIXES or path.suffix == "":
        try:
            return torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise InvalidInputError(
                f"cannot read {path} as a torch checkpoint with weights_only=True "
                f"(ckvc never unpickles code): {str(exc).splitlines()[0]}"
            ) from None
    raise InvalidInputError(f"{path}: unknown checkpoint type (use .pt, .pth, .bin, .ckpt or .safetensors)")


def export_commit(
    repo: Repo,
    rev: str,
    out: Path | str,
    *,
    format: Literal["pt", "safetensors", "dir"] | None = None,
    prefix: str | None = None,
    progress: Any = None,
) -> list[Path]:
    """Write commit ``rev`` to ``out`` without moving HEAD; returns the files written.
    ``format``: "pt", "safetensors" or "dir" (default: the commit's own kind, else
    the suffix of ``out``); ``prefix`` ("model."): only the leaves under it, with the
    prefix removed from their names, as one file. The parent of ``out`` must exist."""
    out = Path(out)
    if not out.parent.is_dir():
        raise InvalidInputError(f"cannot write {out}: {out.parent} does not exist")
    if format in ("pt", "safetensors"):
        wanted = TORCH_SUFFIXES if format == "pt" else (SAFETENSORS_SUFFIX,)
        if out.suffix not in wanted:
            raise InvalidInputError(f"--format {format} writes a {' or '.join(wanted)} file, not {out.name!r}")
    if prefix is not None:
        flat = repo.load(rev, map_location="cpu", prefix=prefix, progress=progress)
        return write_checkpoint({k[len(prefix) :]: v for k, v in flat.items()}, out, {})
    state = repo.load(rev, map_location="cpu", progress=progress)
    metadata = dict(repo.readable_commit(rev).metadata)
    if format == "dir":
        metadata["ckvc.source"] = DIRECTORY_SOURCE
    elif format is not None:
        metadata.pop("ckvc.source", None)
    return write_checkpoint(state, out, metadata)


def write_checkpoint(state: Any, out: Path, metadata: dict[str, str]) -> list[Path]:
    """Write ``state`` to ``out`` by its suffix, or as a directory when the commit
    came from one. Every file is written atomically. Returns the files written."""
    if metadata.get("ckvc.source") == DIRECTORY_SOURCE:
        if out.exists() and not out.is_dir():
            raise InvalidInputError(f"{out} exists and is not a directory (this commit is a directory)")
        written = []
        for rel, value in state.items():
            target = (out / rel).resolve()
            if out.resolve() not in target.parents:
                raise InvalidInputError(f"refusing to write {rel!r} outside {out}")
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(value, bytes):
                _atomic(target, lambda tmp, v=value: tmp.write_bytes(v))
            else:
                _write_file(value, target)
            written.append(target)
        return written
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_file(state, out)
    return [out]


def _write_file(state: Any, out: Path) -> None:
    if out.suffix == SAFETENSORS_SUFFIX:
        tensors = _flat_tensors(state)
        _atomic(out, lambda tmp: safetensors.torch.save_file(tensors, str(tmp)))
    elif out.suffix in TORCH_SUFFIXES:
        _atomic(out, lambda tmp: torch.save(state, str(tmp)))
    else:
        raise InvalidInputError(f"{out}: unknown output type (use .pt, .pth, .bin, .ckpt or .safetensors)")


def _flat_tensors(state: Any) -> dict[str, torch.Tensor]:
    """A flat name -> tensor dict for safetensors, which refuses non-tensors and shared storage."""
    if not isinstance(state, dict):
        raise UnsupportedTypeError("", "a .safetensors file holds a dict of tensors; use .pt for this state")
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for path, leaf in flatten(state).items():
        if isinstance(leaf, np.ndarray):
            leaf = torch.from_numpy(np.ascontiguousarray(leaf))
        if not isinstance(leaf, torch.Tensor):
            raise UnsupportedTypeError(path, f"{type(leaf).__name__} cannot go in a .safetensors file; use .pt")
        t = leaf.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
        seen.add(ptr)
        out[path] = t
    return out


def _atomic(target: Path, write: Any) -> None:
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        if tmp.exists():
            tmp.unlink()
