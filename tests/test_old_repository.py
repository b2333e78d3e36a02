"""A repository written by an older ckvc (tests/data/old_repository.tar.gz, made by
tests/data/make_old_repository.py before issue 14's refactor) opens with today's
code: every commit loads bit-exact against the manifest, fsck is clean, a new
commit lands on top, and the CLI reads its history."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import blake3
import pytest
from click.testing import CliRunner
from helpers import describe_state

import ckvc
from ckvc.cli import cli
from ckvc.formats import export_commit

DATA = Path(__file__).parent / "data"
MANIFEST: dict[str, Any] = json.loads((DATA / "old_repository.json").read_text())


@pytest.fixture
def old_root(tmp_path: Path) -> Path:
    with tarfile.open(DATA / "old_repository.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path / "old_repository"


def test_manifest_covers_what_the_fixture_promises() -> None:
    """Guards the fixture itself: several dtypes, deltas' branches, pruned commits, a file."""
    commits = MANIFEST["commits"]
    dtypes = {leaf["dtype"] for c in commits.values() for leaf in c.get("leaves", {}).values() if "dtype" in leaf}
    assert {"float32", "bfloat16", "float16", "int64", "bool", "uint8", "int16"} <= dtypes
    assert set(MANIFEST["branches"]) == {"main", "exp", "files", "lossy"}
    assert set(MANIFEST["tags"]) == {"v1", "v2"}
    assert len(MANIFEST["pruned"]) == 2 and all(commits[c]["pruned"] for c in MANIFEST["pruned"])
    assert MANIFEST["format_version"] == 3 and MANIFEST["head"] == ["main", MANIFEST["branches"]["main"]]


def test_every_commit_loads_bit_exact(old_root: Path) -> None:
    with ckvc.Repo.open(old_root) as repo:
        assert repo.config.format_version == MANIFEST["format_version"]
        assert repo.branches() == MANIFEST["branches"]
        assert repo.tags() == MANIFEST["tags"]
        assert list(repo.head()) == MANIFEST["head"]
        assert sorted(repo.pruned()) == MANIFEST["pruned"]
        tag = repo.tag_object("v2")
        assert tag is not None and tag.message == MANIFEST["tag_messages"]["v2"]
        for cid, expected in MANIFEST["commits"].items():
            commit = repo.read_commit(cid)
            assert (commit.message, list(commit.parents)) == (expected["message"], expected["parents"])
            if expected["pruned"]:
                with pytest.raises(ckvc.PrunedCommitError):
                    repo.load(cid)
                continue
            assert describe_state(repo.load(cid)) == expected["leaves"], cid


def test_stored_file_exports_byte_for_byte(old_root: Path, tmp_path: Path) -> None:
    ((cid, expected),) = ((c, e) for c, e in MANIFEST["commits"].items() if "file_blake3" in e)
    with ckvc.Repo.open(old_root) as repo:
        (written,) = export_commit(repo, cid, tmp_path / expected["file_name"])
    assert blake3.blake3(written.read_bytes()).hexdigest() == expected["file_blake3"]


def test_fsck_clean_and_a_new_commit_on_top(old_root: Path) -> None:
    with ckvc.Repo.open(old_root) as repo:
        report = repo.fsck(level="full")
        assert report.ok and report.problems == []
        assert report.commits_reachable == len(MANIFEST["commits"])
        tip = MANIFEST["branches"]["main"]
        state = repo.load(tip)
        state["epoch"] = 99
        state["model"]["layer.weight"][0, :5] = 7.0
        new = repo.commit(state, "on top of the old format", metrics={"val_loss": 0.01})
        assert repo.read_commit(new).parents == (tip,)
        assert repo.branches()["main"] == new
        assert describe_state(repo.load(new)) == describe_state(state)
        report = repo.fsck(level="full")
        assert report.ok and report.problems == []
        assert report.commits_reachable == len(MANIFEST["commits"]) + 1
        assert repo.config.format_version == MANIFEST["format_version"]


def test_cli_log_reads_old_history(old_root: Path) -> None:
    result = CliRunner().invoke(cli, ["-C", str(old_root), "log", "--all", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    logged = {c["id"]: c["message"] for c in json.loads(result.output)}
    assert logged == {cid: c["message"] for cid, c in MANIFEST["commits"].items()}
