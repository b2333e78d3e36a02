"""ckvc: version control for deep-learning checkpoints."""

from ckvc.errors import (
    CkvcError,
    CorruptObjectError,
    IncompatibleStateError,
    InvalidInputError,
    InvalidRefNameError,
    InvalidRevisionError,
    NotARepositoryError,
    ObjectNotFoundError,
    PrunedCommitError,
    RefConflictError,
    RefNotFoundError,
    RepositoryLockedError,
    UnknownKeyError,
    UnsafeContentError,
    UnsupportedFormatError,
    UnsupportedTypeError,
)
from ckvc.objects import Commit, Tag
from ckvc.repo import CommitInfo, CommitStats, Repo, StateDiff, TensorChange, TensorSummary
from ckvc.state import rng_state, set_rng_state
from ckvc.view import CommitView, IncompatibleKeys

__version__ = "0.1.0"

__all__ = [
    "CkvcError",
    "Commit",
    "CommitInfo",
    "CommitStats",
    "CommitView",
    "CorruptObjectError",
    "IncompatibleKeys",
    "IncompatibleStateError",
    "InvalidInputError",
    "InvalidRefNameError",
    "InvalidRevisionError",
    "NotARepositoryError",
    "ObjectNotFoundError",
    "PrunedCommitError",
    "RefConflictError",
    "RefNotFoundError",
    "Repo",
    "RepositoryLockedError",
    "StateDiff",
    "Tag",
    "TensorChange",
    "TensorSummary",
    "UnknownKeyError",
    "UnsafeContentError",
    "UnsupportedFormatError",
    "UnsupportedTypeError",
    "__version__",
    "rng_state",
    "set_rng_state",
]
