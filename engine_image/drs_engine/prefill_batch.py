"""Prefill iterations of the ``sim`` engine, with the prefix cache a real engine has (part of the test double).

An in-flight batching engine (TensorRT-LLM's executor) runs iterations: each takes the context
requests waiting when it starts, looks up their prompts' blocks in the prefix cache as it
schedules them, computes what was not cached, and only when the iteration's context phase ends
stores the new blocks for reuse (TensorRT-LLM's ``storeContextBlocks`` after the context phase).
So blocks still being computed are shared with nobody:

* requests scheduled in the same iteration never share blocks with each other, even with the same
  prompt: two siblings that reach an idle engine together both compute it;
* a request that arrives while an iteration runs waits for the next one, and reuses every block
  that iteration stored.

:class:`PrefillIterations` does exactly that with :class:`~drs_engine.prefix_cache.PrefixCache`:
one iteration at a time (prefill throughput is bounded, as before), each taking every request
waiting at its start (requests that arrived in the same event-loop turn join it), lasting the
latency model's time for the uncached tokens of all of them. Not modelled: the per-iteration
token budget (``max_num_tokens``, 8192 by default; a larger batch would be split over
iterations) and chunked prefill.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from drs_engine.latency import LatencyModel
from drs_engine.prefix_cache import CacheLookup, PrefixCache


@dataclass(slots=True)
class _Waiting:
    prompt_len: int
    hashes: Sequence[bytes] | None  #: None: compute every token, neither look up nor store (a re-prefill)
    done: asyncio.Future[CacheLookup]


class PrefillIterations:
    def __init__(self, cache: PrefixCache, latency: LatencyModel) -> None:
        self._cache = cache
        self._latency = latency
        self._waiting: list[_Waiting] = []
        self._runner: asyncio.Task[None] | None = None
        self.iterations = 0

    async def prefill(self, prompt_len: int, block_hashes: Sequence[bytes] | None) -> CacheLookup:
        """Wait for the iteration that schedules this prompt and for its end; the lookup as scheduled."""
        done: asyncio.Future[CacheLookup] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(prompt_len, block_hashes, done))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return await done

    async def _run(self) -> None:
        while self._waiting:
            await asyncio.sleep(0)  # requests that arrived together start together
            batch = [w for w in self._waiting if not w.done.done()]  # a cancelled leg is not scheduled
            self._waiting = []
            lookups = [self._schedule(w) for w in batch]  # every lookup before any block is stored
            uncached = sum(w.prompt_len - lookup.hit_tokens for w, lookup in zip(batch, lookups, strict=True))
            self.iterations += 1
            try:
                await self._latency.sleep(self._latency.prefill_seconds(uncached))
            except BaseException as exc:  # the engine is stopping: nothing computed, nothing stored
                for w in batch:
                    if not w.done.done():
                        w.done.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
                raise
            for w, lookup in zip(batch, lookups, strict=True):
                if w.hashes is not None:
                    self._cache.insert(w.hashes)
                if not w.done.done():
                    w.done.set_result(lookup)

    def _schedule(self, waiting: _Waiting) -> CacheLookup:
        if waiting.hashes is None:
            return CacheLookup(query_tokens=waiting.prompt_len, hit_tokens=0, hit_blocks=0)
        return self._cache.lookup(waiting.prompt_len, waiting.hashes)
