"""CkvcCallback with the real Hugging Face Trainer: 8 steps saving every 2, the
training process SIGKILLed after step 5, a fresh process resuming from the ckvc
commit of step 4 (checkout_for_resume) gets the losses of steps 5-8 of a run that
never stopped, bit for bit; the repository holds the 4 saves with their metrics and
the disk at most ``keep_local`` folders. Blocking and background commits alike.

Run as a script, this file is the training process:

    python test_transformers_callback.py OUT_DIR REPO RESULT_JSON MODE [KILL_AFTER|RESUME_REV]

MODE: "stock" (no callback), "blocking" or "async".
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from preloaded import Completed, run_script

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ckvc
from ckvc.errors import CkvcError, CkvcWarning, InvalidInputError, PrunedCommitError

MAX_STEPS = 8
SAVE_STEPS = 2
KILL_AFTER = 5
RESUME_STEP = 4


def train(out_dir: str, repo: str, mode: str, kill_after: int | None, resume: str | None, result: Path) -> None:
    """One training process: losses (exact floats) and the local folders go to ``result``."""
    from hf_models import random_tokens, recording_trainer, tiny_bert, training_args
    from transformers import TrainerCallback

    from ckvc.integrations.transformers import CkvcCallback, checkout_for_resume

    callbacks: list[Any] = []
    ckvc_cb = None
    if mode != "stock":
        ckvc_cb = CkvcCallback(repo, keep_local=1, blocking=mode == "blocking")
        callbacks.append(ckvc_cb)

    def report(trainer: Any) -> None:
        folders = sorted(p.name for p in Path(out_dir).glob("checkpoint-*"))
        first = trainer.state.global_step - len(trainer.losses)
        result.write_text(json.dumps({"first_step": first, "losses": trainer.losses, "folders": folders}))

    class Killer(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == kill_after:
                assert ckvc_cb is not None
                ckvc_cb.wait()  # the commit of step 4 is durable, as it would be two steps later anyway
                report(trainer)
                os.kill(os.getpid(), signal.SIGKILL)

    if kill_after is not None:
        callbacks.append(Killer())
    args = training_args(out_dir, MAX_STEPS, SAVE_STEPS)
    trainer = recording_trainer(model=tiny_bert(), args=args, train_dataset=random_tokens(), callbacks=callbacks)
    path = checkout_for_resume(repo, resume, out_dir) if resume else None
    trainer.train(resume_from_checkpoint=path)
    report(trainer)


def _run(tmp: Path, name: str, mode: str, extra: str | None = None) -> Completed:
    """This file as a training script, in a preloaded child (tests/preloaded.py; offline)."""
    args = [str(tmp / name), str(tmp / f"{name}.repo"), str(tmp / f"{name}.json"), mode]
    return run_script(__file__, args + ([extra] if extra is not None else []))


def _result(tmp: Path, name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((tmp / f"{name}.json").read_text())
    return out


def _tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The stock Trainer, no callback, every step: the losses to match."""
    tmp = tmp_path_factory.mktemp("stock")
    done = _run(tmp, "full", "stock")
    assert done.returncode == 0, done.stderr[-3000:]
    full = _result(tmp, "full")
    assert full["first_step"] == 0 and len(full["losses"]) == MAX_STEPS
    return list(full["losses"])


