"""What every file format of ckvc.formats shares: the suffixes it knows, how a
stored file's layout names its literal bytes and its parts (docs/FORMAT.md 10.7),
the errors of reading and writing files, and a part's raw bytes."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, Literal

import numpy as np

from ckvc.errors import CkvcError, InvalidInputError
from ckvc.state import StoredFile

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")

SAFETENSORS_SUFFIX = ".safetensors"

DCP_SUFFIX = ".distcp"  # torch.distributed.checkpoint's data files: torch.save archives back to back

DIRECTORY_SOURCE = "directory"

REPOSITORY_DIR = ".ckvc"

# Files up to this size are kept inline in the state tree; larger ones become a
# uint8 blob (chunked, deduplicated, compressed) that ``load`` returns as bytes.
INLINE_BYTES = 64 << 10


Format = Literal["pt", "safetensors", "dir"]

Progress = Callable[[int, int], None]


class UnsupportedFileError(InvalidInputError):
    """A path to commit is not a regular file, directory or symlink (a FIFO, socket,
    device), or cannot be read; nothing was read from it and nothing was written."""

    exit_code = 35


class LinkOutsideTreeError(InvalidInputError):
    """A symlink in a committed directory points outside it (use follow_links / --follow-links)."""

    exit_code = 36


class OutputPathError(InvalidInputError):
    """An output path cannot be written: missing parent, wrong kind, unsafe name."""

    exit_code = 33


class MalformedFileError(UnsupportedFileError):
    """``strict``: a file that claims a format (its suffix) but does not parse as it:
    nothing was committed (without ``strict`` it is stored as bytes, with a warning)."""


class NotParsed(Exception):
    """A reader's word that a file is stored as bytes, and why; ``malformed``: it
    does not parse as the format its name claims (rather than needing pickle)."""

    def __init__(self, reason: str, *, malformed: bool) -> None:
        super().__init__(reason)
        self.reason, self.malformed = reason, malformed


def first_line(exc: BaseException, limit: int = 160) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def bytes_file(data: Any, mode: int) -> StoredFile:
    layout = {"type": "file", "format": "bytes", "mode": mode, "size": len(data)}
    if len(data) <= INLINE_BYTES:
        return StoredFile(bytes(data), layout)
    # A zero-copy view of the mapping; the array keeps it alive until the commit is written.
    return StoredFile(np.frombuffer(data, dtype=np.uint8), layout, as_bytes=True)


def file_layout(fmt: str, mode: int, size: int, pieces: list[bytes | int], parts: list[Any]) -> dict[str, Any]:
    return {"type": "file", "format": fmt, "mode": mode, "size": size, "pieces": pieces, "parts": parts}


def pieces(data: Any, spans: list[tuple[int, int]]) -> list[bytes | int]:
    """The file as literal bytes between ``spans`` (sorted, disjoint) and part
    indices in their place."""
    pieces: list[bytes | int] = []
    pos = 0
    for i, (begin, end) in enumerate(spans):
        if begin > pos:
            pieces.append(bytes(data[pos:begin]))
        pieces.append(i)
        pos = end
    if pos < len(data):
        pieces.append(bytes(data[pos:]))
    return pieces


def raw_bytes(value: Any, name: str) -> memoryview:
    import torch

    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).reshape(-1).view(np.uint8).data.cast("B")
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        return (t.view(torch.uint8) if t.element_size() else t).numpy().data.cast("B")
    raise corrupt(name, f"part is a {type(value).__name__}, not an array")


def corrupt(name: str, why: str) -> CkvcError:
    from ckvc.errors import CorruptObjectError

    return CorruptObjectError(f"stored file {name!r}: {why}")


def contents(state: Any) -> Any:
    """``state`` with each StoredFile replaced by its content (what ``load`` returns)."""
    if isinstance(state, StoredFile):
        return state.content
    if isinstance(state, dict) and any(isinstance(v, StoredFile) for v in state.values()):
        return {k: contents(v) for k, v in state.items()}
    return state


def names_in_weight_files(paths: Iterable[str]) -> dict[str, str] | None:
    """A committed model folder's tensor paths ("sub/model-00001-of-00002.safetensors.w")
    by their names inside the weight files ("w"), as the model's state dict names them;
    None when two files hold the same name."""
    listed = list(paths)
    inner = {re.sub(r"^(?:[^/]*/)*[^/]*?\.safetensors\.", "", p): p for p in listed}
    return inner if len(inner) == len(listed) else None
