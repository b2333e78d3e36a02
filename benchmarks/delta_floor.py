"""How far a lossless coder could go below what ckvc stores for a checkpoint sequence.

For every changed 4 MiB chunk of every tensor kind (frozen weights, trained
weights, Adam's first and second moments) it prints, against the chunk at the
same place one commit back:

- ``whole``: ckvc's encoding of the chunk alone (byte planes);
- ``parent delta``: the smaller of that and ckvc's delta against the parent's chunk,
  with no minimum gain (what parent-chain deltas would store, restore cost aside);
- ``delta <=3 back``: the same against the chunk three commits back (two, one in
  the first commits): the drift a delta against an older keyframe pays;
- ``entropy``: the order-0 entropy of the delta residual's byte planes, each plane
  coded in the context of the base's exponent byte (a coder ckvc does not have),
  or of the chunk's own planes when that is smaller.

Then the totals over the sequence (bit-identical chunks counted once): what ckvc
stores with its defaults, what parent deltas everywhere would store, and the
entropy bound. The acceptance target of the tensor-aware compression issue for the
last-two-layers MiniLM sequence (0.30 of raw) is judged against these.

Last, keyframe policies replayed chunk by chunk with ckvc's coder and its minimum
gain, from one table of every save's encoding against every other, each within one
keyframe plus one delta per checkout but the last: keyframe deltas as ckvc
stores them (a chunk whose delta against its keyframe does not pay becomes the next
keyframe; ckvc's per-tensor backoff is not replayed); re-basing (such a chunk stays
provisional, and when the next save comes, that save becomes the keyframe and the
provisional chunk is re-coded as a reverse delta against it); and the best keyframes
in hindsight: per chunk position, the saves stored whole that minimise the
sequence's bytes when every other save is a delta against one of them, earlier or
later (what a re-keying pass over finished history could reach within that bound);
and, outside that bound, chains of two deltas.

    python benchmarks/delta_floor.py [--mode last2|all]   # MiniLM (needs '.[bench]')
    python benchmarks/delta_floor.py --scratch            # the from-scratch GPT-2-style run
    python benchmarks/delta_floor.py --synthetic          # a small MLP, no extras
    python benchmarks/delta_floor.py --multinode 64       # rank 0 of benchmarks/multinode.py's
                                                          # run (MiB over the 4 ranks), no extras
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compression import flat_tensors, pack_bytes

import ckvc
import ckvc.codecs.auto as auto_codec
from ckvc.chunking import DEFAULT_CHUNK_SIZE, chunk_spans
from ckvc.codecs import ChunkLayout, DeltaBase, TensorCodec, layout_for
from ckvc.codecs.delta import SUB, residual
from ckvc.codecs.planes import split_planes
from ckvc.state import dtype_name

MB = 1e6
KINDS = ("frozen weights", "trained weights", "master weights", "Adam m", "Adam v", "other")


def kind_of(path: str, changes: bool) -> str:
    if path.endswith("exp_avg"):
        return "Adam m"
    if path.endswith("exp_avg_sq"):
        return "Adam v"
    if path.endswith(".master"):
        return "master weights"
    if path.startswith("model."):
        return "trained weights" if changes else "frozen weights"
    return "other"


def plane_entropy_bytes(planes: Iterable[np.ndarray], context: np.ndarray | None) -> float:
    """Order-0 entropy in bytes of each plane, coded alone or per value of ``context``."""
    bits = 0.0
    for plane in planes:
        if context is None:
            counts = np.bincount(plane, minlength=256).reshape(1, 256)
        else:
            counts = np.bincount(context.astype(np.int64) * 256 + plane, minlength=65536).reshape(256, 256)
        totals = counts.sum(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            p = np.where(counts > 0, counts / np.maximum(totals, 1), 1.0)
        bits -= float((counts * np.log2(p)).sum())
    return bits / 8


def entropy_whole(chunk: np.ndarray, width: int) -> float:
    planes, tail = split_planes(chunk.data, width, True)
    return plane_entropy_bytes(planes, None) + len(tail)


def entropy_delta(chunk: np.ndarray, base: np.ndarray, width: int) -> float:
    diff = residual(chunk.data, base.data, SUB, width)
    planes, tail = split_planes(diff.data, width, False)
    base_planes, _ = split_planes(base.data, width, True)
    return plane_entropy_bytes(planes, base_planes[-1]) + len(tail)


class Totals:
    def __init__(self) -> None:
        self.sizes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.raw: dict[str, float] = defaultdict(float)

    def add(self, kind: str, column: str, size: float) -> None:
        self.sizes[kind][column] += size


def measure(states: list[dict[str, Any]]) -> tuple[Totals, int]:
    codec = TensorCodec()
    flat = [flat_tensors(s) for s in states]
    changing = {
        path for f in flat[1:] for path, t in f.items() if path not in flat[0] or not torch.equal(t, flat[0][path])
    }
    totals, raw_total = Totals(), 0
    seen: set[bytes] = set()
    for epoch, tensors in enumerate(flat):
        for path, tensor in tensors.items():
            data = tensor.view(-1).view(torch.uint8).numpy()
            raw_total += len(data)
            if not tensor.is_floating_point() or tensor.element_size() == 1:
                continue
            layout = layout_for(dtype_name(tensor.dtype))
            history = [f.get(path) for f in flat[max(0, epoch - 3) : epoch]]
            kind = kind_of(path, path in changing)
            for a, b in chunk_spans(len(data), DEFAULT_CHUNK_SIZE):
                chunk = data[a:b]
                key = blake3.blake3(chunk.data).digest()
                if key in seen:
                    continue
                seen.add(key)
                totals.raw[kind] += len(chunk)
                whole = len(codec.encode_chunk(chunk.data, layout)[1])
                totals.add(kind, "whole", whole)
                bases = [h.view(-1).view(torch.uint8).numpy()[a:b] for h in history if h is not None]
                bases = [base for base in bases if len(base) == len(chunk)]
                own_h = entropy_whole(chunk, layout.width)
                if not bases:  # the first commit: stored whole by every scheme
                    for column in ("parent delta", "delta <=3 back"):
                        totals.add(kind, column, whole)
                    totals.add(kind, "entropy", min(own_h, whole))
                    continue
                parent, oldest = bases[-1], bases[0]
                for column, base in (("parent delta", parent), ("delta <=3 back", oldest)):
                    stored = codec.encode_chunk(chunk.data, layout, DeltaBase(b"", base.data, 0))
                    totals.add(kind, column, len(stored[1]))
                totals.add(kind, "entropy", min(own_h, entropy_delta(chunk, parent, layout.width), whole))
    return totals, raw_total


def keyframe_policies(states: list[dict[str, Any]]) -> dict[str, int]:
    """Bytes stored by each keyframe policy (see the module's docstring), summed
    over every float chunk position; a chunk equal to the one before it at its
    position, or a position whose history another one repeats, costs nothing (it
    deduplicates)."""
    codec = TensorCodec()
    flat = [flat_tensors(s) for s in states]
    totals = {"keyframe deltas": 0, "re-basing": 0, "best keyframes in hindsight": 0, "chains of two deltas": 0}
    seen: set[tuple[bytes, ...]] = set()
    for path, first in flat[0].items():
        if not first.is_floating_point() or first.element_size() == 1:
            continue
        layout = layout_for(dtype_name(first.dtype))
        series = [f[path].view(-1).view(torch.uint8).numpy() for f in flat if path in f]
        for a, b in chunk_spans(len(series[0]), DEFAULT_CHUNK_SIZE):
            chunks = [data[a:b] for data in series if len(data) == len(series[0])]
            history = tuple(blake3.blake3(chunk.data).digest() for chunk in chunks)
            if history in seen:
                continue  # a tied tensor (an embedding and its output layer): stored once
            seen.add(history)
            whole, cost = _costs(codec, list(_changed(chunks)), layout)
            totals["keyframe deltas"] += _keyframe_deltas(whole, cost)
            totals["re-basing"] += _re_basing(whole, cost)
            totals["chains of two deltas"] += _two_deep(whole, cost)
            totals["best keyframes in hindsight"] += _best_in_hindsight(whole, cost)
    return totals


def _changed(chunks: list[np.ndarray]) -> Iterable[np.ndarray]:
    previous = None
    for chunk in chunks:
        if previous is None or not np.array_equal(chunk, previous):
            yield chunk
        previous = chunk


def _costs(codec: TensorCodec, changed: list[np.ndarray], layout: ChunkLayout) -> tuple[list[int], list[list[int]]]:
    """Every encoding the policies choose from, each computed once: ``whole[i]``, save
    i alone, and ``cost[i][j]``, save i against save j as ckvc's coder stores it (a
    delta where it pays, else whole: a delta pays exactly where ``cost < whole``)."""
    n = len(changed)
    whole = [len(codec.encode_chunk(c.data, layout)[1]) for c in changed]
    cost = [
        [whole[i] if i == j else len(codec.encode_chunk(changed[i].data, layout, DeltaBase(b"", changed[j].data, 0))[1])
         for j in range(n)]
        for i in range(n)
    ]  # fmt: skip
    return whole, cost


def _keyframe_deltas(whole: list[int], cost: list[list[int]]) -> int:
    stored, keyframe = 0, None
    for i in range(len(whole)):
        stored += whole[i] if keyframe is None else cost[i][keyframe]
        if keyframe is None or cost[i][keyframe] == whole[i]:
            keyframe = i
    return stored


def _re_basing(whole: list[int], cost: list[list[int]]) -> int:
    stored, keyframe, provisional = 0, None, False
    for i in range(len(whole)):
        if keyframe is None or provisional:
            stored += whole[i]
            if keyframe is not None and cost[keyframe][i] < whole[keyframe]:
                # the provisional keyframe becomes a reverse delta against this save
                stored += cost[keyframe][i] - whole[keyframe]
                provisional = False
            else:
                provisional = True
            keyframe = i
        else:
            stored += cost[i][keyframe]
            if cost[i][keyframe] == whole[i]:
                keyframe, provisional = i, True
    return stored


def _two_deep(whole: list[int], cost: list[list[int]]) -> int:
    """Outside the bound, for comparison: each save the smaller of a delta against its
    keyframe and one against the parent's chunk where that is one delta deep (a
    checkout then decodes up to three records)."""
    stored, keyframe, parent_depth = 0, None, 0
    for i in range(len(whole)):
        options = [(whole[i], 0)]
        if keyframe is not None:
            options.append((cost[i][keyframe], 1))
        if parent_depth == 1:
            options.append((cost[i][i - 1], 2))
        size, parent_depth = min((size, depth) for size, depth in options if depth == 0 or size < whole[i])
        stored += size
        if parent_depth == 0:
            keyframe = i
    return stored


def _best_in_hindsight(whole: list[int], cost: list[list[int]]) -> int:
    n = len(whole)
    best = sum(whole)
    for mask in range(1, 1 << n):
        keys = [j for j in range(n) if mask >> j & 1]
        best = min(
            best,
            sum(whole[j] for j in keys) + sum(min(cost[i][j] for j in keys) for i in range(n) if not mask >> i & 1),
        )
    return best


def ckvc_stored(states: list[dict[str, Any]], workdir: Path) -> int:
    with tempfile.TemporaryDirectory(dir=workdir) as tmp, ckvc.Repo.init(tmp) as repo:
        for i, state in enumerate(states):
            repo.commit(state, message=f"epoch {i}")
        return pack_bytes(repo)


def synthetic_sequence(epochs: int) -> list[dict[str, Any]]:
    """A small MLP trained with AdamW, the first layer frozen."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x, y = torch.randn(256, 256), torch.randn(256, 256)
    states = []
    for _ in range(epochs):
        for _ in range(8):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        moments = {k: {n: t.clone() for n, t in v.items()} for k, v in optimizer.state_dict()["state"].items()}
        states.append({"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": {"state": moments}})
    return states


