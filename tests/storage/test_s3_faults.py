"""The S3 backend behind a fault-injecting proxy (fault_proxy.py) in front of the
S3 test server: transient faults are survived byte-exact through RetryingBackend,
a body cut short never reads as short data, a permanent 403 is one clear error,
and a conditional write whose answer was lost reports what the key shows."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from fault_proxy import FaultProxy, Rule
from s3server import S3Server, s3_backend

from ckvc.errors import CorruptObjectError, RepositoryLockedError
from ckvc.storage.backend import BackendError
from ckvc.storage.objectstore import MIN_PART_SIZE, ObjectStoreBackend
from ckvc.storage.retry import RetryingBackend, RetryPolicy

FAST = RetryPolicy(attempts=8, first_delay=0.01, max_delay=0.05, total_seconds=30)


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.endpoint) as p:
        yield p


def through(proxy: FaultProxy, bucket: str, **options: object) -> ObjectStoreBackend:
    return s3_backend(proxy.endpoint, bucket, **options)  # type: ignore[arg-type]


def test_transient_faults_are_survived_byte_exact(proxy: FaultProxy, s3_bucket: str) -> None:
    data = os.urandom(3 << 20)
    plain = through(proxy, s3_bucket)
    plain.put("packs/p.pack", data)
    proxy.rules = [
        Rule("status", method="GET", status=500, count=2),
        Rule("status", method="GET", status=503, count=1),
        Rule("reset", method="GET", count=1),
        Rule("truncate", method="GET", count=1),
        Rule("status", method="PUT", status=503, count=1),
        Rule("reset", method="PUT", count=1),
        Rule("status", method="HEAD", status=500, count=1),
    ]
    backend = RetryingBackend(plain, FAST)
    out = bytearray(1 << 20)
    backend.read_into("packs/p.pack", 12345, memoryview(out))
    assert out == data[12345 : 12345 + (1 << 20)]
    ranges = [(0, 1000), (5000, 70000), (2 << 20, 4096)]
    assert [(o, bytes(b)) for o, b in backend.read_ranges("packs/p.pack", ranges)] == [
        (o, data[o : o + n]) for o, n in ranges
    ]
    assert backend.get("packs/p.pack") == data
    backend.put("config", b"settings")
    assert backend.get("config") == b"settings"
    info = backend.stat("config")
    assert info is not None and info.size == 8
    assert proxy.fired() == 8 and backend.retries == 8


def test_a_truncated_body_is_never_short_data(proxy: FaultProxy, s3_bucket: str) -> None:
    data = os.urandom(1 << 20)
    backend = through(proxy, s3_bucket)
    backend.put("packs/t.pack", data)
    proxy.rules = [Rule("truncate", method="GET", count=None)]
    out = bytearray(len(data))
    with pytest.raises(BackendError) as info:
        backend.read_into("packs/t.pack", 0, memoryview(out))
    assert info.value.transient and "packs/t.pack" in str(info.value)
    with pytest.raises(BackendError):
        backend.get("packs/t.pack")
    with pytest.raises(BackendError):
        list(backend.read_ranges("packs/t.pack", [(0, 100), (500_000, 100)]))
    # A server that says the object is shorter (a consistent short answer) is
    # CorruptObjectError, whatever wraps the backend: never fewer bytes than asked.
    proxy.rules = []
    backend.put("packs/short.pack", data[:100])
    with pytest.raises(CorruptObjectError, match="truncated"):
        RetryingBackend(backend, FAST).read_into("packs/short.pack", 50, memoryview(bytearray(100)))


def test_a_permanent_403_is_one_clear_error(proxy: FaultProxy, s3_bucket: str) -> None:
    backend = RetryingBackend(through(proxy, s3_bucket), FAST)
    proxy.rules = [Rule("status", status=403, count=None)]
    with pytest.raises(BackendError) as info:
        backend.get("refs/heads/main")
    err = info.value
    assert not err.transient and err.key == "refs/heads/main"
    assert str(err) == f"s3://{s3_bucket}/repo: GET refs/heads/main failed: access denied (HTTP 403 AccessDenied)"
    assert "\n" not in str(err)
    assert len(proxy.requests) == 1 and backend.retries == 0  # never retried


def test_a_missing_bucket_is_permanent(s3_server: S3Server, s3_bucket: str) -> None:
    backend = RetryingBackend(s3_backend(s3_server.endpoint, s3_bucket + "-gone"), FAST)
    with pytest.raises(BackendError, match=r"-gone/repo: PUT config failed: the bucket does not exist$") as info:
        backend.put("config", b"x")
    assert not info.value.transient and backend.retries == 0
    with pytest.raises(BackendError, match="the bucket does not exist"):
        backend.get("config")  # not "absent": the bucket is


def test_a_lost_answer_to_a_conditional_write(proxy: FaultProxy, s3_bucket: str) -> None:
    """The request lands and its answer is dropped: the swap and the create
    report success, having read the key back."""
    backend = RetryingBackend(through(proxy, s3_bucket), FAST)
    v1 = backend.compare_and_swap("refs/heads/main", None, b"a" * 64)
    proxy.rules = [Rule("reset", method="PUT", after=True, count=1)]
    v2 = backend.compare_and_swap("refs/heads/main", v1, b"b" * 64)
    assert proxy.fired() == 1
    assert backend.get_versioned("refs/heads/main") == (b"b" * 64, v2)
    proxy.rules = [Rule("status", method="PUT", status=500, after=True, count=1)]
    assert backend.put_if_absent("refs/tags/v1", b"c" * 64) is True
    assert proxy.fired() == 1 and backend.get("refs/tags/v1") == b"c" * 64


def test_a_slow_answer_times_out_and_is_retried(proxy: FaultProxy, s3_bucket: str) -> None:
    backend = RetryingBackend(through(proxy, s3_bucket, timeout=0.5), FAST)
    backend.put("config", b"x")
    proxy.rules = [Rule("slow", method="GET", delay=1.5, count=1)]
    assert backend.get("config") == b"x"
    assert proxy.fired() == 1 and backend.retries == 1


def test_a_multipart_upload_survives_failed_parts(proxy: FaultProxy, s3_bucket: str) -> None:
    """Parts are retried by the store itself (they are idempotent and their bytes
    have left the writer); publish completes the upload byte-exact."""
    backend = through(proxy, s3_bucket, part_size=MIN_PART_SIZE)
    data = os.urandom(2 * MIN_PART_SIZE + 12345)
    proxy.rules = [
        Rule("status", method="PUT", path="partNumber=2", status=500, count=1),
        Rule("reset", method="PUT", path="partNumber=1", count=1),
    ]
    with backend.open_sink("packs/big.pack") as sink:
        for at in range(0, len(data), 1 << 20):
            sink.write(data[at : at + (1 << 20)])
        assert backend.stat("packs/big.pack") is None
        sink.publish()
    assert proxy.fired() == 2
    assert backend.get("packs/big.pack") == data
    uploads = [p for m, p in proxy.requests if m == "POST"]
    assert len(uploads) == 2  # one multipart upload: created, completed


def test_a_lock_survives_store_hiccups(proxy: FaultProxy, s3_bucket: str) -> None:
    """Taking a lease looks again after a transient error; a create whose answer
    was lost finds its own lease; nothing is left after release."""
    backend = through(proxy, s3_bucket)
    proxy.rules = [
        Rule("status", method="PUT", path="/locks/", status=503, count=1),
        Rule("reset", method="PUT", path="/locks/", after=True, count=1),
        Rule("status", method="GET", path="list-type", status=500, count=1),
    ]
    with backend.lock("gc.lock", timeout=30):
        assert proxy.fired() == 3
        assert len(list(backend.list("locks/gc.lock/"))) == 1
        with pytest.raises(RepositoryLockedError), backend.lock("gc.lock", shared=True, timeout=0):
            pass
    assert list(backend.list("locks/")) == []
