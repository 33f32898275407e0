"""The live state of one replica's engine pools: in-flight counts, cool-downs, probe results.

This is the only mutable state the routers read; it belongs to one relay (no module-level
state). An engine is a *candidate* when its last health probe did not fail and it is not in a
cool-down after a failed call. Cool-downs use a monotonic clock that tests can replace.

A pool may also hold *fallback* engines (another replica's engines of the same role, from the
operator): they are candidates only while no engine of this replica is, so a replica whose engines
restart (a roll, a crash) keeps serving its sessions on borrowed engines, and returns to its own
as soon as one answers again. KV never crosses replicas otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from drs_frontend.routing import Candidate


@dataclass(slots=True)
class Engine:
    url: str
    in_flight: int = 0
    pending: int = 0  #: prompt tokens the context legs in flight here are expected to compute
    down_until: float = 0.0
    probe_ok: bool | None = None  #: None until the first probe answers
    fallback: bool = False  #: another replica's engine, used only while none of ours is a candidate


class EnginePool:
    """The engines of one role (``prefill`` or ``decode``) in this replica."""

    def __init__(
        self,
        role: str,
        urls: list[str],
        *,
        cooldown: float,
        clock: Callable[[], float] = time.monotonic,
        fallback: list[str] | None = None,
    ) -> None:
        self.role = role
        self.cooldown = cooldown
        self._clock = clock
        self.engines = {url: Engine(url) for url in urls}
        for url in fallback or ():
            self.engines.setdefault(url, Engine(url, fallback=True))
        self._came_up = asyncio.Event()

    @property
    def urls(self) -> list[str]:
        return list(self.engines)

    def candidates(self, exclude: frozenset[str] | set[str] = frozenset()) -> list[Candidate]:
        """This replica's usable engines; while there are none, the usable fallback engines."""
        now = self._clock()
        usable = [
            e for e in self.engines.values() if e.url not in exclude and e.probe_ok is not False and e.down_until <= now
        ]
        own = [Candidate(e.url, e.in_flight, e.pending) for e in usable if not e.fallback]
        return own or [Candidate(e.url, e.in_flight, e.pending) for e in usable]

    def set_fallback(self, urls: list[str]) -> tuple[list[str], list[str]]:
        """Make ``urls`` the fallback engines (own engines stay as they are): the ones added and removed."""
        wanted = [u for u in urls if u not in self.engines or self.engines[u].fallback]
        removed = [u for u, e in self.engines.items() if e.fallback and u not in wanted]
        for url in removed:  # a leg in flight on it keeps its Engine (track); calls naming it are ignored
            del self.engines[url]
        added = [u for u in wanted if u not in self.engines]
        for url in added:
            self.engines[url] = Engine(url, fallback=True)
        return added, removed

    async def wait_for_engine(self, timeout: float) -> None:
        """Until a probe finds an engine answering again, or ``timeout`` seconds (whichever is first)."""
        self._came_up.clear()
        with suppress(TimeoutError):
            await asyncio.wait_for(self._came_up.wait(), timeout)

    def mark_down(self, url: str, seconds: float | None = None) -> None:
        """A call failed: skip this engine for ``seconds`` (default: the cool-down period), if it is
        still in the pool."""
        if url in self.engines:
            self.engines[url].down_until = self._clock() + (self.cooldown if seconds is None else seconds)

    def record_probe(self, url: str, ok: bool) -> None:
        engine = self.engines.get(url)
        if engine is None:  # a fallback engine dropped while its probe was out
            return
        engine.probe_ok = ok
        if ok:
            engine.down_until = 0.0
            self._came_up.set()

    def answering(self) -> int:
        """Engines whose last probe succeeded (fallback engines included: this frontend serves on them)."""
        return sum(1 for e in self.engines.values() if e.probe_ok)

    @contextmanager
    def track(self, url: str) -> Iterator[Engine]:
        engine = self.engines[url]
        engine.in_flight += 1
        try:
            yield engine
        finally:
            engine.in_flight -= 1
