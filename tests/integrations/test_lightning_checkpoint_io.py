"""CkvcCheckpointIO with the real Lightning Trainer and a stock
``ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)``, sanity
validation left on: 4 epochs of 2 steps, the process SIGKILLed after step 5, a fresh
process resuming with ``fit(ckpt_path="ckvc:main~1")`` (the top-k save of step 4)
gets the losses of steps 5-8 of a run that never stopped, bit for bit. The two best
and the last stay loadable by their paths; every other save is released, and still
listed with its metrics. Blocking (plugin only) and background commits (plugin also
a callback, so every logged metric is recorded) alike, with both Lightning packages:
``lightning`` (``lightning.pytorch``) and ``pytorch_lightning``.

Run as a script, this file is the training process:

    CKVC_TEST_LIGHTNING=pytorch_lightning python test_lightning_checkpoint_io.py ROOT REPO RESULT_JSON MODE \
        [KILL_AFTER|resume:REV]

MODE: "stock" (Lightning's own files), "blocking" or "async"; the package defaults to lightning.
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from preloaded import Completed, run_script

if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None:
    pytest.skip("needs lightning or pytorch_lightning (the integrations extra)", allow_module_level=True)

import ckvc
from ckvc.errors import CkvcError, InvalidInputError, PrunedCommitError

PACKAGES = [
    pytest.param(name, marks=pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"{name} not installed"))
    for name in ("lightning", "pytorch_lightning")
]
EPOCHS = 4  # 2 steps each
KILL_AFTER = 5
RESUME_STEP = 4


def train(root: str, repo: str, mode: str, kill_after: int | None, resume: str | None, result: Path) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from ckvc.integrations.lightning import CkvcCheckpointIO

    package = os.environ.get("CKVC_TEST_LIGHTNING", "lightning")
    pl: Any = importlib.import_module("lightning.pytorch" if package == "lightning" else package)

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
            self.losses: list[float] = []

        def training_step(self, batch: Any, index: int) -> Any:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.detach()))
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, index: int) -> None:
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.02)

    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    train_data = DataLoader(TensorDataset(x[:16], y[:16]), batch_size=8, shuffle=True)
    val_data = DataLoader(TensorDataset(x[16:], y[16:]), batch_size=8)
    model = Regression()
    checkpoint = pl.callbacks.ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)
    callbacks: list[Any] = [checkpoint]
    plugins: list[Any] = []
    io = None
    if mode != "stock":
        io = CkvcCheckpointIO(repo, blocking=mode == "blocking")
        plugins.append(io)
        if mode == "async":
            callbacks.append(io)

    def report() -> None:
        out: dict[str, Any] = {
            "first_step": trainer.global_step - len(model.losses),
            "losses": model.losses,
            "best_k": {p: float(v) for p, v in checkpoint.best_k_models.items()},
            "best": checkpoint.best_model_path,
            "last": checkpoint.last_model_path,
            "files": sorted(p.name for p in Path(root).rglob("*.ckpt")),
        }
        if io is not None and kill_after is None:  # what each remaining path loads, through a fresh plugin
            fresh = CkvcCheckpointIO(repo)
            out["loaded"] = {
                p: fresh.load_checkpoint(p)["global_step"]
                for p in [*checkpoint.best_k_models, checkpoint.last_model_path]
            }
        result.write_text(json.dumps(out))

    class Killer(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == kill_after:
                assert io is not None
                io.wait()  # the saves of step 4 are durable, as they would be a step later anyway
                report()
                os.kill(os.getpid(), signal.SIGKILL)

    if kill_after is not None:
        callbacks.append(Killer())
    trainer = pl.Trainer(
        max_epochs=EPOCHS, default_root_dir=root, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, plugins=plugins, accelerator="cpu", deterministic=True,
    )  # fmt: skip
    trainer.fit(model, train_data, val_data, ckpt_path=resume)
    report()


def _run(tmp: Path, name: str, mode: str, extra: str | None = None, package: str = "lightning") -> Completed:
    """This file as a training script, in a preloaded child (tests/preloaded.py)."""
    args = [str(tmp / name), str(tmp / f"{name}.repo"), str(tmp / f"{name}.json"), mode]
    env = {**os.environ, "CKVC_TEST_LIGHTNING": package}
    return run_script(__file__, args + ([extra] if extra is not None else []), env=env)


def _result(tmp: Path, name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((tmp / f"{name}.json").read_text())
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Stock Lightning writing its own files, every step: the run to match."""
    tmp = tmp_path_factory.mktemp("stock")
    done = _run(tmp, "full", "stock")
    assert done.returncode == 0, done.stderr[-3000:]
    full = _result(tmp, "full")
    assert full["first_step"] == 0 and len(full["losses"]) == 2 * EPOCHS
    return full


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("mode", ["blocking", pytest.param("async", marks=pytest.mark.stress)])
def test_killed_run_resumes_bit_exact_from_ckvc_path(
    uninterrupted: dict[str, Any], tmp_path: Path, mode: str, package: str
) -> None:
    killed = _run(tmp_path, "run", mode, str(KILL_AFTER), package)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    before = _result(tmp_path, "run")
    assert before["losses"] == uninterrupted["losses"][:KILL_AFTER]
    assert before["files"] == []  # every checkpoint went to the repository, none to disk
    with ckvc.Repo.open(tmp_path / "run.repo") as repo:
        # top-k save then last.ckpt at steps 2 and 4; the first last.ckpt was overwritten
        names = [(c.message, c.metadata["lightning.global_step"]) for c in repo.log("main")]
        assert names == [("last.ckpt", 4), ("epoch=1-step=4.ckpt", 4), ("last.ckpt", 2), ("epoch=0-step=2.ckpt", 2)]

    resumed = _run(tmp_path, "run", mode, "resume:ckvc:main~1", package)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _result(tmp_path, "run")
    assert after["first_step"] == RESUME_STEP
    assert after["losses"] == uninterrupted["losses"][RESUME_STEP:]  # floats compared exactly
    assert after["files"] == []

    # ModelCheckpoint ends as it does with files: same scores, same names.
    stock_names = {Path(p).name: v for p, v in uninterrupted["best_k"].items()}
    assert {Path(p).name: v for p, v in after["best_k"].items()} == stock_names
    assert Path(after["best"]).name == Path(uninterrupted["best"]).name
    assert Path(after["last"]).name == "last.ckpt"
    # The two best and the last load by their paths, in a fresh plugin.
    steps = {Path(p).name: s for p, s in after["loaded"].items()}
    assert steps == {**{n: int(n.split("step=")[1].split(".")[0]) for n in stock_names}, "last.ckpt": 2 * EPOCHS}

    with ckvc.Repo.open(tmp_path / "run.repo") as repo:
        commits = repo.log("main")
        released = set(repo.pruned())
        live = {(c.message, c.metadata["lightning.global_step"]) for c in commits if c.id not in released}
        assert live == {*((n, s) for n, s in steps.items())}
        assert len(commits) > len(live)  # the others: released, listed, with their metrics
        for c in commits:
            assert c.metrics["step"] == c.metadata["lightning.global_step"]
            assert "val_loss" in c.metrics
            if mode == "async":
                assert "train_loss" in c.metrics  # the plugin was a callback too: every logged metric
            if c.id in released:
                with pytest.raises(PrunedCommitError):
                    repo.load(c.id)
        top_k = [c for c in commits if c.message != "last.ckpt" and c.id not in released]
        assert sorted(c.metrics["val_loss"] for c in top_k) == pytest.approx(sorted(stock_names.values()))


