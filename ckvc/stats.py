"""Storage reports: logical vs stored bytes, dedup and compression, unique bytes per
commit, and breakdowns by top-level key (model vs optimizer) and by codec."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ckvc.codecs import CODEC_NAMES

if TYPE_CHECKING:
    from ckvc.repo import Repo


@dataclass
class CommitUsage:
    commit: str
    message: str
    logical_bytes: int
    unique_stored_bytes: int  # chunks no other live commit uses: what pruning it would free
    pruned: bool = False


@dataclass
class KeyUsage:
    key: str  # top-level key of the state ("model", "optimizer", ...)
    logical_bytes: int = 0  # over every live commit
    unique_raw_bytes: int = 0  # distinct chunks first seen under this key
    stored_bytes: int = 0  # their stored size


@dataclass
class CodecUsage:
    """Distinct chunks stored with one codec: their plain and stored bytes."""

    chunks: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0


def codec_usage(repo: Repo, chunk_ids: Iterable[bytes]) -> dict[str, CodecUsage]:
    """Stored bytes per codec over distinct chunks, largest first."""
    usage: dict[str, CodecUsage] = {}
    for oid in chunk_ids:
        st = repo.store.stat(oid)
        entry = usage.setdefault(CODEC_NAMES.get(st.codec, str(st.codec)), CodecUsage())
        entry.chunks += 1
        entry.raw_bytes += st.raw_size
        entry.stored_bytes += st.stored_size
    return dict(sorted(usage.items(), key=lambda kv: -kv[1].stored_bytes))


@dataclass
class DiskUsage:
    commits: int = 0
    pruned_commits: int = 0
    logical_bytes: int = 0  # sum of every live (unpruned, reachable) commit's tensor bytes
    unique_raw_bytes: int = 0  # distinct chunks, before compression
    stored_chunk_bytes: int = 0  # distinct chunks as stored (compressed, with record headers)
    pack_bytes: int = 0  # all pack files on disk, reachable or not
    pack_count: int = 0
    per_commit: list[CommitUsage] = field(default_factory=list)
    by_key: list[KeyUsage] = field(default_factory=list)
    by_codec: dict[str, CodecUsage] = field(default_factory=dict)

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
        for name, codec in self.by_codec.items():
            out["by_codec"][name]["ratio"] = codec.ratio
        return out


def disk_usage(repo: Repo) -> DiskUsage:
    usage = DiskUsage()
    pruned = repo.pruned()
    per_commit_chunks: list[tuple[str, str, int, set[bytes]]] = []
    refcount: Counter[bytes] = Counter()
    first_key: dict[bytes, str] = {}
    keys: dict[str, KeyUsage] = {}
    for commit in repo.iter_reachable_commits(repo.ref_tips(include_reflogs=False)):
        if commit.id in pruned:
            usage.pruned_commits += 1
            usage.per_commit.append(CommitUsage(commit.id, commit.message, 0, 0, pruned=True))
            continue
        snapshot = repo.read_snapshot(commit)
        chunks: set[bytes] = set()
        for blob in snapshot.blobs:
            key = blob.path.split(".", 1)[0]
            keys.setdefault(key, KeyUsage(key)).logical_bytes += blob.nbytes
            for oid in blob.chunks:
                chunks.add(oid)
                first_key.setdefault(oid, key)
        logical = sum(blob.nbytes for blob in snapshot.blobs)
        per_commit_chunks.append((commit.id, commit.message, logical, chunks))
        refcount.update(chunks)
        usage.commits += 1
        usage.logical_bytes += logical
    sizes: dict[bytes, int] = {}
    for oid in refcount:
        st = repo.store.stat(oid)
        sizes[oid] = st.stored_size
        usage.unique_raw_bytes += st.raw_size
        usage.stored_chunk_bytes += st.stored_size
        key_usage = keys[first_key[oid]]
        key_usage.unique_raw_bytes += st.raw_size
        key_usage.stored_bytes += st.stored_size
    for cid, message, logical, chunks in per_commit_chunks:
        unique = sum(sizes[o] for o in chunks if refcount[o] == 1)
        usage.per_commit.append(CommitUsage(cid, message, logical, unique))
    usage.by_key = sorted(keys.values(), key=lambda k: -k.stored_bytes)
    usage.by_codec = codec_usage(repo, refcount)
    for name in repo.store.packs():
        usage.pack_count += 1
        info = repo.store.pack_info(name)
        usage.pack_bytes += info.size if info is not None else 0
    return usage
