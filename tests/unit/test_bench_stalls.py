"""``bench/stalls.py``: a stall of the event loop is sampled with the stack that held it."""

from __future__ import annotations

import asyncio
import time

from bench.stalls import StallSampler


def _holds_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # a blocking call on the loop thread


async def test_a_blocking_call_on_the_loop_is_sampled_by_its_stack() -> None:
    async with StallSampler(threshold_s=0.05, tick_s=0.005) as sampler:
        await asyncio.sleep(0.05)
        _holds_the_loop(0.4)
        await asyncio.sleep(0.05)
    top = sampler.top(1)
    assert top, "no stall sampled"
    assert any("_holds_the_loop" in frame for frame in top[0].stack), top
    assert 0.1 <= top[0].stalled_s <= 0.5, top


async def test_a_loop_that_only_awaits_is_not_sampled() -> None:
    async with StallSampler(threshold_s=0.25, tick_s=0.005) as sampler:  # well above a busy machine's lateness
        await asyncio.sleep(0.3)
    assert sampler.top() == []
