"""A stream's events read ahead, so one SSE chunk carries every token that arrived since the last.

A streaming answer sends one chunk per token by default: one incremental detokenize, one JSON
chunk and one send each. When an engine makes tokens faster than the server's event loop can send
them one by one (the ``torch`` backend at 32 streams: 32 tokens per decode step), that per-token
Python is what limits the rate. :class:`ReadAhead` reads a leg's events on a task of its own into
a queue; :meth:`ReadAhead.next_run` waits for one event and takes every other one already there,
so a stream that fell behind catches up in one chunk (its ``token_ids`` then hold several ids, the
shape a chunk already has). A backend opts in with ``EngineBackend.stream_runs``; with the others a
stream still sends exactly one chunk per token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from drs_engine.backends.base import LegEvent, LegFinished


class ReadAhead:
    """``events`` read on a task of its own; :meth:`next_run` gives what arrived, oldest first."""

    def __init__(self, events: AsyncGenerator[LegEvent, None]) -> None:
        self._events = events
        self._queue: asyncio.Queue[LegEvent | Exception] = asyncio.Queue()
        self._failed: Exception | None = None
        self._task = asyncio.create_task(self._pump(), name="drs-stream-read-ahead")

    async def _pump(self) -> None:
        try:
            async for event in self._events:
                self._queue.put_nowait(event)
                if isinstance(event, LegFinished):
                    return
            self._queue.put_nowait(RuntimeError("the leg's events ended without a finish"))
        except Exception as exc:  # the stream sends the tokens before it, then the error
            self._queue.put_nowait(exc)

    async def next_run(self) -> list[LegEvent]:
        """At least one event (waiting for it) and every event already read after it; an error
        the events raised comes after the events before it, on the next call."""
        if self._failed is not None:
            raise self._failed
        run: list[LegEvent] = []
        item = await self._queue.get()
        while True:
            if isinstance(item, Exception):
                if not run:
                    raise item
                self._failed = item
                return run
            run.append(item)
            if self._queue.empty():
                return run
            item = self._queue.get_nowait()

    async def close(self) -> None:
        """Stop reading (the client left, or the stream ended) and close the events."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._events.aclose()
