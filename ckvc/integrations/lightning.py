"""PyTorch Lightning through ckvc: a CheckpointIO plugin, so that a stock
ModelCheckpoint stores every checkpoint as a commit and ``fit(ckpt_path="ckvc:REV")``
resumes from any of them, bit for bit. Both packages work: ``lightning``
(``lightning.pytorch``) and ``pytorch_lightning``; the plugin is an instance of the
classes of whichever the process has imported (both, if it has both), so either
Trainer accepts it (``package=`` chooses explicitly).

    io = CkvcCheckpointIO("runs/exp1")
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(monitor="val_loss"), io])
    trainer.fit(model, ckpt_path="ckvc:main~3")

Each save is a commit of the checkpoint dict itself (no pickle: ckvc.state stores
its tensors, numbers and strings), plus the RNG states Lightning does not save;
the path ModelCheckpoint chose is the commit's metadata. A path names the newest
commit saved under it; when ModelCheckpoint removes or overwrites a path (top-k,
``last.ckpt``), the commit it named is released (prune log: history and metrics
stay, gc frees the data). docs/DESIGN.md, "Framework integrations", says when the
RNG is captured and restored and how this differs from files on disk.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckvc.errors import InvalidInputError
from ckvc.integrations.runs import Landings, commit, finish_backups, open_repo, use_branch
from ckvc.state import rng_state, set_rng_state

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from ckvc.committer import PendingCommit
    from ckvc.repo import Repo

__all__ = ["PATH_KEY", "PREFIX", "RNG_KEY", "CkvcCheckpointIO", "export_checkpoint"]

PREFIX = "ckvc:"  # ckpt_path="ckvc:main~3": a revision, not a file
# package -> (its fabric plugins module, its Trainer package): where CheckpointIO and Callback live
PACKAGES = {
    "lightning": ("lightning.fabric.plugins", "lightning.pytorch"),
    "pytorch_lightning": ("lightning_fabric.plugins", "pytorch_lightning"),
}
PATH_KEY = "lightning.path"  # the path ModelCheckpoint saved to, as given
STEP_KEY = "lightning.global_step"
RNG_KEY = "ckvc_rng"  # the checkpoint's extra entry: ckvc.rng_state() at the save


def lightning_packages(package: str | None = None) -> tuple[str, ...]:
    """The Lightning packages a plugin made now serves: ``package`` if given; else
    those this process has imported (a Trainer's package is imported before its
    plugins are made); else the first installed of lightning, pytorch_lightning."""
    if package is not None:
        if package not in PACKAGES:
            raise InvalidInputError(f"package must be one of {', '.join(PACKAGES)}, got {package!r}")
        return (package,)
    imported = tuple(name for name, (_, trainer) in PACKAGES.items() if trainer in sys.modules)
    if imported:
        return imported
    for name in PACKAGES:
        if importlib.util.find_spec(name) is not None:
            return (name,)
    raise ImportError("ckvc.integrations.lightning needs lightning or pytorch_lightning: pip install lightning")


def _bases(packages: tuple[str, ...]) -> tuple[type, ...]:
    bases: list[type] = []
    for name in packages:
        plugins, trainer = PACKAGES[name]
        bases += [importlib.import_module(plugins).CheckpointIO, importlib.import_module(trainer).Callback]
    return tuple(bases)


def _file_io(packages: tuple[str, ...]) -> Any:
    """Lightning's own TorchCheckpointIO, for real files on disk."""
    return importlib.import_module(PACKAGES[packages[0]][0]).TorchCheckpointIO()


_classes: dict[tuple[type, tuple[str, ...]], type] = {}
_SEPARATOR = "__"  # CkvcCheckpointIO__lightning__pytorch_lightning: the packages, by name


def _made(cls: type, packages: tuple[str, ...]) -> type:
    """``cls`` with the CheckpointIO and Callback of ``packages`` (one class per pair)."""
    made = _classes.get((cls, packages))
    if made is None:
        name = _SEPARATOR.join((cls.__name__, *packages))
        made = type(name, (cls, *_bases(packages)), {"_packages": packages, "__module__": cls.__module__})
        made.__qualname__ = name
        _classes[(cls, packages)] = made
    return made


