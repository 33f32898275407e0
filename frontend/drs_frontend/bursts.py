"""First turns that share an opening, in flight on this frontend: GRPO siblings in one burst.

The ctx router sends siblings (the same opening, :mod:`.routing.groups`) to one prefill engine,
but an engine shares no prompt blocks that are still being computed (TensorRT-LLM stores a
request's context blocks for reuse when its context phase ends; the sim engine does the same), so
siblings that reach it together would each compute the prompt. So the first of a burst (the
*leader*) goes at once and the others wait here until its context leg is over, then read the
prompt from the engine's cache:

* a follower waits at most until the leader's context leg ends (answered, failed or cancelled)
  or ``hold_seconds``, whichever is first, so it waits at most one leader prefill longer than it
  would alone; then it is routed as usual (to the group's engine, within the load bound);
* a burst lasts while any of its first turns is in flight here; when the last one answers, the
  burst's *completion time* (first dispatch to the last answer) is observed if it had more than
  one member, and a later first
  turn with the same opening starts a new burst (the prompt is cached by then: no holding);
* at most ``max_bursts`` bursts are tracked; beyond that a first turn neither leads nor waits.

Only I/O-free bookkeeping and one wait; the routing rule stays in :mod:`.routing`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from drs_frontend.metrics import FrontendMetrics


@dataclass(slots=True)
class _Burst:
    started: float
    in_flight: int = 1
    members: int = 1
    leader_done: asyncio.Event = field(default_factory=asyncio.Event)


class Member:
    """One first turn's place in its burst: the relay calls :meth:`context_done` after the context
    leg and :meth:`leave` when the turn is over (both idempotent)."""

    __slots__ = ("_burst", "_bursts", "_key", "_left", "leader")

    def __init__(self, bursts: GroupBursts, key: str, burst: _Burst, *, leader: bool) -> None:
        self._bursts = bursts
        self._key = key
        self._burst = burst
        self._left = False
        self.leader = leader

    def context_done(self) -> None:
        if self.leader:
            self._burst.leader_done.set()

    def leave(self) -> None:
        if self._left:
            return
        self._left = True
        self.context_done()
        self._bursts._leave(self._key, self._burst)


class GroupBursts:
    def __init__(
        self, metrics: FrontendMetrics, *, max_bursts: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_bursts < 1:
            raise ValueError("max_bursts must be at least 1")
        self._metrics = metrics
        self._max = max_bursts
        self._clock = clock
        self._bursts: dict[str, _Burst] = {}

    def __len__(self) -> int:
        return len(self._bursts)

    async def join(self, key: str, hold_seconds: float) -> Member | None:
        """Lead a new burst of ``key``, or follow the one in flight (waiting for its leader's
        context leg, bounded); None when too many bursts are tracked."""
        burst = self._bursts.get(key)
        if burst is None:
            if len(self._bursts) >= self._max:
                return None
            burst = self._bursts[key] = _Burst(self._clock())
            return Member(self, key, burst, leader=True)
        burst.in_flight += 1
        burst.members += 1
        member = Member(self, key, burst, leader=False)
        if not burst.leader_done.is_set() and hold_seconds > 0:
            started = time.perf_counter()
            try:
                await asyncio.wait_for(burst.leader_done.wait(), hold_seconds)
                outcome = "released"
            except TimeoutError:
                outcome = "timed_out"
            except BaseException:
                member.leave()
                raise
            self._metrics.group_hold_seconds.observe(time.perf_counter() - started)
            self._metrics.group_holds_of(outcome).inc()
        return member

    def _leave(self, key: str, burst: _Burst) -> None:
        burst.in_flight -= 1
        if burst.in_flight == 0 and self._bursts.get(key) is burst:
            del self._bursts[key]
            if burst.members > 1:  # a group, not a lone conversation
                self._metrics.group_completion_seconds.observe(self._clock() - burst.started)
