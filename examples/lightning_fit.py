"""PyTorch Lightning with ckvc: a stock ModelCheckpoint(monitor="val_loss",
save_top_k=2, save_last=True) stores every checkpoint as a commit; a fresh Trainer
resumes from one with ``ckpt_path="ckvc:REV"``. CPU, a few seconds.

    python examples/lightning_fit.py [--dir DIR]

The lines tagged ``[ckvc]`` are all the ckvc code a training script needs
(docs/GUIDE.md, "PyTorch Lightning").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ckvc.integrations.lightning import CkvcCheckpointIO  # [ckvc]


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))

    def training_step(self, batch: Any, index: int) -> Any:
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, index: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.02)


def fit(root: Path, epochs: int, ckpt_path: str | None = None) -> None:
    pl.seed_everything(0, verbose=False)
    x = torch.randn(24, 4, generator=torch.Generator().manual_seed(1))
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    train = DataLoader(TensorDataset(x[:16], y[:16]), batch_size=8, shuffle=True)
    val = DataLoader(TensorDataset(x[16:], y[16:]), batch_size=8)
    best = pl.callbacks.ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)
    io = CkvcCheckpointIO(root / "repo")  # [ckvc]
    trainer = pl.Trainer(
        max_epochs=epochs, default_root_dir=root, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[best, io], plugins=[io],  # [ckvc]
    )  # fmt: skip
    trainer.fit(Regression(), train, val, ckpt_path=ckpt_path)
    print(f"best: {Path(best.best_model_path).name} val_loss={float(best.best_model_score or 0):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="where the run and its repository go (default: a temporary dir)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = opts.dir or Path(tmp)
        fit(root, epochs=3)
        fit(root, epochs=4, ckpt_path="ckvc:main~1")  # [ckvc]  back to epoch 2's top-k save, one more epoch
        subprocess.run([sys.executable, "-m", "ckvc", "-C", str(root / "repo"), "log", "--oneline"], check=True)


if __name__ == "__main__":
    main()
