"""Kept for imports of older code: the file reading and writing now lives in ckvc.files."""

from ckvc.files import (
    DIRECTORY_SOURCE,
    SAFETENSORS_SUFFIX,
    TORCH_SUFFIXES,
    export_commit,
    read_checkpoint,
    write_checkpoint,
)

__all__ = [
    "DIRECTORY_SOURCE",
    "SAFETENSORS_SUFFIX",
    "TORCH_SUFFIXES",
    "export_commit",
    "read_checkpoint",
    "write_checkpoint",
]
