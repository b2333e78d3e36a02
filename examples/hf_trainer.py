"""Hugging Face Trainer with ckvc: every checkpoint-N folder the Trainer saves is a
commit, and a fresh Trainer resumes from an earlier commit. A tiny BERT made from a
config, random tokens, CPU, a few seconds.

    python examples/hf_trainer.py [--dir DIR]

The lines tagged ``[ckvc]`` are all the ckvc code a training script needs
(docs/GUIDE.md, "Hugging Face Trainer").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from ckvc.integrations.transformers import CkvcCallback, checkout_for_resume  # [ckvc]


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=2,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="where the run and its repository go (default: a temporary dir)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = opts.dir or Path(tmp)
        out, repo = str(root / "out"), str(root / "repo")
        g = torch.Generator().manual_seed(1)
        data = [
            {"input_ids": torch.randint(0, 97, (16,), generator=g), "labels": torch.randint(0, 2, (), generator=g)}
            for _ in range(32)
        ]
        args = TrainingArguments(
            output_dir=out, max_steps=6, save_steps=2, per_device_train_batch_size=8, logging_steps=1,
            use_cpu=True, report_to=[], disable_tqdm=True, seed=0,
        )  # fmt: skip
        trainer = Trainer(model=tiny_bert(), args=args, train_dataset=data, callbacks=[CkvcCallback(repo)])  # [ckvc]
        trainer.train()

        # A fresh Trainer goes back to step 4 (one commit before the tip) and trains on, on
        # branch "retry" that starts there: its checkpoint-6 equals main's, bit for bit.
        retry = CkvcCallback(repo, branch="retry")  # [ckvc]
        again = Trainer(model=tiny_bert(), args=args, train_dataset=data, callbacks=[retry])
        again.train(resume_from_checkpoint=checkout_for_resume(repo, "main~1", out))  # [ckvc]
        subprocess.run([sys.executable, "-m", "ckvc", "-C", repo, "log", "--all", "--oneline"], check=True)


if __name__ == "__main__":
    main()
