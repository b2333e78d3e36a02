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
"""

from __future__ import annotations

from ckvc.state.decode import (  # noqa: F401
    ParsedTree,
    PickledValue,
    TensorInfo,
    TensorMaker,
    allocate_blob,
    build_state,
    decode_state,
    describe_state,
    flatten,
    materialize,
    parse_snapshot,
    parse_tree,
    place,
    skeleton,
)
from ckvc.state.encode import (  # noqa: F401
    EncodedState,
    encode_state,
    join_path,
)
from ckvc.state.rng import (  # noqa: F401
    rng_state,
    set_rng_state,
)
from ckvc.state.tables import (  # noqa: F401
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
    TORCH_DTYPE_NAMES,
    TORCH_DTYPES,
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
