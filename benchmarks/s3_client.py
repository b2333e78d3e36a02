"""Object-store client benchmark: obstore against boto3 on one S3 server on loopback.

    .venv/bin/python benchmarks/s3_client.py [--size-mib 64] [--rounds 5] [--small 100] [--json]

The server is moto's (tests/s3server.py) in a subprocess, so its Python does
not share the clients' GIL, with moto's own concurrent writes (no test lock). Both
clients run in this process, against the same server, in alternating rounds (the
order flips each round); the table shows medians and boto3/obstore ratios (> 1:
obstore is faster). Operations:

* PUT of a ``--size-mib`` object as one request, and as a multipart upload
  (8 MiB parts, 8 in flight: boto3's ``upload_fileobj`` with a TransferConfig,
  obstore's ``put(use_multipart=True)``);
* GET of the whole object into memory;
* 256 range GETs of 64 KiB from a 32 MiB object (``--ranged-mib``) (a seeded half of its 64 KiB
  slots, in offset order, like the records of a pack that a checkout needs): one
  GET per range with 16 in flight, and coalesced (ranges 1 MiB apart or less
  merged into one request: obstore's ``get_ranges``; for boto3 the same merge done
  here, 16 in flight). Small on purpose: moto copies the whole object out of its
  buffer for every range request, so on a large object the server's copying is
  all a range GET measures;
* ``--small`` sequential PUTs and GETs of a 100-byte object (latency per request);
* client CPU: this process's CPU seconds (all its threads) per GiB moved, for the
  bulk operations: what the client itself costs, whatever the server's speed;
* the GIL: how far a pure-Python counting thread gets during the whole-object GET,
  as a fraction of how far it gets alone in the same time (1.0: the client left
  the interpreter free). On a machine with fewer cores than busy threads (the
  server, the client's I/O threads, the counter) this is mostly scheduling noise;
* conditional writes: ``If-None-Match: *`` on an existing key and ``If-Match`` with
  a stale ETag must both be refused with 412, a current ETag accepted.

Loopback with moto measures the clients' overhead plus moto's (Python, in memory),
not a network: the ratios say which client costs less per byte and per request.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import io
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from s3server import FAKE_CREDENTIALS, S3Server

MiB = 1 << 20
PART = 8 * MiB
IN_FLIGHT = 8
RANGE_SIZE = 64 << 10
RANGED_OBJECT = 32 * MiB
RANGES = 256
COALESCE = 1 * MiB
REGION = "us-east-1"

Ranges = Sequence[tuple[int, int]]


def merged(ranges: Ranges, gap: int) -> list[tuple[int, int]]:
    """(start, end) runs covering ``ranges`` (sorted), joining those ``gap`` or less apart."""
    runs: list[tuple[int, int]] = []
    for off, size in ranges:
        if runs and off - runs[-1][1] <= gap:
            runs[-1] = (runs[-1][0], max(runs[-1][1], off + size))
        else:
            runs.append((off, off + size))
    return runs


class Obstore:
    name = "obstore"

    def __init__(self, endpoint: str, bucket: str) -> None:
        import obstore
        from obstore.store import S3Store

        self.obs = obstore
        self.store = S3Store(
            bucket,
            endpoint=endpoint,
            region=REGION,
            access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            client_options={"allow_http": True, "timeout": "120s"},
            retry_config={"max_retries": 0},
        )
        self.pool = concurrent.futures.ThreadPoolExecutor(16)

    def put(self, key: str, data: bytes) -> None:
        self.obs.put(self.store, key, data, use_multipart=False)

    def put_multipart(self, key: str, data: bytes) -> None:
        self.obs.put(self.store, key, data, use_multipart=True, chunk_size=PART, max_concurrency=IN_FLIGHT)

    def get(self, key: str) -> int:
        return len(self.obs.get(self.store, key).bytes())

    def ranges(self, key: str, ranges: Ranges) -> int:
        def one(r: tuple[int, int]) -> int:
            return len(self.obs.get_range(self.store, key, start=r[0], length=r[1]))

        return sum(self.pool.map(one, ranges))

    def ranges_coalesced(self, key: str, ranges: Ranges) -> int:
        got = self.obs.get_ranges(
            self.store, key, starts=[o for o, _ in ranges], lengths=[s for _, s in ranges], coalesce=COALESCE
        )
        return sum(len(b) for b in got)

    def conditional(self, key: str) -> dict[str, str]:
        first = self.obs.put(self.store, key, b"one", mode="create")
        out = {}
        try:
            self.obs.put(self.store, key, b"two", mode="create")
            out["If-None-Match: * on an existing key"] = "accepted (WRONG)"
        except self.obs.exceptions.AlreadyExistsError:
            out["If-None-Match: * on an existing key"] = "412 refused"
        try:
            self.obs.put(self.store, key, b"two", mode={"e_tag": '"0123456789abcdef0123456789abcdef"'})
            out["If-Match: stale ETag"] = "accepted (WRONG)"
        except self.obs.exceptions.PreconditionError:
            out["If-Match: stale ETag"] = "412 refused"
        self.obs.put(self.store, key, b"two", mode={"e_tag": first["e_tag"]})
        out["If-Match: current ETag"] = "accepted"
        return out


class Boto3:
    name = "boto3"

    def __init__(self, endpoint: str, bucket: str) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=REGION,
            aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            config=Config(max_pool_connections=16, retries={"max_attempts": 1}, read_timeout=120),
        )
        self.transfer = TransferConfig(
            multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=IN_FLIGHT, use_threads=True
        )
        self.pool = concurrent.futures.ThreadPoolExecutor(16)

    def put(self, key: str, data: bytes) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=data)

    def put_multipart(self, key: str, data: bytes) -> None:
        self.s3.upload_fileobj(io.BytesIO(data), self.bucket, key, Config=self.transfer)

    def _range(self, key: str, start: int, end: int) -> int:
        body = self.s3.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"]
        return len(body.read())

    def get(self, key: str) -> int:
        return len(self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read())

    def ranges(self, key: str, ranges: Ranges) -> int:
        return sum(self.pool.map(lambda r: self._range(key, r[0], r[0] + r[1]), ranges))

    def ranges_coalesced(self, key: str, ranges: Ranges) -> int:
        runs = merged(ranges, COALESCE)
        got = sum(self.pool.map(lambda r: self._range(key, r[0], r[1]), runs))
        return got - sum(e - s for s, e in runs) + sum(s for _, s in ranges)  # the requested bytes

    def conditional(self, key: str) -> dict[str, str]:
        from botocore.exceptions import ClientError

        first = self.s3.put_object(Bucket=self.bucket, Key=key, Body=b"one", IfNoneMatch="*")
        out = {}
        for what, kwargs in [
            ("If-None-Match: * on an existing key", {"IfNoneMatch": "*"}),
            ("If-Match: stale ETag", {"IfMatch": '"0123456789abcdef0123456789abcdef"'}),
        ]:
            try:
                self.s3.put_object(Bucket=self.bucket, Key=key, Body=b"two", **kwargs)
                out[what] = "accepted (WRONG)"
            except ClientError as exc:
                out[what] = f"{exc.response['ResponseMetadata']['HTTPStatusCode']} refused"
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=b"two", IfMatch=first["ETag"])
        out["If-Match: current ETag"] = "accepted"
        return out


def gil_share(call: Callable[[], object]) -> tuple[float, float]:
    """(seconds of ``call``, the fraction of the interpreter a counting thread got meanwhile)."""

    def count(stop: threading.Event, out: list[int]) -> None:
        n = 0
        while not stop.is_set():
            n += 1
        out.append(n)

    def counted(body: Callable[[], object]) -> tuple[float, int]:
        stop, out = threading.Event(), list[int]()
        t = threading.Thread(target=count, args=(stop, out))
        t.start()
        start = time.perf_counter()
        body()
        elapsed = time.perf_counter() - start
        stop.set()
        t.join()
        return elapsed, out[0]

    elapsed, busy = counted(call)
    _, idle = counted(lambda: time.sleep(elapsed))
    return elapsed, busy / idle if idle else float("nan")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--small", type=int, default=100, help="small-object PUTs and GETs per round")
    parser.add_argument(
        "--ranged-mib", type=int, default=RANGED_OBJECT // MiB, help="size of the object read by ranges"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    server = S3Server.start(atomic_writes=False)
    try:
        bucket = server.create_bucket()
        clients: list[Any] = [Obstore(server.endpoint, bucket), Boto3(server.endpoint, bucket)]
        size = args.size_mib * MiB
        data = os.urandom(size)
        big = os.urandom(args.ranged_mib * MiB)
        rng = random.Random(0)
        slots = sorted(rng.sample(range(len(big) // RANGE_SIZE), min(RANGES, len(big) // RANGE_SIZE // 2)))
        ranges = [(s * RANGE_SIZE, RANGE_SIZE) for s in slots]
        want = sum(n for _, n in ranges)
        clients[0].put("bench/ranged", big)
        clients[0].put("bench/whole", data)
        small = b"x" * 100

        ops: dict[str, Callable[[Any], object]] = {
            "PUT single": lambda c: c.put(f"bench/put-{c.name}", data),
            "PUT multipart": lambda c: c.put_multipart(f"bench/mp-{c.name}", data),
            "GET whole": lambda c: c.get("bench/whole") == size or sys.exit("short GET"),
            "ranges, one GET each": lambda c: c.ranges("bench/ranged", ranges) == want or sys.exit("short ranges"),
            "ranges, coalesced": lambda c: c.ranges_coalesced("bench/ranged", ranges) == want or sys.exit("short"),
            "small PUT": lambda c: [c.put(f"bench/small-{c.name}", small) for _ in range(args.small)],
            "small GET": lambda c: [c.get(f"bench/small-{c.name}") for _ in range(args.small)],
        }
        times: dict[str, dict[str, list[float]]] = {op: {c.name: [] for c in clients} for op in ops}
        cpu: dict[str, dict[str, list[float]]] = {op: {c.name: [] for c in clients} for op in ops}
        gil: dict[str, list[float]] = {c.name: [] for c in clients}
        for name in ("small PUT",):  # warm connections and credentials, untimed
            for c in clients:
                ops[name](c)
        for r in range(args.rounds):
            order = clients if r % 2 == 0 else clients[::-1]
            for op, call in ops.items():
                for c in order:
                    start, start_cpu = time.perf_counter(), time.process_time()
                    call(c)
                    times[op][c.name].append(time.perf_counter() - start)
                    cpu[op][c.name].append(time.process_time() - start_cpu)
            for c in order:
                gil[c.name].append(gil_share(functools.partial(c.get, "bench/whole"))[1])

        results: dict[str, Any] = {"size_mib": args.size_mib, "rounds": args.rounds, "ops": {}}
        print(f"obstore vs boto3 on moto at {server.endpoint}: {args.size_mib} MiB, {args.rounds} rounds, medians")
        print(f"{'operation':<24}{'obstore':>14}{'boto3':>14}{'boto3/obstore':>15}{'client CPU s/GiB o | b':>26}")
        for op, by in times.items():
            med: dict[str, float] = {n: statistics.median(v) for n, v in by.items()}
            per = args.small if op.startswith("small") else 1
            mib = {"PUT single": size, "PUT multipart": size, "GET whole": size}.get(op, want) / MiB
            cpu_gib = {n: statistics.median(v) / (mib * per / 1024) for n, v in cpu[op].items()}
            results["ops"][op] = {n: {"median_s": m / per, "cpu_s_per_gib": cpu_gib[n]} for n, m in med.items()}

            def cell(n: str, med: dict[str, float] = med, per: int = per, mib: float = mib) -> str:
                m = med[n]
                return f"{m / per * 1e3:9.2f} ms/op" if per > 1 else f"{mib / m:8.0f} MiB/s"

            cpus = "" if per > 1 else f"{cpu_gib['obstore']:>15.2f} | {cpu_gib['boto3']:<8.2f}"
            print(f"{op:<24}{cell('obstore'):>14}{cell('boto3'):>14}{med['boto3'] / med['obstore']:>15.2f}{cpus}")
        shares = {n: statistics.median(v) for n, v in gil.items()}
        results["gil_share_during_get"] = shares
        print(f"{'Python thread progress':<24}{shares['obstore']:>14.2f}{shares['boto3']:>14.2f}   (1.0 = GIL free)")
        print("conditional writes on moto:")
        for c in clients:
            found = c.conditional(f"bench/cond-{c.name}")
            results.setdefault("conditional", {})[c.name] = found
            print(f"  {c.name}: " + "; ".join(f"{k}: {v}" for k, v in found.items()))
        if args.json:
            print(json.dumps(results, indent=2))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