def __getattr__(name: str) -> Any:
    """The made classes by name (a pickled plugin unpickled in a fresh process, e.g.
    ddp_spawn's workers, finds its class here)."""
    base, _, rest = name.partition(_SEPARATOR)
    packages = tuple(rest.split(_SEPARATOR)) if rest else ()
    if base == "CkvcCheckpointIO" and packages and all(p in PACKAGES for p in packages):
        return _made(CkvcCheckpointIO, packages)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class CkvcCheckpointIO:
    """Lightning checkpoints as ckvc commits: pass it in ``plugins`` (and, to record
    every logged metric, in ``callbacks`` too).

    An instance is made of a subclass that is also Lightning's CheckpointIO and
    Callback, of the packages :func:`lightning_packages` names (``package``:
    "lightning" or "pytorch_lightning" to choose).

    ``save_checkpoint`` commits the checkpoint dict with the RNG states (torch, CUDA,
    numpy, Python) under ``ckvc_rng``; metrics are ``trainer.callback_metrics``
    (scalars) when the plugin is also a callback of the trainer, else each
    ModelCheckpoint's score of this path (``best_k_models``), and always ``epoch``
    and ``step``; a ``last.ckpt`` save at the same step as a top-k save gets that
    save's metrics. ``load_checkpoint`` reads ``ckvc:REV``, a path saved through
    the plugin (the newest commit under it on the branch), or a real file (as
    TorchCheckpointIO), and restores the RNG states the commit holds
    (``restore_rng``). ``remove_checkpoint`` releases the path's commit (a branch
    head only once it no longer is one). ``blocking=False``: commits go in the
    background; a removal waits for the commit it releases, the next save raises an
    earlier failure, and teardown waits for all. ``allow_pickle``: as for
    ``Repo.commit`` (hyperparameters of custom classes; off by default)."""

    _packages: tuple[str, ...] = ()

    def __new__(cls, *args: Any, package: str | None = None, **kwargs: Any) -> CkvcCheckpointIO:
        if cls._packages:  # a class made by _made (or a subclass of one)
            return super().__new__(cls)
        instance: CkvcCheckpointIO = super().__new__(_made(cls, lightning_packages(package)))
        return instance

    def __init__(
        self,
        repo_or_path: Repo | str | os.PathLike[str],
        blocking: bool = True,
        *,
        branch: str | None = None,
        restore_rng: bool = True,
        allow_pickle: bool = False,
        package: str | None = None,
    ) -> None:
        super().__init__()
        self._source = repo_or_path
        self._repo: Repo | None = None
        self.blocking = blocking
        self.branch = branch
        self.restore_rng = restore_rng
        self.allow_pickle = allow_pickle
        self._paths: dict[str, str | PendingCommit] | None = None  # path -> the commit saved under it
        self._landings = Landings()
        self._held: list[tuple[str, str]] = []  # (commit id, why) released once no branch head names it
        self._trainer: pl.Trainer | None = None
        self._last: tuple[int, dict[str, float]] = (-1, {})  # (global step, metrics) of the last save

    @property
    def repo(self) -> Repo:
        if self._repo is None:
            self._repo = open_repo(self._source)
            use_branch(self._repo, self.branch)
        return self._repo

    @property
    def paths(self) -> dict[str, str | PendingCommit]:
        """Each path saved through the plugin -> the commit it names: the newest one
        under it on the branch that is not released (read once; a resumed run's
        ModelCheckpoint removes the paths of the run before, and older commits under
        a path, overwritten, are released), then this run's saves."""
        if self._paths is None:
            self._paths = {}
            if self.repo.head()[1] is not None:
                released = self.repo.pruned()
                for c in self.repo.log("HEAD", first_parent=True):  # newest first
                    key = c.metadata.get(PATH_KEY)
                    if not isinstance(key, str) or c.id in released:
                        continue
                    if key in self._paths:  # overwritten by a save a killed run could not release
                        self._held.append((c.id, f"{Path(key).name} overwritten"))
                    else:
                        self._paths[key] = c.id
                self._release_held()
        return self._paths

    # ---- CheckpointIO -------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        self._landings.settle()  # an earlier background commit's failure raises here
        key = _key(path)
        paths = self.paths  # read before this commit lands
        step = int(checkpoint.get("global_step", 0))
        metrics = self._metrics(checkpoint, key, step)
        metadata = {PATH_KEY: key, STEP_KEY: step, "lightning.epoch": int(checkpoint.get("epoch", 0))}
        state = {**checkpoint, RNG_KEY: rng_state()}
        made = commit(
            self.repo, state, Path(key).name, metrics, metadata, blocking=self.blocking, allow_pickle=self.allow_pickle
        )
        self._last = (step, metrics)
        previous = paths.get(key)
        paths[key] = made

        def landed(_: str) -> None:
            if previous is not None:  # an overwrite (last.ckpt): the old content goes once the new is durable
                self._release(previous, f"{Path(key).name} overwritten")
            self._release_held()  # heads have moved on

        self._landings.add(made, landed)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        """The checkpoint dict of ``ckvc:REV``, of a path saved through this plugin, or
        of a file on disk; ``weights_only`` only matters for files (a commit holds no
        pickle unless ``allow_pickle``). Tensors load to the CPU unless
        ``map_location`` (ckvc.state.MapLocation) says otherwise."""
        text = os.fspath(path)
        if text.startswith(PREFIX):
            rev = text[len(PREFIX) :]
            if not rev:
                raise InvalidInputError(f"{text!r}: name a revision after {PREFIX} (ckvc:main, ckvc:main~3)")
        else:
            found = self._commit_of(_key(text))
            if found is None:
                return _file_io(self._packages).load_checkpoint(
                    text, map_location=map_location, weights_only=weights_only
                )
            rev = found
        # Lightning's own default loads to the CPU and lets the strategy move the model.
        state = self.repo.load(rev, "cpu" if map_location is None else map_location, allow_pickle=self.allow_pickle)
        rng = state.pop(RNG_KEY, None)
        if rng is not None and self.restore_rng:
            set_rng_state(rng)
        return state

    def remove_checkpoint(self, path: Any) -> None:
        key = _key(path)
        made = self.paths.pop(key, None)
        if made is not None:
            self._release(made, f"{Path(key).name} removed by Lightning")
        elif os.path.exists(key):
            _file_io(self._packages).remove_checkpoint(key)

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        """CheckpointIO.teardown() and Callback.teardown(trainer, module, stage):
        wait for every background commit (raising a failure) and settle releases."""
        if self._repo is not None:
            self.wait()
            finish_backups(self._repo)

    def wait(self) -> None:
        """Wait for this plugin's background commits and the releases behind them."""
        self._landings.settle(wait=True)

    # ---- Callback: only to see the trainer's metrics ------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    # ---- the work -----------------------------------------------------------
    def _metrics(self, checkpoint: dict[str, Any], key: str, step: int) -> dict[str, float]:
        metrics: dict[str, float] = dict(self._last[1]) if self._last[0] == step else {}
        if self._trainer is not None:
            for name, value in self._trainer.callback_metrics.items():
                number = _scalar(value)
                if number is not None:
                    metrics[name] = number
        for cb_state in (checkpoint.get("callbacks") or {}).values():  # ModelCheckpoint: the path's score
            monitor = cb_state.get("monitor") if isinstance(cb_state, dict) else None
            scores = cb_state.get("best_k_models") if isinstance(monitor, str) else None
            for p, value in scores.items() if isinstance(scores, dict) else ():
                score = _scalar(value)
                if _key(p) == key and score is not None:
                    metrics[str(monitor)] = score
        metrics["epoch"] = float(checkpoint.get("epoch", 0))
        metrics["step"] = float(step)
        return metrics

    def _commit_of(self, key: str) -> str | None:
        made = self.paths.get(key)
        return made if made is None or isinstance(made, str) else made.result()

    def _release(self, made: str | PendingCommit, why: str) -> None:
        """Release ``made`` once it has landed (a removal never races its commit)."""

        def hold(commit_id: str) -> None:
            self._held.append((commit_id, why))
            self._release_held()

        self._landings.add(made, hold)

    def _release_held(self) -> None:
        """Record as pruned every held commit that no branch head or HEAD names."""
        if not self._held:
            return
        heads = set(self.repo.branches().values()) | {self.repo.head()[1]}
        free = [(c, why) for c, why in self._held if c not in heads]
        self._held = [(c, why) for c, why in self._held if c in heads]
        for commit_id, why in free:
            self.repo.prune_log.add([commit_id], f"lightning: {why}")


def export_checkpoint(repo: Repo | str | os.PathLike[str], rev: str, out: str | os.PathLike[str]) -> str:
    """Write commit ``rev`` as a stock ``.ckpt`` file (torch.save, without the ckvc
    RNG entry) for ``LightningModule.load_from_checkpoint(out)``; returns ``out``."""
    from ckvc.formats import write_checkpoint
    from ckvc.repo import Repo

    repo = repo if isinstance(repo, Repo) else Repo.open(repo)
    state = repo.load(rev[len(PREFIX) :] if rev.startswith(PREFIX) else rev)
    state.pop(RNG_KEY, None)
    write_checkpoint(state, os.fspath(out), format="pt")
    return os.fspath(out)


def _key(path: Any) -> str:
    return os.path.normpath(os.fspath(path))


def _scalar(value: Any) -> float | None:
    """A logged value as a metric: a number or a one-element tensor, else None."""
    try:
        number = float(value.item() if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1 else value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return number
