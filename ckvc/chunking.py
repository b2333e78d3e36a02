"""Split a tensor's bytes into dtype-aligned fixed-size chunks (pure, no I/O).

Fixed offsets rather than content-defined cut points: the chunk at the same
position in the next checkpoint is the natural delta base, and unchanged
regions dedupe exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

DEFAULT_CHUNK_SIZE = 4 << 20
# Every chunk boundary must fall on an element boundary for every element width
# (1, 2, 4, 8, 16 bytes), so the chunk size must be a multiple of 16.
CHUNK_ALIGNMENT = 16
MIN_CHUNK_SIZE = 4 << 10
MAX_CHUNK_SIZE = 1 << 30


def validate_chunk_size(chunk_size: int) -> int:
    if (
        not isinstance(chunk_size, int)
        or chunk_size < MIN_CHUNK_SIZE
        or chunk_size > MAX_CHUNK_SIZE
        or chunk_size % CHUNK_ALIGNMENT
    ):
        raise ValueError(
            f"chunk size must be a multiple of {CHUNK_ALIGNMENT} between "
            f"{MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE} bytes, got {chunk_size!r}"
        )
    return chunk_size


def chunk_spans(nbytes: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """(start, end) byte offsets covering [0, nbytes) in order; the last may be short.

    A zero-byte buffer has no chunks.
    """
    for start in range(0, nbytes, chunk_size):
        yield start, min(start + chunk_size, nbytes)


def chunk_count(nbytes: int, chunk_size: int) -> int:
    return -(-nbytes // chunk_size)
