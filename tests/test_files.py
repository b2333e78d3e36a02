"""Files and folders in and out (ckvc.formats): every file committed as it is, exported
byte for byte with its mode, links kept as links, bad inputs and outputs refused
with typed errors, output atomic. Round trips through the CLI with no flags for
the folders real tools write (Hugging Face save_pretrained and Trainer, Lightning,
torch.distributed.checkpoint)."""

from __future__ import annotations

import hashlib
import itertools
import os
import pickle
import random
import stat
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from helpers import run

from ckvc.errors import CorruptObjectError, InvalidInputError
from ckvc.formats import (
    LinkOutsideTreeError,
    OutputPathError,
    UnsupportedFileError,
    export_commit,
    read_checkpoint,
    write_checkpoint,
)
from ckvc.repo import Repo
from ckvc.state import StoredFile

Tree = dict[str, tuple[Any, ...]]


def tree_of(root: Path) -> Tree:
    """Every entry under root, links not followed: a file by sha256 and mode, a link
    by its target, a directory by its mode."""
    out: Tree = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            rel = path.relative_to(root).as_posix()
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", oct(stat.S_IMODE(st.st_mode)))
            else:
                out[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest(), oct(stat.S_IMODE(st.st_mode)))
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cli_round_trip(tmp_path: Path, src: Path, name: str = "out") -> Path:
    """``ckvc commit SRC`` with no flags into a fresh repository, then ``checkout -o``."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    if not (work / ".ckvc").exists():
        assert run(work, "init").exit_code == 0
    r = run(work, "commit", str(src), "-m", "files")
    assert r.exit_code == 0, r.output
    out = tmp_path / name
    r = run(work, "checkout", "HEAD", "-o", str(out))
    assert r.exit_code == 0, r.output
    return out


def assert_same_tree(src: Path, out: Path) -> None:
    a, b = tree_of(src), tree_of(out)
    assert a, "nothing to compare"
    assert a == b
    assert stat.S_IMODE(os.stat(out).st_mode) == stat.S_IMODE(os.stat(src).st_mode) or out.is_file()


# --------------------------------------------------------------------------- a tree of everything


@pytest.fixture
def odd_tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "nested" / "deeper").mkdir(parents=True)
    (src / ".hidden").mkdir()
    (src / "empty_dir").mkdir()
    (src / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (src / ".metadata").write_bytes(b"\x80\x04dcp")
    (src / ".hidden" / "x").write_bytes(b"x")
    (src / "zero.pt").write_bytes(b"")  # a 0-byte file with a tensor suffix
    (src / "empty.txt").write_bytes(b"")
    (src / "args.bin").write_bytes(pickle.dumps({"path": Path("/x"), "lr": 0.1}))
    (src / "nested" / "deeper" / "模型 ü.json").write_text('{"ß": 1}', encoding="utf-8")
    (src / "nested" / "big.raw").write_bytes(np.random.default_rng(0).bytes(300_000))
    torch.save({"w": torch.arange(12.0).reshape(3, 4), "tail": torch.arange(6)[2:]}, src / "nested" / "w.pt")
    safetensors.torch.save_file({"b": torch.ones(3), "a": torch.zeros(2, 2)}, src / "m.safetensors", {"k": "v"})
    (src / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "run.sh", 0o755)
    os.chmod(src / "args.bin", 0o600)
    os.chmod(src / "m.safetensors", 0o444)
    os.chmod(src / "empty_dir", 0o750)
    os.symlink("nested/deeper/模型 ü.json", src / "link_to_file")
    os.symlink("nested", src / "link_to_dir")
    os.symlink("../m.safetensors", src / "nested" / "up_link")
    os.symlink("not_there", src / "dangling_inside")
    return src


def test_tree_round_trips_byte_for_byte_and_mode_for_mode(tmp_path: Path, odd_tree: Path) -> None:
    out = cli_round_trip(tmp_path, odd_tree)
    assert_same_tree(odd_tree, out)
    assert len(tree_of(out)) == 19  # 4 directories, 11 files, 4 links
    # A second export over the first gives the same tree (and removes nothing it should keep).
    assert run(tmp_path / "work", "checkout", "HEAD", "-o", str(out)).exit_code == 0
    assert_same_tree(odd_tree, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src", "work"]  # no temporary leftovers


def test_directory_load_gives_content(tmp_path: Path, odd_tree: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    state, meta = read_checkpoint(odd_tree)
    assert meta == {"ckvc.source": "directory"}
    repo.commit(state, metadata=meta)
    loaded = repo.load()
    assert loaded["args.bin"] == (odd_tree / "args.bin").read_bytes()  # a pickle: bytes, never unpickled
    assert loaded["nested/big.raw"] == (odd_tree / "nested" / "big.raw").read_bytes()  # a blob, loaded as bytes
    assert loaded["zero.pt"] == b"" and loaded["empty_dir"] is None
    assert loaded["link_to_dir"] == "nested" and loaded["dangling_inside"] == "not_there"
    assert list(loaded["m.safetensors"]) == ["a", "b"] and torch.equal(loaded["m.safetensors"]["b"], torch.ones(3))
    w = loaded["nested/w.pt"]
    assert torch.equal(w["w"], torch.arange(12.0).reshape(3, 4)) and torch.equal(w["tail"], torch.arange(6)[2:])
    # The torch file's storages are stored once: the content and its rebuild share blobs.
    blobs = repo.read_snapshot(repo.read_commit(repo.resolve("HEAD"))).blobs
    assert sorted(b.nbytes for b in blobs) == sorted([48, 48, 12, 16, 300_000])
    # One tensor file of the folder, by prefix, as a file of its own (converted, not the original bytes).
    export_commit(repo, "HEAD", tmp_path / "m_only.safetensors", prefix="m.safetensors.")
    assert list(safetensors.torch.load_file(tmp_path / "m_only.safetensors")) == ["a", "b"]


def test_safetensors_and_torch_files_export_identical_bytes(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    safetensors.torch.save_file(
        {"z": torch.randn(5, 5), "a": torch.arange(3, dtype=torch.int16)}, src / "m.safetensors", {"format": "pt"}
    )
    shared = torch.arange(10.0)
    torch.save({"v": shared[2:5], "full": shared, "bf": torch.ones(3, dtype=torch.bfloat16)}, src / "s.pt")
    for name in ("m.safetensors", "s.pt"):
        out = cli_round_trip(tmp_path, src / name, f"copy-{name}")
        assert sha(out) == sha(src / name)
        assert stat.S_IMODE(os.stat(out).st_mode) == stat.S_IMODE(os.stat(src / name).st_mode)


def test_rng_state_file_reads_with_numpy_allowlist(tmp_path: Path) -> None:
    import ckvc

    path = tmp_path / "rng_state.pth"
    torch.save({"numpy": np.random.get_state(), "python": random.getstate(), "ckvc": ckvc.rng_state()}, path)
    state, _ = read_checkpoint(path)
    assert isinstance(state, StoredFile) and state.layout["format"] == "torch"
    assert np.array_equal(state.content["numpy"][1], np.random.get_state()[1])  # type: ignore[index]
    out = cli_round_trip(tmp_path, path, "rng_copy.pth")
    assert sha(out) == sha(path)


def test_pickle_needing_file_alone_is_stored_as_bytes(tmp_path: Path) -> None:
    path = tmp_path / "training_args.bin"
    torch.save({"obj": Path("x")}, path)  # weights_only refuses it
    repo = Repo.init(tmp_path / "r")
    state, meta = read_checkpoint(path)
    repo.commit(state, metadata=meta)
    assert repo.load() == path.read_bytes()
    assert sha(cli_round_trip(tmp_path, path, "copy.bin")) == sha(path)


def test_python_commit_exports_deterministic_torch_file(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    repo.commit({"w": torch.randn(4, 4), "step": 3})
    a = export_commit(repo, "HEAD", tmp_path / "a.pt")
    export_commit(repo, "HEAD", tmp_path / "b.pt")
    assert a == [tmp_path / "a.pt"] and (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "a.pt").st_mode) == 0o644 & ~umask
    assert torch.load(tmp_path / "a.pt", weights_only=True)["step"] == 3


def test_pickled_commit_exports_only_when_allowed(tmp_path: Path) -> None:
    from ckvc.errors import UnsafeContentError

    repo = Repo.init(tmp_path / "r")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        repo.commit({"w": torch.ones(2), "c": 1 + 2j}, allow_pickle=True)
    with pytest.raises(UnsafeContentError):
        export_commit(repo, "HEAD", tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()
    export_commit(repo, "HEAD", tmp_path / "x.pt", allow_pickle=True)
    assert torch.load(tmp_path / "x.pt", weights_only=False)["c"] == 1 + 2j


def test_export_converts_on_request(tmp_path: Path) -> None:
    src = tmp_path / "w.pt"
    torch.save({"w": torch.ones(2), "b": torch.zeros(1)}, src)
    repo = Repo.init(tmp_path / "r")
    state, meta = read_checkpoint(src)
    repo.commit(state, metadata=meta)
    export_commit(repo, "HEAD", tmp_path / "w.safetensors")
    assert list(safetensors.torch.load_file(tmp_path / "w.safetensors")) == ["b", "w"]
    export_commit(repo, "HEAD", tmp_path / "w_only.safetensors", prefix="w")
    assert list(safetensors.torch.load_file(tmp_path / "w_only.safetensors")) == [""]
    with pytest.raises(OutputPathError, match="one file, not a directory"):
        export_commit(repo, "HEAD", tmp_path / "d", format="dir")


def test_progress_covers_reading_and_writing(tmp_path: Path, odd_tree: Path) -> None:
    calls: list[tuple[int, int]] = []
    state, meta = read_checkpoint(odd_tree, progress=lambda d, t: calls.append((d, t)))
    total = sum(p.stat().st_size for p in odd_tree.rglob("*") if p.is_file() and not p.is_symlink())
    assert calls[-1] == (total, total) and len(calls) >= 10
    written: list[tuple[int, int]] = []
    write_checkpoint(state, tmp_path / "o", meta, progress=lambda d, t: written.append((d, t)))
    assert written[-1] == (total, total)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(written))


# --------------------------------------------------------------------------- refused inputs


def test_fifo_socket_refused_nothing_written(tmp_path: Path) -> None:
    import socket

    work = tmp_path / "work"
    work.mkdir()
    assert run(work, "init").exit_code == 0
    before = sorted(p.name for p in (work / ".ckvc").rglob("*"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.txt").write_text("ok")
    os.mkfifo(src / "pipe")
    r = run(work, "commit", str(src))
    assert r.exit_code == UnsupportedFileError.exit_code
    assert r.output == f"ckvc: error: {src / 'pipe'} is a FIFO; only files can be committed\n"
    r = run(work, "commit", str(src / "pipe"))  # named itself: never opened, so no hang
    assert r.exit_code == UnsupportedFileError.exit_code and "is not a regular file or directory (a FIFO)" in r.output
    os.unlink(src / "pipe")
    sock = socket.socket(socket.AF_UNIX)
    sock_path = src / "s"
    try:
        sock.bind(str(sock_path))
        r = run(work, "commit", str(src))
        assert r.exit_code == UnsupportedFileError.exit_code and "is a socket" in r.output
    finally:
        sock.close()
    assert sorted(p.name for p in (work / ".ckvc").rglob("*")) == before
    assert run(work, "log").output.strip() == "" or "no commits" in run(work, "log").output


def test_links_leaving_the_tree(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "shards").mkdir(parents=True)
    (outside / "secret").write_text("s")
    safetensors.torch.save_file({"w": torch.ones(2)}, outside / "shards" / "s1.safetensors")
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    os.symlink(outside / "shards", src / "shards")  # a symlinked shard folder: never skipped
    with pytest.raises(LinkOutsideTreeError, match="--follow-links"):
        read_checkpoint(src)
    work = tmp_path / "work"
    work.mkdir()
    assert run(work, "init").exit_code == 0
    r = run(work, "commit", str(src))
    assert r.exit_code == LinkOutsideTreeError.exit_code and r.output.count("\n") == 1
    assert run(work, "commit", str(src), "--follow-links").exit_code == 0
    out = tmp_path / "out"
    assert run(work, "checkout", "HEAD", "-o", str(out)).exit_code == 0
    assert sha(out / "shards" / "s1.safetensors") == sha(outside / "shards" / "s1.safetensors")
    assert not (out / "shards").is_symlink()
    os.unlink(src / "shards")
    os.symlink("/etc/passwd", src / "pw")
    with pytest.raises(LinkOutsideTreeError):
        read_checkpoint(src)
    os.unlink(src / "pw")
    os.symlink("../outside/secret", src / "up")
    with pytest.raises(LinkOutsideTreeError):
        read_checkpoint(src)
    os.unlink(src / "up")
    os.symlink(".", src / "loop")
    state, _ = read_checkpoint(src)  # a link inside the tree is kept as a link, not walked
    assert state["loop"].content == "." and state["loop"].layout == {"type": "link"}


def test_empty_torch_file_alone_refused(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    assert run(work, "init").exit_code == 0
    (work / "e.pt").write_bytes(b"")
    r = run(work, "commit", "e.pt")
    assert r.exit_code == InvalidInputError.exit_code
    assert r.output == f"ckvc: error: {work / 'e.pt'} is empty (0 bytes): nothing to commit\n"


def test_committing_the_repository_folder_leaves_the_repository_out(tmp_path: Path) -> None:
    assert run(tmp_path, "init").exit_code == 0
    (tmp_path / "model.safetensors").write_bytes(safetensors.torch.save({"w": torch.ones(2)}))
    (tmp_path / ".env").write_text("x")
    assert run(tmp_path, "commit", ".").exit_code == 0
    assert sorted(Repo.open(tmp_path).load()) == [".env", "model.safetensors"]


def test_non_utf8_file_name_refused(tmp_path: Path) -> None:
    src = tmp_path / "d"
    src.mkdir()
    try:
        (src / os.fsdecode(b"bad\xff")).write_text("x")
    except OSError:
        pytest.skip("this filesystem refuses non-UTF-8 names")
    with pytest.raises(UnsupportedFileError, match="not valid UTF-8"):
        read_checkpoint(src)


def test_unreadable_file_refused(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    src = tmp_path / "d"
    src.mkdir()
    (src / "x").write_text("x")
    os.chmod(src / "x", 0)
    with pytest.raises(UnsupportedFileError, match="cannot read"):
        read_checkpoint(src)


# --------------------------------------------------------------------------- refused outputs


def test_uncreatable_output_targets(tmp_path: Path, odd_tree: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    state, meta = read_checkpoint(odd_tree)
    repo.commit(state, metadata=meta)
    with pytest.raises(OutputPathError, match="does not exist"):
        export_commit(repo, "HEAD", tmp_path / "missing" / "out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match="exists and is not a directory"):
        export_commit(repo, "HEAD", tmp_path / "file")
    with pytest.raises(OutputPathError, match="is not a directory"):
        export_commit(repo, "HEAD", tmp_path / "file" / "sub")
    with pytest.raises(OutputPathError, match="holds a ckvc repository"):
        export_commit(repo, "HEAD", tmp_path / "r")
    assert (tmp_path / "file").read_text() == "x"
    work = tmp_path / "w"
    work.mkdir()
    assert run(work, "init").exit_code == 0
    assert run(work, "commit", str(odd_tree)).exit_code == 0
    r = run(work, "checkout", "HEAD", "-o", str(tmp_path / "nope" / "x"))
    assert r.exit_code == OutputPathError.exit_code
    assert r.output == f"ckvc: error: cannot write {tmp_path / 'nope' / 'x'}: {tmp_path / 'nope'} does not exist\n"


@pytest.mark.parametrize("key", ["../escape", "/abs/x", "a/../../x", "a\x00b", "./a", "a//b", ""])
def test_crafted_directory_keys_refused_on_export(tmp_path: Path, key: str) -> None:
    repo = Repo.init(tmp_path / "r")
    repo.commit({key: b"evil", "ok": b"fine"}, metadata={"ckvc.source": "directory"})
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputPathError, match="refusing to write the stored name"):
        export_commit(repo, "HEAD", tmp_path / "out" / "d")
    assert sorted(p.name for p in tmp_path.rglob("*") if ".ckvc" not in p.parts and p.name != "r") == ["out"]


def test_crafted_links_and_layouts_refused_on_export(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    repo.commit({"l": StoredFile("../../etc", {"type": "link"}), "f": b"x"}, metadata={"ckvc.source": "directory"})
    with pytest.raises(OutputPathError, match="points outside"):
        export_commit(repo, "HEAD", tmp_path / "o1")
    repo.commit({"f": StoredFile(b"abc", {"type": "file", "mode": 0o644, "size": 5})})
    with pytest.raises(CorruptObjectError, match="3 bytes where the layout says 5"):
        export_commit(repo, "HEAD", tmp_path / "o2.bin")
    repo.commit(StoredFile(b"abc", {"type": "file", "format": "bytes", "mode": 0o4755, "size": 3}))
    export_commit(repo, "HEAD", tmp_path / "o3.bin")
    assert stat.S_IMODE(os.stat(tmp_path / "o3.bin").st_mode) == 0o755  # no set-uid from a stored commit
    os.unlink(tmp_path / "o3.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


# --------------------------------------------------------------------------- atomic output


def test_export_replaces_older_directory_whole_and_sweeps_leftovers(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "a.txt").write_text("one")
    (v1 / "only_in_v1").write_text("old")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "a.txt").write_text("two")
    for src in (v1, v2):
        state, meta = read_checkpoint(src)
        repo.commit(state, metadata=meta)
    out = tmp_path / "out"
    export_commit(repo, "HEAD~1", out)
    assert tree_of(out) == tree_of(v1)
    # What killed runs leave: a half-written directory and files, with ckvc's hidden names.
    (tmp_path / f".out.ckvc-tmp-{'a' * 32}").mkdir()
    (tmp_path / f".out.ckvc-tmp-{'a' * 32}" / "a.txt").write_text("half")
    (tmp_path / f".x.pt.ckvc-tmp-{'b' * 32}").write_bytes(b"half")
    (tmp_path / f".x.pt.{'c' * 32}.tmp").write_bytes(b"half")  # older ckvc's temporary name
    (tmp_path / ".out.keep").write_text("a user's file")
    export_commit(repo, "HEAD", out)
    assert tree_of(out) == tree_of(v2)  # replaced whole: nothing of v1 is left in it
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([f".x.pt.ckvc-tmp-{'b' * 32}", f".x.pt.{'c' * 32}.tmp", ".out.keep", "out", "r", "v1", "v2"])
    repo.commit({"w": torch.ones(2)})
    export_commit(repo, "HEAD", tmp_path / "x.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.keep", "out", "r", "v1", "v2", "x.pt"]


def test_leftover_in_use_is_left_alone(tmp_path: Path) -> None:
    import fcntl

    repo = Repo.init(tmp_path / "r")
    repo.commit({"w": torch.ones(2)})
    live = tmp_path / f".x.pt.ckvc-tmp-{'d' * 32}"
    live.write_bytes(b"")
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another run still writing it
        export_commit(repo, "HEAD", tmp_path / "x.pt")
        assert live.exists()
    finally:
        os.close(fd)
    export_commit(repo, "HEAD", tmp_path / "x.pt")
    assert not live.exists()


def test_directory_commit_of_older_ckvc_still_exports(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    old_style = {"config.json": b"{}", "model.safetensors": {"w": torch.ones(2)}, "sub/opt.pt": {"s": torch.zeros(1)}}
    repo.commit(old_style, metadata={"ckvc.source": "directory"})
    export_commit(repo, "HEAD", tmp_path / "o")
    assert (tmp_path / "o" / "config.json").read_bytes() == b"{}"
    assert torch.equal(safetensors.torch.load_file(tmp_path / "o" / "model.safetensors")["w"], torch.ones(2))
    assert torch.equal(torch.load(tmp_path / "o" / "sub" / "opt.pt", weights_only=True)["s"], torch.zeros(1))


# --------------------------------------------------------------------------- folders real tools write


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A save_pretrained folder and a Trainer checkpoint folder of a tiny BERT (no download)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    root = tmp_path_factory.mktemp("hf")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, num_labels=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(root / "bert")
    model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (8,), generator=g), "labels": torch.tensor(i % 2)} for i in range(16)]
    args = transformers.TrainingArguments(
        output_dir=str(root / "run"), max_steps=2, save_steps=2, per_device_train_batch_size=4,
        report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True, seed=0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.Trainer(model=model, args=args, train_dataset=data).train()
    return {"bert": root / "bert", "trainer": root / "run" / "checkpoint-2"}


def test_hf_model_folder_round_trip(tmp_path: Path, hf_folders: dict[str, Path]) -> None:
    src = hf_folders["bert"]
    assert (src / "model.safetensors").exists() and (src / "config.json").exists()
    assert_same_tree(src, cli_round_trip(tmp_path, src))


def test_hf_trainer_folder_round_trip_and_load(tmp_path: Path, hf_folders: dict[str, Path]) -> None:
    src = hf_folders["trainer"]
    names = {p.name for p in src.iterdir()}
    assert {"rng_state.pth", "training_args.bin", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= names
    assert "model.safetensors" in names
    assert_same_tree(src, cli_round_trip(tmp_path, src))
    repo = Repo.open(tmp_path / "work")
    loaded = repo.load()
    weights = safetensors.torch.load_file(src / "model.safetensors")
    assert list(loaded["model.safetensors"]) == list(weights)
    for name, tensor in weights.items():
        assert torch.equal(loaded["model.safetensors"][name], tensor), name
    assert loaded["training_args.bin"] == (src / "training_args.bin").read_bytes()
    assert set(loaded["optimizer.pt"]) == {"state", "param_groups"}
    assert "cpu" in loaded["rng_state.pth"]


@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pl = pytest.importorskip("lightning.pytorch")
    root = tmp_path_factory.mktemp("pl")

    class Tiny(pl.LightningModule):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g))
    callback = pl.callbacks.ModelCheckpoint(dirpath=str(root / "ckpts"), every_n_train_steps=2)
    trainer = pl.Trainer(
        max_steps=2, accelerator="cpu", callbacks=[callback], logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(root),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    (ckpt,) = (root / "ckpts").glob("*.ckpt")
    return ckpt


def test_lightning_ckpt_round_trip(tmp_path: Path, lightning_ckpt: Path) -> None:
    out = cli_round_trip(tmp_path, lightning_ckpt, "copy.ckpt")
    assert sha(out) == sha(lightning_ckpt)
    state, _ = read_checkpoint(lightning_ckpt)
    assert isinstance(state, StoredFile) and state.layout["format"] == "torch"  # split into tensors, not bytes
    assert set(state.content["state_dict"]) == {"layer.weight", "layer.bias"}
    assert_same_tree(lightning_ckpt.parent, cli_round_trip(tmp_path, lightning_ckpt.parent, "ckpts"))


def test_dcp_directory_round_trip_and_loads(tmp_path: Path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    src = tmp_path / "dcp"
    state: dict[str, Any] = {"w": torch.randn(8, 8), "b": torch.arange(4.0), "step": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it runs single-process
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(src)))
    assert (src / ".metadata").exists() and list(src.glob("*.distcp"))
    out = cli_round_trip(tmp_path, src)
    assert_same_tree(src, out)
    restored: dict[str, Any] = {"w": torch.zeros(8, 8), "b": torch.zeros(4), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(restored, storage_reader=dcp.FileSystemReader(str(out)))
    assert torch.equal(restored["w"], state["w"]) and torch.equal(restored["b"], state["b"])
    assert restored["step"] == 7
    # The shard's tensors are stored as tensors (read without DCP's pickled .metadata), so
    # a second save with the same weights and a new step adds no chunks.
    repo = Repo.open(tmp_path / "work")
    (shard,) = (p.name for p in src.glob("*.distcp"))
    loaded = repo.load()[shard]
    assert sorted(v.shape for v in loaded.values() if isinstance(v, torch.Tensor)) == [(4,), (8, 8)]
    assert 7 in loaded.values()
    state["step"] = 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(src), overwrite=True))
    assert run(tmp_path / "work", "commit", str(src), "-m", "step 8").exit_code == 0
    head, parent = (repo.read_snapshot(c) for c in repo.log()[:2])
    assert {b.chunks for b in head.blobs} == {b.chunks for b in parent.blobs}
    assert_same_tree(src, cli_round_trip(tmp_path, src, "out8"))


def test_dot_file_folder_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "dots"
    (src / ".cache" / "huggingface").mkdir(parents=True)
    (src / ".gitattributes").write_text("*.bin filter=lfs\n")
    (src / ".cache" / "huggingface" / ".gitignore").write_text("*\n")
    (src / ".env").write_text("A=1\n")
    safetensors.torch.save_file({"w": torch.ones(2)}, src / ".hidden.safetensors")
    out = cli_round_trip(tmp_path, src)
    assert_same_tree(src, out)
    assert len(tree_of(out)) == 6


def test_file_nodes_decode_as_content_or_stored_file() -> None:
    import msgpack

    from ckvc.state import EXT_FILE, decode_state, describe_state, encode_state

    t = torch.tensor([1.0, -2.0])
    big = np.arange(100, dtype=np.uint8)
    state = {
        "m.pt": StoredFile({"w": t}, {"type": "file", "format": "torch", "mode": 0o600, "size": 8, "parts": [t]}),
        "raw": StoredFile(big, {"type": "file", "format": "bytes", "mode": 0o644, "size": 100}, as_bytes=True),
    }
    tree, blobs, _, _ = encode_state(state)
    assert len(blobs) == 2  # the tensor and its part share one blob
    assert [b.dtype for b in blobs] == ["numpy:|u1", "float32"]  # numpy blobs first (FORMAT.md 10.4)
    bases: list[Any] = [big.copy(), torch.frombuffer(bytearray(bytes(blobs[1].data)), dtype=torch.float32)]
    plain = decode_state(tree, lambda i: bases[i])
    assert plain["raw"] == big.tobytes() and torch.equal(plain["m.pt"]["w"], t)
    files = decode_state(tree, lambda i: bases[i], files=True)
    assert isinstance(files["m.pt"], StoredFile) and files["m.pt"].layout["mode"] == 0o600
    assert files["m.pt"].layout["parts"][0].data_ptr() == files["m.pt"].content["w"].data_ptr()
    assert set(describe_state(tree)) == {"m.pt.w", "raw"}
    bad = msgpack.packb({"x": msgpack.ExtType(EXT_FILE, msgpack.packb([b"", 1, b"\x80"]))})
    with pytest.raises(CorruptObjectError, match="malformed file node"):
        decode_state(bad, lambda i: bases[i])


def test_output_name_too_long_and_write_failures_are_typed(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    repo.commit({"w": torch.ones(2)})
    with pytest.raises(OutputPathError, match="the name is too long"):
        export_commit(repo, "HEAD", tmp_path / ("x" * 210 + ".pt"))
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(OutputPathError, match="not writable"):
            export_commit(repo, "HEAD", ro / "x.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"] + (["ro"] if os.geteuid() != 0 else [])


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_disk_full_while_exporting_leaves_the_old_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    import errno

    repo = Repo.init(tmp_path / "r")
    if kind == "dir":
        repo.commit({"a": b"old"}, metadata={"ckvc.source": "directory"})
        repo.commit({"a": b"new", "b": b"more"}, metadata={"ckvc.source": "directory"})
        out = tmp_path / "out"
    else:
        repo.commit({"w": torch.zeros(2)})
        repo.commit({"w": torch.ones(2)})
        out = tmp_path / "out.pt"
    export_commit(repo, "HEAD~1", out)

    def outputs() -> Tree:
        return {k: v for k, v in tree_of(tmp_path).items() if not k.startswith("r/")}

    before = outputs()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OutputPathError, match="No space left on device"):
        export_commit(repo, "HEAD", out)
    monkeypatch.undo()
    assert outputs() == before  # the old version whole, no temporary left


def test_killed_directory_export_leaves_old_version_and_next_run_sweeps(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    repo = Repo.init(tmp_path / "r")
    repo.commit({"a": b"old", "b": b"old"}, metadata={"ckvc.source": "directory"})
    repo.commit({"a": b"new", "b": b"new"}, metadata={"ckvc.source": "directory"})
    out = tmp_path / "out"
    export_commit(repo, "HEAD~1", out)
    old = tree_of(out)
    # The child stalls after its first file, inside the temporary directory.
    child = (
        "import sys, time, ckvc.formats.export as f\n"
        "from ckvc.repo import Repo\n"
        "real = f._write_one\n"
        "def slow(*a):\n"
        "    real(*a)\n"
        "    time.sleep(60)\n"
        "f._write_one = slow\n"
        "f.export_commit(Repo.open(sys.argv[1]), 'HEAD', sys.argv[2])\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child, str(tmp_path / "r"), str(out)])
    try:
        for _ in range(600):
            tmps = [p for p in tmp_path.iterdir() if p.name.startswith(".out.ckvc-tmp-")]
            if tmps and any(tmps[0].iterdir()):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the child never started writing")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert tree_of(out) == old  # never a mix of two versions
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".out.ckvc-tmp-")]) == 1
    export_commit(repo, "HEAD", out)
    assert (out / "a").read_bytes() == b"new" and (out / "b").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "r"]


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "dir"])
def test_two_exports_of_one_commit_are_byte_identical(tmp_path: Path, fmt: str) -> None:
    """Reproducible exports (issue 29): one commit exported twice, the clock a day apart
    and under other temporary names, gives the same bytes in every format (a state as
    pt and safetensors; a committed folder as dir)."""
    import time

    repo = Repo.init(tmp_path / "r")
    shared = torch.arange(12.0)
    state = {"w": torch.randn(4, 4), "view": shared[3:7], "full": shared, "b": torch.ones(2, dtype=torch.bfloat16)}
    if fmt == "dir":
        folder = tmp_path / "folder"
        (folder / "sub").mkdir(parents=True)
        torch.save(state, folder / "model.pt")
        safetensors.torch.save_file({"w": state["w"]}, folder / "sub" / "w.safetensors")
        assert run(tmp_path / "r", "commit", str(folder)).exit_code == 0
    else:
        repo.commit(state, "s")
    name = {"pt": "x.pt", "safetensors": "x.safetensors", "dir": "x"}[fmt]
    real_time, real_ns = time.time, time.time_ns
    outs = []
    for day in range(2):
        with pytest.MonkeyPatch.context() as clock:
            clock.setattr(time, "time", lambda day=day: real_time() + 86400 * day)
            clock.setattr(time, "time_ns", lambda day=day: real_ns() + 86400 * 10**9 * day)
            out = tmp_path / f"e{day}" / name
            out.parent.mkdir()
            export_commit(repo, "HEAD", out, format=fmt)  # type: ignore[arg-type]
        outs.append(out)
    files = [{p.relative_to(o).as_posix(): sha(p) for p in sorted(o.rglob("*")) if p.is_file()} if o.is_dir()
             else {"": sha(o)} for o in outs]  # fmt: skip
    assert files[0] == files[1] and files[0]
    repo.close()
