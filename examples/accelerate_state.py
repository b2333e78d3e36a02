"""Accelerate with ckvc: the folder ``accelerator.save_state`` writes becomes a
commit, and ``load_state`` goes back to any commit (model, optimizer, scheduler,
RNG). CPU, a few seconds.

    python examples/accelerate_state.py [--dir DIR]

The lines tagged ``[ckvc]`` are all the ckvc code a training script needs
(docs/GUIDE.md, "Accelerate").
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

import ckvc  # [ckvc]
from ckvc.integrations.accelerate import load_state, save_state  # [ckvc]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="where the run and its repository go (default: a temporary dir)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = opts.dir or Path(tmp)
        set_seed(0)
        accelerator = Accelerator(cpu=True, project_dir=str(root))
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        x = torch.randn(64, 4)
        data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16, shuffle=True)
        model, optimizer, data = accelerator.prepare(model, optimizer, data)
        repo = ckvc.Repo.init(root / "repo")  # [ckvc]
        losses: dict[int, list[float]] = {}
        for epoch in range(3):
            losses[epoch] = []
            for xb, yb in data:
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses[epoch].append(round(loss.item(), 6))
            save_state(accelerator, repo, root / f"epoch_{epoch}", metrics={"loss": losses[epoch][-1]})  # [ckvc]
        load_state(accelerator, repo, "main~1")  # [ckvc]  back to the end of epoch 1
        again = []
        for xb, yb in data:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            again.append(round(loss.item(), 6))
        print("epoch 2 losses:", losses[2])
        print("again from main~1:", again, "(the same)" if again == losses[2] else "(DIFFERENT)")
        repo.close()


if __name__ == "__main__":
    main()
