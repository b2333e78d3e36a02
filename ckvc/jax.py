"""JAX pytrees in and out of a ckvc repository, in the same format as torch states.

``ckvc.jax.commit(repo, pytree, message=...)`` stores every ``jax.Array`` as the
torch tensor of the same dtype, shape and bytes (bfloat16 and float8 included),
so ``Repo.load`` in PyTorch gives it back bit-exact; ``ckvc.jax.load(repo, rev)``
reads any commit (one made from PyTorch too) through ckvc.numpy, without torch,
and puts the arrays on JAX devices, shaped after ``like`` when given. Needs the
``jax`` extra: ``pip install 'ckvc[jax]'`` (jax, flax, ml_dtypes)."""

from __future__ import annotations

import collections
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ckvc.errors import IncompatibleStateError, InvalidInputError, UnsupportedTypeError
from ckvc.state.parse import join_path
from ckvc.state.tables import DTYPE_FACTS

if TYPE_CHECKING:
    from ckvc.core import ProgressCallback
    from ckvc.repo import Repo
    from ckvc.write import CommitStats


def _jax() -> Any:
    try:
        import jax
    except ImportError:
        raise InvalidInputError("ckvc.jax needs jax: pip install 'ckvc[jax]'") from None
    return jax


def _torch_dtype_name(dtype: np.dtype[Any], path: str) -> str:
    """The torch dtype name an array of ``dtype`` is stored as; UnsupportedTypeError
    for one torch has no dtype for (int4, float4_e2m1fn, float8_e4m3b11fnuz, ...)."""
    name = dtype.name  # NumPy's and ml_dtypes' names are torch's ("bfloat16", "float8_e4m3fn")
    if name not in DTYPE_FACTS or name in ("complex32", "float4_e2m1fn_x2") or DTYPE_FACTS[name][0] != dtype.itemsize:
        raise UnsupportedTypeError(path, f"JAX dtype {dtype.name} has no torch dtype; cast it before committing")
    return name


def _is_ml_dtype(dtype: np.dtype[Any]) -> bool:
    """One of ml_dtypes' (bfloat16, float8, int4): JAX's host arrays use them; NumPy and torch.from_numpy do not."""
    return bool(dtype.type.__module__ == "ml_dtypes")


def _as_tensor(array: np.ndarray, path: str) -> Any:
    """The torch tensor with ``array``'s dtype, shape and bytes (no copy for host arrays)."""
    import torch

    name = _torch_dtype_name(array.dtype, path)
    if not array.flags.c_contiguous:
        array = array.copy(order="C")  # not np.ascontiguousarray: it makes a 0-d array 1-d
    with warnings.catch_warnings():  # a jax array's host copy is read-only; ckvc only reads it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if not _is_ml_dtype(array.dtype):  # a NumPy dtype torch reads as it is
            return torch.from_numpy(array)
        raw = torch.from_numpy(array.view(np.dtype(f"u{array.dtype.itemsize}")))  # ml_dtypes: same bytes
    return raw.view(getattr(torch, name))


def to_torch(pytree: Any, path: str = "") -> Any:
    """``pytree`` with every ``jax.Array`` (and every ml_dtypes NumPy array) as a
    torch tensor of the same dtype and bytes; dicts (FrozenDict too), lists and
    tuples kept, NumPy arrays and scalars and plain values as they are.
    UnsupportedTypeError for another kind of pytree node (flax: commit
    ``flax.serialization.to_state_dict(obj)``) or a dtype torch lacks."""
    jax = _jax()
    if isinstance(pytree, jax.Array):
        if not pytree.is_fully_addressable:
            raise UnsupportedTypeError(
                path, "an array sharded over other hosts; commit each host's shards with ckvc.dcp"
            )
        return _as_tensor(np.asarray(pytree), path)
    if isinstance(pytree, np.ndarray) and _is_ml_dtype(pytree.dtype):  # bfloat16, float8 in NumPy
        return _as_tensor(pytree, path)
    if type(pytree) in (dict, collections.OrderedDict):
        return type(pytree)((k, to_torch(v, join_path(path, k))) for k, v in pytree.items())
    if isinstance(pytree, Mapping):  # flax's FrozenDict, defaultdicts and other mappings: a dict
        return {k: to_torch(v, join_path(path, k)) for k, v in pytree.items()}
    if type(pytree) in (list, tuple):
        return type(pytree)(to_torch(v, join_path(path, i)) for i, v in enumerate(pytree))
    if jax.tree_util.all_leaves([pytree]) or pytree is None:
        return pytree
    raise UnsupportedTypeError(
        path, f"a {type(pytree).__name__} pytree node; commit flax.serialization.to_state_dict(value) instead"
    )


