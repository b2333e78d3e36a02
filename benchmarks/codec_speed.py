"""The chunk codec's speed on one core against ZipNN's, in the same run (issue 33:
bf16 encode >= 1.5 GB/s, decode >= 3 GB/s on one core).

Data: MiniLM's pretrained weights (the packaged all-MiniLM-L6-v2, 45 MB in bf16),
cut into chunks as a commit cuts them. One thread throughout: ckvc's codec with
Huffman planes (format version 4) and with zstd planes (version 3), and ZipNN with
``threads=1``. Rounds alternate between them; the figures are medians. Codec work
only: no hashing, no I/O.

Decode is timed twice for ckvc: into a warm destination (the codec's own speed),
and into fresh memory allocated per round as ZipNN's output is (its first touch,
a page fault per 4 KiB, is then part of both).

Run: ``python benchmarks/codec_speed.py [--dtypes bfloat16 float32] [--rounds 9]``.
``--data synthetic --size-mb 8`` uses random normal weights instead (no bench extras
needed; ZipNN's rows are left out where it is not installed): the test suite's smoke run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckvc.chunking import DEFAULT_CHUNK_SIZE, chunk_spans
from ckvc.codecs import TensorCodec, decode_chunk_into, layout_for
from ckvc.codecs.planes import can_write_huffman
from ckvc.state import dtype_name

Chunk = tuple[memoryview, Any]


def chunks_of(state: dict[str, torch.Tensor]) -> list[Chunk]:
    chunks: list[Chunk] = []
    for tensor in state.values():
        data = tensor.contiguous().view(-1).view(torch.uint8).numpy().data.cast("B")
        layout = layout_for(dtype_name(tensor.dtype))
        chunks += [(data[a:b], layout) for a, b in chunk_spans(len(data), DEFAULT_CHUNK_SIZE)]
    return chunks


class CkvcCodec:
    def __init__(self, chunks: list[Chunk], huffman: bool) -> None:
        self.chunks = chunks
        self.codec = TensorCodec(format4=huffman)
        self.encoded = self.encode()
        sizes = [len(c) for c, _ in chunks]
        self.raw = sum(sizes)
        self.stored = sum(len(p) for _, p in self.encoded)
        self.ends = np.cumsum(sizes).tolist()
        self.warm = np.empty(self.raw, dtype=np.uint8)

    def encode(self) -> list[tuple[int, Any]]:
        return [self.codec.encode_chunk(c, layout) for c, layout in self.chunks]

    def decode_into(self, out: np.ndarray) -> None:
        start = 0
        for (codec_id, payload), end in zip(self.encoded, self.ends, strict=True):
            decode_chunk_into(codec_id, payload, out[start:end])
            start = end

    def decode_warm(self) -> None:
        self.decode_into(self.warm)

    def decode_fresh(self) -> None:
        # Allocated by torch, as a checkout's tensors are (numpy would ask for huge pages).
        self.decode_into(torch.empty(self.raw, dtype=torch.uint8).numpy())

    def check(self) -> None:
        self.decode_warm()
        assert self.warm.tobytes() == b"".join(bytes(c) for c, _ in self.chunks), "ckvc did not round-trip"


class ZipnnCodec:
    def __init__(self, data: bytes, dtype: str) -> None:
        import zipnn  # a bench extra

        self.data = data
        self.codec = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
        self.packed = self.codec.compress(bytes(bytearray(data)))  # it rewrites its input: a private copy
        assert bytes(self.codec.decompress(self.packed)) == data, "zipnn did not round-trip"
        self.private = bytes(bytearray(data))

    def encode(self) -> None:
        self.codec.compress(self.private)

    def reset(self) -> None:  # untimed: a fresh private copy for the next round's encode
        self.private = bytes(bytearray(self.data))

    def decode(self) -> None:
        self.codec.decompress(self.packed)


def rounds_of(fns: dict[str, Callable[[], Any]], rounds: int, between: Callable[[], None]) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            between()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def synthetic_weights(dtype: torch.dtype, size_mb: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    rows = max(1, (size_mb << 20) // (dtype.itemsize * 1024 * 4))
    return {f"w{i}": (torch.randn(rows, 1024, generator=generator) * 0.02).to(dtype) for i in range(4)}


def run(dtype: str, rounds: int, data: str, size_mb: int) -> None:
    torch.set_num_threads(1)
    if data == "minilm":
        from minilm_data import minilm_weights

        state = minilm_weights(getattr(torch, dtype))
    else:
        state = synthetic_weights(getattr(torch, dtype), size_mb)
    chunks = chunks_of(state)
    huffman = CkvcCodec(chunks, huffman=True)
    zstd_planes = CkvcCodec(chunks, huffman=False)
    for codec in (huffman, zstd_planes):
        codec.check()
    raw_bytes = b"".join(bytes(c) for c, _ in chunks)
    try:
        zipnn: ZipnnCodec | None = ZipnnCodec(raw_bytes, dtype)
    except ImportError:
        zipnn = None
    fns = {
        "ckvc encode, Huffman planes": huffman.encode,
        "ckvc encode, zstd planes": zstd_planes.encode,
        "ckvc decode, Huffman planes, warm": huffman.decode_warm,
        "ckvc decode, zstd planes, warm": zstd_planes.decode_warm,
        "ckvc decode, Huffman planes, fresh": huffman.decode_fresh,
    }
    if zipnn is not None:
        fns |= {"zipnn encode": zipnn.encode, "zipnn decode (fresh output)": zipnn.decode}
    medians = rounds_of(fns, rounds, zipnn.reset if zipnn is not None else lambda: None)
    gb = huffman.raw / 1e9
    label = "MiniLM weights" if data == "minilm" else "random normal weights"
    print(f"\n{label}, {dtype}: {huffman.raw / 1e6:.1f} MB in {len(chunks)} chunks, one thread")
    stored = huffman.stored / huffman.raw, zstd_planes.stored / huffman.raw
    sizes = f"  stored/raw: ckvc Huffman {stored[0]:.5f}, zstd planes {stored[1]:.5f}"
    if zipnn is not None:
        sizes += (
            f", zipnn {len(zipnn.packed) / huffman.raw:.5f} (ckvc / zipnn {huffman.stored / len(zipnn.packed):.4f})"
        )
    print(sizes if zipnn is not None else sizes + " (zipnn not installed: its rows are left out)")
    for name, seconds in medians.items():
        print(f"  {name:<38} {seconds * 1e3:8.1f} ms  {gb / seconds:6.2f} GB/s")
    if zipnn is not None:
        enc = medians["zipnn encode"] / medians["ckvc encode, Huffman planes"]
        dec = medians["zipnn decode (fresh output)"] / medians["ckvc decode, Huffman planes, fresh"]
        print(f"  speed against zipnn (x faster): encode {enc:.2f}, decode into fresh memory {dec:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--data", choices=["minilm", "synthetic"], default="minilm")
    parser.add_argument("--size-mb", type=int, default=64, help="synthetic data only")
    args = parser.parse_args(argv)
    if not can_write_huffman():
        raise SystemExit("ckvc's native loops did not build: the Huffman planes need them")
    for dtype in args.dtypes:
        run(dtype, args.rounds, args.data, args.size_mb)


if __name__ == "__main__":
    main()
