"""The S3 backend behind a fault-injecting proxy (tests/fault_proxy.py) in front of the
S3 test server: transient faults are survived byte-exact through RetryingBackend,
a body cut short never reads as short data, a permanent 403 is one clear error,
and a conditional write whose answer was lost reports what the key shows."""

from __future__ import annotations

import os

import pytest
from fault_proxy import FaultProxy, Rule
from s3server import S3Server, s3_backend

from ckvc.errors import CorruptObjectError, RepositoryLockedError
from ckvc.storage.backend import BackendError
from ckvc.storage.cloud import MIN_PART_SIZE, ObjectStoreBackend
from ckvc.storage.retry import RetryingBackend, RetryPolicy

FAST = RetryPolicy(attempts=8, first_delay=0.01, max_delay=0.05, total_seconds=30)


def through(s3_proxy: FaultProxy, bucket: str, **options: object) -> ObjectStoreBackend:
    return s3_backend(s3_proxy.endpoint, bucket, **options)  # type: ignore[arg-type]


def test_transient_faults_are_survived_byte_exact(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    data = os.urandom(3 << 20)
    plain = through(s3_proxy, s3_bucket)
    plain.put("packs/p.pack", data)
    s3_proxy.rules = [
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
    assert s3_proxy.fired() == 8 and backend.retries == 8


def test_a_truncated_body_is_never_short_data(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    data = os.urandom(1 << 20)
    backend = through(s3_proxy, s3_bucket)
    backend.put("packs/t.pack", data)
    s3_proxy.rules = [Rule("truncate", method="GET", count=None)]
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
    s3_proxy.rules = []
    backend.put("packs/short.pack", data[:100])
    with pytest.raises(CorruptObjectError, match="truncated"):
        RetryingBackend(backend, FAST).read_into("packs/short.pack", 50, memoryview(bytearray(100)))


def test_a_stream_cut_short_goes_on_from_where_it_stopped(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    data = os.urandom(3 << 20)
    plain = through(s3_proxy, s3_bucket)
    plain.put("packs/s.pack", data)
    s3_proxy.rules = [Rule("truncate", method="GET", count=1, keep=1 << 20), Rule("reset", method="GET", count=1)]
    backend = RetryingBackend(plain, FAST)
    got = b"".join(bytes(piece) for piece in backend.read_stream("packs/s.pack", 100, len(data) - 100, piece=256 << 10))
    assert got == data[100:]
    assert s3_proxy.fired() == 2 and backend.retries == 2
    with pytest.raises(BackendError):  # without the wrapper the cut is an error, never short data
        s3_proxy.rules = [Rule("truncate", method="GET", count=1)]
        b"".join(bytes(piece) for piece in plain.read_stream("packs/s.pack", 0, len(data)))


def test_a_permanent_403_is_one_clear_error(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    backend = RetryingBackend(through(s3_proxy, s3_bucket), FAST)
    s3_proxy.rules = [Rule("status", status=403, count=None)]
    with pytest.raises(BackendError) as info:
        backend.get("refs/heads/main")
    err = info.value
    assert not err.transient and err.key == "refs/heads/main"
    assert str(err) == f"s3://{s3_bucket}/repo: GET refs/heads/main failed: access denied (HTTP 403 AccessDenied)"
    assert "\n" not in str(err)
    assert len(s3_proxy.requests) == 1 and backend.retries == 0  # never retried


def test_a_missing_bucket_is_permanent(s3_server: S3Server, s3_bucket: str) -> None:
    backend = RetryingBackend(s3_backend(s3_server.endpoint, s3_bucket + "-gone"), FAST)
    with pytest.raises(BackendError, match=r"-gone/repo: PUT config failed: the bucket does not exist$") as info:
        backend.put("config", b"x")
    assert not info.value.transient and backend.retries == 0
    with pytest.raises(BackendError, match="the bucket does not exist"):
        backend.get("config")  # not "absent": the bucket is


def test_a_lost_answer_to_a_conditional_write(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    """The request lands and its answer is dropped: the swap and the create
    report success, having read the key back."""
    backend = RetryingBackend(through(s3_proxy, s3_bucket), FAST)
    v1 = backend.compare_and_swap("refs/heads/main", None, b"a" * 64)
    s3_proxy.rules = [Rule("reset", method="PUT", after=True, count=1)]
    v2 = backend.compare_and_swap("refs/heads/main", v1, b"b" * 64)
    assert s3_proxy.fired() == 1
    assert backend.get_versioned("refs/heads/main") == (b"b" * 64, v2)
    s3_proxy.rules = [Rule("status", method="PUT", status=500, after=True, count=1)]
    assert backend.put_if_absent("refs/tags/v1", b"c" * 64) is True
    assert s3_proxy.fired() == 1 and backend.get("refs/tags/v1") == b"c" * 64


def test_a_slow_answer_times_out_and_is_retried(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    backend = RetryingBackend(through(s3_proxy, s3_bucket, timeout=0.5), FAST)
    backend.put("config", b"x")
    s3_proxy.rules = [Rule("slow", method="GET", delay=1.5, count=1)]
    assert backend.get("config") == b"x"
    assert s3_proxy.fired() == 1 and backend.retries == 1


def test_a_multipart_upload_survives_failed_parts(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    """Parts are retried by the store itself (they are idempotent and their bytes
    have left the writer); publish completes the upload byte-exact."""
    backend = through(s3_proxy, s3_bucket, part_size=MIN_PART_SIZE)
    data = os.urandom(2 * MIN_PART_SIZE + 12345)
    s3_proxy.rules = [
        Rule("status", method="PUT", path="partNumber=2", status=500, count=1),
        Rule("reset", method="PUT", path="partNumber=1", count=1),
    ]
    with backend.open_sink("packs/big.pack") as sink:
        for at in range(0, len(data), 1 << 20):
            sink.write(data[at : at + (1 << 20)])
        assert backend.stat("packs/big.pack") is None
        sink.publish()
    assert s3_proxy.fired() == 2
    assert backend.get("packs/big.pack") == data
    uploads = [p for m, p in s3_proxy.requests if m == "POST"]
    assert len(uploads) == 2  # one multipart upload: created, completed


def test_a_lock_survives_store_hiccups(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    """Taking a lease looks again after a transient error; a create whose answer
    was lost finds its own lease; nothing is left after release."""
    backend = through(s3_proxy, s3_bucket)
    s3_proxy.rules = [
        Rule("status", method="PUT", path="/locks/", status=503, count=1),
        Rule("reset", method="PUT", path="/locks/", after=True, count=1),
        Rule("status", method="GET", path="list-type", status=500, count=1),
    ]
    with backend.lock("gc.lock", timeout=30):
        assert s3_proxy.fired() == 3
        assert len(list(backend.list("locks/gc.lock/"))) == 1
        with pytest.raises(RepositoryLockedError), backend.lock("gc.lock", shared=True, timeout=0):
            pass
    assert list(backend.list("locks/")) == []


def test_a_failed_multipart_upload_raises_typed(s3_proxy: FaultProxy, s3_server: S3Server, s3_bucket: str) -> None:
    """Parts refused for good: the writer gets the permanent error (at a write or
    at publish), and the upload is aborted, not left behind."""
    backend = through(s3_proxy, s3_bucket, part_size=MIN_PART_SIZE, upload_retries=0)
    s3_proxy.rules = [Rule("status", method="PUT", path="partNumber=", status=403, count=None)]
    sink = backend.open_sink("packs/f.pack")
    with pytest.raises(BackendError, match=r"PUT packs/f\.pack failed: access denied") as info:
        for _ in range(3):
            sink.write(os.urandom(MIN_PART_SIZE))
        sink.publish()
    assert not info.value.transient
    sink.abort()
    assert backend.stat("packs/f.pack") is None
    assert "<UploadId>" not in s3_server.request("GET", f"/{s3_bucket}?uploads").decode()  # aborted
