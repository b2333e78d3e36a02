"""The remote commands: remote add|list|remove, push, fetch, pull, clone, ls-remote,
with --json summaries, one-line errors and their exit codes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from helpers import run

import ckvc
from ckvc.errors import NonFastForwardError, RemoteSupportMissingError, UnknownRemoteError, UnsupportedFormatError


def commit(work: Path, value: float, message: str) -> str:
    torch.save({"w": torch.full((64, 64), value), "v": value}, work / "ckpt.pt")
    r = run(work, "commit", "ckpt.pt", "-m", message, "--metric", f"loss={value}", "--json")
    assert r.exit_code == 0, r.output
    return str(json.loads(r.output)["commit"])


@pytest.fixture
def work(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    assert run(tmp_path, "init", "work").exit_code == 0
    return work


def test_remote_add_list_remove(work: Path, tmp_path: Path) -> None:
    r = run(work, "remote", "add", "origin", "../remote", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["url"] == str(tmp_path / "remote")
    r = run(work, "remote", "add", "s3r", "s3://bucket/prefix", "--endpoint", "http://127.0.0.1:9", "--region", "x")
    assert r.exit_code == 0
    listed = json.loads(run(work, "remote", "list", "--json").output)
    assert [(s["name"], s["url"], s["endpoint"], s["region"]) for s in listed] == [
        ("origin", str(tmp_path / "remote"), None, None),
        ("s3r", "s3://bucket/prefix", "http://127.0.0.1:9", "x"),
    ]
    assert run(work, "remote").output.splitlines()[0] == f"origin\t{tmp_path / 'remote'}"
    for url, endpoint in (("s3://key:secret@bucket/p", None), ("s3://bucket/p", "http://key:secret@127.0.0.1:9")):
        extra = ["--endpoint", endpoint] if endpoint else []
        refused = run(work, "remote", "add", "leaky", url, *extra)
        assert refused.exit_code != 0 and "never hold credentials" in refused.output
        assert "secret" not in (work / ".ckvc" / "remotes.json").read_text()
    again = run(work, "remote", "add", "origin", "/elsewhere")
    assert again.exit_code == ckvc.InvalidInputError.exit_code and again.output.count("\n") == 1
    assert run(work, "remote", "remove", "s3r").exit_code == 0
    gone = run(work, "remote", "remove", "s3r")
    assert gone.exit_code == UnknownRemoteError.exit_code and "no remote named 's3r'" in gone.output
    bad = run(work, "remote", "add", "-x", "/p")
    assert bad.exit_code == 2  # click: an unknown option
    bad = run(work, "remote", "add", "a/b", "/p")
    assert bad.exit_code == ckvc.InvalidInputError.exit_code and "invalid remote name" in bad.output


def test_push_fetch_pull_clone_ls_remote(work: Path, tmp_path: Path) -> None:
    first = commit(work, 1.0, "one")
    assert run(work, "tag", "v1").exit_code == 0
    assert run(work, "remote", "add", "origin", str(tmp_path / "remote")).exit_code == 0
    pushed = json.loads(run(work, "push", "--tags", "--json").output)
    assert {u["ref"] for u in pushed["updated"]} == {"refs/tags/v1"}  # --tags alone: the tags
    pushed = json.loads(run(work, "push", "--json").output)
    assert [u["ref"] for u in pushed["updated"]] == ["refs/heads/main"] and pushed["objects"] == 0
    assert pushed["bytes_sent"] == 0  # the tag push sent the commit already
    plain = run(work, "push")
    assert plain.exit_code == 0 and "Everything up-to-date" in plain.output
    refs = json.loads(run(work, "ls-remote", "--json").output)
    assert refs == {"HEAD": first, "refs/heads/main": first, "refs/tags/v1": first}
    assert run(work, "ls-remote").output.splitlines()[0] == f"{first}\tHEAD"

    cloned = run(tmp_path, "clone", str(tmp_path / "remote"), "copy", "--json")
    assert cloned.exit_code == 0, cloned.output
    assert json.loads(cloned.output) == {"path": str(tmp_path / "copy"), "branch": "main", "head": first}
    copy = tmp_path / "copy"
    second = commit(work, 2.0, "two")
    assert run(work, "push").exit_code == 0
    fetched = json.loads(run(copy, "fetch", "--json").output)
    assert [u["new"] for u in fetched["updated"]] == [second] and fetched["bytes_received"] > 0
    pulled = run(copy, "pull")
    assert pulled.exit_code == 0 and f"Fast-forward main: {first[:12]}..{second[:12]}" in pulled.output
    assert json.loads(run(copy, "pull", "--json").output)["fast_forward"] is False
    log = json.loads(run(copy, "log", "--json").output)
    assert [c["id"] for c in log] == [second, first] and log[0]["metrics"] == {"loss": 2.0}
    branches = json.loads(run(copy, "branch", "-a", "--json").output)
    assert branches == {"current": "main", "branches": {"main": second}, "remotes": {"origin/main": second}}
    assert "remotes/origin/main" in run(copy, "branch", "-a").output
    assert "origin/main" in run(copy, "log", "--oneline").output.splitlines()[0]
    assert run(copy, "fsck").exit_code == 0


def test_non_fast_forward_exit_code_and_force(work: Path, tmp_path: Path) -> None:
    commit(work, 1.0, "one")
    assert run(work, "remote", "add", "origin", str(tmp_path / "remote")).exit_code == 0
    assert run(work, "push").exit_code == 0
    assert run(tmp_path, "clone", str(tmp_path / "remote"), "other").exit_code == 0
    commit(tmp_path / "other", 5.0, "theirs")
    assert run(tmp_path / "other", "push").exit_code == 0
    mine = commit(work, 3.0, "mine")
    refused = run(work, "push")
    assert refused.exit_code == NonFastForwardError.exit_code
    assert refused.output.startswith("ckvc: error: ") and refused.output.count("\n") == 1
    as_json = run(work, "push", "--json")
    assert as_json.exit_code == NonFastForwardError.exit_code
    assert json.loads(as_json.output)["error"]["type"] == "NonFastForwardError"
    assert run(work, "push", "--force").exit_code == 0
    assert json.loads(run(work, "ls-remote", "--json").output)["refs/heads/main"] == mine
    diverged = run(tmp_path / "other", "pull")
    assert diverged.exit_code == NonFastForwardError.exit_code and "diverged" in diverged.output


def test_errors_are_one_line_with_their_exit_codes(work: Path, tmp_path: Path) -> None:
    commit(work, 1.0, "one")
    r = run(work, "push", "nowhere")
    assert r.exit_code == UnknownRemoteError.exit_code and r.output.count("\n") == 1
    assert run(work, "remote", "add", "empty", str(tmp_path / "none")).exit_code == 0
    r = run(work, "fetch", "empty")
    assert r.exit_code == UnknownRemoteError.exit_code and "holds no ckvc repository" in r.output
    r = run(tmp_path, "clone", str(tmp_path / "none"), "c")
    assert r.exit_code == ckvc.InvalidInputError.exit_code and not (tmp_path / "c").exists()
    assert run(work, "remote", "add", "origin", str(tmp_path / "remote")).exit_code == 0
    assert run(work, "push").exit_code == 0
    config = json.loads((tmp_path / "remote" / "config.json").read_text())
    (tmp_path / "remote" / "config.json").write_text(json.dumps({**config, "format_version": 99}))
    r = run(work, "fetch")
    assert r.exit_code == UnsupportedFormatError.exit_code and "99" in r.output and r.output.count("\n") == 1
    r = run(tmp_path, "clone", str(tmp_path / "remote"), "c")
    assert r.exit_code == UnsupportedFormatError.exit_code and not (tmp_path / "c").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("ckvc.storage.cloud") is not None,
    reason="the object-store backend is installed (its own tests run against a local server)",
)
def test_object_store_url_without_the_extra(work: Path) -> None:
    commit(work, 1.0, "one")
    assert run(work, "remote", "add", "s3r", "s3://bucket/x", "--endpoint", "http://127.0.0.1:9").exit_code == 0
    r = run(work, "push", "s3r")
    assert r.exit_code == RemoteSupportMissingError.exit_code and "remote extra" in r.output


def test_fsck_remote(work: Path, tmp_path: Path) -> None:
    commit(work, 1.0, "one")
    commit(work, 2.0, "two")
    assert run(work, "remote", "add", "origin", str(tmp_path / "remote")).exit_code == 0
    assert run(work, "push").exit_code == 0
    report = json.loads(run(work, "fsck", "--remote", "origin", "--json").output)
    assert report["ok"] is True and report["commits_reachable"] == 2 and report["objects_checked"] > 0
    sample = run(work, "fsck", "--remote", "origin", "--sample", "50%", "--json")
    assert sample.exit_code == 0 and json.loads(sample.output)["ok"] is True
    pack = next((tmp_path / "remote" / "packs").glob("*.pack"))
    data = bytearray(pack.read_bytes())
    data[32 + 92 + 20] ^= 0xFF  # the first record's payload
    pack.write_bytes(bytes(data))
    damaged = run(work, "fsck", "--remote", "origin", "--json")
    assert damaged.exit_code == 1 and json.loads(damaged.output)["ok"] is False
    assert run(work, "fsck").exit_code == 0  # the local repository is not the damaged one
    both = run(work, "fsck", "--remote", "origin", "--rebuild-index")
    assert both.exit_code == ckvc.InvalidInputError.exit_code
