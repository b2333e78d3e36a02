"""A commit whose parts several processes wrote, published on a remote: the
bucket side of a multi-node commit (ckvc.distributed with ``remote=``; docs/DESIGN.md,
"Training across machines").

Each node's repository is a (lazy) clone of the remote, its fast tier. A rank
writes its chunks into its node's packs, then :func:`upload_part` sends what the
remote lacks of them. Once every rank has, the coordinator's :func:`publish`
uploads the snapshot and commit and moves the remote's branch by compare-and-swap,
last: the branch never names anything that is not there. Then each node's
:func:`record` writes the same snapshot and commit locally (every rank knows
every part, so nothing is downloaded) and moves the remote-tracking ref and the
local branch.

Every step that touches the remote runs under the remote's writer pin (as push
does): a remote gc deletes nothing an upload counted on, and packs of a commit
that never landed are unreferenced, for ``gc --remote`` after its grace period.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from ckvc import signing, write
from ckvc.core import Repository
from ckvc.errors import CkvcError, CkvcWarning, RefConflictError
from ckvc.graph import is_ancestor
from ckvc.objects import Blob
from ckvc.refs import BRANCH_PREFIX
from ckvc.remote.common import TransferStats, move_tracking, remotes_of, tracking_ref
from ckvc.remote.location import RemoteSpec
from ckvc.remote.push import upload_objects
from ckvc.remote.repository import Remote, open_remote, refresh_catalog
from ckvc.storage.object_writer import ObjectWriter


def open_for_commit(local: Repository, remote: str, *, create: bool) -> Remote:
    """The remote ``remote`` of ``local``, its catalog fresh; ``create``: make the
    remote repository if there is none (the coordinator's first commit)."""
    spec = remotes_of(local).get(remote)
    return open_remote(local, spec, create_from=local.config if create else None)


class _KeptOpen:
    """Remotes kept open between one repository's commits to them (opening one
    costs a client, the config's GET and the catalog's LMDB: DESIGN, "Training
    across machines"); an attachment of the repository, closed with it."""

    def __init__(self) -> None:
        self.handles: dict[RemoteSpec, Remote] = {}
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            handles, self.handles = list(self.handles.values()), {}
        for handle in handles:
            handle.close()


@contextlib.contextmanager
def kept_open_for_commit(local: Repository, remote: str, *, create: bool) -> Iterator[Remote]:
    """:func:`open_for_commit`, the handle kept open on ``local`` for the next
    commit to ``remote``; a kept one has its catalog refreshed (other writers'
    packs) instead. A commit that fails with it closes it: the next one opens
    afresh."""
    spec = remotes_of(local).get(remote)
    kept = local.attachments.setdefault("kept-remotes", _KeptOpen())
    assert isinstance(kept, _KeptOpen)
    with kept.lock:
        handle = kept.handles.pop(spec, None)
    if handle is not None:
        try:
            refresh_catalog(handle.core.store, handle.damaged)
        except BaseException:
            handle.close()
            raise
    else:
        handle = open_for_commit(local, remote, create=create)
    try:
        yield handle
    except BaseException:
        handle.close()
        raise
    with kept.lock:
        previous = kept.handles.get(spec)  # another thread's, kept meanwhile
        kept.handles[spec] = handle
    if previous is not None:
        previous.close()


def upload_part(local: Repository, handle: Remote, blobs: Sequence[Blob]) -> TransferStats:
    """Send what the remote lacks of one rank's chunks (and their delta bases)."""
    return upload_objects(local, handle, chunks=[chunk for blob in blobs for chunk in blob.chunks])


@dataclass(frozen=True)
class StepCommit:
    """One commit of several ranks' parts, as every rank knows it: the parts'
    blobs, the request, the parent and the branch it moves."""

    blobs: Sequence[Blob]
    request: write.CommitRequest
    parent: str | None
    ref: str

    def write_to(self, writer: ObjectWriter) -> tuple[bytes, str]:
        """Its snapshot and commit written (and made durable) through ``writer``: (snapshot id, commit id)."""
        snapshot_id, commit_id = write.put_commit(writer, self.blobs, self.request, self.parent)
        writer.commit()
        return snapshot_id, commit_id


def publish(
    local: Repository, handle: Remote, writer: ObjectWriter, step: StepCommit, on_conflict: write.OnConflict = "fail"
) -> tuple[StepCommit, str]:
    """The coordinator's step once every part is on the remote: the snapshot and
    commit written locally and uploaded, then ``ref`` on the remote moved from
    the step's parent by compare-and-swap. Another writer moved it meanwhile:
    RefConflictError (nothing is committed) or, with ``on_conflict="retry"`` and
    a forward move, the commit goes on top of theirs. Returns the step as it
    landed (its parent the one it went on top of) and the commit's id."""
    signer = signing.signer_for(local, step.request.sign)
    for attempt in range(write.MAX_RETRIES_ON_CONFLICT + 1):
        snapshot_id, commit_id = step.write_to(writer)
        upload_objects(local, handle, metadata=[[snapshot_id, bytes.fromhex(commit_id)]])
        if signer is not None:  # here and on the remote, before the remote's branch names the commit
            signature = signing.sign(local, commit_id, "commit", signer)
            signing.SignatureStore(handle.backend).add(signature)
        # a pin whose lease lapsed no longer holds a remote gc off what the ref will name
        handle.backend.check_locks_held()
        message = write.commit_reflog_message(step.request)
        if attempt:
            message += f" (on top of {step.parent and step.parent[:12]}, committed meanwhile)"
        try:
            handle.core.refs.set_if_equals(step.ref, step.parent, commit_id, message)
            return step, commit_id
        except RefConflictError:
            theirs = handle.core.refs.read(step.ref)
            handle.core.store.refresh()  # their commit's pack, for the ancestry walk
            forward = theirs is not None and (step.parent is None or is_ancestor(handle.core, step.parent, theirs))
            if on_conflict != "retry" or not forward or attempt == write.MAX_RETRIES_ON_CONFLICT:
                raise write.moved_meanwhile(write.Head(step.ref, step.parent), theirs, forward, on_conflict) from None
            step = replace(step, parent=theirs)
    raise AssertionError("unreachable")


def landed_on_remote(handle: Remote, ref: str, commit_id: str) -> bool:
    """Whether the remote's ``ref`` names ``commit_id`` now (a lost coordinator's
    outcome, read from the remote)."""
    try:
        return handle.core.refs.read(ref) == commit_id
    except (CkvcError, OSError):
        return False


def record(local: Repository, remote: str, writer: ObjectWriter, step: StepCommit) -> str:
    """A commit that landed on ``remote``, made known to this node: its snapshot
    and commit written here (from the parts every rank was sent), the
    remote-tracking ref moved, and the local branch fast-forwarded when it was at
    the step's parent or behind it (else left, with a warning). The commit observers
    run (stats, retention, the cache; auto_push finds the remote up to date).
    Several ranks of one node may record the same commit (when its first rank
    was lost): the refs they find already moved to it are done."""
    _, commit_id = step.write_to(writer)
    if signing.TrustSettings.load(local).require_signatures:  # the coordinator's signature, for reads here
        handle = open_for_commit(local, remote, create=False)
        try:
            signing.copy_signatures(
                signing.SignatureStore(handle.backend), signing.signatures_of(local), commit_id.__eq__, only=commit_id
            )
        finally:
            handle.close()
    ref, parent = step.ref, step.parent
    branch = ref[len(BRANCH_PREFIX) :]
    try:
        move_tracking(local, remote, branch, commit_id, "commit")
    except RefConflictError:
        if local.refs.read(tracking_ref(remote, branch)) != commit_id:
            raise  # another rank of this node recorded the same commit: done; anything else is not
    current = local.refs.read(ref)
    if current == commit_id:
        return commit_id
    if current is None or current == parent or (parent is not None and is_ancestor(local, current, parent)):
        try:
            local.refs.set_if_equals(ref, current, commit_id, write.commit_reflog_message(step.request))
        except RefConflictError:
            if local.refs.read(ref) == commit_id:
                return commit_id
            raise
        write.announce(local, write.Committed(commit_id, write.Head(ref, current)))
    else:
        warnings.warn(
            CkvcWarning(
                f"commit {commit_id[:12]} landed on {remote}/{branch}; the local branch {branch} "
                f"({current[:12]}) has commits the remote lacks and was left where it is"
            ),
            stacklevel=2,
        )
    return commit_id
