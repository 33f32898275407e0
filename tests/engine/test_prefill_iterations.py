"""The sim engine's prefill iterations: blocks still being computed are shared with nobody."""

from __future__ import annotations

import asyncio

from drs_engine.latency import LatencyModel
from drs_engine.prefill_batch import PrefillIterations
from drs_engine.prefix_cache import PrefixCache

BLOCK = 4
PROMPT = 40  # ten full blocks
HASHES = [bytes([i]) * 16 for i in range(PROMPT // BLOCK)]


def iterations(seconds_per_token: float = 0.001) -> tuple[PrefillIterations, PrefixCache]:
    cache = PrefixCache(tokens_per_block=BLOCK, capacity_tokens=10_000)
    latency = LatencyModel(
        speed=1.0,
        prefill_seconds_per_token=seconds_per_token,
        decode_seconds_per_token=0.0,
        decode_seconds_per_batch_slot=0.0,
        weights_load_seconds=0.0,
    )
    return PrefillIterations(cache, latency), cache


async def test_requests_that_arrive_together_each_compute_the_prompt() -> None:
    prefill, cache = iterations()
    lookups = await asyncio.gather(*(prefill.prefill(PROMPT, HASHES) for _ in range(8)))
    assert [lookup.hit_tokens for lookup in lookups] == [0] * 8
    assert prefill.iterations == 1
    assert len(cache) == len(HASHES)


async def test_a_request_arriving_during_an_iteration_reuses_what_it_stored() -> None:
    prefill, _ = iterations(seconds_per_token=0.002)  # 80 ms for the prompt
    leader = asyncio.create_task(prefill.prefill(PROMPT, HASHES))
    await asyncio.sleep(0.02)  # the leader's iteration is computing
    follower = await prefill.prefill(PROMPT, HASHES)
    assert (await leader).hit_tokens == 0
    assert follower.hit_tokens == PROMPT - 1  # every block the leader stored; the last token is recomputed
    assert prefill.iterations == 2


async def test_the_follower_waits_for_the_iteration_that_is_running() -> None:
    prefill, _ = iterations(seconds_per_token=0.002)
    loop = asyncio.get_running_loop()
    started = loop.time()
    leader = asyncio.create_task(prefill.prefill(PROMPT, HASHES))
    await asyncio.sleep(0.01)
    await prefill.prefill(PROMPT, HASHES)
    assert leader.done()
    assert loop.time() - started >= PROMPT * 0.002 * 0.9


async def test_a_re_prefill_neither_looks_up_nor_stores() -> None:
    prefill, cache = iterations(seconds_per_token=0.0)
    lookup = await prefill.prefill(PROMPT, None)
    assert lookup.hit_tokens == 0 and cache.query_tokens == 0 and len(cache) == 0


async def test_a_cancelled_leg_is_not_scheduled_and_others_still_finish() -> None:
    prefill, cache = iterations(seconds_per_token=0.002)
    busy = asyncio.create_task(prefill.prefill(PROMPT, HASHES))
    await asyncio.sleep(0.01)
    gone = asyncio.create_task(prefill.prefill(PROMPT, [b"x" * 16] * 10))
    kept = asyncio.create_task(prefill.prefill(PROMPT, HASHES))
    await asyncio.sleep(0)
    gone.cancel()
    await busy
    assert (await kept).hit_tokens == PROMPT - 1
    assert cache.query_tokens == 2 * PROMPT  # the cancelled one was never looked up
