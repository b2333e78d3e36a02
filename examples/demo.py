"""ckvc demo: train a small model on CPU, commit every epoch, branch a fine-tuning
experiment from an earlier epoch, check out, and show the log, storage stats and
what a retention policy would keep; then push the history to a remote (a folder
next to the repository: the same code path as an s3:// bucket), clone it back,
and compare.

    python examples/demo.py [--dir DIR] [--epochs N]

Without --dir the repository, its remote and the clone go in a temporary directory
that is removed at the end (also on error or Ctrl-C); with --dir they are kept: the
repository in DIR, the remote in DIR-remote and the clone in DIR-clone.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
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
        run(Path(tmp) / "repo", args.epochs)
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
    push_and_clone(work)
    print(f"\ndemo finished in {time.perf_counter() - started:.1f} s")


def file_size(state: Any) -> int:
    """The bytes of ``state`` as a torch.save file (what a folder of epoch_*.pt holds)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


def same_state(a: Any, b: Any) -> bool:
    """Equal nested states, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def push_and_clone(work: Path) -> None:
    """Push every branch and tag to a remote in a folder next to the repository,
    clone it into another, and check that every commit came back the same."""
    remote = work.with_name(work.name + "-remote")
    clone_dir = work.with_name(work.name + "-clone")
    cli(work, "remote", "add", "origin", str(remote))  # or s3://bucket/prefix (docs/GUIDE.md, "Remotes")
    with ckvc.Repo.open(work) as repo:
        pushed = repo.push("origin", ["main", "lr-sweep"], tags=True)
        again = repo.push("origin", ["main", "lr-sweep"], tags=True)
        commits = {c.id: c for branch in ("main", "lr-sweep") for c in repo.log(branch)}
        as_files = sum(file_size(repo.load(cid)) for cid in commits)
        print(
            f"pushed {len(pushed.updated)} refs, {pushed.stats.objects} objects: {pushed.bytes_sent / 1024:.0f} KiB "
            f"for {len(commits)} checkpoints that take {as_files / 1024:.0f} KiB as torch.save files "
            f"({pushed.bytes_sent / as_files:.2f}x); pushing again sent {again.bytes_sent} bytes"
        )
        received = 0

        def count(done: int, total: int) -> None:
            nonlocal received
            received = done

        with ckvc.Repo.clone(str(remote), clone_dir, progress=count) as clone:
            print(f"cloned into {clone_dir}: {received / 1024:.0f} KiB received")
            tips = {f"origin/{b}": repo.resolve(b) for b in ("main", "lr-sweep")}
            same_refs = clone.remote_branches() == tips and clone.tags() == repo.tags()
            same = all(
                clone.show(cid, tensors=False).commit.metrics == commit.metrics
                and same_state(clone.load(cid), repo.load(cid))
                for cid, commit in commits.items()
            )
            state = clone.checkout("main")
            print(
                f"clone: same branches and tags: {same_refs}; all {len(commits)} checkpoints bit-identical "
                f"with the same metrics: {same}; checked out main (epoch {state['epoch']}); "
                f"fsck: {'ok' if clone.fsck().ok else 'DAMAGED'}"
            )
    cli(clone_dir, "log", "--oneline", "origin/lr-sweep")


if __name__ == "__main__":
    main()