@pytest.mark.parametrize("package", PACKAGES)
def test_the_plugin_serves_the_one_package_a_process_imported(tmp_path: Path, package: str) -> None:
    """In a fresh interpreter that imports only ``package``, the plugin is that package's
    CheckpointIO and Callback, its Trainer takes it, and the other package stays unimported."""
    import subprocess

    trainer = "lightning.pytorch" if package == "lightning" else package
    other = "pytorch_lightning" if package == "lightning" else "lightning"
    code = f"""
import sys, importlib
pl = importlib.import_module({trainer!r})
from ckvc.integrations.lightning import CkvcCheckpointIO
io = CkvcCheckpointIO({str(tmp_path / "repo")!r})
trainer = pl.Trainer(plugins=[io], callbacks=[io], logger=False, enable_progress_bar=False, accelerator="cpu")
assert trainer.strategy.checkpoint_io is io and isinstance(io, pl.Callback) and isinstance(io, CkvcCheckpointIO)
assert {other!r} not in sys.modules, "the other package was imported"
print("ok", type(io).__name__)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == f"CkvcCheckpointIO__{package}"
    from ckvc.integrations.lightning import CkvcCheckpointIO

    with pytest.raises(InvalidInputError, match="package must be one of"):
        CkvcCheckpointIO(tmp_path / "repo", package="lightning_fabric")


def test_subclasses_and_pickling(tmp_path: Path) -> None:
    """A user's subclass stays itself; a plugin pickles and unpickles by its made class's name."""
    import pickle

    from ckvc.integrations.lightning import CkvcCheckpointIO

    class MyIO(CkvcCheckpointIO):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.mine = True

    mine = MyIO(tmp_path / "a")
    plain = CkvcCheckpointIO(tmp_path / "b")
    assert isinstance(mine, MyIO) and mine.mine and not isinstance(plain, MyIO)
    import ckvc.integrations.lightning as module

    name = type(plain).__name__
    assert getattr(module, name) is type(plain)
    assert type(pickle.loads(pickle.dumps(plain))) is type(plain)


def test_ckvc_paths_are_checked(tmp_path: Path) -> None:
    from ckvc.integrations.lightning import CkvcCheckpointIO, export_checkpoint

    io = CkvcCheckpointIO(tmp_path / "repo")
    with pytest.raises(InvalidInputError, match="name a revision"):
        io.load_checkpoint("ckvc:")
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")  # neither saved through the plugin nor a file
    with pytest.raises(TypeError):
        io.save_checkpoint({"epoch": 0}, tmp_path / "a.ckpt", storage_options={"x": 1})
    import torch

    io.save_checkpoint({"epoch": 0, "global_step": 3, "state_dict": {"w": torch.arange(4.0)}}, tmp_path / "a.ckpt")
    loaded = io.load_checkpoint(tmp_path / "a.ckpt")
    assert loaded["global_step"] == 3 and torch.equal(loaded["state_dict"]["w"], torch.arange(4.0))
    out = export_checkpoint(io.repo, "ckvc:main", tmp_path / "out.ckpt")
    stock = torch.load(out, weights_only=True)
    assert set(stock) == {"epoch", "global_step", "state_dict"}  # no ckvc RNG entry in the exported file
    io.remove_checkpoint(tmp_path / "a.ckpt")  # the branch head: held until another commit moves the branch
    assert io.repo.pruned() == {}
    io.save_checkpoint({"epoch": 1, "global_step": 4}, tmp_path / "b.ckpt")
    assert list(io.repo.pruned()) == [io.repo.resolve("main~1")]


def test_background_failure_surfaces_and_releases_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A background commit that fails raises in the training process (the next save or
    teardown), and the checkpoint it would have replaced stays loadable."""
    import torch

    import ckvc.write
    from ckvc.integrations.lightning import CkvcCheckpointIO

    io = CkvcCheckpointIO(tmp_path / "repo", blocking=False)
    io.save_checkpoint({"epoch": 0, "global_step": 1, "state_dict": {"w": torch.zeros(3)}}, tmp_path / "last.ckpt")
    io.wait()
    first = io.repo.resolve("main")

    def disk_full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckvc.write, "write_blobs", disk_full)
    with pytest.raises(CkvcError, match="nothing was committed"):  # at the save itself when it failed already
        io.save_checkpoint({"epoch": 0, "global_step": 2, "state_dict": {"w": torch.ones(3)}}, tmp_path / "last.ckpt")
        io.teardown()
    monkeypatch.undo()
    assert io.repo.resolve("main") == first and io.repo.pruned() == {}
    assert io.load_checkpoint("ckvc:main")["global_step"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["blocking", "async"])
