"""safetensors files: read into their tensors plus the header verbatim (so export
rebuilds the file byte for byte), and a state flattened for safetensors to write."""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ckvc.errors import UnsupportedTypeError
from ckvc.state import StoredFile

if TYPE_CHECKING:
    import torch


from ckvc.formats.layout import NotParsed, file_layout, first_line, pieces


def read_safetensors(path: Path, data: Any, mode: int) -> StoredFile | None:
    """The tensors as safetensors loads them, plus the header verbatim; None when
    the file is not valid safetensors (it is then stored as bytes)."""
    import safetensors.torch

    try:
        (n,) = struct.unpack("<Q", data[:8])
        if 8 + n > len(data):
            raise ValueError(f"its header claims {n:,} bytes, past the end of the file")
        header = json.loads(bytes(data[8 : 8 + n]))
        tensors = safetensors.torch.load_file(str(path))
    except Exception as exc:
        raise NotParsed(f"not valid safetensors: {first_line(exc)}", malformed=True) from None
    start = 8 + n
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        spans.append((start + begin, start + end, name))
    spans.sort()
    if any(a < b for (_, a, _), (b, _, _) in itertools.pairwise(spans)):
        return None  # overlapping tensors cannot be rebuilt from separate blobs
    parts = []
    for begin, end, name in spans:
        t = tensors.get(name)
        if t is None or t.numel() * t.element_size() != end - begin:
            return None
        parts.append(t)
    literal = pieces(data, [(a, b) for a, b, _ in spans])
    return StoredFile(tensors, file_layout("safetensors", mode, len(data), literal, parts))


def flat_tensors(state: Any) -> dict[str, torch.Tensor]:
    """A flat name -> tensor dict for safetensors, which refuses non-tensors and shared storage."""
    import torch

    from ckvc.state import flatten

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
