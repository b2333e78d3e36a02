"""DCP data files (``.distcp``): torch.save archives back to back, one per item;
the ``.metadata`` pickle beside them is stored as bytes and never read."""

from __future__ import annotations

import io
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from ckvc.state import StoredFile

if TYPE_CHECKING:
    import torch


from ckvc.formats.layout import file_layout, pieces, raw_bytes
from ckvc.formats.torch_save import archive_end, numpy_allowed, zip_data_spans


def read_distcp(data: Any, mode: int) -> StoredFile | None:
    """A DCP data file, which holds one torch.save archive per item back to back (its
    .metadata, a pickle, is stored as bytes and never read): the content is each
    item as torch.load(weights_only=True) reads it, by its byte offset; the tensors'
    storages fill the rebuild. None when it is not laid out so."""
    import torch

    from ckvc.state import flatten

    content: dict[str, Any] = {}
    spans: list[tuple[int, int]] = []
    parts: list[Any] = []
    pos = 0
    while pos < len(data):
        end = archive_end(data, pos) if data[pos : pos + 4] == b"PK\x03\x04" else None
        if end is None:
            return None
        archive = bytes(data[pos:end])
        entries = zip_data_spans(archive)
        try:
            with numpy_allowed(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                item = torch.load(io.BytesIO(archive), map_location="cpu", weights_only=True)
        except Exception:
            return None
        if entries is None:
            return None
        content[str(pos)] = item
        by_size: dict[int, list[torch.Tensor]] = {}
        for leaf in flatten(item).values():
            if isinstance(leaf, torch.Tensor):
                s = leaf.untyped_storage()
                full = torch.empty(0, dtype=leaf.dtype).set_(s)
                if all(t.untyped_storage().data_ptr() != s.data_ptr() for t in by_size.get(s.nbytes(), [])):
                    by_size.setdefault(s.nbytes(), []).append(full)
        for begin, stop in sorted(entries.values()):
            raw = archive[begin:stop]
            found = [t for t in by_size.get(stop - begin, []) if bytes(raw_bytes(t, "distcp")) == raw]
            if found and (stop - begin) % found[0].element_size() == 0:
                parts.append(found[0])
            else:
                parts.append(np.frombuffer(raw, dtype=np.uint8).copy())
            spans.append((pos + begin, pos + stop))
        pos = end
    return StoredFile(content, file_layout("dcp", mode, len(data), pieces(data, spans), parts))
