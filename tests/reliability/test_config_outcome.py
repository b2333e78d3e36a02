"""A config change that took effect is told as done, even when the disk does not
confirm the rename (the directory fsync fails): a warning, not an error, as for
refs (docs/DESIGN.md, "Exact outcomes"); a failure before the rename changes nothing."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

import ckvc
from ckvc.config import RepoConfig
from ckvc.errors import DurabilityWarning, StorageIOError
from ckvc.storage import local


def eio(*args: object, **kwargs: object) -> None:
    raise OSError(errno.EIO, "Input/output error")


def test_a_failed_folder_sync_after_the_rename_warns_and_the_change_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        calls: list[Path] = []

        def failing_sync(path: Path) -> None:
            calls.append(path)
            eio()

        monkeypatch.setattr(local, "fsync_dir", failing_sync)
        with pytest.warns(DurabilityWarning, match=r"^the new config is in place, but the disk did not confirm it"):
            repo.set_config(gc_grace_s=5.0)
        monkeypatch.undo()
        assert calls == [tmp_path / ".ckvc"]
        assert RepoConfig.load(tmp_path / ".ckvc").gc_grace_s == 5.0


def test_a_failed_write_before_the_rename_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with ckvc.Repo.init(tmp_path) as repo:
        before = (tmp_path / ".ckvc" / "config.json").read_bytes()
        monkeypatch.setattr(local, "write_atomic", eio)
        with pytest.raises(StorageIOError, match="the config is unchanged"):
            repo.set_config(gc_grace_s=5.0)
        monkeypatch.undo()
        assert (tmp_path / ".ckvc" / "config.json").read_bytes() == before
