"""Optimizer state under its parameter's name (inspect.parameter_names): the mapping
torch's order allows, and nothing where the state leaves it open."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import ckvc
from ckvc import inspect
from ckvc import state as state_mod


def names_of(tmp_path: Path, state: dict[str, Any]) -> dict[str, str]:
    with ckvc.Repo.init(tmp_path / "repo") as repo:
        commit = repo.read_commit(repo.commit(state, message="s"))
        snapshot = repo.read_snapshot(commit)
        skeleton = state_mod.parse_snapshot(snapshot, commit.id, allow_pickle=None).build()
        return inspect.parameter_names(skeleton, snapshot)


def trained(model: torch.nn.Module, params: Any = None) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters() if params is None else params)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return optimizer


def bn_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))


def test_adam_state_maps_past_batchnorm_buffers_of_the_same_shape(tmp_path: Path) -> None:
    model = bn_model()
    optimizer = trained(model)
    got = names_of(tmp_path, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    names = [n for n, _ in model.named_parameters()]
    assert got == {f"optimizer.state.{i}": f"model.{n}" for i, n in enumerate(names)}


def test_lightning_layout_and_an_ema_copy_resolve_to_the_model(tmp_path: Path) -> None:
    model = bn_model()
    optimizer = trained(model)
    state = {
        "state_dict": model.state_dict(),
        "ema": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer_states": [optimizer.state_dict()],
    }
    got = names_of(tmp_path, state)
    assert got["optimizer_states.0.state.0"] == "state_dict.0.weight"
    assert got["optimizer_states.0.state.5"] == "state_dict.2.bias"


def test_two_copies_neither_named_like_a_model_give_no_names(tmp_path: Path) -> None:
    model = bn_model()
    optimizer = trained(model)
    sd = model.state_dict()
    state = {"student": sd, "teacher": {k: v.clone() for k, v in sd.items()}, "optimizer": optimizer.state_dict()}
    assert names_of(tmp_path, state) == {}


def test_a_frozen_layer_shaped_like_a_trained_one_gives_no_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    optimizer = trained(model, model[1].parameters())  # layer 0 frozen: ids 0, 1 are layer 1's
    # the leftmost match would name layer 0: a guess, so nothing is said
    assert names_of(tmp_path, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}) == {}


def test_a_frozen_layer_of_another_shape_is_skipped(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    optimizer = trained(model, model[1].parameters())
    got = names_of(tmp_path, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    assert got == {"optimizer.state.0": "model.1.weight", "optimizer.state.1": "model.1.bias"}


def test_param_groups_out_of_model_order_give_no_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    groups = [
        {"params": [model[0].weight, model[1].weight], "weight_decay": 0.1},
        {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0},
    ]
    optimizer = trained(model, groups)
    assert names_of(tmp_path, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}) == {}


def test_state_without_param_groups_is_not_an_optimizer(tmp_path: Path) -> None:
    state = {"model": {"w": torch.zeros(2, 2)}, "optimizer": {"state": {0: {"exp_avg": torch.zeros(2, 2)}}}}
    assert names_of(tmp_path, state) == {}


def test_malformed_optimizer_like_state_gives_no_names(tmp_path: Path) -> None:
    model = {"w": torch.zeros(2, 2)}
    for optimizer in (
        {"state": 5, "param_groups": [{"params": [0]}]},
        {"state": {}, "param_groups": [{"params": "abc"}]},
        {"state": {0: 1}, "param_groups": [{"params": [0]}]},
        {"state": {}, "param_groups": [{"params": [[0]]}]},
        {"state": {1: {"exp_avg": torch.zeros(2, 2)}}, "param_groups": [{"params": [0]}]},
    ):
        assert names_of(tmp_path / str(len(list(tmp_path.iterdir()))), {"model": model, "optimizer": optimizer}) == {}
