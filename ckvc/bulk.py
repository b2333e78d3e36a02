"""Bulk work in the interpreter: the cyclic garbage collector paused while it runs."""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while bulk work runs (a commit, a load): they
    allocate objects per tensor and chunk, none of them in cycles, and with tens of
    thousands of tensors the collections those allocations trigger cost a fifth of
    the time (docs/DESIGN.md, "Many small tensors"). Nested and concurrent pauses
    count; the collector is back on, if it was on, when the last one ends."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def pauses_gc(fn: F) -> F:
    """``fn`` run under :func:`gc_paused`. A wrapper of this module's own, not
    contextlib's decorator form, so a warning's caller frame (the first outside
    ckvc, ``caller_stacklevel``) is still the user's."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
