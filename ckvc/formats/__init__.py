"""Checkpoint files and folders in, exact files out: what ``ckvc commit PATH`` reads
and ``ckvc checkout -o`` / ``ckvc export`` write (docs/GUIDE.md, "Files and folders").

Every file is stored as it is. A .safetensors file, a torch.save file or a DCP
data file (read with ``weights_only=True`` plus the numpy types RNG states use,
never unpickling code) is split into its tensors, so they dedup and compress; its
other bytes (the header, the zip skeleton with its pickle program) are kept so
that export rebuilds the file byte for byte with no pickling. Anything else,
including files that would need pickle, is stored as bytes. Each file becomes a
:class:`ckvc.state.StoredFile` (ext 10, docs/FORMAT.md 10.7); ``load`` returns its
content, so a directory commit loads as ``{relative path: tensors | bytes | link
target}``.

One module per format (``safetensors``, ``torch_save``, ``distcp``), each with
its reader and what writes it back; ``folder`` reads a path, ``export`` writes
files out atomically, ``layout`` is what they share.
"""

from __future__ import annotations

from ckvc.formats.export import CommitSource, export_commit, safe_relative, write_checkpoint
from ckvc.formats.folder import read_checkpoint
from ckvc.formats.layout import (
    DCP_SUFFIX,
    DIRECTORY_SOURCE,
    INLINE_BYTES,
    SAFETENSORS_SUFFIX,
    TORCH_SUFFIXES,
    Format,
    LinkOutsideTreeError,
    OutputPathError,
    Progress,
    UnsupportedFileError,
    contents,
)

__all__ = [
    "DCP_SUFFIX",
    "DIRECTORY_SOURCE",
    "INLINE_BYTES",
    "SAFETENSORS_SUFFIX",
    "TORCH_SUFFIXES",
    "CommitSource",
    "Format",
    "LinkOutsideTreeError",
    "OutputPathError",
    "Progress",
    "UnsupportedFileError",
    "contents",
    "export_commit",
    "read_checkpoint",
    "safe_relative",
    "write_checkpoint",
]
