"""``GET /metrics`` (issue 30): the Prometheus text format, parsed by prometheus_client,
with the values of ``ckvc stats --json`` and ``du``; behind the token like every route."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run
from prometheus_client.parser import text_string_to_metric_families
from webrepo import serving

import ckvc
from ckvc.web import WebServer


@pytest.fixture
def repo_path(tmp_path: Path) -> Path:
    with ckvc.Repo.init(tmp_path / "r") as repo:
        repo.remotes.add("origin", str(tmp_path / "remote"))
        repo.commit({"w": torch.arange(1000.0)}, message="one")
        repo.push("origin")
        repo.commit({"w": torch.arange(1000.0) * 2}, message="two")
        repo.branch("side", "main~1")
        repo.set_config(auto_push=None)
    return tmp_path / "r"


@pytest.fixture
def server(repo_path: Path) -> Iterator[WebServer]:
    yield from serving(repo_path, token="metrics-token-0123456789")


def scrape(server: WebServer, headers: dict[str, str]) -> tuple[int, str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", int(server.server_address[1]), timeout=60)
    conn.request("GET", "/metrics", headers=headers)
    res = conn.getresponse()
    body = res.read().decode()
    conn.close()
    return res.status, res.getheader("Content-Type") or "", body


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_parse_and_equal_stats_and_du(server: WebServer, repo_path: Path) -> None:
    assert scrape(server, {})[0] == 401
    status, ctype, body = scrape(server, {"Authorization": "token metrics-token-0123456789"})
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    got = samples(body)
    stats = json.loads(run(repo_path, "stats", "--json").stdout)
    du = json.loads(run(repo_path, "du", "--json").stdout)
    for name in ("pack_bytes", "logical_bytes", "unique_raw_bytes", "stored_chunk_bytes"):
        assert got[(f"ckvc_{name}", ())] == stats[f"ckvc_{name}"] == du[name]
    assert got[("ckvc_dedup_ratio", ())] == pytest.approx(du["dedup_ratio"])
    assert got[("ckvc_commits_live", ())] == du["commits"] == 2
    assert got[("ckvc_branch_commits", (("branch", "main"),))] == 2
    assert got[("ckvc_branch_commits", (("branch", "side"),))] == 1
    assert got[("ckvc_remote_commits_not_pushed", (("branch", "main"), ("remote", "origin")))] == 1
    assert ("ckvc_remote_commits_not_pushed", (("branch", "side"), ("remote", "origin"))) not in got
    ages: Any = {s["branch"]: s["value"] for s in stats["ckvc_branch_newest_commit_age_seconds"]}
    assert set(ages) == {"main", "side"} and all(v >= 0 for v in ages.values())
    assert [s for s in stats["ckvc_remote_commits_not_pushed"]] == [{"remote": "origin", "branch": "main", "value": 1}]


def test_stats_text_is_human_readable(repo_path: Path) -> None:
    result = run(repo_path, "stats")
    assert result.exit_code == 0, result.output
    assert "ckvc_branch_commits{branch=main}  2" in result.stdout
    assert any(line.startswith("ckvc_pack_bytes  ") and line.endswith("B") for line in result.stdout.splitlines())


def test_a_browser_asking_for_html_gets_the_metrics_page(server: WebServer) -> None:
    status, ctype, body = scrape(
        server, {"Authorization": "token metrics-token-0123456789", "Accept": "text/html,application/xhtml+xml"}
    )
    assert status == 200 and ctype.startswith("text/html") and "<html" in body.lower()
