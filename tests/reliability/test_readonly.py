"""Read-only repositories: every read works, every write is one ReadOnlyRepositoryError.

Two ways to be read-only: a real read-only bind mount (needs root and mount;
skipped with a message otherwise) and a wrapper that makes every write-side OS
call raise EROFS (runs anywhere)."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_state_equal, run

import ckvc
from ckvc.errors import ReadOnlyRepositoryError
from ckvc.retention import RetentionPolicy


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(32, 64, generator=g)}, "step": seed}


def make_repo(root: Path) -> Path:
    with ckvc.Repo.init(root, chunk_size=64 << 10) as repo:
        repo.commit(state(1), "one")
        repo.commit(state(2), "two")
        repo.tag("v1", "HEAD~1", message="first")
    return root


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` with its content hash: 'the repository is unchanged'."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath, name)
            if name == "lock.mdb":
                continue  # LMDB's reader table, not repository content
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture
def ro_mount(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(writable source, read-only bind mount of it)."""
    src = make_repo(tmp_path / "src")
    dst = tmp_path / "ro"
    dst.mkdir()
    try:
        subprocess.run(["mount", "--bind", str(src), str(dst)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot bind-mount (needs root and mount): {exc}")
    try:
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(dst)], check=True, capture_output=True)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot remount read-only: {exc.stderr.decode(errors='replace').strip()}")
        yield src, dst
    finally:
        subprocess.run(["umount", str(dst)], check=False, capture_output=True)


def test_a_read_only_bind_mount_is_fully_readable(ro_mount: tuple[Path, Path], tmp_path: Path) -> None:
    src, ro = ro_mount
    before = tree_digest(src)
    with pytest.raises(OSError) as info:
        (ro / "probe").write_bytes(b"x")
    assert info.value.errno == errno.EROFS
    with ckvc.Repo.open(ro) as repo:
        assert [c.message for c in repo.log()] == ["two", "one"]
        assert_state_equal(repo.load(), state(2))
        assert_state_equal(repo.load("v1"), state(1))
        assert repo.fsck(level="full").ok
        assert repo.du() is not None
        assert repo.reflog("main")[0].message == "commit: two"
    for args in (("log",), ("show", "v1"), ("fsck",), ("du",), ("status",), ("branch",), ("tag",), ("reflog",)):
        result = run(ro, *args)
        assert result.exit_code == 0, (args, result.output)
        assert "Traceback" not in result.output
    out = tmp_path / "out.pt"
    result = run(ro, "checkout", "main", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert_state_equal(torch.load(out, weights_only=True), state(2))
    # An older commit: the files are written, HEAD cannot move and says so.
    result = run(ro, "checkout", "v1", "-o", str(tmp_path / "v1.pt"))
    assert result.exit_code == 0, result.output
    assert "ckvc: warning: the repository is read-only: HEAD was not moved" in result.output
    assert_state_equal(torch.load(tmp_path / "v1.pt", weights_only=True), state(1))
    assert run(ro, "checkout", "-b", "side", "v1", "-o", str(tmp_path / "side.pt")).exit_code == 21
    assert not (tmp_path / "side.pt").exists()
    assert tree_digest(src) == before


@pytest.mark.parametrize(
    "args",
    [
        ("tag", "v2"),
        ("branch", "side"),
        ("gc", "--now"),
        ("config", "gc_grace", "2h"),
        ("retain", "--keep-last", "1"),
        ("commit", "CKPT", "-m", "three"),
    ],
    ids=lambda a: a[0],
)
def test_writes_to_a_read_only_bind_mount_are_one_typed_error(
    ro_mount: tuple[Path, Path], tmp_path: Path, args: tuple[str, ...]
) -> None:
    src, ro = ro_mount
    ckpt = tmp_path / "ckpt.pt"
    torch.save(state(3), ckpt)
    before = tree_digest(src)
    result = run(ro, *(str(ckpt) if a == "CKPT" else a for a in args))
    assert result.exit_code == ReadOnlyRepositoryError.exit_code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckvc: error: cannot write (read-only or no permission) while ")
    assert "Traceback" not in result.output
    assert tree_digest(src) == before


def test_python_writes_to_a_read_only_bind_mount_raise_read_only_repository_error(
    ro_mount: tuple[Path, Path],
) -> None:
    src, ro = ro_mount
    before = tree_digest(src)
    with ckvc.Repo.open(ro) as repo:
        head = repo.head()
        writes: list[Callable[[], Any]] = [
            lambda: repo.commit(state(3), "three"),
            lambda: repo.tag("v2"),
            lambda: repo.branch("side"),
            lambda: repo.gc(now=True),
            lambda: repo.set_config(gc_grace_s=5.0),
            lambda: repo.retain(RetentionPolicy(keep_last=1)),
            lambda: repo.set_retention(RetentionPolicy(keep_last=1)),
        ]
        for write in writes:
            with pytest.raises(ReadOnlyRepositoryError) as info:
                write()
            assert "\n" not in str(info.value)
        assert repo.head() == head
    assert tree_digest(src) == before


# ---- without a mount: every write-side OS call raises EROFS ---------------------------

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


@contextmanager
def erofs_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What a read-only file system does to our own calls (LMDB's are in C)."""
    real_open = os.open

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), args[0] if args else None)

    def guarded_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & _WRITE_FLAGS:
            fail(path)
        return real_open(path, flags, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "open", guarded_open)
        for name in ("mkdir", "rename", "replace", "unlink", "rmdir"):
            m.setattr(os, name, fail)
        yield


