"""Locks on a store without OS locks: lease objects (docs/DESIGN.md, "Backends:
local mechanisms on an object store", and "Object-store client").

A holder of lock NAME writes ``locks/NAME/<uuid>`` holding (holder, shared or
exclusive, expiry) with a conditional create, renews it by compare-and-swap every
third of its term, and deletes it on release. Taking the lock is write, then
list: a shared taker that sees an unexpired exclusive lease withdraws its own and
waits; an exclusive taker that sees another exclusive lease withdraws and waits,
and one that sees only shared leases keeps its own (the intent: no new pin gets
in) and waits for them to go. Of two takers, the later one's listing sees the
earlier one's lease (the store lists what was written before: S3, GCS and Azure
list strongly), so two conflicting holders never both proceed; two exclusive
takers that see each other both withdraw and retry after a random pause.

An expired lease is a dead holder's: anyone may delete it. Expiry compares the
holder's clock with the reader's, so the term must exceed the clock skew.
Written against the Backend interface only (conditional writes, list, get,
delete), so any backend with ``conditional_put`` can use it. A transient store
error while taking the lock is another look at it, until the deadline (a create
whose answer was lost finds its own unique key); one while releasing leaves the
lease to expire.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckvc.errors import CkvcWarning, ObjectNotFoundError, RefConflictError, RepositoryLockedError
from ckvc.storage.backend import BackendError

if TYPE_CHECKING:
    from ckvc.storage.backend import Backend, Version

LEASE_FOLDER = "locks"
FIRST_POLL = 0.02  # seconds between looks at a held lock, growing to MAX_POLL
MAX_POLL = 1.0
# Taking a lock waits for its holders up to the caller's timeout (120 s for a
# writer's pin), but not for a store that does not answer: transient failures with
# no answer in between for this long end the wait (the retries of every other call).
UNREACHABLE_S = 10.0
# Deleting a lease on release: tries, and the pause before each retry (times the try).
RELEASE_TRIES = 4
RELEASE_PAUSE_S = 0.2


@dataclass(frozen=True)
class Lease:
    key: str
    shared: bool
    expires: float  # seconds since the epoch, by the holder's clock


def lease_bytes(holder: str, shared: bool, expires: float) -> bytes:
    body = {"expires": round(expires, 3), "holder": holder, "pid": os.getpid(), "shared": shared}
    return json.dumps({**body, "host": socket.gethostname()}, sort_keys=True).encode()


class LeaseLocks:
    """``hold(name)`` on ``backend`` with leases of ``term`` seconds. ``clock`` (the
    wall clock leases' expiry is stamped and compared in) and ``monotonic`` (the clock
    of deadlines and of how long a held lease surely stands) are injectable for tests."""

    def __init__(
        self,
        backend: Backend,
        *,
        term: float = 60.0,
        folder: str = LEASE_FOLDER,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.term = term
        self.folder = folder
        self.clock = clock
        self.monotonic = monotonic
        self._held: dict[str, _Renewer] = {}  # lease key -> its renewer, while its block runs
        self._held_lock = threading.Lock()

    def check_held(self) -> None:
        """RepositoryLockedError if a lease this process holds here may have
        lapsed: its renewals failed for long enough that another process may
        have deleted it as expired and taken the lock. A holder calls this just
        before a step that cannot be undone (a remote ref move, retiring packs)."""
        with self._held_lock:
            held = list(self._held.items())
        now = self.monotonic()
        for key, renewer in held:
            if renewer.lost or now > renewer.valid_until:
                name = key[len(self.folder) + 1 :].rsplit("/", 1)[0]
                raise RepositoryLockedError(
                    f"the lease on {name} lapsed while held (its renewals failed): "
                    "stopped before changing anything more"
                )

    def renew_held(self) -> None:
        """Renew every lease this process holds here now, as each one's thread does every
        third of its term (a failed renewal is left to the next one, as there)."""
        with self._held_lock:
            held = list(self._held.values())
        for renewer in held:
            renewer.renew()

    def leases(self, name: str) -> list[Lease]:
        """The unexpired leases of ``name``; expired ones are deleted on the way."""
        now = self.clock()
        found: list[Lease] = []
        for key in list(self.backend.list(f"{self.folder}/{name}/")):
            data = self.backend.get(key)
            if data is None:  # released meanwhile
                continue
            try:
                body = json.loads(data)
                lease = Lease(key, bool(body["shared"]), float(body["expires"]))
            except (ValueError, KeyError, TypeError):
                info = self.backend.stat(key)  # unreadable: an exclusive lease, aged by the store's clock
                lease = Lease(key, False, (info.mtime if info else now) + self.term)
            if lease.expires < now:
                self.backend.delete(key)
            else:
                found.append(lease)
        return found

    @contextlib.contextmanager
    def hold(self, name: str, *, shared: bool = False, timeout: float = 30.0) -> Iterator[None]:
        holder = uuid.uuid4().hex
        key = f"{self.folder}/{name}/{holder}"
        deadline = self.monotonic() + timeout
        poll = FIRST_POLL
        renewer: _Renewer | None = None
        failing_since: float | None = None  # transient failures since then, no answer between
        try:
            while True:
                try:
                    if renewer is None:
                        renewer = _Renewer(self, key, holder, shared)
                    others = [lease for lease in self.leases(name) if lease.key != key]
                    failing_since = None
                    exclusive = [lease for lease in others if not lease.shared]
                    if not others or (shared and not exclusive):
                        break
                    if exclusive:  # someone else holds or wants it exclusively: withdraw
                        renewer.stop(delete=True)
                        renewer = None
                except BackendError as exc:  # a store hiccup: look again, until the deadline
                    now = self.monotonic()
                    failing_since = now if failing_since is None else failing_since
                    if not exc.transient or now + poll > deadline or now - failing_since >= UNREACHABLE_S:
                        raise
                if self.monotonic() + poll > deadline:
                    waited = f" (waited {timeout:.0f} s)" if timeout else ""
                    left = max(0.0, min(lease.expires for lease in others) - self.clock())
                    raise RepositoryLockedError(
                        f"{name} is locked by another process{waited}; its lease runs out in {left:.0f} s "
                        "unless renewed (a holder cut off from the store cannot release it)"
                    )
                time.sleep(poll * random.uniform(0.5, 1.5))
                poll = min(poll * 1.5, MAX_POLL)
        except BaseException:
            if renewer is not None:
                renewer.stop(delete=True)
            raise
        with self._held_lock:
            self._held[key] = renewer
        try:
            yield
        finally:
            with self._held_lock:
                self._held.pop(key, None)
            lost = renewer.stop(delete=True)
            if lost:
                warnings.warn(
                    f"the lease on {name} expired while held (renewals failed): another holder may have run",
                    CkvcWarning,
                    stacklevel=3,
                )


class _Renewer:
    """Creates a lease and renews it every third of its term until stopped."""

    def __init__(self, locks: LeaseLocks, key: str, holder: str, shared: bool) -> None:
        self.locks, self.key, self.holder, self.shared = locks, key, holder, shared
        written = locks.monotonic()
        try:
            self.version: Version = locks.backend.compare_and_swap(key, None, self._bytes())
        except RefConflictError:  # ours (the key is unique): an earlier try landed and its answer was lost
            found = locks.backend.get_versioned(key)
            if found is None:
                raise BackendError(f"lease {key} vanished while being created", key=key, transient=True) from None
            self.version = locks.backend.compare_and_swap(key, found[1], self._bytes())
        self.lost = False
        self._renewing = threading.Lock()  # the thread's renewals and renew_held's, one at a time
        self.valid_until = self._valid_from(written)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ckvc-lease {key}", daemon=True)
        self._thread.start()

    def _bytes(self) -> bytes:
        return lease_bytes(self.holder, self.shared, self.locks.clock() + self.locks.term)

    def _valid_from(self, written: float) -> float:
        """Until when (monotonic) a lease written at ``written`` surely stands: its
        term, less a sixth for the clock skew between holder and readers (the
        term must exceed it) and the time the write took to land."""
        return written + self.locks.term * 5 / 6

    def _run(self) -> None:
        while not self._stop.wait(self.locks.term / 3):
            if not self.renew():
                return

    def renew(self) -> bool:
        """One renewal (the thread's, every third of the term); False once the lease is lost."""
        with self._renewing:
            if self.lost:
                return False
            written = self.locks.monotonic()
            try:
                self.version = self.locks.backend.compare_and_swap(self.key, self.version, self._bytes())
                self.valid_until = self._valid_from(written)
            except (RefConflictError, ObjectNotFoundError):  # deleted as expired: the lease is gone
                self.lost = True
            except Exception:  # a failed renewal is retried at the next tick; expiry is the bound
                pass
            return not self.lost

    def stop(self, *, delete: bool) -> bool:
        """Stop renewing (and delete the lease); whether it was lost while held."""
        self._stop.set()
        self._thread.join()
        if delete and not self.lost:
            # A transient failure is tried again: a lease left behind blocks the next
            # taker for a whole term. Past the tries it is left; it expires within its term.
            for attempt in range(1, RELEASE_TRIES + 1):
                try:
                    self.locks.backend.delete(self.key)
                    break
                except BackendError as exc:
                    if not exc.transient:
                        raise
                    if attempt < RELEASE_TRIES:
                        time.sleep(RELEASE_PAUSE_S * attempt)
        return self.lost
