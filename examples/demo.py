"""ckvc demo: train a small model on CPU, commit every epoch, branch a fine-tuning
experiment from an earlier epoch, check out, and show the log, storage stats and
what a retention policy would keep.

    python examples/demo.py [--dir DIR] [--epochs N]

Without --dir the repository goes in a temporary directory that is removed at the end
(also on error or Ctrl-C); with --dir it is kept there.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ckvc


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A synthetic 4-class problem: noisy Gaussian clusters in 32 dimensions."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 32, generator=g) * 2
    labels = torch.randint(0, 4, (4000,), generator=g)
    x = centers[labels] + torch.randn(4000, 32, generator=g) * 2.5
    return x[:3200], labels[:3200], x[3200:], labels[3200:]


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 4)
    )


def train_epoch(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    model.train()
    perm = torch.randperm(len(x))
    for i in range(0, len(x), 64):
        idx = perm[i : i + 64]
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    logits = model(x)
    return float(nn.functional.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())


def training_state(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, epoch: int) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "epoch": epoch,
        "rng": ckvc.rng_state(),
    }


def cli(repo_dir: Path, *args: str) -> None:
    """Run the ckvc command line, as a user would."""
    print(f"\n$ ckvc {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "ckvc", "-C", str(repo_dir), *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to create and keep the repository (default: a temp dir, removed)"
    )
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    if args.dir is not None:
        run(args.dir, args.epochs)
        print(f"repository kept at {args.dir}")
        return
    with tempfile.TemporaryDirectory(prefix="ckvc-demo-") as tmp:
        run(Path(tmp), args.epochs)
    print(f"removed the demo repository {tmp} (pass --dir DIR to keep one)")


def run(work: Path, epochs: int) -> None:
    """The demo itself, with its repository in ``work``."""
    started = time.perf_counter()
    torch.manual_seed(0)
    x_train, y_train, x_val, y_val = make_data()

    repo = ckvc.Repo.init(work)
    print(f"repository: {repo.dir}")
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    for epoch in range(epochs):
        train_epoch(model, opt, x_train, y_train)
        sched.step()
        val_loss, val_acc = evaluate(model, x_val, y_val)
        cid = repo.commit(
            training_state(model, opt, sched, epoch),
            message=f"epoch {epoch}",
            metrics={"val_loss": val_loss, "val_acc": val_acc},
        )
        stats = repo.last_commit_stats
        assert stats is not None
        print(
            f"epoch {epoch}: val_loss={val_loss:.4f} val_acc={val_acc:.3f}  commit {cid[:12]}  "
            f"({stats.new_chunks}/{stats.chunks} chunks new, {stats.stored_bytes / 1024:.0f} KiB written)"
        )

    best = min(repo.log("main"), key=lambda c: c.metrics["val_loss"])
    repo.tag("best", best.id, message=f"lowest val_loss {best.metrics['val_loss']:.4f}")
    print(f"tagged {best.id[:12]} ({best.message}) as 'best'")

    # Fine-tune experiment: resume from three epochs back with a smaller learning rate.
    fork = f"main~{min(3, epochs - 1)}"
    repo.branch("lr-sweep", fork)
    state = repo.checkout("lr-sweep")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    ckvc.set_rng_state(state["rng"])
    for group in opt.param_groups:
        group["lr"] = group["lr"] * 0.3
    print(f"\nbranched 'lr-sweep' from {fork} (epoch {state['epoch']}), lr x0.3")
    for epoch in range(state["epoch"] + 1, state["epoch"] + 3):
        train_epoch(model, opt, x_train, y_train)
        val_loss, val_acc = evaluate(model, x_val, y_val)
        cid = repo.commit(
            training_state(model, opt, sched, epoch),
            message=f"lr-sweep epoch {epoch}",
            metrics={"val_loss": val_loss, "val_acc": val_acc},
        )
        print(f"lr-sweep epoch {epoch}: val_loss={val_loss:.4f} val_acc={val_acc:.3f}  commit {cid[:12]}")

    # Back to main: the restored weights are bit-identical to the last main commit.
    state = repo.checkout("main")
    model.load_state_dict(state["model"])
    again = repo.load("main")
    same = all(torch.equal(a, b) for a, b in zip(state["model"].values(), again["model"].values(), strict=True))
    print(f"\nchecked out main (epoch {state['epoch']}); reload bit-identical: {same}")
    report = repo.fsck()
    print(f"fsck: {'ok' if report.ok else 'DAMAGED'} ({report.objects_checked} objects verified)")
    repo.close()

    cli(work, "log", "--oneline", "main")
    cli(work, "log", "--oneline", "lr-sweep")
    cli(work, "branch")
    cli(work, "du")
    cli(work, "retain", "--keep-last", "2", "--keep-best", "val_loss:min:1", "--dry-run")
    print(f"\ndemo finished in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