def test_writes_under_erofs_are_typed_and_reads_still_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_repo(tmp_path / "r")
    with ckvc.Repo.open(root) as repo:
        repo.delete_tag("v1")  # so that retention releases HEAD~1: a write
        repo.tag("v0")
    before = tree_digest(root)
    with ckvc.Repo.open(root) as repo, erofs_writes(monkeypatch):
        assert_state_equal(repo.load("HEAD~1"), state(1))
        assert [c.message for c in repo.log()] == ["two", "one"]
        writes: dict[str, Callable[[], Any]] = {
            "commit": lambda: repo.commit(state(3), "three"),
            "tag": lambda: repo.tag("v2", message="annotated"),
            "branch": lambda: repo.branch("side"),
            "delete_tag": lambda: repo.delete_tag("v0"),
            "set_config": lambda: repo.set_config(gc_grace_s=5.0),
            "retain": lambda: repo.retain(RetentionPolicy(keep_last=1)),
        }
        for what, write in writes.items():
            with pytest.raises(ReadOnlyRepositoryError) as info:
                write()
                pytest.fail(f"{what} did not raise")
            message = str(info.value)
            assert "\n" not in message and "cannot write (read-only or no permission)" in message
            assert message.endswith(("unchanged", "no tag was created", "no commit was marked as pruned"))
        assert_state_equal(repo.load(), state(2))
    assert tree_digest(root) == before


def test_locks_in_a_directory_that_cannot_be_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flock needs no write access: an existing lock file is opened read-only; a
    missing one is skipped for a shared lock and refused for an exclusive one."""
    from ckvc.storage.durable import file_lock

    existing = tmp_path / "refs.lock"
    existing.touch()
    with erofs_writes(monkeypatch):
        with file_lock(existing):
            pass
        with file_lock(existing, shared=True):
            pass
        with file_lock(tmp_path / "missing.lock", shared=True):
            pass
        with pytest.raises(ReadOnlyRepositoryError) as info, file_lock(tmp_path / "missing.lock"):
            pass
    assert str(info.value) == (
        f"cannot create lock file {tmp_path / 'missing.lock'}: the repository is read-only "
        "(Read-only file system); nothing was changed"
    )
    assert not (tmp_path / "missing.lock").exists()
