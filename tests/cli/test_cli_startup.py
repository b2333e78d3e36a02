"""The CLI's history commands never import torch (issue 13: every call took 1.6 s),
nor numpy and the codecs (issue 14: about 0.3 s of each call).

Each command runs in a fresh interpreter, which then reports the modules it
loaded; the timings themselves are in benchmarks/cli_startup.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckvc

# Runs the CLI in-process, then prints which heavy modules it loaded (and its exit code).
PROBE = """
import json, sys
from ckvc.cli import cli
try:
    cli(sys.argv[1:], prog_name="ckvc")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
loaded = {name: name in sys.modules for name in ("torch", "safetensors", "numpy")}
print("PROBE " + json.dumps({"code": code, **loaded}))
"""

FAST_COMMANDS = [
    ["--help"],
    ["--version"],
    ["log"],
    ["log", "--oneline", "--all", "--graph"],
    ["log", "--best", "val_loss"],
    ["status"],
    ["branch"],
    ["tag", "-n"],
    ["reflog"],
    ["show", "--no-data", "v1"],
    ["config"],
    ["du"],
    ["log", "--json", "nope"],  # an error path too
]


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("startup")
    with ckvc.Repo.init(root) as repo:
        for i in range(2):
            repo.commit({"w": torch.full((8,), float(i))}, message=f"e{i}", metrics={"val_loss": 1.0 - i / 2})
        repo.branch("side", "HEAD~1")
        repo.tag("v1", message="first")
    return root


def probe(repo_dir: Path, args: list[str]) -> tuple[dict[str, object], str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "-C", str(repo_dir), *args], capture_output=True, text=True, timeout=120
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, done.stdout + done.stderr
    return json.loads(lines[-1][len("PROBE ") :]), done.stdout + done.stderr


@pytest.mark.parametrize("args", FAST_COMMANDS, ids=lambda a: " ".join(a))
def test_history_commands_do_not_import_torch(repo_dir: Path, args: list[str]) -> None:
    result, output = probe(repo_dir, args)
    expected = 11 if args[-1] == "nope" else 0  # InvalidRevisionError
    assert result["code"] == expected, output
    assert result["torch"] is False, output
    assert result["safetensors"] is False, output
    assert result["numpy"] is (args == ["--version"]), output  # --version reports the native codec loops


def test_commands_that_read_tensors_still_work(repo_dir: Path) -> None:
    """The lazy imports are taken where tensors are needed: show lists them, diff reads them."""
    result, output = probe(repo_dir, ["diff", "HEAD~1", "HEAD"])
    assert result == {"code": 0, "torch": True, "safetensors": False, "numpy": True}, output
    assert "1 tensor changed (32 B)" in output and "metric val_loss: 1 -> 0.5" in output


def test_diff_stat_parses_the_states_without_torch(repo_dir: Path) -> None:
    """--stat reads the two trees (numpy's dtype tables) but no tensor: the devices
    of tensor nodes are judged without importing torch (a second of a diff)."""
    result, output = probe(repo_dir, ["diff", "--stat", "HEAD~1", "HEAD"])
    assert result == {"code": 0, "torch": False, "safetensors": False, "numpy": True}, output
    assert "1 tensor changed (32 B)" in output


def test_import_ckvc_is_lazy() -> None:
    code = (
        "import sys, ckvc; assert 'torch' not in sys.modules and 'ckvc.repo' not in sys.modules;"
        "ckvc.CkvcError; ckvc.Repo; assert 'torch' not in sys.modules;"
        "ckvc.rng_state; assert 'torch' in sys.modules; print(sorted(ckvc.__all__) == sorted(dir(ckvc)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ckvc.nope  # noqa: B018
