"""Claims: a new group's placement counted on its engine when a frontend decides it.

Groups that a replica's frontends place at once read one snapshot of the engines' work; counted
only when their legs arrive, several took the same room (bench/grpo.py: busiest engine 1.49x the
mean at M = 4 for a bound of 1.25). A claim (``drs_protocol.prefix_lookup.PrefixClaim``) is
counted at once and atomically, only within its limit, so the next placement, by any frontend,
reads it. The frontend's side: tests/frontend/test_frontend_group_claims.py.
"""

from __future__ import annotations

import httpx
import pytest
from drs_engine.prefill_work import PrefillWork
from drs_protocol.prefix_lookup import CLAIM_TTL_S, PrefixHeld
from drs_protocol.routes import PREFIX_HELD

from .conftest import EngineFactory
from .test_prefill_work import Clock
from .test_protocol import context_leg

PROMPT = list(range(100))  #: 3 full blocks of 32


def test_a_claim_counts_at_once_and_only_within_its_limit() -> None:
    work = PrefillWork(clock=Clock())
    assert work.claim(PROMPT, "v1", 100, limit=100, tokens_per_block=32)
    assert work.recent_work() == 100
    other = [7] * 100
    assert not work.claim(other, "v1", 100, limit=199, tokens_per_block=32)  # 200 > 199: refused, not counted
    assert work.recent_work() == 100
    assert work.claim(other, "v1", 100, limit=None, tokens_per_block=32)  # no limit: counted whatever
    assert work.recent_work() == 200


def test_a_siblings_claim_or_leg_in_flight_is_counted_once() -> None:
    work = PrefillWork(clock=Clock())
    assert work.claim(PROMPT, "v1", 100, limit=100, tokens_per_block=32)
    assert work.claim(PROMPT, "v1", 100, limit=100, tokens_per_block=32)  # the replica's other frontend
    assert work.recent_work() == 100
    assert work.pending_blocks(PROMPT, "v1", 32) == 3  # a lookup about the group finds it claimed here
    assert not work.claim(PROMPT, "v2", 100, limit=100, tokens_per_block=32)  # other weights: nothing shared
    leg = work.start([5] * 64, "v1", held_tokens=0, tokens_per_block=32)
    assert work.claim([5] * 64, "v1", 64, limit=1, tokens_per_block=32)  # its leg is in flight: counted
    work.finish(leg, 64)


def test_the_groups_leg_takes_its_claim_and_an_unused_claim_lapses() -> None:
    clock = Clock()
    work = PrefillWork(clock=clock)
    assert work.claim(PROMPT, "v1", 100, limit=None, tokens_per_block=32)
    assert work.claim([9] * 64, "v1", 64, limit=None, tokens_per_block=32)
    leg = work.start(PROMPT, "v1", held_tokens=0, tokens_per_block=32)
    assert work.recent_work() == 100 + 64  # the leg's expected work replaced its claim's
    work.finish(leg, 100)
    assert work.recent_work() == 100 + 64
    clock.now += CLAIM_TTL_S
    assert work.recent_work() == 100  # the second group's leg never came
    assert work.pending_blocks([9] * 64, "v1", 32) == 0
    with pytest.raises(ValueError, match="tokens"):
        work.claim(PROMPT, "v1", 0, limit=None, tokens_per_block=32)
    with pytest.raises(ValueError, match="claim_ttl_s"):
        PrefillWork(claim_ttl_s=0)


async def test_the_engine_answers_a_claim_with_its_live_work(engine_factory: EngineFactory) -> None:
    """Over HTTP, on a sim engine: a claim is counted, a second one over its limit refused with the
    live figure (the quote would still say 0), and the group's leg takes the first one."""
    ids = list(range(1000, 1300))  # 300 tokens: 9 full blocks
    async with engine_factory("prefill", sim={"speed": 1}) as engine, httpx.AsyncClient(timeout=60) as client:
        url = engine.url + PREFIX_HELD

        async def ask(body: dict[str, object]) -> PrefixHeld:
            response = await client.post(url, json=body)
            assert response.status_code == 200, response.text
            return PrefixHeld.model_validate(response.json())

        quoted = await ask({"prompt_token_ids": [3] * 300})
        assert quoted.recent_work == 0 and quoted.claimed is None
        first = await ask({"prompt_token_ids": ids, "claim": {"tokens": 300, "limit": 375}})
        # pending as it stood before the claim (a frontend claiming with its lookup asks whether a
        # sibling is here, not its own claim); a lookup after it sees the claim pending
        assert (first.claimed, first.recent_work, first.pending_blocks) == (True, 300, 0)
        assert (await ask({"prompt_token_ids": ids, "live": True})).pending_blocks == 9
        refused = await ask({"prompt_token_ids": [3] * 300, "claim": {"tokens": 300, "limit": 375}})
        assert (refused.claimed, refused.recent_work) == (False, 300)
        assert (await ask({"prompt_token_ids": [3] * 300})).recent_work == 0  # the quote is unchanged
        assert (await ask({"prompt_token_ids": [3] * 300, "live": True})).recent_work == 300  # unless asked live
        leg = await client.post(
            engine.url + "/v1/completions", json=context_leg({"model": "sim", "prompt": ids, "max_tokens": 2}, 1)
        )
        assert leg.status_code == 200
        after = await ask({"prompt_token_ids": [4] * 64, "claim": {"tokens": 64, "limit": 364}})
        assert (after.claimed, after.recent_work) == (True, 300 + 64)  # the leg's computed work, not twice
        bad = await client.post(url, json={"prompt_token_ids": ids, "claim": {"tokens": 0}})
        assert bad.status_code == 400 and "claim" in bad.text
        both = await client.post(url, json={"prompt_token_ids": ids, "claim": {"tokens": 1}, "release": True})
        assert both.status_code == 400 and "release" in both.text


async def test_a_claim_taken_back_no_longer_counts_nor_is_pending(engine_factory: EngineFactory) -> None:
    """A frontend that claimed with its lookup and found the group elsewhere takes the claim back:
    the engine's work and its pending blocks for the prompt drop, another prompt's claim stays."""
    ids, other = list(range(1000, 1300)), list(range(5000, 5064))
    async with engine_factory("prefill", sim={"speed": 1}) as engine, httpx.AsyncClient(timeout=60) as client:
        url = engine.url + PREFIX_HELD

        async def ask(body: dict[str, object]) -> PrefixHeld:
            response = await client.post(url, json=body)
            assert response.status_code == 200, response.text
            return PrefixHeld.model_validate(response.json())

        assert (await ask({"prompt_token_ids": ids, "claim": {"tokens": 300}})).claimed
        assert (await ask({"prompt_token_ids": other, "claim": {"tokens": 64}})).claimed
        released = await ask({"prompt_token_ids": ids, "release": True, "live": True})
        assert (released.recent_work, released.pending_blocks) == (64, 0)
        assert (await ask({"prompt_token_ids": other, "live": True})).pending_blocks == 2


def test_release_drops_only_that_prompts_claims_under_those_weights() -> None:
    work = PrefillWork()
    work.claim(PROMPT, "v1", 100, limit=None, tokens_per_block=32)
    work.claim(PROMPT, "v2", 100, limit=None, tokens_per_block=32)
    assert work.release(PROMPT[:-32], "v1") == 0  # a prefix is another prompt
    assert work.release(PROMPT, "v1") == 1
    assert work.recent_work() == 100 and work.pending_blocks(PROMPT, "v1", 32) == 0
