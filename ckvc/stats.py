"""Storage reports: logical vs stored bytes, dedup and compression, unique bytes per commit."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ckvc.storage.packs import list_packs

if TYPE_CHECKING:
    from ckvc.repo import Repo


@dataclass
class CommitUsage:
    commit: str
    message: str
    logical_bytes: int
    unique_stored_bytes: int  # chunks no other reachable commit uses: what dropping it frees


@dataclass
class DiskUsage:
    commits: int = 0
    logical_bytes: int = 0  # sum of every reachable commit's tensor bytes
    unique_raw_bytes: int = 0  # distinct chunks, before compression
    stored_chunk_bytes: int = 0  # distinct chunks as stored (compressed, with record headers)
    pack_bytes: int = 0  # all pack files on disk, reachable or not
    pack_count: int = 0
    per_commit: list[CommitUsage] = field(default_factory=list)

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.unique_raw_bytes if self.unique_raw_bytes else 1.0

    @property
    def compression_ratio(self) -> float:
        return self.unique_raw_bytes / self.stored_chunk_bytes if self.stored_chunk_bytes else 1.0

    @property
    def total_ratio(self) -> float:
        return self.logical_bytes / self.pack_bytes if self.pack_bytes else 1.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(dedup_ratio=self.dedup_ratio, compression_ratio=self.compression_ratio, total_ratio=self.total_ratio)
        return out


def disk_usage(repo: Repo) -> DiskUsage:
    usage = DiskUsage()
    per_commit_chunks: list[tuple[str, str, int, set[bytes]]] = []
    refcount: Counter[bytes] = Counter()
    chunk_sizes: dict[bytes, tuple[int, int]] = {}
    for commit in repo.iter_reachable_commits(repo.ref_tips(include_reflogs=False)):
        snapshot = repo.read_snapshot(commit)
        chunks = {oid for blob in snapshot.blobs for oid in blob.chunks}
        logical = sum(blob.nbytes for blob in snapshot.blobs)
        per_commit_chunks.append((commit.id, commit.message, logical, chunks))
        refcount.update(chunks)
        usage.commits += 1
        usage.logical_bytes += logical
    for oid in refcount:
        st = repo.store.stat(oid)
        chunk_sizes[oid] = (st.raw_size, st.stored_size)
        usage.unique_raw_bytes += st.raw_size
        usage.stored_chunk_bytes += st.stored_size
    for cid, message, logical, chunks in per_commit_chunks:
        unique = sum(chunk_sizes[o][1] for o in chunks if refcount[o] == 1)
        usage.per_commit.append(CommitUsage(cid, message, logical, unique))
    for name in list_packs(repo.store.pack_dir):
        usage.pack_count += 1
        usage.pack_bytes += (repo.store.pack_dir / name).stat().st_size
    return usage
