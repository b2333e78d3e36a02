"""A checkpoint sequence of a model trained from scratch (issue 33): a GPT-2-style model built
from a config (about 45M parameters, nothing downloaded), AdamW, 200 steps on synthetic
tokens, the full training state saved every 20 steps: 10 states of about 537 MB.

Where a fine-tune moves few weights far, pre-training moves every weight every step: the
deltas that win on MiniLM win little here, which is what this sequence is for.

The tokens follow a fixed random bigram table over the first 1024 ids of the vocabulary
(each token has four successors), small enough to be learnt in 200 steps: the loss falls
from ln(8192) towards ln(4) as it is. Everything is seeded and the run is deterministic.

    .venv/bin/python benchmarks/scratch_data.py [--cache-dir DIR]

generates (or reuses) the cache under ``~/.cache/ckvc-bench/scratch-gpt2``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()

CACHE_FORMAT = 1
CONFIG = {"vocab_size": 8192, "n_positions": 128, "n_embd": 640, "n_layer": 8, "n_head": 10}
STEPS = 200
SAVE_EVERY = 20
BATCH, SEQ = 4, 64
LR, WEIGHT_DECAY, WARMUP = 6e-4, 0.1, 20
SEED = 0
ACTIVE_VOCAB = 1024
SUCCESSORS = 4


def _bigram_table(vocab: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, vocab, (vocab, SUCCESSORS), generator=gen)


def _batch(table: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """BATCH sequences of SEQ tokens, each token one of its predecessor's likely successors."""
    tokens = torch.empty(BATCH, SEQ, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, table.shape[0], (BATCH,), generator=gen)
    picks = torch.randint(0, SUCCESSORS, (BATCH, SEQ), generator=gen)
    for i in range(1, SEQ):
        tokens[:, i] = table[tokens[:, i - 1], picks[:, i]]
    return tokens


def _snapshot(model: GPT2LMHeadModel, optimizer: torch.optim.AdamW, step: int, loss: float) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "step": step,
        "loss": loss,
    }


def _model() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(**CONFIG, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _train_step(model: GPT2LMHeadModel, optimizer: torch.optim.AdamW, tokens: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=tokens, labels=tokens).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


def train_sequence() -> list[dict[str, Any]]:
    """The 10 training states, in order (each a deep copy)."""
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP))
    table = _bigram_table(ACTIVE_VOCAB, gen)
    model.train()
    states: list[dict[str, Any]] = []
    for step in range(1, STEPS + 1):
        loss = _train_step(model, optimizer, _batch(table, gen))
        schedule.step()
        if step % SAVE_EVERY == 0:
            states.append(_snapshot(model, optimizer, step, float(loss.detach())))
    return states


def loss_after_steps(state: dict[str, Any], steps: int = 20, seed: int = 1) -> float:
    """Rebuild the model and AdamW, load ``state``, train ``steps`` more steps on fresh
    batches, then the mean loss over eight fixed held-out batches: what a resumed run's
    quality is judged by (issue 33). Deterministic given the arguments; the learning
    rate is the saved one (past the warm-up, the schedule is flat)."""
    torch.manual_seed(SEED)
    table = _bigram_table(ACTIVE_VOCAB, torch.Generator().manual_seed(SEED))
    model = _model()
    model.load_state_dict(state["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))  # load_state_dict keeps same-dtype tensors
    batches = torch.Generator().manual_seed(1000 + seed)
    model.train()
    for _ in range(steps):
        _train_step(model, optimizer, _batch(table, batches))
    held_out = torch.Generator().manual_seed(99)
    model.eval()
    with torch.no_grad():
        losses = [float(model(input_ids=(t := _batch(table, held_out)), labels=t).loss) for _ in range(8)]
    return sum(losses) / len(losses)


def _cache_config() -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT, "config": CONFIG, "steps": STEPS, "save_every": SAVE_EVERY, "batch": BATCH,
        "seq": SEQ, "lr": LR, "weight_decay": WEIGHT_DECAY, "warmup": WARMUP, "seed": SEED, "torch": torch.__version__,
        "active_vocab": ACTIVE_VOCAB, "successors": SUCCESSORS,
    }  # fmt: skip


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "ckvc-bench" / "scratch-gpt2"


def cached_sequence(cache_dir: Path | None = None) -> list[Path]:
    """Paths of the cached states (``torch.load(path, weights_only=True)``), generated once; a
    ``done.json`` marker holding the config is written last, so a half-written cache regenerates."""
    directory = cache_dir if cache_dir is not None else _default_cache_dir()
    paths = [directory / f"step_{(i + 1) * SAVE_EVERY:04d}.pt" for i in range(STEPS // SAVE_EVERY)]
    marker = directory / "done.json"
    try:
        if all(p.is_file() for p in paths) and json.loads(marker.read_text()) == _cache_config():
            return paths
    except (OSError, ValueError):
        pass
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    for path, state in zip(paths, train_sequence(), strict=True):
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
    marker.write_text(json.dumps(_cache_config(), indent=2, sort_keys=True))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    paths = cached_sequence(args.cache_dir)
    print(f"{len(paths)} states in {paths[0].parent} ({time.perf_counter() - started:.0f} s)")
    for path in paths:
        state = torch.load(path, weights_only=True)
        print(f"  step {state['step']:4d}  loss {state['loss']:.3f}  file {path.stat().st_size / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
