"""Writer pins and gc exclusivity, over ``Backend.lock``.

Writers (commits, tags, index refreshes) hold the gc lock shared while they
work; gc takes it exclusively for its short critical section. So gc never
removes an object that an in-flight writer deduplicated against, and a writer
never sees an index entry that gc is about to drop.

Locally the locks are flocks on ``gc.lock`` and ``gc-intent.lock`` (the file
names every ckvc version uses, so old and new processes exclude each other);
on an object store they become lease objects (docs/DESIGN.md, "Backends: local
mechanisms on an object store").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ckvc.storage.backend import Backend

GC_LOCK = "gc.lock"
GC_INTENT_LOCK = "gc-intent.lock"
GC_RUN_LOCK = "gc-run.lock"
PIN_TIMEOUT_S = 120.0


class StoreLocks:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.exclusive_held = False
        self._pins = threading.local()  # this thread's pin depth

    @contextlib.contextmanager
    def pin(self, timeout: float = PIN_TIMEOUT_S) -> Iterator[None]:
        """Shared lock held by writers: gc's sweep waits for them and they for it."""
        # Re-entrant: a pinned writer may pin again (an index refresh on a lookup
        # miss). Taking the intent lock again there would deadlock against a gc
        # waiting for this very pin.
        held: int = getattr(self._pins, "depth", 0)
        if self.exclusive_held or held:
            yield
            return
        # Passing through the intent lock first gives a waiting gc priority: flock
        # would otherwise let a stream of overlapping writers starve it.
        with self.backend.lock(GC_INTENT_LOCK, shared=True, timeout=timeout):
            pass
        with self.backend.lock(GC_LOCK, shared=True, timeout=timeout):
            self._pins.depth = 1
            try:
                yield
            finally:
                self._pins.depth = 0

    def one_gc(self) -> contextlib.AbstractContextManager[None]:
        """One gc at a time (a second could delete the first one's temporary packs);
        RepositoryLockedError at once if another holds it."""
        return self.backend.lock(GC_RUN_LOCK, timeout=0)

    @contextlib.contextmanager
    def exclusive(self, timeout: float) -> Iterator[None]:
        """gc's critical section: no writer is in flight while it is held."""
        with (
            self.backend.lock(GC_INTENT_LOCK, shared=False, timeout=timeout),
            self.backend.lock(GC_LOCK, shared=False, timeout=timeout),
        ):
            self.exclusive_held = True
            try:
                yield
            finally:
                self.exclusive_held = False
