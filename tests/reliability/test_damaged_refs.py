"""Stray ref files and damaged log lines: skipped with a warning, reported by fsck,
and never a reason for gc to delete something they might protect."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from helpers import assert_state_equal

import ckvc
from ckvc.cli import cli
from ckvc.errors import DamageWarning, InvalidRefNameError
from ckvc.fsck import DAMAGED_LOG, STRAY_REF
from ckvc.retention import RetentionPolicy


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 32, generator=g), "step": seed}


def run(repo_dir: Path, *args: str) -> Result:
    return CliRunner().invoke(cli, ["-C", str(repo_dir), *args], catch_exceptions=False)


def test_a_stray_file_under_refs_is_skipped_with_a_warning(repo: ckvc.Repo) -> None:
    first = repo.commit(state(1), "one")
    (repo.dir / "refs" / "heads" / "main.lock").write_text(first + "\n")
    second = repo.commit(state(2), "two")
    with pytest.warns(DamageWarning, match=r"^skipping stray file refs/heads/main.lock: not a valid ref name$"):
        assert repo.branches() == {"main": second}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamageWarning)
        assert [c.id for c in repo.log()] == [second, first]
    for args in (("log", "--oneline"), ("branch",), ("fsck",)):
        result = run(repo.path, *args)
        assert result.exit_code == 0, result.output
        assert result.stderr == "ckvc: warning: skipping stray file refs/heads/main.lock: not a valid ref name\n"
    result = run(repo.path, "tag")  # lists refs/tags/ only: nothing stray there
    assert (result.exit_code, result.stderr) == (0, "")
    report = repo.fsck()
    assert report.ok  # a warning, not damage to the data
    assert [(p.kind, p.severity, p.object_id, p.detail) for p in report.problems] == [
        (
            STRAY_REF,
            "warning",
            first,
            "refs/heads/main.lock: invalid ref name 'refs/heads/main.lock': a component ends with '.lock'",
        )
    ]


def test_gc_keeps_what_a_stray_ref_names(repo: ckvc.Repo) -> None:
    """The id in a stray file may be all that keeps a commit; gc must not guess it is garbage."""
    repo.commit(state(1), "one")
    repo.branch("side")
    repo.switch("side")
    kept = repo.commit(state(7), "only the stray file names this")
    repo.switch("main")
    (repo.dir / "refs" / "heads" / "side.lock").write_text(kept + "\n")
    repo.delete_branch("side")
    repo.set_config(reflog_expiry_s=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamageWarning)
        repo.gc(now=True)
        assert_state_equal(repo.load(kept), state(7))
        (repo.dir / "refs" / "heads" / "side.lock").unlink()
        report = repo.gc(now=True)
    assert report.packs_deleted == 1
    assert not repo.store.has(bytes.fromhex(kept))


def test_a_bad_byte_in_the_prune_log_costs_one_line(repo: ckvc.Repo) -> None:
    ids = [repo.commit(state(i), f"c{i}") for i in range(4)]
    repo.retain(RetentionPolicy(keep_last=2))
    assert set(repo.pruned()) == {ids[0], ids[1]}
    log = repo.dir / "pruned.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    lines[0] = lines[0][:10] + b"\xff" + lines[0][11:]  # one bad byte in the first record
    log.write_bytes(b"".join(lines))
    with pytest.warns(DamageWarning, match=r"^skipped 1 damaged line\(s\) in pruned.jsonl$"):
        records = repo.pruned()
    # Skipping is the safe direction: that commit (the newest released, listed
    # first) now counts as not pruned, so gc keeps its data.
    assert set(records) == {ids[0]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamageWarning)
        assert [c.id for c in repo.log()] == ids[::-1]
        repo.gc(now=True)
        assert_state_equal(repo.load(ids[1]), state(1))
        report = repo.fsck()
    assert report.ok
    assert [(p.kind, p.detail) for p in report.problems] == [(DAMAGED_LOG, "pruned.jsonl line 1: not a prune record")]
    result = run(repo.path, "log", "--oneline")
    assert result.exit_code == 0 and result.stderr == "ckvc: warning: skipped 1 damaged line(s) in pruned.jsonl\n"


def test_a_bad_reflog_line_is_skipped_and_its_ids_still_protect(repo: ckvc.Repo) -> None:
    repo.commit(state(1), "one")
    repo.branch("side")
    repo.switch("side")
    only_in_reflog = repo.commit(state(5), "five")
    repo.switch("main")
    repo.delete_branch("side")  # now only HEAD's reflog names `five`
    log = repo.dir / "logs" / "HEAD"
    lines = log.read_bytes().splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if only_in_reflog.encode() in line)
    lines[index] = lines[index].replace(b'"message"', b'"mess\xffage"')
    log.write_bytes(b"".join(lines))
    with pytest.warns(DamageWarning, match=r"^skipped 1 damaged line\(s\) in logs/HEAD$"):
        entries = repo.reflog()
    assert len(entries) == len(lines) - 1
    result = run(repo.path, "reflog")
    assert result.exit_code == 0, result.output
    assert result.stderr == "ckvc: warning: skipped 1 damaged line(s) in logs/HEAD\n"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamageWarning)
        repo.gc(now=True)  # the damaged line's age is unknown: its ids are kept whatever the expiry
        assert_state_equal(repo.load(only_in_reflog), state(5))
    report = repo.fsck()
    assert [(p.kind, p.detail) for p in report.problems if p.kind == DAMAGED_LOG] == [
        (DAMAGED_LOG, f"logs/HEAD line {index + 1}: not a reflog entry")
    ]


def test_a_torn_last_reflog_line_is_silent(repo: ckvc.Repo) -> None:
    repo.commit(state(1), "one")
    with open(repo.dir / "logs" / "HEAD", "ab") as f:
        f.write(b'{"message": "commit: tw')  # a crash mid-append
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(repo.reflog()) == 1
        repo.commit(state(2), "two")
        assert [e.message for e in repo.reflog()] == ["commit: two", "commit: one"]
    assert repo.fsck().problems == []


def test_ref_names_over_255_bytes_in_a_component_are_invalid(repo: ckvc.Repo) -> None:
    repo.commit(state(1), "one")
    with pytest.raises(InvalidRefNameError, match=r"a component is longer than 255 bytes"):
        repo.branch("x" * 256)
    repo.branch("é" * 127)  # 254 bytes: fine
    with pytest.raises(InvalidRefNameError, match=r"a component is longer than 255 bytes"):
        repo.tag("é" * 128)
    with pytest.raises(InvalidRefNameError, match=r"not valid UTF-8"):
        repo.branch("bad\udcff")
    result = run(repo.path, "branch", "y" * 300)
    assert result.exit_code == InvalidRefNameError.exit_code
    assert result.stderr.startswith("ckvc: error: invalid ref name") and result.stderr.count("\n") == 1


def test_a_killed_head_move_leaves_no_temporary_after_the_next_checkout(tmp_path: Path) -> None:
    """SIGKILL between write_atomic's temporary and its rename leaves .HEAD.<hex>.tmp;
    the next checkout removes it even when HEAD is already where it asks."""
    with ckvc.Repo.init(tmp_path) as repo:
        repo.commit({"w": torch.ones(2)})
        leftover = repo.dir / ".HEAD.0123456789abcdef0123456789abcdef.tmp"
        leftover.write_text("ref: refs/heads/other\n")
        repo.checkout("main")
        assert not leftover.exists()
        assert repo.head()[0] == "main"
