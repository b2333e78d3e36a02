"""A repository's commit path: a state staged, its blobs written and the commit
finished over one pack writer (ckvc.write), in the caller's thread or on the
repository's background commit thread, where commits land in the order made.
``Repo.commit`` is :meth:`Committer.commit`."""

from __future__ import annotations

import dataclasses
import sys
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING, Any

from ckvc import graph, retention
from ckvc.core import ProgressCallback, Repository, at_exit
from ckvc.errors import CkvcError, InvalidInputError
from ckvc.runs import RUN_KEY, current_run, step_of

# ckvc.write (torch, numpy, the codecs) is imported by the first commit, so that
# opening a Repo for log or status stays light.
if TYPE_CHECKING:
    from ckvc import write
    from ckvc.codecs.policy import DeltaBackoff, LossySpec
    from ckvc.state import PendingBlob
    from ckvc.write import OnConflict


class Committer:
    """The commits of one repository handle: the background commit thread and the
    per-tensor delta backoff are made by the first commit and shared by the
    commits after it."""

    def __init__(self, core: Repository) -> None:
        self.core = core
        self._background: BackgroundCommits | None = None
        self._backoff: DeltaBackoff | None = None

    def commit(
        self, state: Any, message: str = "", metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None, *, merge: Sequence[str] = (), allow_pickle: bool = False,
        retain: bool | None = None, blocking: bool = True, progress: ProgressCallback | None = None,
        lossy: LossySpec = None, time_ns: int | None = None, on_conflict: OnConflict = "fail",
        sign: bool | None = None,
    ) -> str | PendingCommit:  # fmt: skip
        """``Repo.commit``: a commit id, or with ``blocking=False`` a PendingCommit
        once the state's bytes are copied."""
        from ckvc import signing, write

        self.core.require_writable("committing")
        background = self.background()
        if blocking:
            self.wait()  # commits land in the order they were made; raises unseen background errors
        else:
            background.raise_unseen()
        started = time.perf_counter()
        run = current_run(step_of(state))  # the run this commit comes from, for a resume to check
        if run is not None and (metadata is None or RUN_KEY not in metadata):
            metadata = {**(metadata or {}), RUN_KEY: run}
        request = write.CommitRequest.checked(message, metrics, metadata, time_ns=time_ns, sign=sign)
        signing.signer_for(self.core, sign)  # a key that does not load fails before anything is written
        if retain and retention.stored_policy(self.core) is None:
            raise InvalidInputError("retain=True but no retention policy is set (Repo.set_retention)")
        # Async: GPU tensors go to pinned host memory (when CUDA is present).
        staged = write.stage(
            self.core, state, allow_pickle=allow_pickle, pin_memory=not blocking, lossy=lossy, metadata=metadata
        )
        request = dataclasses.replace(request, tree=staged.tree, pickled=staged.pickled)
        args = (request, tuple(merge), lossy, retain, progress, started, on_conflict)
        if not blocking:
            return background.submit_copy(self.write, staged.pending, *args)
        return self.write(staged.pending, *args)

    def write(
        self, pending: list[PendingBlob], request: write.CommitRequest, merge: tuple[str, ...], lossy: LossySpec,
        retain: bool | None, progress: ProgressCallback | None, started: float, on_conflict: OnConflict = "fail",
    ) -> str:  # fmt: skip
        """write_blobs then finish, in one batch. The outcome is exact (docs/GUIDE.md,
        "Errors and exit codes"): an error means the branch did not move; once it
        has moved the commit is reported, a failing follow-up step (a commit
        observer) being a warning."""
        from ckvc import write

        assert self._backoff is not None  # background() made it
        core, outcome, report = self.core, write.Outcome(), write.WriteReport()
        try:
            with write.batch(core) as writer:
                head = write.read_head(core, outcome)
                parents = tuple(dict.fromkeys(graph.resolve(core, r) for r in merge))
                request = dataclasses.replace(request, merge=parents)
                chunks = write.chunk_policy(core, lossy, self._backoff)
                blobs = write.write_blobs(
                    core, pending, parent=head.parent, policy=chunks, writer=writer, report=report, progress=progress
                )
                request = dataclasses.replace(request, lossy=report.lossy)
                return write.finish(
                    core, blobs, request, head=head, writer=writer, outcome=outcome, report=report,
                    started=started, retain=retain, on_conflict=on_conflict,
                )  # fmt: skip
        except BaseException as exc:
            return write.settle(core, outcome, exc)

    def background(self) -> BackgroundCommits:
        """The background commit thread (and the delta backoff), made by the first commit."""
        if self._background is None:
            from ckvc.codecs.policy import DeltaBackoff

            self._background, self._backoff = BackgroundCommits(str(self.core.path)), DeltaBackoff()
        return self._background

    def run_in_background(self, fn: Callable[..., str], pending: Sequence[PendingBlob], *args: Any) -> PendingCommit:
        """``Repo.run_in_background``."""
        background = self.background()
        background.raise_unseen()
        return background.submit_copy(fn, pending, *args)

    def wait(self) -> None:
        """Wait for every pending background commit; raise the first error not yet seen."""
        if self._background is not None:
            self._background.wait()

    def close(self) -> None:
        if self._background is not None:
            self._background.close()


