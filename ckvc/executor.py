"""The one executor of a repository: a thread pool sized by the ``threads`` setting,
and bounded windows over it (at most ``depth`` tasks in flight, results handed back
in submission order on the calling thread). Commit, load and fsck all pipeline
chunks through a window, so memory stays a few chunks whatever the state's size."""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from ckvc.errors import InvalidInputError

T = TypeVar("T")


def thread_count(threads: int | None) -> int:
    """Worker threads for the chunk pipeline: ``threads``, else $CKVC_THREADS, else
    one per core. 1 runs every step inline, on the calling thread."""
    if threads is None:
        env = os.environ.get("CKVC_THREADS", "").strip()
        if not env:
            return os.cpu_count() or 2
        try:
            threads = int(env)
        except ValueError:
            raise InvalidInputError(f"CKVC_THREADS must be a positive integer, got {env!r}") from None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidInputError(f"threads must be a positive integer, got {threads!r}")
    return threads


def default_window_depth(threads: int) -> int:
    """Tasks in flight that keep every worker busy while the calling thread does
    its ordered part (append, copy out)."""
    return 4 * threads + 2


# A task whose chunks average under this many bytes runs on the calling thread: its
# work is the interpreter's (per-chunk bookkeeping, not the C loops that release the
# GIL), which the GIL serializes anyway, and a worker adds thread switches on top
# (docs/DESIGN.md, "Many small tensors").
INLINE_MEAN_CHUNK_BYTES = 16 << 10


def runs_inline(total_bytes: int, chunks: int) -> bool:
    """Whether a task of ``chunks`` chunks holding ``total_bytes`` is cheaper on the calling thread."""
    return chunks > 1 and total_bytes < INLINE_MEAN_CHUNK_BYTES * chunks


def _run_inline(fn: Callable[..., T], *args: Any) -> Future[T]:
    future: Future[T] = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as exc:
        future.set_exception(exc)
    return future


class Executor:
    """A lazily started thread pool of ``threads`` workers (``threads=1``: inline)."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = thread_count(threads)
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn`` on the pool; inline when serial, and once the interpreter is
        shutting down (a background commit finishing at exit can no longer use it)."""
        if self.threads > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="ckvc")
            try:
                return self._pool.submit(fn, *args)
            except RuntimeError:
                pass
        return _run_inline(fn, *args)

    @property
    def started(self) -> bool:
        """Whether a worker thread runs (never with ``threads=1``: all inline)."""
        return self._pool is not None

    def window(self, depth: int | None = None) -> Window[Any]:
        """A bounded window over this executor (default depth: :func:`default_window_depth`)."""
        return Window(self, depth if depth is not None else default_window_depth(self.threads))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class Window(Generic[T]):
    """Submit tasks with a ``then`` callback; when ``depth`` are in flight the oldest
    is finished first (its result passed to ``then`` on the caller's thread), so
    callbacks run in submission order. Used as a context manager: on leaving with
    an error the queued tasks are cancelled and the running ones waited for, so no
    task outlives the buffers it writes into."""

    def __init__(self, executor: Executor, depth: int) -> None:
        self._executor = executor
        self._depth = max(1, depth)
        self._in_flight: collections.deque[tuple[Future[T], Callable[[T], None] | None]] = collections.deque()

    @property
    def depth(self) -> int:
        """The most tasks in flight at once."""
        return self._depth

    def submit(
        self, fn: Callable[..., T], *args: Any, then: Callable[[T], None] | None = None, inline: bool = False
    ) -> None:
        """``inline``: run ``fn`` now on this thread; its result or error still reaches
        ``then`` or the caller in submission order. A KeyboardInterrupt (or any other
        BaseException that is not an Exception) in it propagates at once."""
        if inline:
            future: Future[T] = Future()
            try:
                future.set_result(fn(*args))
            except Exception as exc:
                future.set_exception(exc)
        else:
            future = self._executor.submit(fn, *args)
        self._in_flight.append((future, then))
        if len(self._in_flight) >= self._depth:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        future, then = self._in_flight.popleft()
        result = future.result()
        if then is not None:
            then(result)

    def drain(self) -> None:
        """Finish every task in flight, in order."""
        while self._in_flight:
            self._finish_oldest()

    def __enter__(self) -> Window[T]:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.drain()
            return
        for future, _ in self._in_flight:
            future.cancel()
        for future, _ in self._in_flight:
            if not future.cancelled():
                future.exception()
        self._in_flight.clear()
