"""The engine's own prefill work and its legs in flight, as the prefix-held answer reports them.

Two frontends of a replica ask the same engines and must read the same facts: a sibling another
frontend sent a moment ago (``pending_blocks``: its blocks are not cached until its context phase
ends) and the engine's recent prefill work (``recent_work``), which the bounded walk reads.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from drs_engine.prefill_work import PrefillWork, common_blocks
from drs_protocol.prefix_lookup import PrefixHeld
from drs_protocol.routes import PREFIX_HELD

from .conftest import EngineFactory
from .test_protocol import context_leg


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_common_blocks_counts_whole_leading_blocks_only() -> None:
    assert common_blocks(list(range(10)), list(range(10)), 4) == 2
    assert common_blocks(list(range(10)), [*range(5), 99, *range(6, 10)], 4) == 1
    assert common_blocks([1, 2, 3], [1, 2, 3], 4) == 0
    assert common_blocks([9, 2, 3, 4], [1, 2, 3, 4], 4) == 0


def test_work_counts_legs_in_flight_at_once_and_forgets_beyond_its_window() -> None:
    clock = Clock()
    work = PrefillWork(window_s=60, clock=clock)
    leg = work.start(list(range(100)), "v1", held_tokens=32, tokens_per_block=32)
    assert work.recent_work() == 68  # expected: the prompt less what the cache holds
    sibling = work.start(list(range(100)), "v1", held_tokens=32, tokens_per_block=32)
    assert work.recent_work() == 68 + 4  # the first leg will store 3 blocks: only the tail is new
    work.finish(leg, 68)
    work.finish(leg, 68)  # idempotent
    work.finish(sibling, 4)
    assert work.recent_work() == 72 and len(work) == 0
    clock.now += 61
    assert work.recent_work() == 0


def test_pending_blocks_are_those_a_leg_in_flight_under_the_weights_served_will_store() -> None:
    work = PrefillWork()
    leg = work.start(list(range(70)), "v1", held_tokens=0, tokens_per_block=32)
    assert work.pending_blocks(list(range(70)), "v1", 32) == 2
    assert work.pending_blocks([*range(40), 7, 7], "v1", 32) == 1
    assert work.pending_blocks(list(range(70)), "v2", 32) == 0  # other weights: blocks nobody can reuse
    work.finish(leg, 70)
    assert work.pending_blocks(list(range(70)), "v1", 32) == 0
    with pytest.raises(ValueError, match="window_s"):
        PrefillWork(window_s=0)


async def test_the_answer_reports_a_sibling_in_flight_and_then_the_work_it_computed(
    engine_factory: EngineFactory,
) -> None:
    """A slow prefill (the latency model at 100x: ~5 ms a token) is asked about while it runs."""
    ids = list(range(1000, 1600))  # 600 tokens: 18 full blocks of 32
    async with engine_factory("prefill", sim={"speed": 100}) as engine, httpx.AsyncClient(timeout=60) as client:
        url = engine.url + PREFIX_HELD
        idle = PrefixHeld.model_validate((await client.post(url, json={"prompt_token_ids": ids[::-1]})).json())
        assert (idle.held_blocks, idle.pending_blocks, idle.recent_work) == (0, 0, 0)
        turn = {"model": "sim", "prompt": ids, "max_tokens": 2}
        leg = asyncio.create_task(client.post(engine.url + "/v1/completions", json=context_leg(turn, 1)))
        async with asyncio.timeout(30):
            while True:  # until the engine has the leg (its prefill lasts ~3 s)
                asked = PrefixHeld.model_validate((await client.post(url, json={"prompt_token_ids": ids})).json())
                if asked.pending_blocks or leg.done():
                    break
        assert not leg.done(), "the leg ended before the engine was asked: too fast to observe"
        assert asked.held_blocks == 0 and asked.pending_blocks == asked.blocks == 18 and asked.will_cover
        now = PrefixHeld.model_validate((await client.post(url, json={"prompt_token_ids": [4] * 64})).json())
        assert now.recent_work == 600  # counted from its arrival (asked.recent_work: quoted before it)
        other = PrefixHeld.model_validate((await client.post(url, json={"prompt_token_ids": [7] * 600})).json())
        assert other.pending_blocks == 0
        assert (await leg).status_code == 200
        done = PrefixHeld.model_validate((await client.post(url, json={"prompt_token_ids": ids})).json())
        assert (done.held_blocks, done.pending_blocks) == (18, 0)
        assert done.recent_work == asked.recent_work  # quoted: every ask about this prompt reads one figure
        fresh = PrefixHeld.model_validate((await client.post(url, json={"prompt_token_ids": [3] * 64})).json())
        assert fresh.recent_work == 600  # computed now, no longer in flight


def test_every_ask_about_one_prompt_within_the_quote_time_reads_the_first_asks_figure() -> None:
    clock = Clock()
    work = PrefillWork(clock=clock)
    group = list(range(64))
    assert work.quote(group, ttl_s=5) == 0
    other = work.start(list(range(500, 600)), "v1", held_tokens=0, tokens_per_block=32)  # another group's leg
    clock.now += 1
    assert work.quote(group, ttl_s=5) == 0  # the replica's other frontend asks about the same group
    assert work.quote([*group, 1], ttl_s=5) == 100  # a new prompt reads the engine as it is now
    clock.now += 5
    assert work.quote(group, ttl_s=5) == 100  # the quote is over
    work.finish(other, 100)


async def test_a_sibling_arriving_with_the_first_waits_for_it_and_reads_the_prompt(
    engine_factory: EngineFactory,
) -> None:
    """Two identical context legs reach an idle engine together (siblings from a replica's two
    frontends, which hold only their own): the second waits for the first one's end and reads
    every full block from the cache, so the prompt is computed once, not twice in one iteration."""
    ids = list(range(2000, 2300))  # 300 tokens: 9 full blocks of 32
    async with engine_factory("prefill", sim={"speed": 20}) as engine, httpx.AsyncClient(timeout=60) as client:
        turn = {"model": "sim", "prompt": ids, "max_tokens": 2}
        legs = await asyncio.gather(
            *(client.post(engine.url + "/v1/completions", json=context_leg(turn, n)) for n in (1, 2))
        )
        cached = sorted(leg.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for leg in legs)
        assert cached == [0, 9 * 32]


def test_a_leg_that_also_generates_is_never_followed() -> None:
    """Its end is its last token, not its prefill: a sibling waiting for it would wait out a whole
    generation (context and generation on one engine), so the sibling computes its prompt."""
    work = PrefillWork()
    ids = list(range(100))
    full = work.start(ids, "v1", held_tokens=0, tokens_per_block=32, followable=False)
    sibling = work.start(ids, "v1", held_tokens=0, tokens_per_block=32)
    assert sibling.follows is None
    assert work.pending_blocks(ids, "v1", 32) == 3  # still reported: its blocks will be stored
    context = work.start(ids, "v1", held_tokens=0, tokens_per_block=32)
    assert context.follows is sibling  # a context-only leg is followed
    for leg in (full, sibling, context):
        work.finish(leg, 0)


async def test_siblings_that_also_generate_on_one_engine_do_not_wait_for_each_other(
    engine_factory: EngineFactory,
) -> None:
    """Two identical turns sent whole to one engine (no disaggregation) run side by side: the
    second does not wait for the first one's last token to read the prompt from the cache."""
    ids = list(range(3000, 3300))
    async with engine_factory("prefill", sim={"speed": 20}) as engine, httpx.AsyncClient(timeout=60) as client:
        turn = {"model": "sim", "prompt": ids, "max_tokens": 8}
        legs = await asyncio.gather(*(client.post(engine.url + "/v1/completions", json=turn) for _ in range(2)))
        assert [leg.status_code for leg in legs] == [200, 200], [leg.text for leg in legs]
        cached = [leg.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for leg in legs]
        assert cached == [0, 0]  # neither waited to read the other's blocks
