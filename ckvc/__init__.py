"""ckvc: version control for deep-learning checkpoints."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Every public name is imported on first use (PEP 562), so that ``import ckvc`` and
# the CLI's history commands do not pay for torch (about 1.5 s) until a commit,
# load or diff needs it. Name -> the module that defines it.
_ERRORS = (
    "CkvcError", "CorruptObjectError", "DamagedIndexError", "DistributedCommitError", "IncompatibleStateError",
    "InterruptedOperationError", "InvalidInputError", "InvalidRefNameError", "InvalidRevisionError",
    "NonFastForwardError", "NotARepositoryError", "ObjectNotFoundError", "PrunedCommitError",
    "ReadOnlyRepositoryError", "RefConflictError", "RefNotFoundError", "RemoteSupportMissingError",
    "RepositoryLockedError", "SignatureError", "StorageError", "StorageFullError", "StorageIOError", "UnknownKeyError",
    "UnknownRemoteError", "UnsafeContentError", "UnsupportedFormatError", "UnsupportedTypeError",
)  # fmt: skip
_LAZY: dict[str, str] = {
    **dict.fromkeys(_ERRORS, "ckvc.errors"),
    **dict.fromkeys(("Commit", "Tag"), "ckvc.objects"),
    **dict.fromkeys(("CommitInfo", "StateDiff", "TensorChange", "TensorSummary"), "ckvc.inspect"),
    "CommitStats": "ckvc.write",
    "Repo": "ckvc.repo",
    **dict.fromkeys(("rng_state", "set_rng_state"), "ckvc.state"),  # these import torch
    "CommitView": "ckvc.view",  # so do these
    **dict.fromkeys(("IncompatibleKeys", "resume"), "ckvc.restore"),
    **dict.fromkeys(("ManifestEntry", "manifest_of"), "ckvc.manifest"),
    "set_mesh": "ckvc.runs",
}

if TYPE_CHECKING:
    from ckvc.errors import (
        CkvcError,
        CorruptObjectError,
        DamagedIndexError,
        DistributedCommitError,
        IncompatibleStateError,
        InterruptedOperationError,
        InvalidInputError,
        InvalidRefNameError,
        InvalidRevisionError,
        NonFastForwardError,
        NotARepositoryError,
        ObjectNotFoundError,
        PrunedCommitError,
        ReadOnlyRepositoryError,
        RefConflictError,
        RefNotFoundError,
        RemoteSupportMissingError,
        RepositoryLockedError,
        SignatureError,
        StorageError,
        StorageFullError,
        StorageIOError,
        UnknownKeyError,
        UnknownRemoteError,
        UnsafeContentError,
        UnsupportedFormatError,
        UnsupportedTypeError,
    )
    from ckvc.inspect import CommitInfo, StateDiff, TensorChange, TensorSummary
    from ckvc.manifest import ManifestEntry, manifest_of
    from ckvc.objects import Commit, Tag
    from ckvc.repo import Repo
    from ckvc.restore import IncompatibleKeys, resume
    from ckvc.runs import set_mesh
    from ckvc.state import rng_state, set_rng_state
    from ckvc.view import CommitView
    from ckvc.write import CommitStats


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckvc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__version__ = "0.1.0"

__all__ = [
    "CkvcError",
    "Commit",
    "CommitInfo",
    "CommitStats",
    "CommitView",
    "CorruptObjectError",
    "DamagedIndexError",
    "DistributedCommitError",
    "IncompatibleKeys",
    "IncompatibleStateError",
    "InterruptedOperationError",
    "InvalidInputError",
    "InvalidRefNameError",
    "InvalidRevisionError",
    "ManifestEntry",
    "NonFastForwardError",
    "NotARepositoryError",
    "ObjectNotFoundError",
    "PrunedCommitError",
    "ReadOnlyRepositoryError",
    "RefConflictError",
    "RefNotFoundError",
    "RemoteSupportMissingError",
    "Repo",
    "RepositoryLockedError",
    "SignatureError",
    "StateDiff",
    "StorageError",
    "StorageFullError",
    "StorageIOError",
    "Tag",
    "TensorChange",
    "TensorSummary",
    "UnknownKeyError",
    "UnknownRemoteError",
    "UnsafeContentError",
    "UnsupportedFormatError",
    "UnsupportedTypeError",
    "__version__",
    "manifest_of",
    "resume",
    "rng_state",
    "set_mesh",
    "set_rng_state",
]
