"""What the S3 backend does beyond the Backend contract: opening by URL, the
prefix and the endpoint variable, coalesced range reads (counted at the wire),
multipart sinks and their abort, and lease locks (on the memory twin, where
time can be short)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_proxy import FaultProxy
from s3server import S3Server, fake_credentials, obstore_available, s3_backend

from ckvc.errors import InvalidInputError, RepositoryLockedError
from ckvc.ids import Buffer
from ckvc.storage.backend import BackendError, ForwardingBackend, Version
from ckvc.storage.cloud import MIN_PART_SIZE, aws_profile_credentials, open_object_store
from ckvc.storage.leases import UNREACHABLE_S, LeaseLocks, lease_bytes
from ckvc.storage.memory import MemoryBackend


@pytest.fixture
def credentials(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fake keys, so that nothing looks for real ones (opening makes no request)."""
    if not obstore_available():
        pytest.skip("obstore is not installed (pip install -e '.[remote]')")
    with fake_credentials(monkeypatch):
        yield


@pytest.mark.usefixtures("credentials")
def test_urls_and_options_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    for url in ["/tmp/x", "http://bucket/x", "s3:///prefix", "file:///tmp"]:
        with pytest.raises(InvalidInputError):
            open_object_store(url)
    with pytest.raises(InvalidInputError, match="plain http to another machine"):
        open_object_store("s3://b/p", endpoint="http://10.0.0.8:9000")
    with pytest.raises(InvalidInputError, match="not an http"):
        open_object_store("s3://b/p", endpoint="ftp://127.0.0.1")
    with pytest.raises(InvalidInputError, match="unknown object store option"):
        open_object_store("s3://b/p", endpoint="http://127.0.0.1:1", colour="blue")
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    with pytest.raises(InvalidInputError, match=r"^cannot open az://container/x: .*Account must be specified"):
        open_object_store("az://container/x")
    with pytest.raises(InvalidInputError, match="minimum of 5 MiB"):
        open_object_store("memory://", part_size=1 << 20)
    assert open_object_store("s3://b/p", endpoint="http://10.0.0.8:9000", allow_http=True).url == "s3://b/p"


@pytest.mark.usefixtures("credentials")
def test_memory_url_is_a_working_store() -> None:
    backend = open_object_store("memory://")
    v = backend.compare_and_swap("refs/heads/main", None, b"x")
    assert backend.get_versioned("refs/heads/main") == (b"x", v)
    assert list(backend.list("")) == ["refs/heads/main"]