@pytest.mark.parametrize("mode", ["blocking", pytest.param("async", marks=pytest.mark.stress)])
def test_killed_run_resumes_bit_exact_from_commit(uninterrupted: list[float], tmp_path: Path, mode: str) -> None:
    killed = _run(tmp_path, "run", mode, str(KILL_AFTER))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    before = _result(tmp_path, "run")
    assert before["losses"] == uninterrupted[:KILL_AFTER]
    assert before["folders"] == [f"checkpoint-{RESUME_STEP}"]  # keep_local=1: checkpoint-2 went once committed
    repo_path = tmp_path / "run.repo"
    with ckvc.Repo.open(repo_path) as repo:
        tip = repo.read_commit(repo.resolve("main"))
        assert tip.metadata["hf.global_step"] == RESUME_STEP and tip.metadata["hf.checkpoint"] == "checkpoint-4"
        # Byte-faithful: the folder the resume gets is the one the killed run wrote.
        from ckvc.integrations.transformers import checkout_for_resume

        exported = checkout_for_resume(repo, "main", tmp_path / "exported")
        assert exported == str(tmp_path / "exported" / "checkpoint-4")
        assert _tree(Path(exported)) == _tree(tmp_path / "run" / "checkpoint-4")

    resumed = _run(tmp_path, "run", mode, "resume:main")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _result(tmp_path, "run")
    assert after["first_step"] == RESUME_STEP
    assert after["losses"] == uninterrupted[RESUME_STEP:]  # floats compared exactly
    assert after["folders"] == [f"checkpoint-{MAX_STEPS}"]

    log = subprocess.run(
        [sys.executable, "-m", "ckvc", "-C", str(repo_path), "log", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert log.returncode == 0, log.stderr
    commits = json.loads(log.stdout)
    commits = commits["commits"] if isinstance(commits, dict) else commits
    assert [c["metadata"]["hf.global_step"] for c in commits] == [8, 6, 4, 2]
    for c in commits:
        assert c["message"] == f"checkpoint-{c['metadata']['hf.global_step']}"
        assert c["metrics"]["step"] == c["metadata"]["hf.global_step"]
        assert c["metrics"]["loss"] == pytest.approx(uninterrupted[c["metadata"]["hf.global_step"] - 1], abs=1e-3)
        assert c["metrics"]["learning_rate"] > 0
        assert c["metadata"]["hf.args"]["save_steps"] == SAVE_STEPS


@pytest.mark.parametrize("blocking", [True, False])
def test_retention_keeps_last_and_best(tmp_path: Path, blocking: bool) -> None:
    """save_total_limit=1 with metric_for_best_model: ckvc keeps the newest commit and
    the best one (the Trainer alone keeps one folder, transformers#35070); the others
    are released and keep their history and metrics."""
    from hf_models import random_tokens, recording_trainer, tiny_bert, training_args

    from ckvc.integrations.transformers import CkvcCallback

    args = training_args(
        str(tmp_path / "out"), 6, 2, eval_strategy="steps", eval_steps=2, save_total_limit=1,
        metric_for_best_model="loss", load_best_model_at_end=True, per_device_eval_batch_size=8,
    )  # fmt: skip
    callback = CkvcCallback(tmp_path / "repo", keep_local=0, blocking=blocking)
    data = random_tokens()
    trainer = recording_trainer(
        model=tiny_bert(), args=args, train_dataset=data, eval_dataset=random_tokens(16, seed=2), callbacks=[callback]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    said = [str(w.message) for w in caught if issubclass(w.category, CkvcWarning)]
    assert len(said) == 1 and said[0].startswith("save_total_limit=1: ckvc released 1 older commit(s) of main")
    repo = callback.repo
    commits = repo.log("main")
    assert [c.metadata["hf.global_step"] for c in commits] == [6, 4, 2]
    best = min(commits, key=lambda c: c.metrics["eval_loss"])
    kept = {commits[0].id, best.id}
    assert set(repo.pruned()) == {c.id for c in commits} - kept
    for c in commits:
        assert "eval_loss" in c.metrics and "loss" in c.metrics  # released ones still list their metrics
        if c.id in kept:
            assert json.loads(repo.load(c.id)["trainer_state.json"])["global_step"] == c.metadata["hf.global_step"]
        else:
            with pytest.raises(PrunedCommitError):
                repo.load(c.id)
    # keep_local=0: only the folder load_best_model_at_end needs stays on disk.
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == (
        [Path(trainer.state.best_model_checkpoint).name] if trainer.state.best_model_checkpoint else []
    )


def test_checkout_for_resume_refuses_what_is_not_a_trainer_folder(tmp_path: Path) -> None:
    from ckvc.formats import read_checkpoint
    from ckvc.integrations.transformers import checkout_for_resume

    with ckvc.Repo.init(tmp_path / "r") as repo:
        import torch

        repo.commit({"w": torch.zeros(3)}, "a state, not a folder")
        with pytest.raises(InvalidInputError, match="not a committed folder"):
            checkout_for_resume(repo, "HEAD", tmp_path / "out")
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain" / "a.txt").write_text("x")
        tree, metadata = read_checkpoint(tmp_path / "plain")
        repo.commit(tree, "a folder, not a Trainer's", metadata=metadata)
        with pytest.raises(InvalidInputError, match=r"trainer_state\.json"):
            checkout_for_resume(repo, "HEAD", tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_background_failure_surfaces_and_keeps_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Trainer's hooks called as the Trainer calls them: a failed background commit
    raises in the training process, and its folder stays on disk."""
    from hf_models import training_args
    from transformers import TrainerControl, TrainerState

    import ckvc.write
    from ckvc.integrations.transformers import CkvcCallback

    args = training_args(str(tmp_path / "out"), 4, 2)
    state, control = TrainerState(), TrainerControl()
    callback = CkvcCallback(tmp_path / "repo", keep_local=1, blocking=False)
    callback.on_train_begin(args, state, control)
    for step in (2, 4):
        folder = tmp_path / "out" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    state.global_step = 2
    callback.on_save(args, state, control)
    callback.wait()

    def disk_full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckvc.write, "write_blobs", disk_full)
    state.global_step = 4
    with pytest.raises(CkvcError, match="nothing was committed"):
        callback.on_save(args, state, control)
        callback.on_train_end(args, state, control)
    monkeypatch.undo()
    assert [c.message for c in callback.repo.log("main")] == ["checkpoint-2"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-4"]  # 2 is in the repository


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["blocking", "async"])
@pytest.mark.parametrize("kill_after", [1, 3, 7])
def test_soak_kill_anywhere_resume_from_tip(
    uninterrupted: list[float], tmp_path: Path, mode: str, kill_after: int
) -> None:
    """CKVC_SOAK=1: killed after any step, a resume from the newest commit (or from
    scratch when there is none) ends with the same losses."""
    killed = _run(tmp_path, "run", mode, str(kill_after))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = kill_after - kill_after % SAVE_STEPS
    resumed = _run(tmp_path, "run", mode, "resume:main" if saved else None)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _result(tmp_path, "run")
    assert after["first_step"] == saved and after["losses"] == uninterrupted[saved:]
    with ckvc.Repo.open(tmp_path / "run.repo") as repo:
        assert [c.metadata["hf.global_step"] for c in repo.log("main")] == list(range(MAX_STEPS, 0, -SAVE_STEPS))


if __name__ == "__main__":
    out_dir, repo_dir, result_path, run_mode, *rest = sys.argv[1:]
    arg = rest[0] if rest else None
    kill = int(arg) if arg is not None and arg.isdigit() else None
    rev = arg.split(":", 1)[1] if arg is not None and arg.startswith("resume:") else None
    train(out_dir, repo_dir, run_mode, kill, rev, Path(result_path))


def test_training_end_waits_for_the_backups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """on_train_end drains auto_push: the pusher is held until something waits for the
    backlog, so the bucket's branch is the last commit when train() returns only if
    on_train_end waited (a job torn down right after the Trainer loses no backup)."""
    import threading

    from hf_models import random_tokens, recording_trainer, tiny_bert, training_args

    import ckvc.hybrid.backup
    import ckvc.remote.push
    from ckvc.integrations.transformers import CkvcCallback

    waited = threading.Event()
    real_push, real_wait = ckvc.remote.push.push, ckvc.hybrid.backup.AutoPush.wait

    def held_push(*args: Any, **kwargs: Any) -> Any:
        waited.wait(60)
        return real_push(*args, **kwargs)

    def wait(self: Any, *args: Any, **kwargs: Any) -> bool:
        waited.set()
        return real_wait(self, *args, **kwargs)

    monkeypatch.setattr(ckvc.remote.push, "push", held_push)
    monkeypatch.setattr(ckvc.hybrid.backup.AutoPush, "wait", wait)
    with ckvc.Repo.init(tmp_path / "repo") as repo:
        repo.remotes.add("origin", str(tmp_path / "backup"))
        repo.set_config(auto_push="origin")
    callback = CkvcCallback(tmp_path / "repo", keep_local=0)
    args = training_args(str(tmp_path / "out"), 4, 2)
    trainer = recording_trainer(model=tiny_bert(), args=args, train_dataset=random_tokens(), callbacks=[callback])
    try:
        trainer.train()
        repo = callback.repo
        assert waited.is_set()
        assert repo.ls_remote("origin")["refs/heads/main"] == repo.resolve("main")
        assert [c.metadata["hf.global_step"] for c in repo.log("main")] == [4, 2]
    finally:
        waited.set()
        callback.repo.close()