class PendingCommit:
    """A commit being written in the background (``Repo.commit(..., blocking=False)``)."""

    def __init__(self, future: Future[str]) -> None:
        self._future = future
        # A commit to a remote (ckvc.distributed) lands in two stages: this
        # process's part durable on its own disk, then the commit on the remote.
        self.local_stage: Future[None] | None = None

    def done(self) -> bool:
        return self._future.done()

    def local(self, timeout: float | None = None) -> None:
        """Wait until this process's part is durable locally (for a commit to a
        remote: before its upload; otherwise the whole commit). Raises the
        commit's error if it failed before that."""
        if self.local_stage is None:
            self.result(timeout)
        else:
            self.local_stage.result(timeout)

    def result(self, timeout: float | None = None) -> str:
        """The commit id once it is durable and the branch has moved; raises its error."""
        self._future.ckvc_reported = True  # type: ignore[attr-defined]
        return self._future.result(timeout)


class BackgroundCommits:
    """One repository's commits written in the background: on one thread, so they
    land in order, each moving the branch from the last. ``label`` names the
    repository in the message at exit."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._thread: ThreadPoolExecutor | None = None
        self.pending: list[Future[str]] = []
        from ckvc.write import StagingBuffers

        self.staging = StagingBuffers()

    def submit(self, fn: Callable[..., str], *args: Any) -> PendingCommit:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckvc-commit")
            _WITH_BACKGROUND.add(self)
        future = self._thread.submit(fn, *args)
        self.pending.append(future)
        return PendingCommit(future)

    def submit_copy(self, fn: Callable[..., str], pending: Sequence[PendingBlob], *args: Any) -> PendingCommit:
        """``fn(private copies of pending, *args)`` in the background; the copies'
        memory is reused by a later commit once this one has landed."""
        blobs, buffer = self.staging.owned(pending)
        handle = self.submit(fn, blobs, *args)
        if buffer is not None:
            staging = self.staging

            def give_back(future: Future[str]) -> None:
                if not future.cancelled() and future.exception() is None:
                    staging.give(buffer)

            handle._future.add_done_callback(give_back)
        return handle

    def wait(self) -> None:
        """Wait for every pending commit; raise the first error not yet seen."""
        futures_wait(self.pending)
        self.raise_unseen()

    def raise_unseen(self) -> None:
        """Drop finished commits; raise the first failure nobody has seen."""
        still, error = [], None
        for future in self.pending:
            if not future.done():
                still.append(future)
            elif future.exception() is not None and not getattr(future, "ckvc_reported", False):
                future.ckvc_reported = True  # type: ignore[attr-defined]
                error = error or future.exception()
        self.pending = still
        if error is not None:
            raise error

    def close(self) -> None:
        """Finish pending commits (raising the first unseen error), then stop the thread."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=True)
                self._thread = None
            self.staging.clear()
            _WITH_BACKGROUND.discard(self)


# Repositories with background commits: finished (or their failure reported) at
# exit, never silently dropped.
_WITH_BACKGROUND: weakref.WeakSet[BackgroundCommits] = weakref.WeakSet()


def _finish_background_commits() -> int | None:
    """Wait for background commits; if one failed and nobody saw its error, say so
    and return a non-zero status (the error's exit code), so a script whose last
    checkpoint was lost does not exit 0."""
    failed: BaseException | None = None
    for commits in list(_WITH_BACKGROUND):
        for future in commits.pending:
            try:
                future.result()
            except BaseException as exc:
                if getattr(future, "ckvc_reported", False):
                    continue  # its caller already got this error
                print(f"ckvc: a background commit in {commits.label} failed: {exc}", file=sys.stderr)
                failed = failed or exc
    if failed is None:
        return None
    return failed.exit_code if isinstance(failed, CkvcError) else 1


at_exit("background commits", _finish_background_commits)
