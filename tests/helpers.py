"""Shared test helpers: compare states by their raw bytes, never by values
(so NaN payloads and -0.0 count)."""

from __future__ import annotations

from typing import Any

import torch


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_state_equal(a: Any, b: Any, path: str = "") -> None:
    """``a`` and ``b`` have the same structure, types, tensor dtypes, shapes and bytes."""
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert tensor_bytes(a) == tensor_bytes(b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_state_equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_equal(x, y, f"{path}.{i}")
    else:
        assert a == b, path
