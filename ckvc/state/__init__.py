"""Training state <-> (value tree, tensor byte buffers), without pickle.

A state is a nested structure of dicts, lists, tuples, tensors, numpy arrays and
plain Python values. :func:`encode_state` (``encode``) turns it into an encoded
*tree* (msgpack with the extension types of ``tables``, docs/FORMAT.md §10) plus
a list of :class:`PendingBlob`: the raw bytes of every tensor, to be chunked and
stored. :func:`decode_state` (``decode``: the one validating parser, then the
tensors made from their blobs) reverses it. ``rng``: the RNG states a run
resumes with. Reading chunks lives in ckvc.read.

Tensors that share one storage (tied weights, views of one buffer) share one blob,
and are restored sharing one storage again.

``parse``, ``tables`` and ``arrays`` import no torch; the names from ``decode``,
``encode`` and ``rng`` (and the torch dtype tables) are imported on first use, so
``import ckvc.state`` stays torch-free for ckvc.numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckvc.state.arrays import ArrayMaker, BlobViews, allocate_array, numpy_dtype  # noqa: F401
from ckvc.state.parse import (  # noqa: F401
    ParsedTree,
    PickledValue,
    TensorInfo,
    describe_state,
    flatten,
    join_path,
    parse_snapshot,
    parse_tree,
    skeleton,
)
from ckvc.state.tables import (  # noqa: F401
    DTYPE_FACTS,
    EXT_BIGINT,
    EXT_DEVICE,
    EXT_DTYPE,
    EXT_FILE,
    EXT_NPSCALAR,
    EXT_ODICT,
    EXT_PICKLE,
    EXT_SIZE,
    EXT_TENSOR,
    EXT_TUPLE,
    INT64_MAX,
    INT64_MIN,
    KIND_NUMPY,
    KIND_PARAMETER,
    KIND_TENSOR,
    MAX_DEPTH,
    MAX_SHARED_SPAN_OVERHEAD,
    NUMPY_DTYPE_PREFIX,
    NUMPY_KINDS,
    UINT64_MAX,
    MapLocation,
    PendingBlob,
    StoredFile,
    blob_itemsize,
    caller_stacklevel,
    check_blob,
    dtype_name,
    is_utf8,
    torch_dtype,
)

if TYPE_CHECKING:
    from ckvc.state.decode import (  # noqa: F401
        TensorMaker,
        allocate_blob,
        build_state,
        decode_state,
        materialize,
        place,
    )
    from ckvc.state.encode import (  # noqa: F401
        EncodedState,
        encode_state,
    )
    from ckvc.state.rng import (  # noqa: F401
        rng_state,
        set_rng_state,
    )
    from ckvc.state.tables import TORCH_DTYPE_NAMES, TORCH_DTYPES  # noqa: F401

# The names that need torch: imported from their module on first use.
_LAZY = {
    "TensorMaker": "decode", "allocate_blob": "decode", "build_state": "decode", "decode_state": "decode",
    "materialize": "decode", "place": "decode", "EncodedState": "encode", "encode_state": "encode",
    "rng_state": "rng", "set_rng_state": "rng", "TORCH_DTYPES": "tables", "TORCH_DTYPE_NAMES": "tables",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ckvc.state.{module}"), name)
    globals()[name] = value
    return value
