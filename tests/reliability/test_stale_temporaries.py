"""What failed writes leave where no later command writes again (a tag whose
creation failed, a config change that failed) is removed by the next ref update:
every writer of refs, HEAD and the config holds the refs lock, so under it any
temporary of theirs is a dead writer's (torture long run: persistent EIO, where
even the failed command's own unlink fails)."""

from __future__ import annotations

import uuid
from pathlib import Path

import torch

import ckvc


def stale(path: Path) -> Path:
    """A temporary as a killed or failed atomic write of ``path`` leaves it."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(b"half")
    return tmp


def test_the_next_commit_removes_failed_writers_temporaries(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        repo.commit({"w": torch.zeros(4)})
        dot = tmp_path / ".ckvc"
        left = [
            stale(dot / "refs" / "tags" / "faulted"),
            stale(dot / "refs" / "heads" / "exp" / "deep"),
            stale(dot / "config.json"),
            stale(dot / "HEAD"),
        ]
        keep = dot / "refs" / "tags" / "notes.tmp"  # not an atomic write's name: left alone
        keep.write_bytes(b"x")
        assert all(p.exists() for p in left)
        repo.commit({"w": torch.ones(4)})
        assert [p for p in left if p.exists()] == []
        assert keep.exists()
        assert repo.fsck().ok


def test_a_config_change_removes_its_own_stale_temporaries(tmp_path: Path) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        tmp = stale(tmp_path / ".ckvc" / "config.json")
        repo.set_config(gc_grace_s=7.0)
        assert not tmp.exists()
        assert repo.config.gc_grace_s == 7.0
