"""A commit read as NumPy arrays, without torch: ``ckvc.numpy.load(repo, rev)``.

Tensors come back as arrays of the same dtype, shape and strides (bfloat16 and
float8 through ``ml_dtypes``: ``pip install 'ckvc[jax]'``), views of one buffer
where they shared storage; NumPy arrays as they were committed; torch dtypes and
devices as their names and ``torch.Size`` as a tuple. Every byte is verified as
``Repo.load`` verifies it, and torch is never imported (tests/test_numpy_jax.py
checks it in a fresh interpreter). ckvc.jax builds on it."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ckvc.core import ProgressCallback

if TYPE_CHECKING:
    from ckvc.repo import Repo


def load(
    repo: Repo | str | os.PathLike[str],
    rev: str = "HEAD",
    *,
    keys: Iterable[str] | None = None,
    prefix: str | None = None,
    subtree: str | None = None,
    allow_pickle: bool = False,
    progress: ProgressCallback | None = None,
    verify_signatures: bool | None = None,
) -> Any:
    """The state ``rev`` stores, its tensors as NumPy arrays: the nested state, or
    with ``keys``/``prefix`` a flat dict by path, with ``subtree`` the value at
    one path (as ``Repo.load``). ``repo``: a Repo or the path of one (opened and
    closed here). Refused as ``Repo.load`` refuses (unsigned under
    ``require_signatures``, pruned, pickles not allowed); InvalidInputError for a
    tensor whose dtype NumPy cannot hold (complex32, float4_e2m1fn_x2) or that
    needs ml_dtypes where it is missing."""
    from ckvc import read
    from ckvc.repo import Repo

    if not isinstance(repo, Repo):
        with Repo.open(repo) as opened:
            return load(
                opened, rev, keys=keys, prefix=prefix, subtree=subtree, allow_pickle=allow_pickle,
                progress=progress, verify_signatures=verify_signatures,
            )  # fmt: skip
    commit = repo.readable_commit(rev, allow_pickle=allow_pickle, verify_signatures=verify_signatures)
    return read.load_state(
        repo.core, commit, allow_pickle=allow_pickle, progress=progress, keys=keys, prefix=prefix, subtree=subtree,
        arrays=True,
    )  # fmt: skip
