"""save_state / load_state through ckvc with the real Accelerate: the folder
``accelerator.save_state`` writes is committed as it is, and loading the commit
back restores model, optimizer, scheduler and RNG so that the next epoch's losses
repeat bit for bit. Blocking and background commits."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

import torch

import ckvc
from ckvc.errors import InvalidInputError
from ckvc.formats import export_commit


def _epoch(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, data: Any) -> list[float]:
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.mark.parametrize("blocking", [True, False])
def test_save_state_commit_and_load_state_resume_bit_exact(tmp_path: Path, blocking: bool) -> None:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, TensorDataset

    from ckvc.integrations.accelerate import load_state, save_state

    set_seed(0)
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path / "project"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    x = torch.randn(24, 4)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)
    model, optimizer, scheduler, data = accelerator.prepare(model, optimizer, scheduler, data)
    _epoch(accelerator, model, optimizer, scheduler, data)

    repo = ckvc.Repo.init(tmp_path / "repo")
    made = save_state(accelerator, repo, tmp_path / "state", metrics={"epoch": 1}, blocking=blocking)
    assert made is not None  # None only on the other processes
    commit_id = made if isinstance(made, str) else made.result()
    expected = _epoch(accelerator, model, optimizer, scheduler, data)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    commit = repo.read_commit(commit_id)
    assert commit.message == "state" and commit.metrics == {"epoch": 1.0}
    assert commit.metadata["accelerate.dir"] == "state"
    export_commit(repo, commit_id, tmp_path / "exported")
    assert _tree(tmp_path / "exported") == _tree(tmp_path / "state")  # byte for byte, every file

    _epoch(accelerator, model, optimizer, scheduler, data)  # move on, then go back
    assert load_state(accelerator, repo, "main") == commit_id
    assert not (tmp_path / "project" / ".ckvc-load").exists() or not any(
        (tmp_path / "project" / ".ckvc-load").iterdir()
    )
    assert _epoch(accelerator, model, optimizer, scheduler, data) == expected  # floats compared exactly
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    repo.close()


def test_refusals(tmp_path: Path) -> None:
    from accelerate import Accelerator

    from ckvc.integrations.accelerate import load_state, save_state

    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path / "project"))
    with pytest.raises(InvalidInputError, match="needs a Repo"):
        save_state(accelerator, tmp_path / "repo", tmp_path / "state", blocking=False)
    assert not (tmp_path / "state").exists()  # refused before anything was written
    with ckvc.Repo.init(tmp_path / "repo") as repo:
        repo.commit({"w": torch.zeros(2)}, "not a save_state folder")
        with pytest.raises(InvalidInputError, match="not made by ckvc's save_state"):
            load_state(accelerator, repo, "HEAD")
