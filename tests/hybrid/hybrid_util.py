"""What the hybrid tests share: a small training-like history, the closure of a
commit's chunks (with the delta bases they decode through) and its stored size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import ckvc
from ckvc.ids import ObjectType
from ckvc.remote.repository import Remote, open_remote

CHUNK = 64 << 10


def train_state(step: int, branch: int = 0) -> dict[str, Any]:
    """A model that drifts a little per step (deltas against keyframes), an optimizer
    moment that changes more, and the counters a resume needs."""
    g = torch.Generator().manual_seed(1000 * branch)
    w = torch.randn(128, 256, generator=g) + 0.001 * step
    m = torch.randn(128, 256, generator=torch.Generator().manual_seed(step + 1000 * branch))
    return {"model": {"w": w, "b": torch.full((512,), float(step))}, "optimizer": {"m": m}, "epoch": step}


def make_history(repo: ckvc.Repo, n: int = 10) -> list[str]:
    return [repo.commit(train_state(i), message=f"epoch {i}", metrics={"loss": 1 / (i + 1)}) for i in range(n)]


def remote_of(repo: ckvc.Repo, name: str = "origin") -> Remote:
    return open_remote(repo.core, repo.remotes.get(name))


def metadata_bytes(remote: Remote) -> int:
    """Stored bytes of the remote's commits, snapshots and tags."""
    return sum(e.record_size for _, e in remote.core.store.index.iter_entries() if e.kind != ObjectType.CHUNK)


def chunk_closure(repo: ckvc.Repo, rev: str, paths: list[str] | None = None) -> set[bytes]:
    """The chunks ``rev`` (or only its tensors ``paths``) needs, delta bases included, read
    from the source repository that holds everything."""
    commit = repo.read_commit(repo.resolve(rev))
    out: set[bytes] = set()
    for blob in repo.read_snapshot(commit).blobs:
        if paths is not None and blob.path not in paths:
            continue
        for chunk in blob.chunks:
            below: bytes | None = chunk
            while below is not None and below not in out:
                out.add(below)
                below = repo.store.delta_base(below)
    return out


def stored(remote: Remote, oids: set[bytes]) -> int:
    return sum(remote.core.store.locate(oid).record_size for oid in oids)


def local_chunk_bytes(repo: ckvc.Repo) -> int:
    return sum(e.record_size for _, e in repo.store.index.iter_entries() if e.kind == ObjectType.CHUNK)


def pack_bytes(repo: ckvc.Repo) -> int:
    total = 0
    for name in repo.store.packs():
        info = repo.store.pack_info(name)
        total += 0 if info is None else info.size
    return total


def source_repo(tmp_path: Path, name: str = "src") -> ckvc.Repo:
    return ckvc.Repo.init(tmp_path / name, chunk_size=CHUNK)
