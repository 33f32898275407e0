"""Where an event loop stalls (not a test): a watchdog thread that samples the loop thread's stack
while the loop is late to a heartbeat of its own.

:class:`StallSampler` runs a heartbeat task on the loop (every ``tick_s``) and a thread that, every
``tick_s``, looks at how long ago the heartbeat last ran; past ``threshold_s`` the loop is stalled
(a callback holds it) and the thread records the loop thread's innermost frames
(``sys._current_frames``). :meth:`StallSampler.top` gives the stacks seen most, with the samples
each got (one sample is about ``tick_s`` of stall): what the benchmark's figures do not say.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass

#: heartbeat and sampling period, seconds
TICK_S = 0.005
#: the loop counts as stalled once its heartbeat is this late
THRESHOLD_S = 0.05
#: innermost frames that name a stall's stack
DEPTH = 8


@dataclass(frozen=True)
class Stall:
    """A stack the loop thread was sampled in while stalled (innermost frame last)."""

    samples: int
    stalled_s: float  #: samples x tick: the stall time it stands for
    stack: list[str]


class StallSampler:
    """Samples the running loop's thread while the loop is stalled; ``async with`` around the work."""

    def __init__(self, threshold_s: float = THRESHOLD_S, tick_s: float = TICK_S, depth: int = DEPTH) -> None:
        self.threshold_s = threshold_s
        self.tick_s = tick_s
        self.depth = depth
        self.samples: Counter[tuple[str, ...]] = Counter()
        self._beat = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop_thread = threading.get_ident()

    async def __aenter__(self) -> StallSampler:
        self._loop_thread = threading.get_ident()
        self._beat = time.perf_counter()
        self._task = asyncio.create_task(self._heartbeat(), name="stall-heartbeat")
        self._thread = threading.Thread(target=self._watch, name="stall-sampler", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
        if self._thread is not None:
            self._thread.join(1)

    async def _heartbeat(self) -> None:
        while True:
            self._beat = time.perf_counter()
            await asyncio.sleep(self.tick_s)

    def _watch(self) -> None:
        while not self._stop.wait(self.tick_s):
            if time.perf_counter() - self._beat < self.threshold_s:
                continue
            frame = sys._current_frames().get(self._loop_thread)
            if frame is None:
                continue
            stack = traceback.extract_stack(frame)[-self.depth :]
            self.samples[tuple(f"{s.filename.rsplit('/', 2)[-1]}:{s.lineno} {s.name}" for s in stack)] += 1

    def top(self, n: int = 5) -> list[Stall]:
        """The ``n`` stacks sampled most while stalled."""
        return [
            Stall(count, round(count * self.tick_s, 3), list(stack)) for stack, count in self.samples.most_common(n)
        ]
