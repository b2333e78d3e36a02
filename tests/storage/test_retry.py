"""RetryingBackend over a fault-injecting wrapper of the memory twin: what is
retried, how often, with what pauses, and what a non-idempotent operation whose
answer was lost reports."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import pytest

from ckvc.errors import CorruptObjectError, ObjectNotFoundError, RefConflictError
from ckvc.storage.backend import BackendError, ForwardingBackend, Sink
from ckvc.storage.memory import MemoryBackend
from ckvc.storage.retry import RetryingBackend, RetryPolicy


class Faulty(ForwardingBackend):
    """Raises BackendError on planned calls: ``plan[op]`` is a list of
    (when, transient) consumed one per call of ``op``; when is "before" (nothing
    happened) or "after" (the call happened, its answer is lost); None passes."""

    def __init__(self, inner: MemoryBackend) -> None:
        super().__init__(inner)
        self.plan: dict[str, list[tuple[str, bool] | None]] = {}
        self.calls: dict[str, int] = {}

    def fail(self, op: str, *steps: tuple[str, bool] | None) -> None:
        self.plan.setdefault(op, []).extend(steps)

    def run(self, op: str, key: str, call: Callable[[], Any]) -> Any:
        self.calls[op] = self.calls.get(op, 0) + 1
        step = self.plan.get(op, [None]).pop(0) if self.plan.get(op) else None
        if step is not None and step[0] == "before":
            raise BackendError(f"s3://b: {op} {key} failed: HTTP 503 SlowDown", key=key, transient=step[1])
        result = call()
        if step is not None:
            raise BackendError(f"s3://b: {op} {key} failed: connection reset", key=key, transient=step[1])
        return result

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self.run("read_into", key, lambda: self.inner.read_into(key, offset, out))

    def get(self, key: str) -> bytes | None:
        return self.run("get", key, lambda: self.inner.get(key))

    def get_versioned(self, key: str) -> Any:
        return self.run("get_versioned", key, lambda: self.inner.get_versioned(key))

    def put(self, key: str, data: Any) -> None:
        self.run("put", key, lambda: self.inner.put(key, data))

    def put_if_absent(self, key: str, data: Any) -> bool:
        return self.run("put_if_absent", key, lambda: self.inner.put_if_absent(key, data))

    def compare_and_swap(self, key: str, expected: Any, data: Any) -> Any:
        return self.run("compare_and_swap", key, lambda: self.inner.compare_and_swap(key, expected, data))

    def open_sink(self, key: str) -> Sink:
        outer = self
        sink = self.inner.open_sink(key)

        class FaultySink(Sink):
            size = property(lambda self: sink.size)

            def write(self, data: Any) -> None:
                sink.write(data)

            def publish(self) -> None:
                outer.run("publish", key, sink.publish)

            def abort(self) -> None:
                sink.abort()

        return FaultySink()


FAST = RetryPolicy(attempts=4, first_delay=0.01, multiplier=2.0, max_delay=0.05, total_seconds=30)
TRANSIENT_BEFORE, TRANSIENT_AFTER, PERMANENT = ("before", True), ("after", True), ("before", False)


@pytest.fixture
def faulty() -> Faulty:
    return Faulty(MemoryBackend(object_store_semantics=True))


def retrying(inner: Faulty, policy: RetryPolicy = FAST) -> tuple[RetryingBackend, list[float]]:
    pauses: list[float] = []
    return RetryingBackend(inner, policy, sleep=pauses.append, rng=random.Random(1)), pauses


def test_transient_reads_are_retried_byte_exact(faulty: Faulty) -> None:
    data = os.urandom(4096)
    faulty.inner.put("packs/p.pack", data)
    backend, pauses = retrying(faulty)
    faulty.fail("read_into", TRANSIENT_BEFORE, TRANSIENT_AFTER)
    out = bytearray(1000)
    backend.read_into("packs/p.pack", 100, memoryview(out))
    assert out == data[100:1100]
    assert faulty.calls["read_into"] == 3 and backend.retries == 2 and len(pauses) == 2
    faulty.fail("get", TRANSIENT_BEFORE)
    assert backend.get("packs/p.pack") == data
    assert backend.get("packs/none") is None  # None is an answer, not a reason to retry
    assert faulty.calls["get"] == 3


def test_permanent_errors_and_other_exceptions_are_not_retried(faulty: Faulty) -> None:
    backend, pauses = retrying(faulty)
    faulty.fail("get", PERMANENT)
    with pytest.raises(BackendError, match="SlowDown") as info:
        backend.get("config")
    assert not info.value.transient and faulty.calls["get"] == 1 and pauses == []
    with pytest.raises(ObjectNotFoundError):
        backend.read_into("packs/none.pack", 0, memoryview(bytearray(1)))
    faulty.inner.put("k", b"abc")
    with pytest.raises(CorruptObjectError):
        backend.read_into("k", 2, memoryview(bytearray(5)))
    assert faulty.calls["read_into"] == 2 and backend.retries == 0


def test_attempts_bound_and_pauses_grow_within_the_jitter(faulty: Faulty) -> None:
    policy = RetryPolicy(attempts=5, first_delay=1.0, multiplier=3.0, max_delay=10.0, total_seconds=1000)
    backend, pauses = retrying(faulty, policy)
    faulty.fail("put", *[TRANSIENT_BEFORE] * 10)
    with pytest.raises(BackendError, match=r"SlowDown \(gave up after 5 tries\)$") as info:
        backend.put("config", b"x")
    assert info.value.transient and info.value.key == "config"
    assert faulty.calls["put"] == 5 and len(pauses) == 4
    for n, pause in enumerate(pauses, start=1):
        assert 0 <= pause <= min(10.0, 3.0 ** (n - 1))
    assert faulty.inner.get("config") is None


def test_total_time_bound(faulty: Faulty) -> None:
    now = [0.0]
    policy = RetryPolicy(attempts=100, first_delay=4.0, multiplier=1.0, max_delay=4.0, total_seconds=10.0)

    def sleep(seconds: float) -> None:
        now[0] += seconds

    backend = RetryingBackend(faulty, policy, sleep=sleep, clock=lambda: now[0], rng=random.Random(3))
    faulty.fail("get", *[TRANSIENT_BEFORE] * 100)
    with pytest.raises(BackendError, match="gave up after"):
        backend.get("config")
    assert now[0] <= 10.0 and faulty.calls["get"] < 100


@pytest.mark.parametrize("when", ["before", "after"])
def test_compare_and_swap_whose_answer_is_lost(faulty: Faulty, when: str) -> None:
    """Before: nothing landed, the swap is made again. After: it landed; the
    retry reads the key back and returns its version instead of a false conflict."""
    v1 = faulty.inner.compare_and_swap("refs/heads/main", None, b"one")
    backend, _ = retrying(faulty)
    faulty.fail("compare_and_swap", (when, True))
    v2 = backend.compare_and_swap("refs/heads/main", v1, b"two")
    assert faulty.inner.get_versioned("refs/heads/main") == (b"two", v2)
    assert faulty.calls["compare_and_swap"] == (2 if when == "before" else 1)
    # Creating: the same, from absence.
    faulty.fail("compare_and_swap", (when, True))
    v3 = backend.compare_and_swap("refs/tags/t", None, b"tag")
    assert faulty.inner.get_versioned("refs/tags/t") == (b"tag", v3)


def test_compare_and_swap_lost_then_another_writer_is_a_conflict(faulty: Faulty) -> None:
    v1 = faulty.inner.compare_and_swap("refs/heads/main", None, b"one")
    backend, _ = retrying(faulty)

    real = faulty.inner.compare_and_swap

    def other_writer_first(key: str, expected: Any, data: Any) -> Any:
        real(key, expected, b"theirs")  # lands first; our try then fails on the wire
        raise BackendError("s3://b: conditional PUT failed: timed out", key=key, transient=True)

    faulty.inner.compare_and_swap = other_writer_first  # type: ignore[method-assign]
    with pytest.raises(RefConflictError, match="was changed or deleted by another writer"):
        backend.compare_and_swap("refs/heads/main", v1, b"ours")
    assert faulty.inner.get("refs/heads/main") == b"theirs"
    assert faulty.inner.get_versioned("refs/heads/main") != (b"theirs", v1)
    # A genuine conflict is never retried.
    faulty.inner.compare_and_swap = real  # type: ignore[method-assign]
    with pytest.raises(RefConflictError):
        backend.compare_and_swap("refs/heads/main", v1, b"stale")
    assert faulty.calls["compare_and_swap"] == 2


@pytest.mark.parametrize("when", ["before", "after"])
def test_put_if_absent_whose_answer_is_lost(faulty: Faulty, when: str) -> None:
    backend, _ = retrying(faulty)
    faulty.fail("put_if_absent", (when, True))
    assert backend.put_if_absent("packs/a.pack", b"mine") is True
    assert faulty.inner.get("packs/a.pack") == b"mine"
    faulty.inner.put("packs/b.pack", b"theirs")
    faulty.fail("put_if_absent", ("before", True))
    assert backend.put_if_absent("packs/b.pack", b"mine") is False
    assert faulty.inner.get("packs/b.pack") == b"theirs"


def test_small_sink_publish_is_replayed(faulty: Faulty) -> None:
    backend, _ = retrying(faulty)
    faulty.fail("publish", TRANSIENT_BEFORE)
    with backend.open_sink("packs/s.pack") as sink:
        sink.write(b"abc")
        sink.writev([b"de", memoryview(b"f")])
        sink.publish()
    assert faulty.inner.get("packs/s.pack") == b"abcdef"
    assert faulty.calls["publish"] == 1 and backend.retries == 0  # replayed as a put, not retried publish


@pytest.mark.parametrize("landed", [False, True])
def test_large_sink_publish_is_checked_not_replayed(faulty: Faulty, landed: bool) -> None:
    backend = RetryingBackend(faulty, FAST, replay_limit=4, sleep=lambda s: None)
    faulty.fail("publish", ("after" if landed else "before", True))
    sink = backend.open_sink("packs/l.pack")
    sink.write(b"0123456789")
    if landed:
        sink.publish()
        assert faulty.inner.get("packs/l.pack") == b"0123456789"
    else:
        with pytest.raises(BackendError, match=r"SlowDown: packs/l.pack was not published$"):
            sink.publish()
        assert faulty.inner.get("packs/l.pack") is None
