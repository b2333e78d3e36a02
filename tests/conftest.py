"""Shared fixtures. Plain helper functions (byte-exact comparison, state makers, the
CLI runner) live in helpers.py, importable from module-level code as well."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_proxy import s3_proxy  # noqa: F401 (fixture: a fault-injecting proxy in front of it)
from s3server import s3_bucket, s3_server  # noqa: F401 (fixtures: the S3 test server on loopback)

import ckvc


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[ckvc.Repo]:
    """A fresh repository at ``tmp_path / "r"`` with 64 KiB chunks (small states
    span several), closed afterwards. A module defining its own ``repo`` overrides it."""
    r = ckvc.Repo.init(tmp_path / "r", chunk_size=64 << 10)
    yield r
    r.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (soak runs) run only with CKVC_SOAK=1."""
    if os.environ.get("CKVC_SOAK") == "1":
        return
    skip = pytest.mark.skip(reason="soak test: run with CKVC_SOAK=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
