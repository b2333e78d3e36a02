"""Files ckvc cannot parse (issue 29): a .pt or .safetensors file that does not parse
is committed byte for byte with a one-line warning naming it and what is wrong;
--strict refuses it (MalformedFileError, exit 35) and commits nothing. A valid file
that needs pickle is stored as bytes quietly (by design), and --strict takes it."""

from __future__ import annotations

import datetime
import io
import json
import struct
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
from helpers import run

import ckvc
from ckvc.formats.layout import MalformedFileError


def good_pt() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(64.0)}, buf)
    return buf.getvalue()


def safetensors_file(header: Mapping[str, object] | bytes, data: bytes, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


TENSOR = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}


def empty_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/other.txt", "x")
    return buf.getvalue()


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


# name -> the file's bytes; 17 inputs that claim a format and do not parse
MALFORMED: dict[str, Callable[[], bytes]] = {
    "random.pt": lambda: bytes(range(256)) * 4,
    "text.pth": lambda: b"hello, not a checkpoint\n",
    "zeros.bin": lambda: bytes(4096),
    "truncated-half.pt": lambda: good_pt()[: len(good_pt()) // 2],
    "truncated-tail.ckpt": lambda: good_pt()[:-10],
    "bad-magic.pt": lambda: b"XK" + good_pt()[2:],
    "damaged-directory.pt": lambda: flip(good_pt(), len(good_pt()) - 30),
    "no-data-pkl.pt": empty_zip,
    "random.safetensors": lambda: bytes(range(255, -1, -1)) * 4,
    "header-past-end.safetensors": lambda: safetensors_file(TENSOR, bytes(16), length=1 << 40),
    "header-not-json.safetensors": lambda: safetensors_file(b"{not json", bytes(16)),
    "offsets-past-end.safetensors": lambda: safetensors_file(
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1600]}}, bytes(16)
    ),
    "data-cut-short.safetensors": lambda: safetensors_file(TENSOR, bytes(8)),
    "unknown-dtype.safetensors": lambda: safetensors_file(
        {"w": {"dtype": "F99", "shape": [4], "data_offsets": [0, 16]}}, bytes(16)
    ),
    "shape-mismatch.safetensors": lambda: safetensors_file(
        {"w": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}, bytes(16)
    ),
    "empty-header.safetensors": lambda: safetensors_file(b"", bytes(16)),
    "eight-bytes.safetensors": lambda: struct.pack("<Q", 0),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_file_is_stored_with_a_warning_and_refused_with_strict(tmp_path: Path, name: str) -> None:
    data = MALFORMED[name]()
    with ckvc.Repo.init(tmp_path / "r") as repo:
        base = repo.commit({"w": torch.zeros(2)}, message="base")
    src = tmp_path / name
    src.write_bytes(data)
    refused = run(tmp_path / "r", "commit", str(src), "-m", "strict", "--strict")
    assert refused.exit_code == MalformedFileError.exit_code == 35, refused.output
    assert refused.stderr.startswith(f"ckvc: error: {src} is ") and "nothing was committed" in refused.stderr
    with ckvc.Repo.open(tmp_path / "r") as repo:
        assert repo.resolve("main") == base
    stored = run(tmp_path / "r", "commit", str(src), "-m", "as bytes")
    assert stored.exit_code == 0, stored.output
    (warning,) = [line for line in stored.stderr.splitlines() if line.startswith("ckvc: warning:")]
    assert warning.startswith(f"ckvc: warning: {src} stored as bytes, byte for byte: ")
    reason = warning.split("byte for byte: ", 1)[1]
    with ckvc.Repo.open(tmp_path / "r") as repo:  # show, log and the web UI show it with the commit
        assert repo.read_commit(repo.resolve("HEAD")).metadata["ckvc.stored_as_bytes"] == {name: reason}
    assert f"NOT PARSED, stored as bytes: {name}: {reason}" in run(tmp_path / "r", "show", "--no-data").stdout
    out = tmp_path / f"out-{name}"
    assert run(tmp_path / "r", "export", "HEAD", str(out)).exit_code == 0
    assert out.read_bytes() == data  # byte for byte


def test_a_file_that_needs_pickle_is_stored_as_bytes_quietly_and_strict_takes_it(tmp_path: Path) -> None:
    """Valid, but not weights-only (as every Trainer folder's training_args.bin): stored
    as bytes by design, never unpickled, with no warning."""
    src = tmp_path / "dated.pt"
    torch.save({"w": torch.zeros(3), "when": datetime.date(2026, 12, 4)}, src)
    with ckvc.Repo.init(tmp_path / "r"):
        pass
    result = run(tmp_path / "r", "commit", str(src), "-m", "pickled", "--strict")
    assert result.exit_code == 0, result.output
    assert "warning" not in result.stderr


def test_the_api_refuses_with_strict(tmp_path: Path) -> None:
    from ckvc.formats import read_checkpoint

    src = tmp_path / "random.pt"
    src.write_bytes(MALFORMED["random.pt"]())
    with pytest.raises(MalformedFileError, match="neither a zip archive nor a pickle"):
        read_checkpoint(src, strict=True)


def test_a_folder_names_only_its_unparsed_files(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    (folder / "sub").mkdir(parents=True)
    (folder / "model.pt").write_bytes(good_pt())
    (folder / "sub" / "broken.safetensors").write_bytes(MALFORMED["header-not-json.safetensors"]())
    (folder / "notes.txt").write_text("not claimed: no word")
    with ckvc.Repo.init(tmp_path / "r"):
        pass
    result = run(tmp_path / "r", "commit", str(folder), "-m", "folder")
    assert result.exit_code == 0, result.output
    with ckvc.Repo.open(tmp_path / "r") as repo:
        marked = repo.read_commit(repo.resolve("HEAD")).metadata["ckvc.stored_as_bytes"]
        assert list(marked) == ["sub/broken.safetensors"] and marked["sub/broken.safetensors"].startswith("not valid")
        assert repo.load("HEAD")["model.pt"]["w"].shape == (64,)  # the good file's tensors, split out
    assert run(tmp_path / "r", "commit", str(folder), "-m", "strict", "--strict").exit_code == 35
