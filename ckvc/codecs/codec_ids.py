"""The codec ids and names of docs/FORMAT.md §6, without the codecs themselves:
what reading metadata, du and a config check need, importable without numpy (the
CLI's history commands never load it). registry.py holds the codecs; a test
checks that the two tables agree."""

from __future__ import annotations

import struct

RAW, ZSTD, BYTEGROUP, DELTA, SPARSE, QUANT = 0, 1, 2, 3, 4, 5

CODEC_NAMES = {RAW: "raw", ZSTD: "zstd", BYTEGROUP: "bytegroup", DELTA: "delta", SPARSE: "sparse", QUANT: "quant"}
# Codecs whose plain bytes need no other object: only these may serve as keyframes.
WHOLE_CODECS = frozenset({RAW, ZSTD, BYTEGROUP, SPARSE})
# The encoders a repository config may name ({"name": ..., "level": n}).
ENCODER_NAMES = frozenset({"raw", "zstd", "auto"})
# A delta's age (commits since its keyframe) is one byte.
MAX_AGE = 255

# The heads of the two based record kinds (FORMAT.md §6): the store reads them to
# follow a record's base without decoding it.
DELTA_HEAD = struct.Struct("<BBBBB")  # transform, width, depth, age, inner codec
QUANT_HEAD = struct.Struct("<BBBBBIQ")  # the lossy tier's head (lossy.py QuantHeader)