@pytest.mark.parametrize(("kill_after", "rev"), [(3, "ckvc:main"), (7, "ckvc:main"), (7, "ckvc:main~3")])
def test_soak_kill_anywhere_resume_from_a_commit(
    uninterrupted: dict[str, Any], tmp_path: Path, mode: str, kill_after: int, rev: str
) -> None:
    """CKVC_SOAK=1: killed after other steps, resumed from the tip (last.ckpt) or an
    older top-k save: the losses from there on match the run that never stopped."""
    killed = _run(tmp_path, "run", mode, str(kill_after))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    with ckvc.Repo.open(tmp_path / "run.repo") as repo:
        step = repo.read_commit(repo.resolve(rev[len("ckvc:") :])).metadata["lightning.global_step"]
    resumed = _run(tmp_path, "run", mode, f"resume:{rev}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _result(tmp_path, "run")
    assert after["first_step"] == step and after["losses"] == uninterrupted["losses"][step:]


if __name__ == "__main__":
    root_dir, repo_dir, result_path, run_mode, *rest = sys.argv[1:]
    arg = rest[0] if rest else None
    kill = int(arg) if arg is not None and arg.isdigit() else None
    rev = arg.split(":", 1)[1] if arg is not None and arg.startswith("resume:") else None
    train(root_dir, repo_dir, run_mode, kill, rev, Path(result_path))
