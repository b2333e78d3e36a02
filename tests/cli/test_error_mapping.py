"""OS and LMDB errors as typed CkvcErrors with one-line messages and exit codes;
config values checked when set and when read; the CLI's last-resort handler."""

from __future__ import annotations

import errno
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from helpers import random_state as state
from helpers import run

import ckvc
from ckvc.errors import (
    CkvcError,
    InterruptedOperationError,
    InvalidConfigError,
    InvalidInputError,
    ObjectNotFoundError,
    ReadOnlyRepositoryError,
    StorageFullError,
    StorageIOError,
    UnexpectedError,
    storage_error,
    storage_errors,
)


@pytest.mark.parametrize(
    ("code", "cls", "what"),
    [
        (errno.ENOSPC, StorageFullError, "disk full"),
        (errno.EDQUOT, StorageFullError, "disk full"),
        (errno.EROFS, ReadOnlyRepositoryError, "cannot write (read-only or no permission)"),
        (errno.EACCES, ReadOnlyRepositoryError, "cannot write (read-only or no permission)"),
        (errno.EPERM, ReadOnlyRepositoryError, "cannot write (read-only or no permission)"),
        (errno.EIO, StorageIOError, "I/O error (Input/output error)"),
        (errno.ENAMETOOLONG, StorageIOError, "I/O error (File name too long)"),
    ],
)
def test_os_errors_map_to_typed_errors(code: int, cls: type[CkvcError], what: str) -> None:
    exc = OSError(code, os.strerror(code), "/repo/.ckvc/packs/x.pack.tmp")
    mapped = storage_error(exc, "writing the commit", "nothing was committed")
    assert type(mapped) is cls
    assert str(mapped) == f"{what} while writing the commit (/repo/.ckvc/packs/x.pack.tmp): nothing was committed"
    assert mapped.errno == code and mapped.path == "/repo/.ckvc/packs/x.pack.tmp"
    with pytest.raises(cls) as info, storage_errors("writing the commit", "nothing was committed"):
        raise exc
    assert info.value.__cause__ is exc


def test_lmdb_errors_map_to_typed_errors() -> None:
    assert type(storage_error(lmdb.MapFullError("full"), "indexing", "x")) is StorageFullError
    assert type(storage_error(lmdb.Error("/r/index: No space left on device"), "indexing", "x")) is StorageFullError
    assert type(storage_error(lmdb.Error("/r/index: Read-only file system"), "a", "x")) is ReadOnlyRepositoryError
    assert str(storage_error(lmdb.CorruptedError("bad page"), "reading", "nothing changed")) == (
        "I/O error (bad page) while reading: nothing changed"
    )


def test_typed_errors_pass_through_storage_errors() -> None:
    with pytest.raises(InvalidInputError, match=r"^bad$"), storage_errors("x", "y"):
        raise InvalidInputError("bad")
    with pytest.raises(ValueError, match=r"^plain$"), storage_errors("x", "y"):
        raise ValueError("plain")


def _fail(code: int) -> Any:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code))

    return fail


