"""Retry of transient backend failures, as a wrapper around any Backend.

``RetryingBackend(inner, policy)`` repeats an operation that failed with a
transient ``BackendError`` (timeouts, throttling, 5xx, connection resets, bodies
cut short), after a pause that grows exponentially with full jitter, until it
succeeds, the attempts are spent, or the time is; a permanent error (403, a
missing bucket, a bad key) and every other exception leave at once, untouched.

Repeating is only safe for what is idempotent. Reads, listings, ``put`` (a whole
replacement) and ``delete`` are. The conditional writes are not, and a transient
error does not say whether the request landed (the answer may be what was lost):

- ``compare_and_swap``: the key is read back; holding our bytes, the swap landed
  (its version is returned); holding the expected version, it did not (try
  again); anything else is another writer's: RefConflictError, as if the swap
  had lost the race (it did, or it won and was overwritten at once).
- ``put_if_absent``: a repeat that finds the key reads it; our bytes there mean
  the first try created it (True), anything else someone else did (False).
- A sink's ``publish``: while the sink is small (``replay_limit``) its bytes are
  kept, and a failed publish becomes a retried ``put``; past that the parts have
  streamed out, so a failed publish checks whether the key now exists at the
  sink's size (the completion landed) and otherwise fails. The object store
  retries the parts of a large upload itself, where the part still is.

Nothing here is retried: ``append`` (not idempotent; object stores have none),
``rename``, ``lock`` (a lease is its own protocol), ``prefetch`` (a hint).
"""

from __future__ import annotations

