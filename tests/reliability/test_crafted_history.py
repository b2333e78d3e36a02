"""Crafted but readable history (issue 31): values too big to print, lossy reports
with a missing or mistyped field, and a repository's own folder given to commit.
Each ends in a typed error or correct output, never an internal error (exit 70)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run

import ckvc
from ckvc.codecs import make_codec
from ckvc.errors import CorruptObjectError, InvalidInputError, MalformedObjectError
from ckvc.fsck import BAD_STATE
from ckvc.ids import ObjectType
from ckvc.inspect import value_text

BIG = 10**5001  # past Python's 4,300-digit limit on int -> str


def test_show_and_diff_print_a_huge_int_by_its_size(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        repo.commit({"n": 7, "w": torch.zeros(3)}, message="small")
        repo.commit({"n": BIG, "w": torch.zeros(3)}, message="big")
        assert repo.load("HEAD")["n"] == BIG  # stored exactly
    shown = run(tmp_path, "show", "HEAD")
    assert shown.exit_code == 0, shown.output
    assert f"n = <int of {BIG.bit_length():,} bits>" in shown.stdout
    as_json = run(tmp_path, "show", "HEAD", "--json")
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["values"]["n"] == f"<int of {BIG.bit_length():,} bits>"
    diff = run(tmp_path, "diff", "HEAD~1", "HEAD")
    assert diff.exit_code == 0, diff.output
    assert f"~ n  7 -> <int of {BIG.bit_length():,} bits>" in diff.stdout
    assert run(tmp_path, "diff", "HEAD~1", "HEAD", "--json").exit_code == 0


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (7, "7"),
        ("x" * 5000, "'" + "x" * 76 + "'… (5,000 chars)"),
        (b"\0" * 5000, "<5,000 bytes>"),
        (b"ab", "b'ab'"),
        ([1, (2,), {"a": None}], "[1, (2,), {'a': None}]"),
        (list(range(100_000)), None),
        ({"k": BIG}, f"{{'k': <int of {BIG.bit_length():,} bits>}}"),
    ],
)
def test_value_text_is_one_bounded_line(value: Any, shown: str | None) -> None:
    text = value_text(value)
    assert len(text) <= 100 and "\n" not in text
    if shown is not None:
        assert text == shown
    else:
        assert text.startswith("[0, 1, 2, ") and text.endswith("…")


def craft_lossy(repo: ckvc.Repo, name: str, report: Any) -> str:
    """A copy of HEAD's lossy commit whose report for 'w' is ``report``, hashed
    consistently (a buggy or hostile writer), on branch ``name``."""
    commit = repo.read_commit(repo.resolve("HEAD"))
    bad = dataclasses.replace(commit, lossy={"w": report}, message=name)
    with repo.store.pin(), repo.store.writer(make_codec("zstd")) as writer:
        oid = writer.put(ObjectType.COMMIT, bad.encode()).hex()
        writer.commit()
    repo.refs.set_if_equals(f"refs/heads/{name}", None, oid, "crafted")
    return oid


GOOD_REPORT = {"codec": "q8", "max_abs_error": 0.01, "rel_rms_error": 0.001, "rms_error": 0.001}
BAD_REPORTS = {
    "missing": ({k: v for k, v in GOOD_REPORT.items() if k != "max_abs_error"}, "max_abs_error is missing"),
    "mistyped": ({**GOOD_REPORT, "rel_rms_error": "high"}, "rel_rms_error is str, not float"),
    "int": ({**GOOD_REPORT, "rms_error": 1}, "rms_error is int, not float"),
    "codec": ({**GOOD_REPORT, "codec": 5}, "codec is int, not str"),
    "extra": ({**GOOD_REPORT, "note": 1.0}, "unknown field 'note'"),
}


def test_a_malformed_lossy_report_is_refused_by_every_reader_and_named_by_fsck(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        repo.commit({"w": torch.randn(64, 64)}, message="lossy", lossy={"w": "q8"})
        ids = {name: craft_lossy(repo, name, report) for name, (report, _) in BAD_REPORTS.items()}
        for name, (_, problem) in BAD_REPORTS.items():
            for read in (repo.load, repo.show, repo.read_commit):
                with pytest.raises(MalformedObjectError, match=f"lossy report for 'w': {problem}"):
                    read(ids[name])
        for level in ("metadata", "full"):
            report = repo.fsck(level=level)
            by_id = {p.object_id: p for p in report.problems}
            assert set(by_id) == set(ids.values())
            for name, (_, problem) in BAD_REPORTS.items():
                assert by_id[ids[name]].kind == BAD_STATE
                assert f"lossy report for 'w': {problem}" in by_id[ids[name]].detail
        assert repo.load("main")["w"].shape == (64, 64)  # the honest commit still loads
    for name in BAD_REPORTS:
        shown = run(tmp_path, "show", name)
        assert shown.exit_code == CorruptObjectError.exit_code, shown.output
        assert shown.stderr.startswith("ckvc: error: malformed commit object: lossy report for 'w'")
    fsck = run(tmp_path, "fsck")
    assert fsck.exit_code == 1 and "bad-state" in fsck.stdout and "internal error" not in fsck.output


def test_committing_the_repository_folder_or_anything_in_it_is_refused(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        head = repo.commit({"w": torch.zeros(3)}, message="one")
    before = sorted((p.relative_to(tmp_path), p.stat().st_size) for p in (tmp_path / ".ckvc").rglob("*") if p.is_file())
    for target in (".ckvc", ".ckvc/refs", ".ckvc/config.json", str(tmp_path / ".ckvc" / "refs" / "heads")):
        result = run(tmp_path, "commit", target, "-m", "internals")
        assert result.exit_code == InvalidInputError.exit_code, result.output
        assert "the ckvc repository folder" in result.stderr and "not a checkpoint" in result.stderr
    after = sorted((p.relative_to(tmp_path), p.stat().st_size) for p in (tmp_path / ".ckvc").rglob("*") if p.is_file())
    assert after == before
    with ckvc.Repo.open(tmp_path) as repo:
        assert repo.resolve("main") == head
    (tmp_path / "ckpt").mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / "ckpt" / "model.pt")
    assert run(tmp_path, "commit", ".", "-m", "the folder, without .ckvc").exit_code == 0
