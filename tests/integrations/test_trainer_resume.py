"""A stock Hugging Face Trainer checkpoint through ckvc and back: commit ``checkpoint-K``
from the CLI with no flags, export it, resume from the export in a fresh process, and
get the same losses bit for bit as the run that never stopped (and the same weights).

The model is a tiny BERT made from a config (no download, tests/integrations/hf_models.py),
trained on CPU on random tokens with dropout on, so a resume that lost the RNG state, the
optimizer or the data position would show in the losses. Run as a script, this file is the training process:

    python tests/integrations/test_trainer_resume.py OUT_DIR MAX_STEPS SAVE_STEPS RESULT_JSON [RESUME_DIR]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from preloaded import run_script

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

MAX_STEPS = 12  # 8 steps per epoch: the run crosses an epoch boundary after the resume point
SAVE_STEPS = 5
RESUME_STEP = 5


def train(out_dir: str, max_steps: int, save_steps: int, resume: str | None) -> dict[str, Any]:
    """Train the tiny BERT; returns each step's loss (exact float) and the final weights' hashes."""
    import hashlib

    from hf_models import random_tokens, recording_trainer, tiny_bert, training_args

    model = tiny_bert()
    args = training_args(out_dir, max_steps, save_steps)
    trainer = recording_trainer(model=model, args=args, train_dataset=random_tokens())
    trainer.train(resume_from_checkpoint=resume)
    weights = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in model.state_dict().items()}
    return {
        "first_step": trainer.state.global_step - len(trainer.losses),
        "losses": trainer.losses,
        "weights": weights,
    }


def _train_in_subprocess(tmp_path: Path, name: str, resume: Path | None = None) -> dict[str, Any]:
    result = tmp_path / f"{name}.json"
    args = [str(tmp_path / name), str(MAX_STEPS), str(SAVE_STEPS), str(result)]
    done = run_script(__file__, args + ([str(resume)] if resume is not None else []))  # preloaded, offline
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(result.read_text())
    return out


def _ckvc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckvc", *args], capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One run of every step, saving checkpoint-5, -10 and -12 on the way (saving draws
    no random numbers, so this is the uninterrupted run; resuming from the original
    checkpoint-5 folder reproduces its losses, and without rng_state.pth it does not)."""
    tmp = tmp_path_factory.mktemp("trainer")
    full = _train_in_subprocess(tmp, "full")
    assert full["first_step"] == 0 and len(full["losses"]) == MAX_STEPS
    return tmp, full


def test_resume_from_exported_commit_matches_uninterrupted_run(
    uninterrupted: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    run_dir, full = uninterrupted
    checkpoint = run_dir / "full" / f"checkpoint-{RESUME_STEP}"
    repo = tmp_path / "repo"
    assert _ckvc("init", str(repo)).returncode == 0
    committed = _ckvc("-C", str(repo), "commit", str(checkpoint))  # no flags: a stock folder must just work
    assert committed.returncode == 0, committed.stderr
    exported = tmp_path / "exported"
    out = _ckvc("-C", str(repo), "export", "HEAD", str(exported))
    assert out.returncode == 0, out.stderr
    names = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
    assert sorted(p.relative_to(exported).as_posix() for p in exported.rglob("*") if p.is_file()) == names
    resumed = _train_in_subprocess(tmp_path, "resumed", resume=exported)
    assert resumed["first_step"] == RESUME_STEP
    assert resumed["losses"] == full["losses"][RESUME_STEP:]  # floats compared exactly
    assert resumed["weights"] == full["weights"]


def test_import_trainer_output_dir(uninterrupted: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """``ckvc import`` of the Trainer's output dir: one commit per checkpoint-N, metrics as logged."""
    run_dir, _ = uninterrupted
    output = run_dir / "full"
    repo = tmp_path / "repo"
    assert _ckvc("init", str(repo)).returncode == 0
    done = _ckvc("-C", str(repo), "import", str(output), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    steps = [SAVE_STEPS, 2 * SAVE_STEPS, MAX_STEPS]  # the Trainer also saves at the last step
    assert [e["name"] for e in summary["checkpoints"]] == [f"checkpoint-{s}" for s in steps]
    for entry in summary["checkpoints"]:
        state = json.loads((output / entry["name"] / "trainer_state.json").read_text())
        logged = next(e for e in state["log_history"] if e["step"] == state["global_step"])
        assert entry["metrics"]["loss"] == logged["loss"]
        assert entry["metrics"]["learning_rate"] == logged["learning_rate"]
        assert entry["metrics"]["step"] == state["global_step"] and entry["status"] == "imported"


if __name__ == "__main__":
    out_dir, max_steps, save_steps, result_path, *resume_dir = sys.argv[1:]
    result = train(out_dir, int(max_steps), int(save_steps), resume_dir[0] if resume_dir else None)
    Path(result_path).write_text(json.dumps(result))


def test_signed_export_of_a_trainer_checkpoint(uninterrupted: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """The Trainer's checkpoint folder, committed and exported with --sign-key: the
    reference verifier (model_signing verify key) accepts it, and refuses it after a
    one-byte change of its optimizer state."""
    pytest.importorskip("model_signing")
    from ckvc.signing import generate_key

    run_dir, _ = uninterrupted
    key = generate_key(tmp_path / "signer", "ecdsa-p256")
    repo = tmp_path / "repo"
    assert _ckvc("init", str(repo)).returncode == 0
    assert _ckvc("-C", str(repo), "commit", str(run_dir / "full" / f"checkpoint-{RESUME_STEP}")).returncode == 0
    exported = tmp_path / "exported"
    done = _ckvc("-C", str(repo), "export", "HEAD", str(exported), "--sign-key", str(key.path))
    assert done.returncode == 0, done.stderr

    def verify() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "model_signing", "verify", "key", str(exported), "--signature",
             str(exported / "model.sig"), "--public_key", str(key.path) + ".pub"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip

    accepted = verify()
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    optimizer = exported / "optimizer.pt"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0x01
    optimizer.write_bytes(bytes(data))
    refused = verify()
    assert refused.returncode != 0 and "optimizer.pt" in refused.stdout + refused.stderr