import builtins
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ckvc.errors import RefConflictError
from ckvc.ids import Buffer
from ckvc.storage.backend import STREAM_PIECE, Backend, BackendError, ForwardingBackend, KeyInfo, Sink, Version

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try. The pause before retry n (1, 2, ...) is uniform in
    [0, min(max_delay, first_delay * multiplier ** (n - 1))] ("full jitter": many
    clients throttled at once spread out); no retry starts once ``total_seconds``
    have passed since the first try, or after ``attempts`` tries in all.

    Defaults: 6 tries over at most 60 s, pauses capped at 10 s (about 0.2, 0.4,
    0.8, 1.6, 3.2 s at most before each retry): long enough for S3's SlowDown and a
    dropped connection, short enough that a dead endpoint fails within a minute."""

    attempts: int = 6
    first_delay: float = 0.2
    multiplier: float = 2.0
    max_delay: float = 10.0
    total_seconds: float = 60.0

    def delay(self, retry: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.max_delay, self.first_delay * self.multiplier ** (retry - 1)))


class RetryingBackend(ForwardingBackend):
    """``inner`` with transient failures retried under ``policy``. ``sleep``,
    ``clock`` and ``rng`` are injectable for tests; ``retries`` counts the
    repeats made (all operations together)."""

    def __init__(
        self,
        inner: Backend,
        policy: RetryPolicy | None = None,
        *,
        replay_limit: int = 8 << 20,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(inner)
        self.policy = policy or RetryPolicy()
        self.replay_limit = replay_limit
        self.sleep, self.clock = sleep, clock
        self.rng = rng or random.Random()
        self.retries = 0

    def retry(self, op: Callable[[], T], *, recover: Callable[[], T | None] | None = None) -> T:
        """``op()`` until it succeeds or the policy gives up. ``recover``: what to
        run instead of ``op`` after a transient failure (a non-idempotent operation
        finds out whether it landed); it returns the result, or None to run ``op``
        again. ``op`` itself may return None (a read into a buffer)."""
        start = self.clock()
        tries = 0
        step: Callable[[], T | None] = op
        while True:
            tries += 1
            try:
                result = step()
                if result is not None or step is op:
                    return result  # type: ignore[return-value]  # op's own result, None included
                step = op  # recover found nothing landed: the op itself again, now
                continue
            except BackendError as exc:
                self._pause_or_raise(exc, tries, start)
                step = op if recover is None else recover

    def _pause_or_raise(self, exc: BackendError, tries: int, start: float) -> None:
        """After the ``tries``-th failure of an operation begun at ``start``: sleep
        before the next try, or raise (a permanent error, or the policy spent)."""
        if not exc.transient:
            raise exc
        pause = self.policy.delay(tries, self.rng)
        if tries >= self.policy.attempts or self.clock() - start + pause > self.policy.total_seconds:
            failure = exc.failure or str(exc)
            raise BackendError(f"{failure} (gave up after {tries} tries)", key=exc.key, transient=True) from exc
        self.retries += 1
        self.sleep(pause)

    # ---- idempotent: retried as they are -------------------------------------------
    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self.retry(lambda: self.inner.read_into(key, offset, out))

    def readv_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.retry(lambda: self.inner.readv_into(key, offset, buffers))

    def size(self, key: str) -> int:
        return self.retry(lambda: self.inner.size(key))

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[int, memoryview]]:
        return iter(self.retry(lambda: builtins.list(self.inner.read_ranges(key, ranges))))

    def read_stream(self, key: str, offset: int, size: int, piece: int = STREAM_PIECE) -> Iterator[memoryview]:
        """A stream cut by a transient failure goes on from the byte it stopped at
        (a new request for the rest), so a long read is never started over."""
        done, tries, start = 0, 0, self.clock()
        while True:
            tries += 1
            try:
                for view in self.inner.read_stream(key, offset + done, size - done, piece):
                    done += len(view)
                    yield view
                return
            except BackendError as exc:
                self._pause_or_raise(exc, tries, start)

    def read_tail(self, key: str, size: int) -> tuple[int, memoryview]:
        return self.retry(lambda: self.inner.read_tail(key, size))

    def get(self, key: str) -> bytes | None:
        return self.retry(lambda: self.inner.get(key))

    def get_versioned(self, key: str) -> tuple[bytes, Version] | None:
        return self.retry(lambda: self.inner.get_versioned(key))

    def stat(self, key: str) -> KeyInfo | None:
        return self.retry(lambda: self.inner.stat(key))

    def list(self, prefix: str = "", *, recursive: bool = True) -> Iterator[str]:
        return iter(self.retry(lambda: builtins.list(self.inner.list(prefix, recursive=recursive))))

    def list_sizes(self, prefix: str = "", *, recursive: bool = True) -> dict[str, int]:
        return self.retry(lambda: self.inner.list_sizes(prefix, recursive=recursive))

    def temporaries(self, prefix: str = "") -> builtins.list[KeyInfo]:
        return self.retry(lambda: self.inner.temporaries(prefix))

    def put(self, key: str, data: Buffer) -> None:
        self.retry(lambda: self.inner.put(key, data))

    def replace(self, key: str, data: Buffer) -> None:
        self.retry(lambda: self.inner.replace(key, data))

    def delete(self, key: str) -> None:
        self.retry(lambda: self.inner.delete(key))

    def delete_temporary(self, key: str) -> None:
        self.retry(lambda: self.inner.delete_temporary(key))

    # ---- not idempotent: find out whether a failed try landed ----------------------------
    def put_if_absent(self, key: str, data: Buffer) -> bool:
        blob = bytes(data)

        def again() -> bool:
            if self.inner.put_if_absent(key, blob):
                return True
            return self.inner.get(key) == blob  # ours from the try whose answer was lost, or another's

        return self.retry(lambda: self.inner.put_if_absent(key, blob), recover=again)

    def compare_and_swap(self, key: str, expected: Version | None, data: Buffer) -> Version:
        blob = bytes(data)

        def landed() -> Version | None:
            found = self.inner.get_versioned(key)
            if found is not None and found[0] == blob:
                return found[1]  # the lost try landed
            if (found[1] if found is not None else None) == expected:
                return None  # it did not: swap again
            state = "was created" if expected is None else "was changed or deleted"
            raise RefConflictError(f"{key} {state} by another writer; nothing was written")

        return self.retry(lambda: self.inner.compare_and_swap(key, expected, blob), recover=landed)

    def open_sink(self, key: str) -> Sink:
        return RetryingSink(self, key, self.retry(lambda: self.inner.open_sink(key)))


class RetryingSink(Sink):
    """``inner`` with its publish made good: replayed as a retried ``put`` while the
    sink is within ``replay_limit``, else checked against the key it should have made."""

    def __init__(self, backend: RetryingBackend, key: str, inner: Sink) -> None:
        self.backend, self.key, self.inner = backend, key, inner
        self._kept: builtins.list[bytes] | None = []

    @property
    def size(self) -> int:
        return self.inner.size

    def write(self, data: Buffer) -> None:
        self.inner.write(data)
        if self._kept is not None:
            self._kept.append(bytes(data))
            if self.inner.size > self.backend.replay_limit:
                self._kept = None  # too big to keep: the store retries the parts itself

    def publish(self) -> None:
        try:
            self.inner.publish()
            return
        except BackendError as exc:
            if not exc.transient:
                raise
            failed = exc
        if self._kept is not None:
            self.backend.put(self.key, b"".join(self._kept))  # retried
            return
        info = self.backend.stat(self.key)  # retried
        if info is None or info.size != self.inner.size:
            raise failed.with_outcome(f"{self.key} was not published")

    def abort(self) -> None:
        self._kept = None
        self.inner.abort()
