"""Shared fixtures. Plain helper functions (byte-exact comparison, state makers, the
CLI runner) live in helpers.py, importable from module-level code as well."""

from __future__ import annotations

import os
import uuid

# No test reaches a model hub: the whole session, and every child started from it
# (tests/preloaded.py's server imports transformers with these already set).
os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_proxy import s3_proxy  # noqa: F401 (fixture: a fault-injecting proxy in front of it)
from helpers import SOAK, STRESS
from s3server import s3_bucket, s3_server  # noqa: F401 (fixtures: the S3 test server on loopback)

import ckvc
from ckvc.remote.location import forget_memory_remote


@pytest.fixture
def make_repo(tmp_path: Path) -> Iterator[Callable[..., ckvc.Repo]]:
    """The repository factory: ``make_repo(name="r", **options)`` makes a new repository
    at ``tmp_path / name`` with ``Repo.init``'s options (64 KiB chunks unless
    ``chunk_size`` says otherwise: small states span several); each is closed after
    the test. A module whose tests want other options overrides ``repo`` with it."""
    made: list[ckvc.Repo] = []

    def make(name: str = "r", **options: Any) -> ckvc.Repo:
        made.append(ckvc.Repo.init(tmp_path / name, **{"chunk_size": 64 << 10, **options}))
        return made[-1]

    yield make
    for r in reversed(made):
        r.close()


@pytest.fixture
def repo(make_repo: Callable[..., ckvc.Repo]) -> ckvc.Repo:
    """A fresh repository at ``tmp_path / "r"`` with 64 KiB chunks, closed afterwards."""
    return make_repo()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Two tiers. Tests marked ``stress`` (long kill loops, soaks, benchmark smoke runs)
    are deselected unless the stress tier runs (CKVC_STRESS=1, as ``bash .ci/test --all``
    sets it) or ``-m`` names them. Tests marked ``slow`` (the longest soaks) are skipped
    unless CKVC_SOAK=1."""
    markexpr = config.getoption("markexpr", "") or ""
    if not STRESS and "stress" not in markexpr:
        kept = [item for item in items if "stress" not in item.keywords]
        if len(kept) != len(items):
            config.hook.pytest_deselected(items=[item for item in items if "stress" in item.keywords])
            items[:] = kept
    if SOAK:
        return
    skip = pytest.mark.skip(reason="soak test: run with CKVC_SOAK=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def restore_torch_switches() -> Iterator[None]:
    """The frameworks set process-wide torch switches and leave them set (the HF
    Trainer's full_determinism and Lightning's deterministic=True call
    torch.use_deterministic_algorithms(True)); under them later tests fail (empty
    float4 tensors have no deterministic fill). Every test gets them back as they were."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


@pytest.fixture(params=["dir", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A remote's URL: a directory, or a bucket-like memory remote (no rename, appends or locks)."""
    if request.param == "dir":
        yield str(tmp_path / "remote")
        return
    name = f"memory://t{uuid.uuid4().hex[:12]}"
    yield name
    forget_memory_remote(name)