def test_disk_full_during_commit_is_one_line_and_exit_code(
    repo: ckvc.Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo.commit(state(1), "one")
    ckpt = tmp_path / "c.pt"
    torch.save(state(2), ckpt)
    packs = sorted(p.name for p in (repo.dir / "packs").iterdir())
    monkeypatch.setattr(os, "writev", _fail(errno.ENOSPC))
    result = run(repo.path, "commit", str(ckpt), "-m", "two")
    monkeypatch.undo()
    assert result.exit_code == StorageFullError.exit_code == 19
    assert result.stderr == (
        "ckvc: error: disk full while writing the commit: nothing was committed; refs/heads/main is unchanged\n"
    )
    assert sorted(p.name for p in (repo.dir / "packs").iterdir()) == packs  # the temporary pack is gone
    assert [c.message for c in repo.log()] == ["one"]


def test_untyped_os_errors_and_bugs_in_the_cli_are_one_line(repo: ckvc.Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    repo.commit(state(1), "one")

    def eio(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EIO, "Input/output error", "/dev/sda")

    monkeypatch.setattr(ckvc.Repo, "log", eio)
    result = run(repo.path, "log")
    assert result.exit_code == StorageIOError.exit_code
    assert (
        result.stderr
        == "ckvc: error: I/O error (Input/output error) while running ckvc log (/dev/sda): ckvc log did not finish\n"
    )

    def bug(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("unexpected\nsecond line")

    monkeypatch.setattr(ckvc.Repo, "log", bug)
    monkeypatch.delenv("CKVC_DEBUG", raising=False)
    result = run(repo.path, "log")
    assert result.exit_code == UnexpectedError.exit_code == 70
    assert result.stderr == "ckvc: internal error: RuntimeError: unexpected (set CKVC_DEBUG=1 for a traceback)\n"
    monkeypatch.setenv("CKVC_DEBUG", "1")
    result = run(repo.path, "log")
    assert result.exit_code == 70
    assert "Traceback (most recent call last)" in result.stderr
    assert result.stderr.endswith("ckvc: internal error: RuntimeError: unexpected\n")


@pytest.mark.parametrize("args", [["log"], ["log", "--json"], ["show"], ["diff", "HEAD~1"], ["du"]])
def test_a_reader_that_goes_away_ends_the_command_quietly_as_git_does(repo: ckvc.Repo, args: list[str]) -> None:
    """`ckvc log | head -1`: the reader gone before ckvc writes (the instant chosen,
    not raced: the pipe's read end is closed before the process starts) ends the
    command with git's 141 and nothing on stderr."""
    repo.commit(state(1), "one")
    repo.commit(state(2), "two")
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "ckvc", "-C", str(repo.path), *args],
            stdout=write_end, stderr=subprocess.PIPE, check=False, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, b"")


def test_a_broken_pipe_that_is_not_stdout_stays_an_error(repo: ckvc.Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    def dropped(*args: Any, **kwargs: Any) -> Any:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")  # a socket to a remote, say

    monkeypatch.setattr(ckvc.Repo, "log", dropped)
    result = run(repo.path, "log")
    assert result.exit_code == StorageIOError.exit_code
    assert result.stderr.startswith("ckvc: error: I/O error (Broken pipe)")


def _error_classes() -> list[type[CkvcError]]:
    """Every CkvcError class ckvc defines, from every module that imports here."""
    for module in pkgutil.walk_packages(ckvc.__path__, "ckvc."):
        if module.name.endswith("__main__"):  # runs the CLI
            continue
        try:
            importlib.import_module(module.name)
        except ImportError:  # an optional dependency missing: its errors are ckvc.errors' anyway
            continue
    found, todo = [], list(CkvcError.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if c.__module__.startswith("ckvc.")]


def test_each_error_class_has_its_own_exit_code_and_the_guide_says_which() -> None:
    """No two error classes that set an exit code share it; a class that refines
    another keeps its code. The GUIDE's tables name every class with its code."""
    classes = _error_classes()
    own: dict[int, list[str]] = {}
    for cls in classes:
        if "exit_code" in vars(cls):
            own.setdefault(cls.exit_code, []).append(cls.__name__)
    assert {code: names for code, names in own.items() if len(names) > 1} == {}
    guide = (Path(__file__).resolve().parents[2] / "docs" / "GUIDE.md").read_text()
    section = guide[guide.index("### Exit codes") : guide.index("Errors from the operating system or LMDB")]
    in_guide: dict[str, int] = {}
    for code, meaning in re.findall(r"^\| (\d+) \| (.*) \|$", section, flags=re.MULTILINE):
        for name in set(re.findall(r"`(\w+Error)`", meaning)) - {"KeyError"}:
            assert name not in in_guide, f"{name} is in two rows"
            in_guide[name] = int(code)
    assert in_guide == {cls.__name__: cls.exit_code for cls in classes}


def test_ctrl_c_in_cli_commit_says_whether_it_landed(
    repo: ckvc.Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = repo.commit(state(1), "one")
    ckpt = tmp_path / "c.pt"
    torch.save(state(2), ckpt)
    real_writev = os.writev

    def interrupt(*args: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "writev", interrupt)
    result = run(repo.path, "commit", str(ckpt), "-m", "two")
    assert (result.exit_code, result.stderr) == (
        130,
        "ckvc: error: interrupted: nothing was committed; refs/heads/main is unchanged\n",
    )
    assert repo.refs.read("refs/heads/main") == first
    monkeypatch.setattr(os, "writev", real_writev)
    import ckvc.journal

    monkeypatch.setattr(ckvc.journal.Journal, "add", interrupt)  # the reflog append, after the move
    result = run(repo.path, "commit", str(ckpt), "-m", "two")
    moved = repo.refs.read("refs/heads/main")
    assert moved is not None and moved != first
    assert result.exit_code == 0
    assert result.stderr.startswith(f"ckvc: interrupted after it took effect: refs/heads/main now names {moved[:12]}")


# A CLI call whose SIGINT lands at a chosen instant after the command ran (the torture
# suite found one landing in main's tail): the signal is raised by a hook, not a timer.
_LATE_SIGINT = """
import signal, sys
import ckvc.cli
m = sys.modules["ckvc.cli.main"]  # the package's name "main" is the function
where = sys.argv[1]
ignore = m._ignore_sigint
calls = []
def hooked():
    calls.append(1)
    if where == "before-ignore" and len(calls) == 1:
        raise KeyboardInterrupt  # the Ctrl-C lands just before SIGINT is ignored
    ignore()
    if where == "after-ignore":
        signal.raise_signal(signal.SIGINT)
m._ignore_sigint = hooked
if where == "in-flush":
    flush = sys.stdout.flush
    def flushing():
        if calls:  # main's own flush, after the outcome
            signal.raise_signal(signal.SIGINT)
        flush()
    sys.stdout.flush = flushing
sys.argv = ["ckvc", "-C", sys.argv[2], "log", "--oneline"]
m.main()
"""


@pytest.mark.parametrize("where", ["after-ignore", "in-flush", "before-ignore"])
def test_a_ctrl_c_after_the_outcome_never_adds_a_traceback(repo: ckvc.Repo, where: str) -> None:
    commit = repo.commit(state(1), "one")
    done = subprocess.run(
        [sys.executable, "-c", _LATE_SIGINT, where, str(repo.path)], capture_output=True, text=True, timeout=120
    )
    # the command's own outcome and output stand, whatever instant after it the signal took
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout.startswith(commit[:7])


def test_interrupt_in_the_python_api_records_the_outcome(repo: ckvc.Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckvc.journal

    def interrupt(*args: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(ckvc.journal.Journal, "add", interrupt)  # the reflog append, after the move
    with pytest.raises(InterruptedOperationError) as info:
        repo.commit(state(1), "one")
    assert info.value.landed and info.value.result == repo.refs.read("refs/heads/main")
    assert isinstance(info.value, KeyboardInterrupt)  # `except KeyboardInterrupt` still stops a training loop


def test_committing_on_a_ref_that_names_a_missing_object_writes_nothing(repo: ckvc.Repo) -> None:
    repo.commit(state(1), "one")
    missing = "ab" * 32
    (repo.dir / "refs" / "heads" / "main").write_text(missing + "\n")
    packs = sorted(p.name for p in (repo.dir / "packs").iterdir())
    with pytest.raises(ObjectNotFoundError) as info:
        repo.commit(state(2), "two")
    assert str(info.value) == (
        "refs/heads/main names commit abababababab, which is not in the repository: "
        "nothing was committed; run `ckvc fsck`"
    )
    assert sorted(p.name for p in (repo.dir / "packs").iterdir()) == packs
    assert repo.refs.read("refs/heads/main") == missing


def test_non_utf8_text_is_refused_before_anything_is_written(repo: ckvc.Repo) -> None:
    with pytest.raises(InvalidInputError, match=r"^message is not valid UTF-8 text: 'bad\\udcff'$"):
        repo.commit(state(1), "bad\udcff")
    with pytest.raises(InvalidInputError, match=r"^metadata is not valid UTF-8 text"):
        repo.commit(state(1), "ok", metadata={"k": "v\udcff"})
    assert repo.head() == ("main", None)
    assert list((repo.dir / "packs").iterdir()) == []


# ---- config -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("codec", "zstd:1000"), "codec.level must be between -7 and 22, got 1000"),
        (("codec", "auto:-100"), "codec.level must be between -7 and 22, got -100"),
        (("codec", "lz4"), "codec: unknown codec 'lz4'; known: ['auto', 'raw', 'zstd']"),
        (("keyframe_interval", "0"), "keyframe_interval must be between 1 and 255"),
    ],
)
def test_bad_config_values_are_refused_when_set(repo: ckvc.Repo, args: tuple[str, str], message: str) -> None:
    before = (repo.dir / "config.json").read_bytes()
    result = run(repo.path, "config", *args)
    assert (result.exit_code, result.stderr) == (InvalidInputError.exit_code, f"ckvc: error: {message}\n")
    assert (repo.dir / "config.json").read_bytes() == before
    repo.commit(state(1), "still works")


def test_a_good_codec_level_is_accepted(repo: ckvc.Repo) -> None:
    assert run(repo.path, "config", "codec", "zstd:19").exit_code == 0
    with ckvc.Repo.open(repo.path) as again:
        assert again.config.codec == {"name": "zstd", "level": 19}
        commit = again.commit(state(1), "level 19")
        assert again.load(commit)["step"] == 1


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("chunk_size", "big", "chunk_size must be int, got 'big'"),
        ("gc_grace_s", True, "gc_grace_s must be int or float, got True"),
        ("reflog_expiry_s", None, "reflog_expiry_s must be int or float, got None"),
        ("codec", "zstd", "codec must be dict, got 'zstd'"),
        ("codec", {"name": "zstd", "level": "9"}, "codec.level must be an integer, got '9'"),
        ("retention", [1], "retention must be dict or null, got [1]"),
        ("retention", {"keep_last": "3"}, "retention: keep-last must be a positive integer, got '3'"),
        ("repack_threshold", float("nan"), "repack_threshold must be finite, got nan"),
    ],
)
def test_wrong_typed_values_in_the_config_file_name_the_key(
    repo: ckvc.Repo, key: str, value: Any, message: str
) -> None:
    path = repo.dir / "config.json"
    raw = json.loads(path.read_text())
    raw[key] = value
    path.write_text(json.dumps(raw))
    with pytest.raises(InvalidConfigError) as info:
        ckvc.Repo.open(repo.path)
    assert str(info.value) == f"bad config {path}: {message}"
    result = run(repo.path, "log")
    assert (result.exit_code, result.stderr) == (24, f"ckvc: error: bad config {path}: {message}\n")


# ---- a background commit that fails at exit -----------------------------------------


@pytest.mark.parametrize("handled", [False, True])
def test_a_background_commit_failing_at_exit_makes_the_process_fail(tmp_path: Path, handled: bool) -> None:
    ckvc.Repo.init(tmp_path / "r").close()
    script = textwrap.dedent(
        f"""
        import errno, os, torch, ckvc
        repo = ckvc.Repo.open({str(tmp_path / "r")!r})
        def full(*args):
            raise OSError(errno.ENOSPC, "No space left on device")
        os.writev = full
        pending = repo.commit({{"w": torch.ones(1000)}}, "bg", blocking=False)
        if {handled}:
            try:
                pending.result()
            except ckvc.errors.StorageFullError as exc:
                print("handled:", exc)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    if handled:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("handled: disk full while writing the commit")
        assert "background commit" not in proc.stderr
    else:
        assert proc.returncode == StorageFullError.exit_code, proc.stderr
        assert (
            proc.stderr.strip()
            .splitlines()[-1]
            .startswith(f"ckvc: a background commit in {tmp_path / 'r'} failed: disk full while writing the commit")
        )