def test_endpoint_variable_and_prefix(s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    backend = open_object_store(f"s3://{s3_bucket}/team/models")
    backend.put("config", b"{}")
    other = open_object_store(f"s3://{s3_bucket}/team")
    assert list(other.list("")) == ["models/config"]  # the prefix is a folder of the bucket
    assert other.get("models/config") == b"{}"
    listing = s3_server.request("GET", f"/{s3_bucket}?list-type=2").decode()
    assert "<Key>team/models/config</Key>" in listing


def test_read_ranges_coalesce_into_few_requests(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    data = os.urandom(12 << 20)
    backend = s3_backend(s3_proxy.endpoint, s3_bucket, max_request=1 << 20)
    backend.put("packs/p.pack", data)

    def gets(ranges: list[tuple[int, int]]) -> int:
        before = len(s3_proxy.requests)
        got = [(o, bytes(b)) for o, b in backend.read_ranges("packs/p.pack", ranges)]
        assert got == [(o, data[o : o + n]) for o, n in ranges]
        return sum(1 for m, _ in s3_proxy.requests[before:] if m == "GET")

    adjacent = [(i * 4096, 4096) for i in range(64)]  # 256 KiB back to back
    assert gets(adjacent) == 1
    assert gets(adjacent[::-1]) == 1  # any order: yielded as asked
    near = [(i * 8192, 4096) for i in range(64)]  # 4 KiB gaps: cheaper read than requested
    assert gets(near) == 1
    far = [(i * (3 << 20), 1000) for i in range(4)]  # 3 MiB apart: one request each
    assert gets(far) == 4
    capped = [(i * 65536, 65536) for i in range(48)]  # 3 MiB contiguous, 1 MiB per request
    assert gets(capped) == 3
    assert gets([]) == 0
    # One large read is GETs of max_request in parallel, scattered across buffers.
    before = len(s3_proxy.requests)
    out = bytearray(3_500_000)
    backend.readv_into(
        "packs/p.pack", 777, [memoryview(out)[:10], memoryview(out)[10:2_000_000], memoryview(out)[2_000_000:]]
    )
    assert out == data[777 : 777 + len(out)]
    assert sum(1 for m, _ in s3_proxy.requests[before:] if m == "GET") == 4


def test_multipart_sink_publish_and_abort(s3_server: S3Server, s3_bucket: str) -> None:
    backend = s3_backend(s3_server.endpoint, s3_bucket, part_size=MIN_PART_SIZE)
    data = os.urandom(2 * MIN_PART_SIZE + 777)
    sink = backend.open_sink("packs/m.pack")
    sink.write(data[:100])
    sink.write(memoryview(data)[100:])
    assert sink.size == len(data)
    assert backend.stat("packs/m.pack") is None and list(backend.list("packs/")) == []
    sink.publish()
    assert backend.get("packs/m.pack") == data
    with pytest.raises(ValueError, match="published or aborted"):
        sink.write(b"more")

    dropped = backend.open_sink("packs/gone.pack")
    dropped.write(data)
    dropped.abort()
    dropped.abort()  # twice is fine
    assert backend.stat("packs/gone.pack") is None
    uploads = s3_server.request("GET", f"/{s3_bucket}?uploads").decode()
    assert "<UploadId>" not in uploads  # aborted, not left for a lifecycle rule


def test_a_dead_holders_lease_expires() -> None:
    backend = MemoryBackend(object_store_semantics=True)
    locks = LeaseLocks(backend, term=60)
    backend.put("locks/gc.lock/dead", lease_bytes("dead", shared=False, expires=time.time() - 1))
    backend.put("locks/gc.lock/garbled", b"not a lease")  # unreadable: exclusive, aged by its mtime
    with (
        pytest.raises(RepositoryLockedError, match=r"gc\.lock is locked by another process"),
        locks.hold("gc.lock", timeout=0),
    ):
        pass
    assert "locks/gc.lock/dead" not in list(backend.list("locks/"))
    backend.delete("locks/gc.lock/garbled")
    with locks.hold("gc.lock", timeout=0):
        [mine] = list(backend.list("locks/gc.lock/"))
        lease = json.loads(backend.get(mine) or b"")
        assert lease["shared"] is False and lease["expires"] > time.time() + 50
    assert list(backend.list("locks/")) == []  # released: gone


class FakeClock:
    """Both of a LeaseLocks' clocks, moved only by ``advance``."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_a_held_lease_is_renewed() -> None:
    """Renewed (here by hand, as the holder's thread does every third of the term), a
    lease held past its first term still keeps others out; once renewals stop for
    longer than the term, it is a dead holder's and another taker deletes it."""
    backend = MemoryBackend(object_store_semantics=True)
    clock = FakeClock()
    locks = LeaseLocks(backend, term=60, clock=clock, monotonic=clock)
    other = LeaseLocks(backend, term=60, clock=clock, monotonic=clock)
    with locks.hold("gc.lock"):
        [key] = list(backend.list("locks/gc.lock/"))
        first = backend.get_versioned(key)
        for _ in range(3):  # 3 x 30 s: past the 60 s term, renewed every 30 s
            clock.advance(30)
            locks.renew_held()
            locks.check_held()
        again = backend.get_versioned(key)
        assert first is not None and again is not None and again[1] != first[1]
        assert json.loads(again[0])["expires"] == clock.now + 60
        with pytest.raises(RepositoryLockedError), other.hold("gc.lock", shared=True, timeout=0):
            pass
        clock.advance(61)  # no renewal for longer than the term: expired
        with other.hold("gc.lock", timeout=0):
            assert key not in list(backend.list("locks/gc.lock/"))
        with pytest.raises(RepositoryLockedError, match=r"gc\.lock lapsed while held"):
            locks.check_held()
    with locks.hold("gc.lock", timeout=0):
        pass


def test_the_lease_renewer_thread_renews() -> None:
    """The holder's thread renews by itself (a 0.3 s term: every 0.1 s); the test waits
    for the renewal, however long it takes."""
    backend = MemoryBackend(object_store_semantics=True)
    locks = LeaseLocks(backend, term=0.3)
    with locks.hold("gc.lock"):
        [key] = list(backend.list("locks/gc.lock/"))
        first = backend.get_versioned(key)
        assert first is not None
        deadline = time.monotonic() + 60
        while (again := backend.get_versioned(key)) is not None and again[1] == first[1]:
            assert time.monotonic() < deadline, "no renewal in 60 s"
            time.sleep(0.01)
        assert again is not None and json.loads(again[0])["expires"] > json.loads(first[0])["expires"]
    assert list(backend.list("locks/")) == []


def test_credentials_from_an_aws_profile_file(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No keys in the environment, a named profile in a credentials file: read
    through boto3's chain (files only here: the keys are found there)."""
    pytest.importorskip("boto3")
    creds = tmp_path / "credentials"
    creds.write_text("[ckvc-test]\naws_access_key_id = fromfile\naws_secret_access_key = fromfile\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "ckvc-test")
    provider = aws_profile_credentials()
    assert provider is not None and provider()["access_key_id"] == "fromfile"
    backend = open_object_store(f"s3://{s3_bucket}/p", endpoint=s3_server.endpoint)
    backend.put("config", b"{}")
    assert backend.get("config") == b"{}"
    listing = s3_server.request("GET", f"/{s3_bucket}?list-type=2").decode()
    assert "<Key>p/config</Key>" in listing


def test_taking_a_lock_gives_up_on_a_store_that_does_not_answer() -> None:
    """A writer's pin waits up to 120 s for a lock's holders, but a store whose every
    listing fails is given UNREACHABLE_S (by the lock's clock, here one second a
    look): the push or commit fails with the store's error instead of hanging."""

    class Unreachable(ForwardingBackend):
        def list(self, prefix: str = "", *, recursive: bool = True) -> Iterator[str]:
            raise BackendError("connection reset", key=prefix, transient=True)

    class Ticking(FakeClock):
        def __call__(self) -> float:
            self.now += 1.0
            return self.now

    clock = Ticking()
    locks = LeaseLocks(Unreachable(MemoryBackend(object_store_semantics=True)), term=60, monotonic=clock)
    started = clock.now
    with pytest.raises(BackendError, match="connection reset"), locks.hold("gc.lock", timeout=120):
        pass
    assert UNREACHABLE_S <= clock.now - started < 120


def test_a_lease_whose_renewals_fail_lapses() -> None:
    """check_held passes while the lease surely stands and raises once its
    renewals have failed for most of its term."""

    class FailingRenewals(ForwardingBackend):
        def compare_and_swap(self, key: str, expected: Version | None, data: Buffer) -> Version:
            if expected is not None:
                raise BackendError("renewal failed", key=key, transient=True)
            return self.inner.compare_and_swap(key, expected, data)

    clock = FakeClock()
    locks = LeaseLocks(FailingRenewals(MemoryBackend(object_store_semantics=True)), term=60, monotonic=clock)
    with locks.hold("gc.lock"):
        locks.check_held()
        for _ in range(2):  # two renewals fail
            clock.advance(20)
            locks.renew_held()
        locks.check_held()  # 40 s: within the term less its margin (50 s)
        clock.advance(11)  # the term (less its margin) is over
        with pytest.raises(RepositoryLockedError, match=r"gc\.lock lapsed while held"):
            locks.check_held()
    locks.check_held()  # released: nothing held, nothing to check


def test_a_refusal_says_when_the_blocking_lease_runs_out() -> None:
    """A holder cut off from the store (a persistent outage, a kill) cannot delete its
    lease: the next taker is told how long it stays."""
    now = [1000.0]
    backend = MemoryBackend(object_store_semantics=True)
    locks = LeaseLocks(backend, term=60, clock=lambda: now[0], monotonic=lambda: now[0])
    backend.put("locks/gc.lock/cut-off", lease_bytes("cut-off", shared=False, expires=now[0] + 42.4))
    with (
        pytest.raises(
            RepositoryLockedError, match=r"gc\.lock is locked by another process; its lease runs out in 42 s"
        ),
        locks.hold("gc.lock", timeout=0),
    ):
        pass
    now[0] += 43
    with locks.hold("gc.lock", timeout=0):
        assert [k.rsplit("/", 1)[1] for k in backend.list("locks/gc.lock/")] != ["cut-off"]


def test_a_release_that_fails_once_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transient failure deleting the lease on release (torture remote: a 500 on
    gc's last request) is tried again, so the next taker is not blocked for a term."""
    from ckvc.storage import leases

    monkeypatch.setattr(leases, "RELEASE_PAUSE_S", 0.0)

    class FailingDeletes(ForwardingBackend):
        failures = 2

        def delete(self, key: str) -> None:
            if key.startswith("locks/") and self.failures:
                self.failures -= 1
                raise BackendError("HTTP 500 InternalError", key=key, transient=True)
            self.inner.delete(key)

    backend = FailingDeletes(MemoryBackend(object_store_semantics=True))
    locks = LeaseLocks(backend, term=60)
    with locks.hold("gc.lock"):
        pass
    assert backend.failures == 0 and list(backend.list("locks/")) == []
    with locks.hold("gc.lock", timeout=0):  # free at once
        pass
