"""The Huffman plane (plane codec 2, docs/FORMAT.md "Huffman plane"), decoded
without the native loops.

ckvc/_native.c encodes and decodes these planes at several GB/s; this module is
the reader for builds without a C compiler (about 0.1 s per MiB, far slower, the
same bytes). It checks the payload as strictly as the native decoder does."""

from __future__ import annotations

import numpy as np

from ckvc.errors import CorruptObjectError
from ckvc.ids import Buffer

MAX_BITS = 11
STREAMS = 4
BITMAP_SIZE = 32
SIZES_SIZE = 4 * (STREAMS - 1)


def stream_spans(n: int) -> list[tuple[int, int]]:
    """The symbols [start, end) each of the four streams codes."""
    q = -(-n // STREAMS)
    return [(min(t * q, n), min((t + 1) * q, n)) for t in range(STREAMS)]


def code_lengths(payload: Buffer) -> tuple[np.ndarray, int]:
    """(length of every symbol's code, 0 for absent symbols; the header's size),
    checked to form a complete prefix code of at least two symbols."""
    view = np.frombuffer(payload, dtype=np.uint8)
    if len(view) < BITMAP_SIZE:
        raise CorruptObjectError("Huffman plane truncated")
    present = np.flatnonzero(np.unpackbits(view[:BITMAP_SIZE], bitorder="little"))
    k = len(present)
    head = BITMAP_SIZE + (k + 1) // 2
    if len(view) < head + SIZES_SIZE:
        raise CorruptObjectError("Huffman plane header truncated")
    nibbles = np.empty(2 * ((k + 1) // 2), dtype=np.uint8)
    nibbles[0::2] = view[BITMAP_SIZE:head] & 15
    nibbles[1::2] = view[BITMAP_SIZE:head] >> 4
    lengths = np.zeros(256, dtype=np.int64)
    lengths[present] = nibbles[:k]
    if k < 2 or nibbles[k:].any() or not np.all((lengths[present] >= 1) & (lengths[present] <= MAX_BITS)):
        raise CorruptObjectError("Huffman plane code lengths invalid")
    if int(np.sum(1 << (MAX_BITS - lengths[present]))) != 1 << MAX_BITS:
        raise CorruptObjectError("Huffman plane code is not a complete prefix code")
    return lengths, head


def decode_table(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(symbol, code length) for every 11-bit window, the next bit in bit 0."""
    symbols = np.empty(1 << MAX_BITS, dtype=np.uint8)
    sizes = np.empty(1 << MAX_BITS, dtype=np.int64)
    code = 0
    order = sorted((int(lengths[s]), s) for s in range(256) if lengths[s])
    previous = order[0][0]
    for length, symbol in order:  # canonical: by length, then symbol
        code <<= length - previous
        previous = length
        reversed_code = int(f"{code:0{length}b}"[::-1], 2)
        symbols[reversed_code :: 1 << length] = symbol
        sizes[reversed_code :: 1 << length] = length
        code += 1
    return symbols, sizes


def decode(payload: Buffer, n: int) -> np.ndarray:
    """The n symbols of a Huffman plane payload (a new uint8 array)."""
    lengths, pos = code_lengths(payload)
    view = np.frombuffer(payload, dtype=np.uint8)
    sizes = np.frombuffer(view[pos : pos + SIZES_SIZE].tobytes(), dtype="<u4").astype(np.int64)
    pos += SIZES_SIZE
    symbols, code_size = decode_table(lengths)
    out = np.empty(n, dtype=np.uint8)
    for t, (start, end) in enumerate(stream_spans(n)):
        size = int(sizes[t]) if t < STREAMS - 1 else len(view) - pos
        if size > len(view) - pos:
            raise CorruptObjectError("Huffman plane stream sizes exceed the payload")
        stream = view[pos : pos + size]
        pos += size
        out[start:end] = _decode_stream(stream, end - start, symbols, code_size)
    return out


def _decode_stream(stream: np.ndarray, count: int, symbols: np.ndarray, code_size: np.ndarray) -> np.ndarray:
    # The 11-bit window at every bit position of the stream at once (zeros past its
    # end), then one step per symbol along them. A valid stream's symbols all start
    # within it, so a step past its last bit means a malformed one.
    limit = 8 * len(stream)
    bits = np.concatenate([np.unpackbits(stream, bitorder="little"), np.zeros(MAX_BITS, dtype=np.uint8)])
    windows = np.zeros(limit + 1, dtype=np.int32)
    for j in range(MAX_BITS):
        windows |= bits[j : j + limit + 1].astype(np.int32) << j
    step = code_size[windows].tolist()
    at = [0] * count
    position = 0
    for i in range(count):
        if position >= limit:
            raise CorruptObjectError("Huffman plane stream ends early")
        at[i] = position
        position += step[position]
    if position > limit:
        raise CorruptObjectError("Huffman plane stream ends early")
    return symbols[windows[np.asarray(at, dtype=np.int64)]]