def commit(repo: Repo, pytree: Any, **kwargs: Any) -> str | CommitStats:
    """Commit a JAX pytree (``Repo.commit``'s keywords: message, metrics, branch,
    sign, ...): arrays stored as torch tensors of the same dtype and bytes, so
    PyTorch loads them bit-exact and :func:`load` gives them back. Nothing is
    committed when a leaf is refused."""
    return repo.commit(to_torch(pytree), **kwargs)


def _paths(like: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(like, Mapping) and like:
        for k, v in like.items():
            _paths(v, join_path(path, k), out)
    elif type(like) in (list, tuple) and like:
        for i, v in enumerate(like):
            _paths(v, join_path(path, i), out)
    elif like is not None and not (isinstance(like, (Mapping, list, tuple)) and not like):
        out[path] = like


def _rebuild(like: Any, path: str, values: Mapping[str, Any]) -> Any:
    if isinstance(like, Mapping) and like:
        items = {k: _rebuild(v, join_path(path, k), values) for k, v in like.items()}
        make: Any = type(like)  # dict, OrderedDict, flax's FrozenDict: built from a dict
        try:
            return make(items)
        except TypeError:
            return items
    if type(like) in (list, tuple) and like:
        return type(like)(_rebuild(v, join_path(path, i), values) for i, v in enumerate(like))
    return values.get(path, like)


def _to_device(jax: Any, value: Any, like: Any) -> Any:
    if not isinstance(value, np.ndarray):
        return value
    return jax.device_put(value, getattr(like, "sharding", None))  # None: the default device


def load(
    repo: Repo | str | os.PathLike[str],
    rev: str = "HEAD",
    *,
    like: Any = None,
    keys: Iterable[str] | None = None,
    prefix: str | None = None,
    strict: bool = True,
    verify_signatures: bool | None = None,
    progress: ProgressCallback | None = None,
) -> Any:
    """``rev``'s state with its tensors as ``jax.Array`` s, read without torch.

    ``like``: a pytree (arrays, ``jax.ShapeDtypeStruct`` s, any leaf with ``shape``
    and ``dtype``) whose leaf paths ("params.Dense_0.kernel") name what to read;
    only those chunks are read, each array checked against its leaf's shape and
    dtype (IncompatibleStateError listing every difference; ``strict=False`` casts
    dtypes) and put on the leaf's ``sharding`` when it has one; the result has
    ``like``'s structure. Without ``like``: the whole state, or with
    ``keys``/``prefix`` a flat dict by path, as ``ckvc.numpy.load``."""
    from ckvc import numpy as ckvc_numpy

    jax = _jax()
    if like is None:
        state = ckvc_numpy.load(
            repo, rev, keys=keys, prefix=prefix, verify_signatures=verify_signatures, progress=progress
        )
        return _map_arrays(state, jax.device_put)
    if keys is not None or prefix is not None:
        raise InvalidInputError("like= names what to read; it takes no keys or prefix")
    wanted: dict[str, Any] = {}
    _paths(like, "", wanted)
    loaded = ckvc_numpy.load(repo, rev, keys=list(wanted), verify_signatures=verify_signatures, progress=progress)
    problems = []
    for path, leaf in wanted.items():
        value = loaded[path]
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            continue
        if isinstance(value, np.generic) and isinstance(leaf, np.generic):
            continue  # a NumPy scalar, stored as one
        if not isinstance(value, np.ndarray):
            problems.append(f"{path}: the commit holds a {type(value).__name__}, not an array")
        elif tuple(value.shape) != tuple(shape):
            problems.append(f"{path}: shape {tuple(value.shape)} in the commit, {tuple(shape)} expected")
        elif value.dtype != np.dtype(dtype):
            if strict:
                problems.append(f"{path}: dtype {value.dtype.name} in the commit, {np.dtype(dtype).name} expected")
            else:
                loaded[path] = value.astype(dtype)
    if problems:
        raise IncompatibleStateError("the commit does not match like=: " + "; ".join(problems[:8]))
    placed = {path: _to_device(jax, loaded[path], leaf) for path, leaf in wanted.items()}
    return _rebuild(like, "", placed)


def _map_arrays(value: Any, fn: Callable[[np.ndarray], Any]) -> Any:
    if isinstance(value, np.ndarray):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, _map_arrays(v, fn)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_map_arrays(v, fn) for v in value)
    return value
