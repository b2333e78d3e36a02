"""Object ids: BLAKE3-256 over a type tag and an object's plain bytes.

The id never depends on how an object is stored (codec, pack, offset), so
re-encoding and repacking never change it.
"""

from __future__ import annotations

import enum

import blake3

# What every byte-level interface accepts (collections.abc.Buffer is 3.12+).
Buffer = bytes | bytearray | memoryview

ID_SIZE = 32
HEX_ID_LENGTH = 2 * ID_SIZE


class ObjectType(enum.IntEnum):
    """The kinds of stored object. The value is the byte stored in pack records."""

    CHUNK = 1
    SNAPSHOT = 2
    COMMIT = 3
    TAG = 4

    @property
    def tag(self) -> bytes:
        """The bytes prepended to an object's plain bytes before hashing."""
        return _TAGS[self]


_TAGS = {
    ObjectType.CHUNK: b"ckvc-chunk\x00",
    ObjectType.SNAPSHOT: b"ckvc-snapshot\x00",
    ObjectType.COMMIT: b"ckvc-commit\x00",
    ObjectType.TAG: b"ckvc-tag\x00",
}


def object_id(kind: ObjectType, data: Buffer) -> bytes:
    """The 32-byte id of an object of ``kind`` whose plain bytes are ``data``."""
    # Single-threaded on purpose: callers already hash chunks on a thread pool.
    hasher = blake3.blake3(kind.tag)
    hasher.update(data)
    return hasher.digest()


def is_full_hex_id(text: str) -> bool:
    return len(text) == HEX_ID_LENGTH and all(c in "0123456789abcdef" for c in text)
