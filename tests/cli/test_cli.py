"""The ckvc command line through click's CliRunner: output, --json, exit codes, files in and out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner
from helpers import files_of, run

import ckvc
from ckvc.cli import cli


@pytest.fixture
def work(tmp_path: Path) -> Path:
    assert run(tmp_path, "init").exit_code == 0
    g = torch.Generator().manual_seed(0)
    torch.save({"w": torch.randn(64, 64, generator=g), "b": torch.zeros(64), "epoch": 1}, tmp_path / "e1.pt")
    torch.save({"w": torch.randn(64, 64, generator=g), "b": torch.zeros(64), "epoch": 2}, tmp_path / "e2.pt")
    return tmp_path


def test_commit_log_show_diff_json(work: Path) -> None:
    r1 = run(work, "commit", "e1.pt", "-m", "epoch 1", "--metric", "val_loss=0.5", "--json")
    assert r1.exit_code == 0, r1.output
    c1 = json.loads(r1.output)["commit"]
    r2 = run(work, "commit", "e2.pt", "-m", "epoch 2", "--metric", "val_loss=0.25")
    assert r2.exit_code == 0 and "[main " in r2.output
    log = json.loads(run(work, "log", "--json").output)
    assert [c["message"] for c in log] == ["epoch 2", "epoch 1"]
    assert log[0]["metrics"] == {"val_loss": 0.25} and log[1]["id"] == c1
    oneline = run(work, "log", "--oneline").output.splitlines()
    assert oneline[0].startswith(log[0]["id"][:12]) and "HEAD -> main" in oneline[0] and "val_loss=0.25" in oneline[0]
    shown = json.loads(run(work, "show", "HEAD~1", "--json").output)
    assert shown["id"] == c1
    assert {t["path"]: (t["dtype"], t["shape"]) for t in shown["tensors"]} == {
        "w": ("float32", [64, 64]),
        "b": ("float32", [64]),
    }
    assert shown["values"] == {"epoch": 1}
    assert "w" in run(work, "show").output
    d = json.loads(run(work, "diff", "HEAD~1", "HEAD", "--json").output)
    assert [c["path"] for c in d["changed"]] == ["w"]
    assert d["changed"][0]["rel_l2"] > 0.5
    assert d["values_changed"] == [{"path": "epoch", "old": 1, "new": 2}]
    assert "~ w" in run(work, "diff", "HEAD~1", "HEAD").output


def test_checkout_writes_pt_and_safetensors(work: Path) -> None:
    run(work, "commit", "e1.pt", "-m", "one")
    run(work, "commit", "e2.pt", "-m", "two")
    r = run(work, "checkout", "HEAD~1", "-o", "out.pt", "--json")
    assert r.exit_code == 0, r.output
    out = torch.load(work / "out.pt", weights_only=True)
    ref = torch.load(work / "e1.pt", weights_only=True)
    assert torch.equal(out["w"], ref["w"]) and out["epoch"] == 1
    assert json.loads(run(work, "status", "--json").output)["branch"] is None  # detached
    # A .safetensors output needs a state of tensors only.
    bad = run(work, "checkout", "main", "-o", "out.safetensors")
    assert bad.exit_code == ckvc.UnsupportedTypeError.exit_code and "epoch" in bad.output
    safetensors.torch.save_file({"x": torch.arange(10.0)}, str(work / "x.safetensors"))
    run(work, "checkout", "main")
    run(work, "commit", "x.safetensors", "-m", "st")
    assert run(work, "checkout", "HEAD", "-o", "back.safetensors").exit_code == 0
    assert torch.equal(safetensors.torch.load_file(str(work / "back.safetensors"))["x"], torch.arange(10.0))


def test_hf_style_directory_round_trip(work: Path) -> None:
    model = work / "model"
    model.mkdir()
    safetensors.torch.save_file({"a.weight": torch.randn(8, 8)}, str(model / "model-00001-of-00002.safetensors"))
    safetensors.torch.save_file({"b.weight": torch.randn(4)}, str(model / "model-00002-of-00002.safetensors"))
    index = {
        "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    }
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / "config.json").write_text('{"hidden_size": 8}')
    assert run(work, "commit", "model", "-m", "hf").exit_code == 0
    assert run(work, "checkout", "HEAD", "-o", "restored").exit_code == 0
    restored = work / "restored"
    for name in ("config.json", "model.safetensors.index.json"):
        assert (restored / name).read_bytes() == (model / name).read_bytes()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        a = safetensors.torch.load_file(str(model / name))
        b = safetensors.torch.load_file(str(restored / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_branch_tag_reflog_fsck_du(work: Path) -> None:
    run(work, "commit", "e1.pt", "-m", "one")
    run(work, "commit", "e2.pt", "-m", "two")
    assert run(work, "branch", "exp", "HEAD~1").exit_code == 0
    branches = json.loads(run(work, "branch", "--json").output)
    assert branches["current"] == "main" and set(branches["branches"]) == {"exp", "main"}
    assert run(work, "tag", "-m", "first release", "v1", "HEAD~1").exit_code == 0
    assert run(work, "tag", "light").exit_code == 0
    tags = json.loads(run(work, "tag", "--json").output)
    assert tags["v1"] == branches["branches"]["exp"]
    assert run(work, "tag", "-d", "light").exit_code == 0
    assert run(work, "branch", "-d", "exp").exit_code == 0
    assert "exp" not in json.loads(run(work, "branch", "--json").output)["branches"]
    reflog = json.loads(run(work, "reflog", "--json").output)
    assert [e["message"] for e in reflog] == ["commit: two", "commit: one"]
    fsck = json.loads(run(work, "fsck", "--json").output)
    assert fsck["ok"] is True and fsck["problems"] == [] and fsck["commits_reachable"] == 2
    du = json.loads(run(work, "du", "--json").output)
    assert du["commits"] == 2 and du["logical_bytes"] == 2 * (64 * 64 + 64) * 4
    assert "dedup" in run(work, "du").output


def test_fsck_exit_code_on_damage(work: Path) -> None:
    run(work, "commit", "e1.pt", "-m", "one")
    (pack,) = (work / ".ckvc/packs").glob("*.pack")
    data = bytearray(pack.read_bytes())
    data[200] ^= 0x01  # inside the first record's payload
    pack.write_bytes(bytes(data))
    r = run(work, "fsck")
    assert r.exit_code == 1 and "DAMAGED" in r.output
    report = json.loads(run(work, "fsck", "--json").output)
    assert report["ok"] is False and len({p["object_id"] for p in report["problems"]}) == 1


def test_fsck_rebuild_index(work: Path) -> None:
    import shutil

    run(work, "commit", "e1.pt", "-m", "one")
    shutil.rmtree(work / ".ckvc/index")
    r = run(work, "fsck", "--rebuild-index")
    assert r.exit_code == 0 and "index rebuilt" in r.output
    assert run(work, "checkout", "HEAD", "-o", "x.pt").exit_code == 0


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["checkout", "nope"], ckvc.InvalidRevisionError),
        (["show", "HEAD~5"], ckvc.InvalidRevisionError),
        (["branch", "../escape"], ckvc.InvalidRefNameError),
        (["tag", "a..b"], ckvc.InvalidRefNameError),
        (["commit", "missing.pt", "-m", "x"], ckvc.InvalidInputError),
        (["commit", "e1.pt", "--metric", "loss=abc"], ckvc.InvalidInputError),
        (["commit", "e1.pt", "--metric", "noequals"], ckvc.InvalidInputError),
        (["branch", "-d", "nope"], ckvc.RefNotFoundError),
        (["branch", "main"], ckvc.RefConflictError),
        (["checkout", "HEAD", "-o", "out.unknown"], ckvc.InvalidInputError),
    ],
)
def test_user_errors_one_line_distinct_code_repo_unchanged(
    work: Path, args: list[str], error: type[ckvc.CkvcError]
) -> None:
    run(work, "commit", "e1.pt", "-m", "one")
    torch.save({"obj": Path("x")}, work / "pickled.pt")  # needs unpickling code: refused by weights_only
    before = files_of(work / ".ckvc")
    r = run(work, *args)
    assert r.exit_code == error.exit_code, r.output
    assert r.output.count("\n") == 1 and r.output.startswith("ckvc: error: ")
    assert "Traceback" not in r.output
    assert files_of(work / ".ckvc") == before


def test_not_a_repository(tmp_path: Path) -> None:
    r = run(tmp_path, "log")
    assert r.exit_code == ckvc.NotARepositoryError.exit_code and "not a ckvc repository" in r.output


def test_exit_codes_are_distinct() -> None:
    classes = [getattr(ckvc, n) for n in ckvc.__all__ if n.endswith("Error") and n != "CkvcError"]
    codes = [c.exit_code for c in classes]
    assert len(set(codes)) == len(codes)
    assert all(code not in (0, 1, 2) for code in codes)


def test_retain_gc_config_and_pruned_log(work: Path) -> None:
    for i in range(5):
        torch.save({"w": torch.full((64, 64), float(i)), "epoch": i}, work / "e.pt")
        assert run(work, "commit", "e.pt", "-m", f"epoch {i}", "--metric", f"val_loss={5 - i}").exit_code == 0
    dry = json.loads(run(work, "retain", "--keep-last", "2", "--keep-every", "4", "--dry-run", "--json").output)
    log = json.loads(run(work, "log", "--json").output)
    ids = [c["id"] for c in reversed(log)]  # root first
    assert dry["dry_run"] is True and sorted(dry["released"]) == sorted([ids[1], ids[2]])
    assert "keep-every 4 on main" in dry["kept"][ids[0]] and "keep-last 2 on main" in dry["kept"][ids[3]]
    assert json.loads(run(work, "log", "--json").output)[3]["pruned"] is None  # dry run changed nothing
    r = run(work, "retain", "--keep-last", "2", "--keep-every", "4")
    assert r.exit_code == 0 and "released 2 commits" in r.output
    stored = json.loads(run(work, "config", "--json").output)["retention"]
    assert (stored["keep_last"], stored["keep_every"], stored["keep_best"]) == (2, 4, [])
    log = json.loads(run(work, "log", "--json").output)
    assert [c["pruned"] is not None for c in log] == [False, False, True, True, False]
    assert "[pruned]" in run(work, "log", "--oneline").output
    # Loading or checking out a pruned commit: one-line typed error.
    bad = run(work, "checkout", ids[1])
    assert bad.exit_code == ckvc.PrunedCommitError.exit_code and "pruned" in bad.output
    dry_gc = json.loads(run(work, "gc", "--dry-run", "--json").output)
    assert dry_gc["executed"] is False and dry_gc["reclaimable_bytes"] == 0  # all packs inside the grace period
    done = json.loads(run(work, "gc", "--now", "--json").output)
    assert done["executed"] is True and done["bytes_freed"] > 0
    fsck = json.loads(run(work, "fsck", "--json").output)
    assert fsck["ok"] and fsck["unreferenced_objects"] == 0
    assert json.loads(run(work, "fsck", "--sample", "50%", "--json").output)["ok"]
    assert run(work, "fsck", "--sample", "150%").exit_code == ckvc.InvalidInputError.exit_code
    du = json.loads(run(work, "du", "--json").output)
    assert du["commits"] == 3 and du["pruned_commits"] == 2 and [k["key"] for k in du["by_key"]] == ["w"]
    assert run(work, "config", "reflog_expiry", "30d").exit_code == 0
    assert json.loads(run(work, "config", "--json").output)["reflog_expiry_s"] == 30 * 86400
    assert run(work, "config", "nope", "1").exit_code == ckvc.InvalidInputError.exit_code
    assert run(work, "retain", "--keep-best", "bad").exit_code == ckvc.InvalidInputError.exit_code


def test_config_sets_keyframe_interval_and_codec(tmp_path: Path) -> None:
    runner = CliRunner()
    base = ["-C", str(tmp_path)]
    assert runner.invoke(cli, [*base, "init"]).exit_code == 0
    out = runner.invoke(cli, [*base, "config", "keyframe_interval", "8", "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["keyframe_interval"] == 8
    out = runner.invoke(cli, [*base, "config", "codec", "zstd:3", "--json"])
    assert json.loads(out.output)["codec"] == {"name": "zstd", "level": 3}
    before = (tmp_path / ".ckvc" / "config.json").read_bytes()
    for bad in (["keyframe_interval", "0"], ["keyframe_interval", "x"], ["codec", "zipnn"], ["codec", "raw:3"]):
        out = runner.invoke(cli, [*base, "config", *bad])
        assert out.exit_code == ckvc.InvalidInputError.exit_code, (bad, out.output)
    assert (tmp_path / ".ckvc" / "config.json").read_bytes() == before


def test_choosing_a_v2_codec_upgrades_a_v1_repository(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path, codec={"name": "zstd"}) as repo:
        state = {"w": torch.randn(64, 64)}
        first = repo.commit(state)
    config = json.loads((tmp_path / ".ckvc" / "config.json").read_text())
    config["format_version"] = 1
    (tmp_path / ".ckvc" / "config.json").write_text(json.dumps(config))
    with ckvc.Repo.open(tmp_path) as repo:
        assert repo.config.format_version == 1
        repo.set_config(codec={"name": "auto"})
        assert repo.config.format_version == 2
        second = repo.commit({"w": state["w"] * 2})
        assert torch.equal(repo.load(first)["w"], state["w"]) and torch.equal(repo.load(second)["w"], state["w"] * 2)
