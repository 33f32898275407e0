"""The ``sim`` backend's latency model (part of the test double).

- prefill: ``uncached prompt tokens * prefill_seconds_per_token`` — cache hits are free, as
  block reuse makes them on a GPU; the sim runs one prefill iteration at a time
  (:mod:`drs_engine.prefill_batch`), so concurrent prompts share the engine's prefill throughput;
- decode: each step takes ``decode_seconds_per_token + decode_seconds_per_batch_slot * (others)``
  where ``others`` is the number of other decodes in flight on the engine, so per-token latency
  grows with batch size;
- weights load: a fixed ``weights_load_seconds``.

Every duration is multiplied by ``speed``: 1.0 gives realistic ratios for benchmarks, 0 skips
sleeping altogether (tests; steps still yield so requests interleave). Sleeping is
``asyncio.sleep``; the event loop is never blocked.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from drs_engine.config import SimSpec


@dataclass(frozen=True, slots=True)
class LatencyModel:
    speed: float
    prefill_seconds_per_token: float
    decode_seconds_per_token: float
    decode_seconds_per_batch_slot: float
    weights_load_seconds: float

    @classmethod
    def from_spec(cls, spec: SimSpec) -> LatencyModel:
        return cls(
            speed=spec.speed,
            prefill_seconds_per_token=spec.prefill_seconds_per_token,
            decode_seconds_per_token=spec.decode_seconds_per_token,
            decode_seconds_per_batch_slot=spec.decode_seconds_per_batch_slot,
            weights_load_seconds=spec.weights_load_seconds,
        )

    def prefill_seconds(self, uncached_tokens: int) -> float:
        return self.speed * self.prefill_seconds_per_token * max(uncached_tokens, 0)

    def decode_step_seconds(self, decodes_in_flight: int) -> float:
        others = max(decodes_in_flight - 1, 0)
        return self.speed * (self.decode_seconds_per_token + self.decode_seconds_per_batch_slot * others)

    def weights_load(self) -> float:
        return self.speed * self.weights_load_seconds

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` (already scaled); at 0 this only yields to other requests."""
        await asyncio.sleep(max(seconds, 0.0))
