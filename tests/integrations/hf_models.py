"""The tiny Hugging Face setup the Trainer tests share: a 2-layer BERT made from a
config (no download), 64 random token sequences, and a Trainer that records each
step's loss as an exact float. Dropout is on, so a resume that lost the RNG state,
the optimizer or the data position shows in the losses."""

from __future__ import annotations

from typing import Any


def tiny_bert() -> Any:
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def random_tokens(n: int = 64, seed: int = 1) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(0, 97, (16,), generator=g),
            "attention_mask": torch.ones(16, dtype=torch.long),
            "labels": torch.randint(0, 2, (), generator=g),
        }
        for _ in range(n)
    ]


def training_args(out_dir: str, max_steps: int, save_steps: int, **overrides: Any) -> Any:
    """Deterministic CPU arguments: batch 8, a log entry every step, saves every ``save_steps``."""
    from transformers import TrainingArguments

    settings: dict[str, Any] = dict(
        output_dir=out_dir,
        max_steps=max_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=save_steps,
        seed=0,
        data_seed=0,
        full_determinism=True,
        use_cpu=True,
        dataloader_num_workers=0,
        report_to=[],
        disable_tqdm=True,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


def recording_trainer(**kwargs: Any) -> Any:
    """A Trainer whose ``losses`` lists each training step's loss (float, exact)."""
    from transformers import Trainer

    class Recording(Trainer):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.losses: list[float] = []

        def compute_loss(self, *args: Any, **kw: Any) -> Any:
            loss = super().compute_loss(*args, **kw)
            if self.model.training:
                self.losses.append(float(loss.detach()))
            return loss

    return Recording(**kwargs)
