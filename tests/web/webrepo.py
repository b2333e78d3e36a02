"""The repository the web tests serve, and a server over it (one per test module).

Two branches, two tags (one annotated), one commit pruned by a retention policy,
one lossy commit; tensors of each commit move by a known amount per layer, so the
diff's order is known."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

import ckvc
from ckvc.retention_policy import RetentionPolicy
from ckvc.web import WebServer, make_server


@dataclass
class Built:
    path: Path
    main: list[str]  # e0..e4, root first
    side: list[str]  # s0, s1 (forked at e2)
    pruned: str
    lossy: str


def state(step: int, moves: dict[int, float]) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(16, 16, generator=g) for i in range(3)}
    model.update({f"layers.{i}.bias": torch.randn(16, generator=g) for i in range(3)})
    for layer, amount in moves.items():  # layer i's weight moves by `amount` relative change per step
        model[f"layers.{layer}.weight"] = model[f"layers.{layer}.weight"] * (1 + amount * step)
    # 4096 elements: big enough for a lossy spec to apply (MIN_LOSSY_ELEMENTS)
    exp_avg = torch.randn(64, 64, generator=g) * 0.01 + 0.1 * step
    optimizer = {"state": {"0": {"exp_avg": exp_avg}}, "lr": 0.01}
    return {"model": model, "optimizer": optimizer, "epoch": step}


MAIN_MOVES = {0: 0.001, 1: 0.01, 2: 0.1}  # layers.2 moves most, then 1, then 0
SIDE_MOVES = {0: 0.2, 1: 0.02}


def build_repo(path: Path) -> Built:
    with ckvc.Repo.init(path, chunk_size=64 << 10) as repo:
        main: list[str] = []
        for step in range(5):
            lossy = {"optimizer.*": "q8"} if step == 3 else None
            metrics = {"val_loss": 1.0 / (step + 1), "acc": 0.5 + 0.1 * step, "step": float(step * 100)}
            main.append(repo.commit(state(step, MAIN_MOVES), message=f"epoch {step}", metrics=metrics, lossy=lossy))
            if step == 2:
                fork = main[-1]
        repo.tag("v1", main[1])
        repo.tag("v2", main[3], message="lossy release")
        repo.switch(fork, new_branch="side")
        side = []
        for step in range(3, 5):
            metrics = {"val_loss": 0.9 / (step + 1), "acc": 0.45 + 0.1 * step, "step": float(step * 100)}
            side.append(repo.commit(state(step, SIDE_MOVES), message=f"side {step}", metrics=metrics))
        repo.switch("main")
        policy = RetentionPolicy(keep_last=3)
        plan = repo.retain(policy)
        repo.set_retention(policy)
        assert plan.released == [main[0]], plan
    return Built(path, main, side, main[0], main[3])


def serving(path: Path, token: str | None = None) -> Iterator[WebServer]:
    """A server over ``path`` on a free loopback port, in a thread, for a fixture to yield."""
    srv = make_server(path, "127.0.0.1", 0, token=token)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        srv.api.close()
        thread.join(10)
