"""Split a tensor's bytes into dtype-aligned fixed-size chunks (pure, no I/O).

Fixed offsets rather than content-defined cut points: the chunk at the same
position in the next checkpoint is the natural delta base, and unchanged
regions dedupe exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

DEFAULT_CHUNK_SIZE = 4 << 20
# Every chunk boundary must fall on an element boundary for every element width
# (1, 2, 4, 8, 16 bytes), so the chunk size must be a multiple of 16.
CHUNK_ALIGNMENT = 16
MIN_CHUNK_SIZE = 4 << 10
MAX_CHUNK_SIZE = 1 << 30
# Chunks smaller than this share a pool task (see size_batches).
BATCH_BYTES = 1 << 20


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


def size_batches(items: Iterable[T], size: Callable[[T], int], limit: int = BATCH_BYTES) -> Iterator[list[T]]:
    """Consecutive items grouped into batches of at most ``limit`` bytes (an item
    of ``limit`` or more goes alone), so that small chunks (biases, norms) share a
    thread-pool task: a task's fixed cost (queueing, a thread wake-up, a future) is
    ~15 µs here, as much as decoding a few KiB."""
    batch: list[T] = []
    total = 0
    for item in items:
        n = size(item)
        if batch and total + n > limit:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += n
    if batch:
        yield batch
