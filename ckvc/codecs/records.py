"""What a stored record's codec header says about the chunk it holds: its base,
the depth of its delta chain, its age. Pure: bytes in, answers out; the object
store moves the bytes and verifies ids, this module reads codec headers."""

from __future__ import annotations

from typing import NamedTuple

from ckvc.codecs.codec_ids import CODEC_NAMES, DELTA, DELTA_HEAD, QUANT, QUANT_HEAD, WHOLE_CODECS
from ckvc.errors import CorruptObjectError, UnsupportedFormatError
from ckvc.ids import Buffer

# How much of a based record's payload base_info needs: the longest codec head
# (the quant head is at least the delta head).
BASE_HEAD_SIZE = max(QUANT_HEAD.size, DELTA_HEAD.size)


class BaseInfo(NamedTuple):
    """A chunk's base (None: stored whole or lossy standalone), the age it records
    (commits since its base was written), and whether it decodes on its own
    without loss of meaning as a keyframe."""

    base: bytes | None
    age: int
    whole: bool


WHOLE = BaseInfo(None, 0, True)


def base_info(codec: int, base: bytes | None, payload_head: Buffer) -> BaseInfo:
    """The BaseInfo of a record of ``codec`` naming ``base``, from the first
    BASE_HEAD_SIZE bytes of its payload (all of a shorter payload)."""
    if codec in WHOLE_CODECS:
        return WHOLE
    if codec == DELTA:
        if base is None:
            raise CorruptObjectError("delta record names no base")
        return BaseInfo(base, delta_depth_age(payload_head)[1], False)
    if codec == QUANT:
        from ckvc.codecs.lossy import quant_header  # numpy: loaded with the first chunk, not with the store

        return BaseInfo(base, quant_header(payload_head).age, False)
    raise UnsupportedFormatError(f"unknown codec id {codec}")


def _quant_age(payload: Buffer) -> int:
    from ckvc.codecs.lossy import quant_header  # numpy: loaded with the first chunk, not with the store

    return quant_header(payload).age


def delta_depth_age(payload: Buffer) -> tuple[int, int]:
    """A delta record's (links down to a chunk stored whole, age), its header checked."""
    from ckvc.codecs.delta import delta_header  # numpy: loaded with the first chunk, not with the store

    head = delta_header(payload)
    return head.depth, head.age


def delta_depth(payload: Buffer) -> int:
    """Links from a delta record down to a chunk stored whole (checked header)."""
    return delta_depth_age(payload)[0]


def is_keyframe_delta(codec: int, base: bytes | None, payload: Buffer) -> bool:
    """A delta one link from a whole chunk (all ckvc writes): its keyframe can be
    decoded straight into the destination and the residual added in place."""
    return codec == DELTA and base is not None and delta_depth(payload) == 1


def base_to_decode(codec: int, base: bytes | None, payload: Buffer) -> tuple[bytes, int] | None:
    """(base id, depth the base must have) for a record that decodes against a
    base, None for one that decodes alone; CorruptObjectError where the header
    and the base id contradict each other. A lossy residual's base is met at
    one less than its age: a keyframe, or (the compact tier) the lossy link
    below it."""
    if codec == DELTA:
        if base is None:
            raise CorruptObjectError("delta record names no base")
        return base, delta_depth(payload) - 1
    if codec == QUANT and base is not None:
        return base, _quant_age(payload) - 1
    if base is not None:
        raise CorruptObjectError(f"a {CODEC_NAMES.get(codec, codec)} record names a base")
    return None


def check_base_link(oid: bytes, codec: int, base: bytes | None, payload: Buffer, depth: int) -> bytes | None:
    """A link of a delta chain, met at ``depth`` links above a keyframe: the
    base it decodes against (None for the keyframe itself). Depths strictly
    decrease, so a chain cannot loop: a delta's header names its depth, and a
    lossy residual (the compact tier's chains) must be exactly ``depth`` old."""
    if codec == QUANT:
        if base is None:
            return None  # a chain's first lossy link
        if _quant_age(payload) != depth or depth < 1:
            raise CorruptObjectError(
                f"lossy chain link of age {_quant_age(payload)} met at depth {depth}", object_id=oid.hex()
            )
        return base
    if codec != DELTA:
        return None
    if base is None:
        raise CorruptObjectError("delta record names no base", object_id=oid.hex())
    own_depth = delta_depth(payload)
    if own_depth != depth or depth < 1:
        raise CorruptObjectError(f"delta chain depth {own_depth} where {depth} was expected", object_id=oid.hex())
    return base
