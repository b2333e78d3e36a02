"""What push, fetch, pull and clone share: their results, remote-tracking refs,
ancestry, and the rule they keep (docs/DESIGN.md, "Remotes"; FORMAT 18.2).

Both directions keep one invariant on the receiving side, which is what lets a
walk stop early and an interrupted transfer resume by sending only what is
missing: *an object there means everything it needs is there*. A delta's base
is published before the delta (packs in waves by chain depth, or one pack),
chunks before the snapshots naming them, snapshots before commits, commits
before tag objects; and a ref moves (compare-and-swap) only after all of it.
A transfer killed at any instant leaves whole packs of whole records and no
ref naming anything incomplete.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ckvc.core import Repository
from ckvc.inspect import fields_json
from ckvc.refs import check_ref_name
from ckvc.remote.location import RemoteList, check_remote_name
from ckvc.remote.repository import Remote, drop_catalog
from ckvc.storage.backend import Backend
from ckvc.storage.packs import FOOTER, PACK_HEADER, TOC_ENTRY, TOC_HEADER

REMOTES_PREFIX = "refs/remotes/"
# done bytes, total bytes (of stored records)
Progress = Callable[[int, int], None]


def pack_framing(records: int) -> int:
    """Bytes a pack of ``records`` records adds around them: header, TOC and footer."""
    return PACK_HEADER.size + TOC_HEADER.size + records * TOC_ENTRY.size + FOOTER.size


def toc_copy_size(records: int) -> int:
    """Bytes of the TOC copy a push writes beside a pack of ``records`` records."""
    return TOC_HEADER.size + records * TOC_ENTRY.size + FOOTER.size


def remotes_of(core: Repository) -> RemoteList:
    """The remotes configured in ``core`` (``repo.remotes``); removing one also
    deletes its remote-tracking refs and its catalog."""

    def forget(name: str) -> None:
        for ref, value in core.refs.list_refs(f"{REMOTES_PREFIX}{name}/").items():
            core.refs.delete_if_equals(ref, value, f"remote remove {name}")
        drop_catalog(core, name)

    return RemoteList(core.refs.backend, core.path, on_remove=forget)


def tracking_ref(remote: str, branch: str) -> str:
    """``refs/remotes/<remote>/<branch>``, the local copy of a remote branch."""
    return check_ref_name(f"{REMOTES_PREFIX}{check_remote_name(remote)}/{branch}")


def remote_branches(core: Repository) -> dict[str, str]:
    """Remote-tracking branches: "origin/main" -> commit id."""
    return {k[len(REMOTES_PREFIX) :]: v for k, v in core.refs.list_refs(REMOTES_PREFIX).items()}


@dataclass(frozen=True)
class RefUpdate:
    ref: str
    old: str | None
    new: str
    forced: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"ref": self.ref, "old": self.old, "new": self.new, "forced": self.forced}


@dataclass
class TransferStats:
    """What moved: records, their stored bytes, the bytes on the wire (records plus
    pack framing for a push; the records read for a fetch), packs written,
    backend requests, seconds."""

    objects: int = 0
    record_bytes: int = 0
    wire_bytes: int = 0
    packs: int = 0
    requests: int = 0
    seconds: float = 0.0

    def to_json(self, wire_key: str) -> dict[str, Any]:
        """The figures of a push (``wire_key`` "bytes_sent") or fetch ("bytes_received")."""
        return {
            "objects": self.objects,
            "record_bytes": self.record_bytes,
            wire_key: self.wire_bytes,
            "packs": self.packs,
            "requests": self.requests,
            "seconds": self.seconds,
        }


@dataclass
class TransferResult:
    """A push's or fetch's outcome: the remote, the refs moved, what moved."""

    remote: str
    url: str
    updated: list[RefUpdate] = field(default_factory=list)
    stats: TransferStats = field(default_factory=TransferStats)
    wire_key: ClassVar[str]

    def _refs_json(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        return {
            "remote": self.remote,
            "url": self.url,
            "updated": [u.to_json() for u in self.updated],
            **self._refs_json(),
            **self.stats.to_json(self.wire_key),
        }


@dataclass
class PushResult(TransferResult):
    up_to_date: list[str] = field(default_factory=list)
    wire_key: ClassVar[str] = "bytes_sent"

    @property
    def bytes_sent(self) -> int:
        return self.stats.wire_bytes

    def _refs_json(self) -> dict[str, Any]:
        return {"up_to_date": self.up_to_date}


@dataclass
class FetchResult(TransferResult):
    tags: list[RefUpdate] = field(default_factory=list)
    wire_key: ClassVar[str] = "bytes_received"

    @property
    def bytes_received(self) -> int:
        return self.stats.wire_bytes

    def _refs_json(self) -> dict[str, Any]:
        return {"tags": [u.to_json() for u in self.tags]}


@contextlib.contextmanager
def counted(handle: Remote, stats: TransferStats, started: float) -> Iterator[None]:
    """Close ``handle`` at the end of a transfer, its requests and the seconds
    since ``started`` counted in ``stats``."""
    try:
        yield
    finally:
        stats.requests = handle.backend.requests
        handle.close()
    stats.seconds = time.monotonic() - started


@dataclass
class PullResult:
    fetch: FetchResult
    branch: str
    old: str | None
    new: str | None
    fast_forward: bool

    def to_json(self) -> dict[str, Any]:
        return {**self.fetch.to_json(), **fields_json(self, skip=("fetch",))}


# ---- history questions -----------------------------------------------------------


def move_tracking(local: Repository, remote: str, branch: str, new: str, action: str) -> RefUpdate | None:
    ref = tracking_ref(remote, branch)
    old = local.refs.read(ref)
    if old == new:
        return None
    local.refs.set_if_equals(ref, old, new, f"{action}: {remote}/{branch}")
    return RefUpdate(ref, old, new)


def copy_sidecars(source: Backend, target: Backend, wanted: Callable[[str], bool]) -> None:
    """The signatures and notes (ckvc.sidecars) ``source`` holds and ``target`` lacks, for
    the objects ``wanted`` accepts: push sends them before it moves a ref, fetch takes
    them before it moves one, so a ref never names a commit whose records lag."""
    from ckvc import notes, sidecars, signing

    notes.copy_notes(source, target, wanted)
    noted: set[str] | None = None

    def signed(oid: str) -> bool:  # an object there, or a note there (a note's signature names its id)
        nonlocal noted
        if wanted(oid):
            return True
        if noted is None:
            listing = sidecars.by_object(target, notes.NOTES).values()
            noted = {key.rpartition("/")[2].removesuffix(sidecars.SUFFIX) for keys in listing for key in keys}
        return oid in noted

    signing.copy_signatures(signing.SignatureStore(source), signing.SignatureStore(target), signed)
