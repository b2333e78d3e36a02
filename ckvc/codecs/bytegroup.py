"""Codec 2, bytegroup: a chunk's elements split into byte planes, each plane raw or
zstd (the transform and payload layout are planes.py's; docs/FORMAT.md §6)."""

from __future__ import annotations

import numpy as np

from ckvc.codecs.base import BYTEGROUP
from ckvc.codecs.planes import decode_planes_into
from ckvc.codecs.registry import RecordCodec, register
from ckvc.ids import Buffer


def decode_bytegroup_into(payload: Buffer, out: np.ndarray, base: Buffer | np.ndarray | None = None) -> None:
    decode_planes_into(payload, out)


register(RecordCodec(BYTEGROUP, "bytegroup", decode_bytegroup_into, whole=True))
