"""Notes (ckvc.notes): metrics and text added to a commit after the fact, which
change no commit id, travel with push and clone, decide --best and keep-best
retention, and are skipped (with a warning) and reported by fsck when damaged."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from helpers import run

import ckvc
from ckvc import notes, signing
from ckvc.errors import DamageWarning, InvalidInputError
from ckvc.retention_policy import KeepBest, RetentionPolicy

VECTOR_COMMIT = "cd" * 32


def state(seed: int) -> dict[str, Any]:
    return {"w": torch.full((8,), float(seed)), "step": seed}


def history(repo: ckvc.Repo, losses: list[float]) -> list[str]:
    return [repo.commit(state(i), f"epoch {i}", metrics={"val_loss": v}) for i, v in enumerate(losses)]


def test_note_record_vector() -> None:
    note = notes.Note(
        commit=VECTOR_COMMIT, time_ns=1_700_000_000_000_000_000, author="eval@ci", message="held-out eval",
        metrics={"eval_acc": 0.5}, metadata={"dataset": "val"},
    )  # fmt: skip
    data = note.encode()
    assert data == (
        b'{"author":"eval@ci","commit":"' + VECTOR_COMMIT.encode() + b'","format":1,"message":"held-out eval",'
        b'"metadata":{"dataset":"val"},"metrics":{"eval_acc":0.5},"time_ns":1700000000000000000}\n'
    )
    assert note.id == blake3.blake3(data).hexdigest() == NOTE_VECTOR_ID
    assert note.key == f"notes/{VECTOR_COMMIT}/{NOTE_VECTOR_ID}.json"
    assert notes.Note.decode(data) == note
    for bad in (data.replace(b'"format":1', b'"format":2'), data[:-1], data.replace(b"0.5", b'"x"'), b"[]"):
        with pytest.raises(ValueError):
            notes.Note.decode(bad)


NOTE_VECTOR_ID = "71b22c1b9b772aae52cc00d140761ef69afcf0138ceaafd7c285052fd4a9c758"


def test_a_later_metric_decides_best_and_keep_best(make_repo: Any) -> None:
    repo = make_repo()
    ids = history(repo, [0.9, 0.5, 0.7, 0.6])
    before = [repo.read_commit(c) for c in ids]
    assert repo.best("val_loss").id == ids[1]
    repo.note(ids[3], metrics={"val_loss": 0.2}, message="re-evaluated on the full set")
    assert [repo.read_commit(c) for c in ids] == before  # no commit changed
    assert repo.best("val_loss").id == ids[3]
    assert [c.id for c in repo.rank("val_loss")][:2] == [ids[3], ids[1]]
    # an eval metric the commit never had
    repo.note(ids[0], metrics={"eval_acc": 0.95})
    assert repo.best("eval_acc", "max").id == ids[0]
    repo.commit(state(9), "epoch 9", metrics={"val_loss": 0.8})
    repo.retain(RetentionPolicy(keep_last=1, keep_best=(KeepBest("val_loss", "min", 1),)))
    assert set(repo.pruned()) == {ids[0], ids[1], ids[2]}  # ids[3] kept by its note's value
    newest = repo.notes(ids[3])
    assert [n.metrics for n in newest] == [{"val_loss": 0.2}]


def test_newest_value_wins(make_repo: Any) -> None:
    repo = make_repo()
    (cid,) = history(repo, [0.9])
    repo.note(cid, metrics={"val_loss": 0.4}, message="first")
    repo.note(cid, metrics={"val_loss": 0.3, "acc": 0.8}, message="second")
    commit = repo.read_commit(cid)
    assert notes.metrics_with_notes(commit, repo.notes(cid)) == {"val_loss": 0.3, "acc": 0.8}
    with pytest.raises(InvalidInputError, match="needs a metric"):
        repo.note(cid)
    with pytest.raises(InvalidInputError, match="must be a number"):
        repo.note(cid, metrics={"x": "high"})


def test_notes_travel_with_push_and_clone(make_repo: Any, tmp_path: Path, url: str) -> None:
    repo = make_repo()
    ids = history(repo, [0.9, 0.5])
    repo.remotes.add("origin", url)
    repo.push()
    added = repo.note(ids[0], metrics={"val_loss": 0.1})  # after the push: the next one carries it
    assert repo.push().up_to_date == ["refs/heads/main"]
    clone = ckvc.Repo.clone(url, tmp_path / "clone")
    assert clone.notes(ids[0]) == [added]
    assert clone.best("val_loss").id == ids[0]
    more = clone.note(ids[1], message="checked by hand")
    clone.push()
    repo.fetch()
    assert repo.notes(ids[1]) == [more]
    clone.close()


def test_damaged_notes_are_skipped_and_reported(make_repo: Any) -> None:
    repo = make_repo()
    (cid,) = history(repo, [0.9])
    good = repo.note(cid, metrics={"val_loss": 0.1})
    folder = repo.core.local_dir / "notes" / cid
    path = folder / f"{good.id}.json"
    tampered = json.loads(path.read_bytes())
    tampered["metrics"]["val_loss"] = 0.01
    path.write_bytes(json.dumps(tampered, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    truncated = repo.note(cid, metrics={"acc": 0.5})
    (folder / f"{truncated.id}.json").write_bytes(truncated.encode()[:20])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert repo.notes(cid) == []
        assert repo.best("val_loss").id == cid and repo.best("val_loss").metrics["val_loss"] == 0.9
    assert any(issubclass(w.category, DamageWarning) and "damaged note" in str(w.message) for w in caught)
    report = repo.fsck()
    assert not report.ok
    assert sorted(p.kind for p in report.problems) == ["bad-note", "bad-note"]


def test_signed_notes_and_require_signatures(make_repo: Any, tmp_path: Path) -> None:
    repo = make_repo()
    (cid,) = history(repo, [0.9])
    key = signing.generate_key(tmp_path / "k")
    signing.set_trust(repo.core, "sign_key", str(key.path))
    signing.set_trust(repo.core, "trusted_keys", str(key.path) + ".pub")
    signed = repo.note(cid, metrics={"val_loss": 0.2}, sign=True)
    assert signing.verify(repo.core, signed.id, "note").good
    unsigned = repo.note(cid, metrics={"val_loss": 0.1}, sign=False)
    assert repo.notes(cid) == [signed, unsigned]
    repo.sign(cid)
    signing.set_trust(repo.core, "require_signatures", "true")
    with pytest.warns(DamageWarning, match="no trusted key signed"):
        assert repo.notes(cid) == [signed]


def test_cli_note_log_and_show(tmp_path: Path) -> None:
    root = tmp_path / "w"
    assert run(tmp_path, "init", str(root)).exit_code == 0
    torch.save({"w": torch.ones(3)}, root / "a.pt")
    cid = json.loads(run(root, "commit", "a.pt", "-m", "one", "--metric", "val_loss=0.5", "--json").stdout)["commit"]
    added = run(root, "note", "HEAD", "--metric", "eval_acc=0.91", "--meta", "dataset=val", "-m", "eval", "--json")
    assert added.exit_code == 0, added.output
    assert json.loads(added.stdout)["metrics"] == {"eval_acc": 0.91}
    assert "eval_acc=0.91" in run(root, "note", "HEAD").stdout
    assert "Note:" in run(root, "log").stdout and "eval_acc=0.91" in run(root, "log", "--oneline").stdout
    entries = json.loads(run(root, "log", "--json").stdout)
    assert entries[0]["notes"][0]["metadata"] == {"dataset": "val"} and entries[0]["metrics"] == {"val_loss": 0.5}
    assert json.loads(run(root, "show", cid, "--no-data", "--json").stdout)["notes"][0]["message"] == "eval"
    assert json.loads(run(root, "log", "--best", "eval_acc", "--mode", "max", "--json").stdout)[0]["id"] == cid
    bad = run(root, "note", "HEAD", "--metric", "x=high")
    assert bad.exit_code == 14 and "not a number" in bad.output
    assert os.listdir(root / ".ckvc" / "notes" / cid)  # one record


def test_signed_notes_count_after_a_clone_under_require_signatures(make_repo: Any, tmp_path: Path, url: str) -> None:
    """A note's signature names the note's id, not a stored object: push and clone carry
    it with the note, so a clone that requires signatures still counts the note."""
    repo = make_repo()
    (cid,) = history(repo, [0.9])
    key = signing.generate_key(tmp_path / "k")
    signing.set_trust(repo.core, "sign_key", str(key.path))
    repo.sign(cid)
    noted = repo.note(cid, metrics={"val_loss": 0.2}, sign=True)
    repo.remotes.add("origin", url)
    repo.push()
    clone = ckvc.Repo.clone(url, tmp_path / "c", trusted_keys=str(key.path) + ".pub", require_signatures=True)
    assert clone.notes(cid) == [noted]
    clone.close()