def multinode_sequence(size_mb: int, saves: int) -> list[dict[str, Any]]:
    """Rank 0's saves in benchmarks/multinode.py's run (its defaults: 4 AdamW steps
    at lr 1e-5 between saves), each a copy."""
    from multinode import Trainer

    trainer, states = Trainer(0, size_mb, lr=1e-5), []
    for _ in range(saves):
        states.append(_copied(trainer.state()))
        trainer.advance(4)
    return states


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="last2", help="MiniLM sequence: last2 or all")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--synthetic", action="store_true", help="a small MLP instead of MiniLM")
    parser.add_argument("--scratch", action="store_true", help="the GPT-2-style run from scratch (scratch_data.py)")
    parser.add_argument("--multinode", type=int, metavar="MIB", help="benchmarks/multinode.py's rank 0 at this size")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(argv)
    if args.multinode:
        states = multinode_sequence(args.multinode, args.epochs)
        title = f"multinode.py rank 0 ({args.multinode} MiB over 4 ranks), {args.epochs} saves"
    elif args.scratch:
        from scratch_data import cached_sequence as scratch_sequence

        states = [torch.load(p, weights_only=True) for p in scratch_sequence()]
        title = f"GPT-2-style model from scratch, {len(states)} saves"
    elif args.synthetic:
        states, title = synthetic_sequence(args.epochs), f"synthetic MLP, {args.epochs} checkpoints"
    else:
        from minilm_data import cached_sequence

        paths = cached_sequence(args.mode, args.epochs)
        states = [torch.load(p, weights_only=True) for p in paths]
        title = f"MiniLM fine-tune ({args.mode}), {args.epochs} checkpoints"
    # Any gain: a bound, not a policy. The encoder reads its module's constant.
    default_gain, auto_codec.DELTA_MIN_GAIN = auto_codec.DELTA_MIN_GAIN, 1.0
    try:
        totals, raw = measure(states)
    finally:
        auto_codec.DELTA_MIN_GAIN = default_gain
    policies = keyframe_policies(states)
    actual = ckvc_stored(states, args.workdir or Path(tempfile.gettempdir()))
    columns = ("whole", "parent delta", "delta <=3 back", "entropy")
    print(f"\n{title}  (raw {raw / MB:.1f} MB; distinct chunks by kind, stored MB and /raw)")
    print(f"  {'kind':16s} {'raw MB':>8s}" + "".join(f" {c:>20s}" for c in columns))
    for kind in KINDS:
        if kind not in totals.raw:
            continue
        cells = "".join(
            f" {totals.sizes[kind][c] / MB:9.1f} ({totals.sizes[kind][c] / totals.raw[kind]:.3f})" for c in columns
        )
        print(f"  {kind:16s} {totals.raw[kind] / MB:8.1f}{cells}")
    sums = {c: sum(totals.sizes[k][c] for k in totals.sizes) for c in columns}
    print("  stored / (raw of every checkpoint), bit-identical chunks once:")
    print(f"    ckvc with its defaults (keyframe deltas)   {actual / raw:.5f}")
    print(f"    parent deltas everywhere, ckvc's coder     {sums['parent delta'] / raw:.5f}")
    print(f"    deltas up to 3 commits back, ckvc's coder {sums['delta <=3 back'] / raw:.5f}")
    print(f"    order-0 entropy bound (exponent context)   {sums['entropy'] / raw:.5f}")
    print("  keyframe policies replayed with ckvc's coder (float chunks; a checkout decodes one keyframe and one")
    print("  delta, chains of two deltas excepted):")
    for name, stored in policies.items():
        print(f"    {name:42s} {stored / raw:.5f}")


if __name__ == "__main__":
    main()
