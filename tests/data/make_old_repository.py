"""Write tests/data/old_repository.tar.gz and its manifest with the ckvc of the day.

Run once, before a change that could touch the on-disk format (issue 14's
refactor), from the repository root:

    .venv/bin/python tests/data/make_old_repository.py

tests/test_old_repository.py then opens that repository with the current code and
checks every commit against the manifest. Regenerating it with newer code would
defeat the point: the archive is what an older ckvc wrote.

What it holds: main: five commits (float32/bf16/float16/int64/bool/uint8/int16
tensors, one of two 64 KiB chunks stored as deltas against keyframe_interval 4
keyframes, ties and views, non-tensor state of every kind), the first and third
released by keep-last 2 (every branch) and gc'd;
tag v1 (lightweight) and v2 (annotated); branch exp off v1 with two commits;
branch files holding a stored safetensors file; branch lossy with a q8 commit.
Commit times and the author are fixed, so the commit ids are reproducible.
"""

from __future__ import annotations

import json
import os
import sys
import tarfile
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import blake3
import safetensors.torch
import torch

import ckvc
from ckvc.formats import read_checkpoint
from ckvc.retention import RetentionPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import describe_state

HERE = Path(__file__).resolve().parent
ARCHIVE = HERE / "old_repository.tar.gz"
MANIFEST = HERE / "old_repository.json"
TOP = "old_repository"  # the archive's one top-level directory
BASE_TIME_NS = 1_750_000_000 * 10**9
AUTHOR = "fixture <fixture@ckvc>"


def epoch_state(epoch: int, g: torch.Generator) -> dict[str, Any]:
    """A training-like state; each epoch perturbs a fixed base a little (deltas)."""
    base = torch.Generator().manual_seed(1234)
    w = torch.randn(32, 64, generator=base)  # two chunks; one row moves per epoch
    w[epoch % 32] += 1e-3 * torch.randn(64, generator=g)
    emb = torch.randn(32, 64, generator=base).to(torch.bfloat16)
    emb[epoch % 32] += 1
    half = torch.randn(16, 64, generator=base).to(torch.float16)
    half[:, epoch % 64] = epoch
    moment = torch.randn(32, 64, generator=base).abs()
    moment[16:] *= 1 + 2**-10 * epoch
    # Two 64 KiB chunks of low-entropy floats: the first moves a little each epoch
    # (a delta against its keyframe), the second stays (deduplicated).
    big = torch.randint(-64, 64, (256, 128), generator=base).to(torch.float32) / 16
    big[epoch % 128] += 0.5
    return {
        "model": OrderedDict(
            [
                ("layer.weight", w),
                ("big", big),
                ("layer.bias", torch.arange(64, dtype=torch.float32) * (epoch + 1)),
                ("embed.weight", emb),
                ("norm.weight", half),
                ("tied", w),  # the same tensor twice: stored once
                ("w_row", w[3]),  # a view into it
            ]
        ),
        "optimizer": {
            "state": {0: {"step": torch.tensor(float(epoch)), "exp_avg_sq": moment}},
            "param_groups": [{"lr": 1e-3 / (epoch + 1), "betas": (0.9, 0.999), "params": [0], "name": None}],
        },
        "buffers": {
            "index": torch.arange(100, dtype=torch.int64) * (epoch + 1),
            "mask": torch.arange(77) % (epoch + 2) == 0,
            "bytes": torch.arange(300, dtype=torch.int32).to(torch.uint8),
            "scalar": torch.tensor(epoch, dtype=torch.int16),
        },
        "epoch": epoch,
        "tag": f"epoch-{epoch}",
        "blob": bytes(range(epoch, epoch + 20)),
        "nan": float("inf") if epoch % 2 else -0.0,
        "dtype": torch.bfloat16,
        "size": torch.Size([epoch, 3]),
        "flags": [True, False, None],
    }


def build(root: Path) -> dict[str, Any]:
    os.environ["CKVC_AUTHOR"] = AUTHOR
    repo = ckvc.Repo.init(root, chunk_size=64 << 10, keyframe_interval=4, threads=1)
    g = torch.Generator().manual_seed(7)
    step = iter(range(1, 1000))

    def commit(state: Any, message: str, **kwargs: Any) -> str:
        return repo.commit(state, message, time_ns=BASE_TIME_NS + next(step) * 10**9, **kwargs)

    main = [commit(epoch_state(e, g), f"epoch {e}", metrics={"val_loss": 1.0 / (e + 1)}) for e in range(3)]
    repo.tag("v1", main[1])
    repo.branch("exp", main[1])
    main += [commit(epoch_state(e, g), f"epoch {e}", metrics={"val_loss": 1.0 / (e + 1)}) for e in range(3, 5)]
    repo.tag("v2", main[3], message="release two\n\nannotated")

    repo.checkout("exp")
    exp = [commit(epoch_state(10 + e, g), f"exp {e}", metadata={"note": "fine-tune"}) for e in range(2)]

    repo.switch("main", new_branch="files")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.safetensors"
        safetensors.torch.save_file(
            {"a": torch.arange(2048, dtype=torch.float32), "b": torch.ones(8, 8, dtype=torch.bfloat16)},
            str(path),
            metadata={"format": "pt"},
        )
        path.chmod(0o644)
        file_bytes = path.read_bytes()
        stored, source = read_checkpoint(path)
        files_commit = commit(stored, "a stored file", metadata=source)

    repo.switch("main", new_branch="lossy")
    lossy_commit = commit(epoch_state(20, g), "quantized", lossy={"optimizer.*": "q8"})

    repo.checkout("main")
    released = repo.retain(RetentionPolicy(keep_last=2)).released
    repo.gc(now=True)

    commits: dict[str, Any] = {}
    for branch_commits in (main, exp, [files_commit, lossy_commit]):
        for cid in branch_commits:
            c = repo.read_commit(cid)
            entry: dict[str, Any] = {"message": c.message, "parents": list(c.parents), "pruned": cid in released}
            if cid not in released:
                entry["leaves"] = describe_state(repo.load(cid))
            commits[cid] = entry
    commits[files_commit]["file_blake3"] = blake3.blake3(file_bytes).hexdigest()
    commits[files_commit]["file_name"] = "weights.safetensors"
    report = repo.fsck(level="full")
    assert report.ok and not report.problems, report.problems
    manifest = {
        "ckvc_version": ckvc.__version__,
        "format_version": repo.config.format_version,
        "head": list(repo.head()),
        "branches": repo.branches(),
        "tags": repo.tags(),
        "tag_messages": {"v2": "release two\n\nannotated"},
        "pruned": sorted(released),
        "commits": commits,
    }
    repo.close()
    return manifest


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / TOP
        manifest = build(root)
        with tarfile.open(ARCHIVE, "w:gz", compresslevel=9) as tar:
            tar.add(root, arcname=TOP, filter=lambda info: None if info.name.endswith("lock.mdb") else info)
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"{ARCHIVE.name}: {ARCHIVE.stat().st_size} bytes, {len(manifest['commits'])} commits", file=sys.stderr)


if __name__ == "__main__":
    main()
