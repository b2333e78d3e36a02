"""`ckvc serve` on a long history: answer times of the pages' JSON, and a check that
the API's numbers equal the CLI's.

    .venv/bin/python benchmarks/web.py [--commits 2000] [--repeats 5] [--dir DIR] [--browser]

Builds a repository of ``--commits`` tiny commits (a main line, a branch forked at
two thirds with the last third, a tag every 100 commits, metrics on each), serves it
on a loopback port in this process, and times over HTTP, in alternating rounds with
the baseline ``/api/version`` (one refs read):

- ``/api/log?all=1`` (what the history page draws) and ``/api/metrics``;
- the history page as a browser loads it: the page, its script and style, then
  ``/api/log?all=1`` and ``/api/refs``; the metrics page likewise with ``/api/metrics``;
- ``/api/du`` (reads every snapshot) for scale.

Then it compares ``/api/log?all=1``, ``/api/du`` and ``/api/retain`` with ``ckvc log
--all --json``, ``ckvc du --json`` and ``ckvc retain --dry-run --json`` run as
commands. ``--browser``: also the time headless Chromium takes from navigation to
the drawn history and metrics pages (median of ``--repeats``).

Acceptance (issue 18): history and metrics pages <= 1 s each (median), numbers equal.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LIMIT_S = 1.0


def build_repo(root: Path, commits: int) -> float:
    """The repository, through the ordinary write path; returns seconds taken."""
    import torch

    import ckvc
    from ckvc.retention_policy import RetentionPolicy

    started = time.perf_counter()
    fork = commits * 2 // 3
    with ckvc.Repo.init(root) as repo:
        for i in range(fork):
            metrics = {"val_loss": 1.0 / (i + 1), "acc": i / commits, "step": float(i * 10)}
            repo.commit({"w": torch.full((8,), float(i)), "epoch": i}, message=f"step {i}", metrics=metrics)
            if i % 100 == 0:
                repo.tag(f"t{i}")
        repo.branch("side", "HEAD~1")
        repo.switch("side")
        for i in range(fork, commits):
            metrics = {"val_loss": 0.9 / (i + 1), "acc": i / commits, "step": float(i * 10)}
            repo.commit({"w": torch.full((8,), -float(i)), "epoch": i}, message=f"side {i}", metrics=metrics)
        repo.switch("main")
        repo.set_retention(RetentionPolicy(keep_last=50, keep_every=10))
    return time.perf_counter() - started


def fetch(port: int, paths: list[str]) -> float:
    """Seconds to GET each path in turn on one keep-alive connection (as a browser would)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    started = time.perf_counter()
    for path in paths:
        conn.request("GET", path)
        res = conn.getresponse()
        res.read()
        assert res.status == 200, (path, res.status)
    elapsed = time.perf_counter() - started
    conn.close()
    return elapsed


def get_json(port: int, path: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("GET", path)
    body = json.loads(conn.getresponse().read())
    conn.close()
    return body


def cli_json(root: Path, *args: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "ckvc", "-C", str(root), *args, "--json"], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def browser_times(url: str, repeats: int) -> dict[str, float]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    out: dict[str, list[float]] = {"history": [], "metrics": []}
    try:
        for _ in range(repeats):
            for page in out:
                started = time.perf_counter()
                driver.get(url + page)
                WebDriverWait(driver, 60, poll_frequency=0.01).until(
                    lambda d: d.execute_script("return document.body.dataset.rendered || null")
                )
                out[page].append(time.perf_counter() - started)
    finally:
        driver.quit()
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commits", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--browser", action="store_true", help="also time the drawn pages in headless Chromium")
    args = ap.parse_args()

    from ckvc.web import make_server

    scratch = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        root = scratch / "repo"
        built_s = build_repo(root, args.commits)
        print(f"built {args.commits} commits in {built_s:.1f} s")
        server = make_server(root, "127.0.0.1", 0)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        port = int(server.server_address[1])
        static = ["/history", "/static/app.js", "/static/style.css"]
        cases: dict[str, Callable[[], float]] = {
            "baseline /api/version": lambda: fetch(port, ["/api/version"]),
            "/api/log?all=1": lambda: fetch(port, ["/api/log?all=1"]),
            "/api/metrics": lambda: fetch(port, ["/api/metrics"]),
            "history page (html+js+css+log+refs)": lambda: fetch(port, [*static, "/api/log?all=1", "/api/refs"]),
            "metrics page (html+js+css+metrics)": lambda: fetch(port, [*static, "/api/metrics"]),
            "/api/du": lambda: fetch(port, ["/api/du"]),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for case in cases.values():  # one untimed warm-up each
            case()
        for _ in range(args.repeats):  # alternating rounds: load on the machine hits all alike
            for name, case in cases.items():
                times[name].append(case())
        base = statistics.median(times["baseline /api/version"])
        print(f"{'request':<40} {'median s':>9} {'x baseline':>11}")
        for name, values in times.items():
            med = statistics.median(values)
            print(f"{name:<40} {med:9.3f} {med / base:11.1f}")
        log = get_json(port, "/api/log?all=1")
        equal = {
            "log --all": log == cli_json(root, "log", "--all"),
            "du": get_json(port, "/api/du") == cli_json(root, "du"),
            "retain --dry-run": get_json(port, "/api/retain") == cli_json(root, "retain", "--dry-run"),
        }
        print(f"log entries: {len(log)}; API == CLI: " + ", ".join(f"{k} {v}" for k, v in equal.items()))
        drawn: dict[str, float] = {}
        if args.browser:
            drawn = browser_times(server.url, args.repeats)
            print(
                "headless Chromium, navigation to drawn page (median): "
                + ", ".join(f"{k} {v:.3f} s" for k, v in drawn.items())
            )
        server.shutdown()
        server.server_close()
        server.api.close()
        history = statistics.median(times["history page (html+js+css+log+refs)"])
        metrics = statistics.median(times["metrics page (html+js+css+metrics)"])
        ok = history <= LIMIT_S and metrics <= LIMIT_S and all(equal.values())
        print(
            f"acceptance (<= {LIMIT_S} s, API == CLI): history {history:.3f} s, metrics {metrics:.3f} s, "
            f"equal {all(equal.values())}: {'PASS' if ok else 'FAIL'}"
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
