"""Hugging Face Trainer through ckvc: every ``checkpoint-N`` folder the Trainer saves
becomes a commit, and any commit becomes the folder ``resume_from_checkpoint`` wants.

    trainer = Trainer(..., callbacks=[CkvcCallback("runs/exp1")])
    trainer.train()
    trainer.train(resume_from_checkpoint=checkout_for_resume("runs/exp1", "main~2", args.output_dir))

The folder is committed as it is, file by file (ckvc.formats: the tensors of
model.safetensors, optimizer.pt, rng_state.pth deduplicate and compress; every
byte comes back), so a resume from a commit is the Trainer's own resume, bit for
bit. docs/DESIGN.md, "Framework integrations", says why each hook is where it is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ckvc.errors import CkvcWarning, InvalidInputError
from ckvc.formats import DIRECTORY_SOURCE, export_commit, read_checkpoint
from ckvc.importer import HF_TRAINER_STATE, trainer_log_metrics
from ckvc.integrations.runs import Landings, commit, finish_backups, open_repo, use_branch
from ckvc.retention_policy import KeepBest, RetentionPolicy

if TYPE_CHECKING:
    from ckvc.repo import Repo

__all__ = ["ARGS_KEY", "CHECKPOINT_KEY", "STEP_KEY", "CkvcCallback", "checkout_for_resume", "retention_for"]

CHECKPOINT_KEY = "hf.checkpoint"  # the folder's name, "checkpoint-8"
STEP_KEY = "hf.global_step"
ARGS_KEY = "hf.args"  # the TrainingArguments below, as given
BEST_KEY = "hf.best_model_checkpoint"  # the best folder's name when the Trainer tracks one
# The arguments that shape a run's numbers (the rest are paths, logging and hardware).
RECORDED_ARGS = (
    "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "weight_decay", "adam_beta1",
    "adam_beta2", "adam_epsilon", "max_grad_norm", "optim", "per_device_train_batch_size",
    "gradient_accumulation_steps", "num_train_epochs", "max_steps", "seed", "data_seed", "save_steps",
    "save_total_limit", "metric_for_best_model", "greater_is_better", "load_best_model_at_end", "fp16", "bf16",
)  # fmt: skip
_FOLDER = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class CkvcCallback(TrainerCallback):
    """Commits each ``checkpoint-N`` folder right after the Trainer saved it.

    ``repo_or_path``: a Repo, or the path of one (created when missing). ``branch``:
    commit there (default: HEAD's branch); a missing branch is created at the commit
    of the step the Trainer resumed from (the newest on HEAD's history), else at HEAD.
    ``keep_local``: how many of the newest local checkpoint folders to keep (None:
    all); older ones are deleted once their commit is durable, never the Trainer's
    ``best_model_checkpoint``, never a folder no commit on the branch holds.
    ``commit_every_save=False``: commit only the last folder saved, at the end of
    training. ``blocking=False``: commit in the background; the next save and the end
    of training wait for it, and its failure raises there.

    Metrics: the numbers the Trainer logged at the checkpoint's step (loss,
    learning_rate, grad_norm, eval_*), epoch and step. Metadata: ``hf.checkpoint``,
    ``hf.global_step``, ``hf.args`` (RECORDED_ARGS), ``hf.best_model_checkpoint``.
    ``save_total_limit`` / ``metric_for_best_model`` become ckvc retention
    (:func:`retention_for`): released commits keep their history and metrics.
    Runs on the main process only (``state.is_world_process_zero``), after every
    rank has written its files."""

    def __init__(
        self,
        repo_or_path: Repo | str | os.PathLike[str],
        keep_local: int | None = 1,
        branch: str | None = None,
        commit_every_save: bool = True,
        blocking: bool = True,
    ) -> None:
        if keep_local is not None and (
            isinstance(keep_local, bool) or not isinstance(keep_local, int) or keep_local < 0
        ):
            raise InvalidInputError(f"keep_local must be None or an integer >= 0, got {keep_local!r}")
        self._source = repo_or_path
        self._repo: Repo | None = None
        self.keep_local = keep_local
        self.branch = branch
        self.commit_every_save = commit_every_save
        self.blocking = blocking
        self.commits: dict[str, str] = {}  # folder name -> commit id, for the folders the branch holds
        self._landings = Landings()
        self._last_saved: Path | None = None
        self._said_released = False

    @property
    def repo(self) -> Repo:
        if self._repo is None:
            self._repo = open_repo(self._source)
        return self._repo

    # ---- Trainer events -----------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if not state.is_world_process_zero:
            return
        history = self.repo.log("HEAD", first_parent=True) if self.repo.head()[1] is not None else []
        # A resumed run (the Trainer has loaded the step) starts a new branch at the commit of that step.
        resumed = next((c.id for c in history if c.metadata.get(STEP_KEY) == state.global_step), None)
        use_branch(self.repo, self.branch, resumed if state.global_step else None)
        for c in reversed(self.repo.log("HEAD", first_parent=True) if history else []):
            name = c.metadata.get(CHECKPOINT_KEY)
            if isinstance(name, str):  # folders these commits hold may go once they are old
                self.commits[name] = c.id

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        _barrier()  # every rank has written its part of the folder (rng_state_K.pth, shards)
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        # One background commit at a time: the previous save's lands first, so its
        # folder can go now and host copies never pile up behind a slow disk.
        self._landings.settle(wait=True)
        if self.commit_every_save:
            self._commit(folder, args, state)
        else:
            self._last_saved = folder
        self._tidy(args, state)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if not state.is_world_process_zero:
            return
        if self._last_saved is not None and self._last_saved.is_dir():
            self._commit(self._last_saved, args, state)
            self._last_saved = None
        self.wait()
        if self._repo is not None:
            finish_backups(self._repo)
        self._tidy(args, state)

    # ---- the work -----------------------------------------------------------
    def wait(self) -> None:
        """Wait for this callback's background commits; raises the first failure."""
        self._landings.settle(wait=True)

    def _commit(self, folder: Path, args: TrainingArguments, state: TrainerState) -> None:
        tree, source = read_checkpoint(folder)
        log = {"global_step": state.global_step, "log_history": state.log_history, "epoch": state.epoch}
        metadata: dict[str, Any] = {
            **source, CHECKPOINT_KEY: folder.name, STEP_KEY: state.global_step,
            ARGS_KEY: _recorded_args(args),
        }  # fmt: skip
        if state.best_model_checkpoint:
            metadata[BEST_KEY] = Path(state.best_model_checkpoint).name
        made = commit(self.repo, tree, folder.name, trainer_log_metrics(log), metadata, blocking=self.blocking)
        self._landings.add(made, lambda commit_id: self.commits.__setitem__(folder.name, commit_id))

    def _tidy(self, args: TrainingArguments, state: TrainerState) -> None:
        """Retention over the commits that have landed, then the local folders."""
        self._landings.settle()
        branch = self.repo.head()[0]
        policy = retention_for(args, branch) if branch in self.repo.branches() else None  # born once a commit landed
        if policy is not None:
            released = self.repo.retain(policy).released
            if released and not self._said_released:  # once a run: history is not pruned silently
                self._said_released = True
                warnings.warn(
                    CkvcWarning(
                        f"save_total_limit={args.save_total_limit}: ckvc released {len(released)} older commit(s) of "
                        f"{branch} (their history and metrics stay; `ckvc gc` frees their data). Unset "
                        "save_total_limit to keep every checkpoint in the repository."
                    ),
                    stacklevel=2,
                )
        if self.keep_local is None:
            return
        folders = sorted(
            (p for p in Path(args.output_dir).iterdir() if _FOLDER.match(p.name) and p.is_dir()),
            key=lambda p: int(p.name.rsplit("-", 1)[1]),
        )
        keep = {p.name for p in folders[len(folders) - self.keep_local :]} if self.keep_local else set()
        if state.best_model_checkpoint:
            keep.add(Path(state.best_model_checkpoint).name)
        for p in folders:
            if p.name not in keep and p.name in self.commits:
                shutil.rmtree(p)


def retention_for(args: TrainingArguments, branch: str | None) -> RetentionPolicy | None:
    """The ckvc retention matching the Trainer's: ``save_total_limit`` newest commits
    (keep-last) and, with ``metric_for_best_model``, the best one by that metric as
    the Trainer names it (eval_ prefix) and orders it (``greater_is_better``). Both
    are kept even with ``save_total_limit=1``. None (keep every commit) without a
    limit or off a branch."""
    if not args.save_total_limit or branch is None:
        return None
    best: tuple[KeepBest, ...] = ()
    metric = args.metric_for_best_model
    if metric:
        name = metric if metric.startswith("eval_") else f"eval_{metric}"
        greater = args.greater_is_better if args.greater_is_better is not None else not metric.endswith("loss")
        best = (KeepBest(name, "max" if greater else "min", 1),)
    return RetentionPolicy(keep_last=args.save_total_limit, keep_best=best, branches=(branch,))


def checkout_for_resume(repo: Repo | str | os.PathLike[str], rev: str, output_dir: str | os.PathLike[str]) -> str:
    """Write commit ``rev`` (a Trainer checkpoint folder) to ``output_dir/checkpoint-N``
    byte for byte, without moving HEAD, and return that path, for
    ``trainer.train(resume_from_checkpoint=...)``. N is the commit's global step. A
    folder already there is replaced. Under torch.distributed, call it on every
    process: rank 0 writes, the others wait. InvalidInputError when ``rev`` is not a
    checkpoint folder; PrunedCommitError when retention released its data."""
    from ckvc.repo import Repo

    repo = repo if isinstance(repo, Repo) else Repo.open(repo)
    commit = repo.readable_commit(rev)
    if commit.metadata.get("ckvc.source") != DIRECTORY_SOURCE:
        raise InvalidInputError(f"{rev!r} ({commit.id[:12]}) is not a committed folder, not a Trainer checkpoint")
    name = commit.metadata.get(CHECKPOINT_KEY)
    if not isinstance(name, str) or not _FOLDER.match(name):  # committed some other way (`ckvc commit DIR`)
        raw = repo.load(commit.id).get(HF_TRAINER_STATE)
        try:
            step = json.loads(raw)["global_step"]
        except (TypeError, ValueError, KeyError):
            raise InvalidInputError(
                f"{rev!r} ({commit.id[:12]}) holds no {HF_TRAINER_STATE} with a global_step"
            ) from None
        name = f"{PREFIX_CHECKPOINT_DIR}-{int(step)}"
    out = Path(output_dir) / name
    if _rank() == 0:  # under torchrun every process asks; one writes, the others wait for it
        out.parent.mkdir(parents=True, exist_ok=True)
        export_commit(repo, commit.id, out)
    _barrier()
    return str(out)


def _recorded_args(args: TrainingArguments) -> dict[str, Any]:
    """RECORDED_ARGS this transformers version has, as plain values (enums by value)."""
    out: dict[str, Any] = {}
    for key in RECORDED_ARGS:
        value = getattr(args, key, None)
        value = value.value if isinstance(value, Enum) else value
        if value is None or isinstance(value, (bool, int, float, str)):
            out[key] = value
    return out


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
