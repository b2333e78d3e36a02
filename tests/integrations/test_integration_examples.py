"""The framework examples run on CPU in seconds and do what their docstrings say;
each needs at most 5 lines of ckvc code (tagged ``# [ckvc]``), the number
docs/GUIDE.md states for it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from preloaded import run_script

import ckvc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {  # example -> (the library it needs, the GUIDE section that counts its lines)
    "hf_trainer.py": ("transformers", "Hugging Face Trainer"),
    "lightning_fit.py": ("lightning", "PyTorch Lightning"),
    "accelerate_state.py": ("accelerate", "Accelerate"),
}
MARK = "# [ckvc]"


def _ckvc_lines(name: str) -> int:
    return sum(MARK in line for line in (ROOT / "examples" / name).read_text().splitlines())


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_integration_is_at_most_five_lines_as_the_guide_says(name: str) -> None:
    lines = _ckvc_lines(name)
    assert 1 <= lines <= 5
    guide = (ROOT / "docs" / "GUIDE.md").read_text()
    section = guide.split(f"### {EXAMPLES[name][1]}\n", 1)[1].split("\n### ", 1)[0]
    assert f"examples/{name}" in section
    assert re.search(rf"\b{lines} lines of ckvc code\b", section), f"GUIDE's {EXAMPLES[name][1]} section: {lines} lines"


def _run(name: str, tmp_path: Path) -> str:
    pytest.importorskip(EXAMPLES[name][0])
    done = run_script(ROOT / "examples" / name, ["--dir", str(tmp_path)])  # a preloaded child (tests/preloaded.py)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_hf_trainer_example_resumes_on_a_branch_bit_exact(tmp_path: Path) -> None:
    _run("hf_trainer.py", tmp_path)
    with ckvc.Repo.open(tmp_path / "repo") as repo:
        main = repo.log("main", first_parent=True)
        retry = repo.log("retry", first_parent=True)
    assert [c.message for c in main] == ["checkpoint-6", "checkpoint-4", "checkpoint-2"]
    assert [c.message for c in retry] == ["checkpoint-6", "checkpoint-4", "checkpoint-2"]
    assert retry[1].id == main[1].id  # the branch starts at the commit it resumed from
    assert retry[0].id != main[0].id and retry[0].metrics == main[0].metrics  # the same numbers, again


def test_lightning_example_resumes_from_a_ckvc_path(tmp_path: Path) -> None:
    _run("lightning_fit.py", tmp_path)
    with ckvc.Repo.open(tmp_path / "repo") as repo:
        commits = repo.log("main")
        released = repo.pruned()
    assert commits[0].message == "last.ckpt" and commits[0].metadata["lightning.global_step"] == 8
    assert released and all(c.id not in released for c in commits[:2])
    assert all("val_loss" in c.metrics and "train_loss" in c.metrics for c in commits)


def test_accelerate_example_goes_back_bit_exact(tmp_path: Path) -> None:
    out = _run("accelerate_state.py", tmp_path)
    assert "(the same)" in out
