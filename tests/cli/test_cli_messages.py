"""The CLI's messages for everyday mistakes (issue 13): exact text and exit code of each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run

import ckvc


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """main: e0 -> e1 -> e2 (val_loss 0.5, 0.4, 0.3); branch exp at e1; tag v1 (annotated) at e2."""
    with ckvc.Repo.init(tmp_path) as repo:
        for i in range(3):
            repo.commit({"w": torch.full((4,), float(i))}, message=f"e{i}", metrics={"val_loss": 0.5 - i / 10})
        repo.branch("exp", "HEAD~1")
        repo.tag("v1", message="release one")
    return tmp_path


def head(repo_dir: Path) -> tuple[str | None, str | None]:
    with ckvc.Repo.open(repo_dir) as repo:
        return repo.head()


def test_branch_that_exists(work: Path) -> None:
    r = run(work, "branch", "exp")
    assert (r.exit_code, r.stderr) == (ckvc.RefConflictError.exit_code, "ckvc: error: branch 'exp' already exists\n")
    assert r.stdout == ""


def test_tag_that_exists(work: Path) -> None:
    r = run(work, "tag", "v1", "HEAD~1", "-m", "again")
    assert (r.exit_code, r.stderr) == (10, "ckvc: error: tag 'v1' already exists\n")
    with ckvc.Repo.open(work) as repo:
        assert repo.tag_object("v1").message == "release one"  # type: ignore[union-attr]


def test_unknown_revision_did_you_mean(work: Path) -> None:
    r = run(work, "show", "mian")
    assert (r.exit_code, r.stderr) == (11, "ckvc: error: unknown revision 'mian'; did you mean 'main'?\n")
    r = run(work, "log", "ex~1")
    assert (r.exit_code, r.stderr) == (11, "ckvc: error: unknown revision 'ex~1'; did you mean 'exp'?\n")
    r = run(work, "log", "zzzzzz")
    assert (r.exit_code, r.stderr) == (11, "ckvc: error: unknown revision 'zzzzzz'\n")


def test_unknown_refs_did_you_mean(work: Path) -> None:
    r = run(work, "branch", "-d", "exq")
    assert (r.exit_code, r.stderr) == (9, "ckvc: error: branch 'exq' not found; did you mean 'exp'?\n")
    r = run(work, "tag", "-d", "v11")
    assert (r.exit_code, r.stderr) == (9, "ckvc: error: tag 'v11' not found; did you mean 'v1'?\n")
    r = run(work, "reflog", "mainn")
    assert (r.exit_code, r.stderr) == (9, "ckvc: error: no branch or tag 'mainn'; did you mean 'main'?\n")
    r = run(work, "switch", "ep")
    assert (r.exit_code, r.stderr) == (9, "ckvc: error: no branch 'ep'; did you mean 'exp'?\n")
    r = run(work, "switch", "fresh")
    assert (r.exit_code, r.stderr) == (9, "ckvc: error: no branch 'fresh'; create it with: ckvc switch -c fresh\n")


def test_unknown_metric_did_you_mean(work: Path) -> None:
    r = run(work, "log", "--best", "val_los")
    expected = "ckvc: error: no commit reachable from 'HEAD' has metric 'val_los'; did you mean 'val_loss'?\n"
    assert (r.exit_code, r.stderr) == (14, expected)
    r = run(work, "log", "--sort", "acc")
    expected = "ckvc: error: no commit reachable from 'HEAD' has metric 'acc'; metrics recorded: val_loss\n"
    assert (r.exit_code, r.stderr) == (14, expected)


def test_errors_under_json_are_json_on_stderr(work: Path) -> None:
    plain = run(work, "show", "mian")
    r = run(work, "show", "mian", "--json")
    assert r.exit_code == plain.exit_code == 11
    assert r.stdout == ""
    assert json.loads(r.stderr) == {
        "error": {
            "type": "InvalidRevisionError",
            "message": "unknown revision 'mian'; did you mean 'main'?",
            "exit_code": 11,
        }
    }
    r = run(work, "branch", "exp", "--json")
    assert r.exit_code == 10
    assert json.loads(r.stderr)["error"] == {
        "type": "RefConflictError",
        "message": "branch 'exp' already exists",
        "exit_code": 10,
    }


def test_init_on_an_existing_repository(work: Path) -> None:
    before = head(work)
    r = run(work, "init")
    assert (r.exit_code, r.stdout) == (0, f"Reinitialized existing ckvc repository in {work}/.ckvc\n")
    assert head(work) == before
    r = run(work, "init", "--json")
    assert json.loads(r.stdout) == {"path": f"{work}/.ckvc", "reinitialized": True}
    r = run(work, "init", "--chunk-size", "1024")
    assert r.exit_code == 14
    assert r.stderr == f"ckvc: error: {work}/.ckvc exists with chunk size 4194304; --chunk-size cannot change it\n"


def test_checkout_warns_when_it_detaches_head(work: Path) -> None:
    with ckvc.Repo.open(work) as repo:
        e1 = repo.resolve("HEAD~1")
    r = run(work, "checkout", "HEAD~1")
    assert r.exit_code == 0
    assert r.stdout == f"Switched to detached HEAD at {e1[:12]}\n"
    assert r.stderr == (
        f"ckvc: warning: HEAD is now detached at {e1[:12]} (it was on branch 'main'); new commits will be on "
        "no branch. To write a commit without moving HEAD: ckvc export HEAD~1 OUT; to go back: ckvc switch "
        "main; to branch here: ckvc switch -c NAME\n"
    )
    assert head(work) == (None, e1)
    r = run(work, "checkout", "main")  # onto a branch: no warning
    assert (r.exit_code, r.stdout, r.stderr) == (0, "Switched to branch 'main'\n", "")


def test_checkout_head_with_output_keeps_the_branch(work: Path) -> None:
    """git checkout HEAD moves nothing: exporting the tip with checkout -o leaves HEAD on main."""
    before = head(work)
    r = run(work, "checkout", "HEAD", "-o", str(work / "tip.pt"))
    assert r.exit_code == 0 and "detached" not in r.stderr, r.stderr
    assert head(work) == before and before[0] == "main"


def test_commit_on_a_detached_head_warns(work: Path) -> None:
    assert run(work, "checkout", "HEAD~1").exit_code == 0
    torch.save({"w": torch.ones(4)}, work / "x.pt")
    r = run(work, "commit", "x.pt", "-m", "detached")
    assert r.exit_code == 0
    _, commit_id = head(work)
    assert commit_id is not None
    assert r.stderr == (
        f"ckvc: warning: committed on a detached HEAD: {commit_id[:12]} is on no branch and only the reflog "
        f"keeps it; to keep it: ckvc branch NAME {commit_id[:12]}\n"
    )
    assert run(work, "branch", "keep", commit_id[:12]).exit_code == 0
    with ckvc.Repo.open(work) as repo:
        assert repo.branches()["keep"] == commit_id


def test_retain_tells_the_truth_about_the_grace_period(work: Path) -> None:
    r = run(work, "retain", "--keep-last", "1")
    assert r.exit_code == 0
    assert r.stdout.splitlines()[-1] == (
        "their data is freed by `ckvc gc`, except packs written in the last 1h (gc_grace), which gc keeps "
        "for concurrent writers; `ckvc gc --now` frees those too (only when nothing else is writing to "
        "this repository)"
    )


def test_fsck_names_what_keeps_unreferenced_objects(work: Path) -> None:
    assert run(work, "retain", "--keep-last", "1").exit_code == 0
    r = run(work, "fsck")
    assert r.exit_code == 0
    hint = [line for line in r.stdout.splitlines() if line.startswith("warning: unreferenced")]
    assert len(hint) == 1
    assert hint[0].endswith(
        "are unreferenced (no branch, tag or HEAD reaches them); `ckvc gc` frees those no reflog entry names "
        "(entries live reflog_expiry) once their pack is older than gc_grace; `ckvc gc --now` skips the grace "
        "period"
    )


def test_switch_and_checkout_b_create_branches(work: Path) -> None:
    with ckvc.Repo.open(work) as repo:
        e0 = repo.resolve("main~2")
    r = run(work, "switch", "-c", "retry", "main~2")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "Switched to a new branch 'retry'\n", "")
    assert head(work) == ("retry", e0)
    r = run(work, "checkout", "-b", "again", "exp")
    assert (r.exit_code, r.stdout) == (0, "Switched to a new branch 'again'\n")
    r = run(work, "switch", "-c", "again")
    assert (r.exit_code, r.stderr) == (10, "ckvc: error: branch 'again' already exists\n")
    r = run(work, "switch", "exp", "HEAD")
    assert (r.exit_code, r.stderr) == (14, "ckvc: error: a start point needs -c: ckvc switch -c exp HEAD\n")


def test_export_does_not_move_head(work: Path) -> None:
    before = head(work)
    r = run(work, "export", "HEAD~1", str(work / "w.safetensors"))
    assert (r.exit_code, r.stdout, r.stderr) == (0, f"wrote {work / 'w.safetensors'}\n", "")
    assert head(work) == before
    r = run(work, "export", "HEAD", str(work / "w.bin"), "--format", "safetensors")
    assert (r.exit_code, r.stderr) == (
        14,
        "ckvc: error: --format safetensors writes a .safetensors file, not 'w.bin'\n",
    )


def test_diff_with_an_empty_revision_is_refused(work: Path) -> None:
    r = run(work, "diff", "HEAD", "")
    assert (r.exit_code, r.stderr) == (11, "ckvc: error: invalid revision ''\n")


@pytest.mark.parametrize(
    ("head_bytes", "exit_code"),
    [(b"\x00\xff garbage", 9), (b"ref: ../../../etc/passwd\n", 8)],
    ids=["garbage", "escape"],
)
def test_checkout_output_with_a_damaged_head_writes_nothing(work: Path, head_bytes: bytes, exit_code: int) -> None:
    """The move is refused before the export: no file appears next to a refusal
    (the torture suite's long run found out.pt written, then exit 9)."""
    (work / ".ckvc" / "HEAD").write_bytes(head_bytes)
    r = run(work, "checkout", "v1", "-o", str(work / "out.pt"))
    assert r.exit_code == exit_code, r.output
    assert not (work / "out.pt").exists()


def test_checkout_output_onto_an_existing_branch_writes_nothing(work: Path) -> None:
    r = run(work, "checkout", "v1", "-b", "exp", "-o", str(work / "out.pt"))
    assert r.exit_code == 10 and "branch 'exp' already exists" in r.output, r.output
    assert not (work / "out.pt").exists()
    assert head(work)[0] == "main"
