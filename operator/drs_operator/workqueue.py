"""A keyed work queue: the controller-runtime model on asyncio.

Watch handlers only *enqueue* the key (``namespace/name``) of the DisaggReplicaSet that an event
concerns; workers take keys off the queue and reconcile them from scratch. Invariants:

* a key is queued at most once, however many events arrive before a worker takes it (dedup);
* a key is reconciled by at most one worker at a time; an event that arrives during a reconcile
  re-queues the key after the reconcile finishes ("dirty" bit), so no event is lost;
* ``add_after`` schedules a key for later (requeue-after, periodic resync) without blocking;
* a key dirtied during its reconcile runs again only after as long as that reconcile took
  (``done(key, took)``): while a large fleet's pods stream events, its passes take at most half
  of a worker, and every event is still seen by the next pass.

It lives in the operator's memory only: losing it on restart is safe because every known key is
enqueued again when the watches replay their initial listing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)
#: Requeue delay after a reconcile raised an unexpected exception.
ERROR_REQUEUE_S = 5.0


class WorkQueue:
    def __init__(self) -> None:
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._processing: set[str] = set()
        self._dirty: set[str] = set()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._known: set[str] = set()

    @property
    def known(self) -> frozenset[str]:
        """Every key seen and not forgotten (for periodic resync and node events)."""
        return frozenset(self._known)

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, key: str) -> None:
        self._known.add(key)
        if key in self._processing:
            self._dirty.add(key)
            return
        if key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def touch(self, key: str) -> None:
        """Enqueue ``key`` if it is known (a child's or node's event for a resource seen before)."""
        if key in self._known:
            self.add(key)

    def touch_all(self) -> None:
        """Enqueue every known key."""
        for key in list(self._known):
            self.add(key)

    def add_after(self, key: str, delay: float) -> None:
        """Enqueue ``key`` in ``delay`` seconds; an earlier pending schedule wins."""
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.0, delay)
        existing = self._timers.get(key)
        if existing is not None and existing.when() <= when:
            return
        if existing is not None:
            existing.cancel()
        self._timers[key] = loop.call_at(when, self._fire, key)

    def _fire(self, key: str) -> None:
        self._timers.pop(key, None)
        if key in self._known:
            self.add(key)

    def forget(self, key: str) -> None:
        """The object is gone: drop pending work and schedules for it."""
        self._known.discard(key)
        self._dirty.discard(key)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    async def get(self) -> str:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            if key not in self._known:
                continue
            self._processing.add(key)
            return key

    def done(self, key: str, took: float = 0.0) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            if took > 0:
                self.add_after(key, took)
            else:
                self.add(key)

    def shutdown(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()


async def run_workers(
    queue: WorkQueue, count: int, work: Callable[[str], Awaitable[float | None]], stop: asyncio.Event
) -> None:
    """Run ``count`` workers until ``stop`` is set. ``work(key)`` returns a requeue delay or None."""

    async def worker() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            key = await queue.get()
            started = loop.time()
            try:
                delay = await work(key)
            except Exception:  # a bug or an unexpected API failure: log it, retry later, keep the worker
                log.exception("reconcile of %s failed; retrying in %.0fs", key, ERROR_REQUEUE_S)
                delay = ERROR_REQUEUE_S
            finally:
                queue.done(key, loop.time() - started)
            if delay is not None:
                queue.add_after(key, delay)

    tasks = [asyncio.create_task(worker(), name=f"drs-reconcile-worker-{i}") for i in range(count)]
    try:
        await stop.wait()
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
