"""A refused group claim, over real HTTP: the relay walks on and the whole group lands where it claimed.

Two real sim prefill engines and one decode engine behind the serving token, one real frontend with
the group lookup on. A new group's burst of siblings is looked up, then claimed on the first
engine in rendezvous order of its opening. In the race, another frontend's claim reaches that engine
first (the test counts a large claim there just before the frontend's, through the engine's own
bookkeeping): the engine refuses the frontend's claim with its live work, the frontend asks again,
walks on and claims the other engine, and every sibling's leg goes there. Without the race (the
control, same prompt, fresh engines) the group stays on its first engine: the refusal is what moved
it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from drs_engine.prefill_work import PrefillWork
from drs_engine.server.runner import RunningEngine, start_engine
from drs_frontend.app import FrontendApp
from drs_frontend.routing.groups import opening_of
from drs_frontend.routing.rendezvous import hrw_order
from drs_frontend.server import start_frontend
from drs_protocol.fields import HEADER_PREFILL_ENGINE

from .conftest import frontend_config, metric_value, sim_config

TOKEN = "group-refused-claim-serving-token"
SIBLINGS = 3
SYSTEM = "You are a careful agent. Solve the task step by step, calling tools when useful. " * 6
RIVAL_TOKENS = 1_000_000  #: another frontend's group, counted first: past any bound of this burst
CLAIMS = "drs_frontend_group_claims_total"


def opening(p: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task {p}: " + "fact " * 60}]


def first_engine(p: int, urls: list[str]) -> str:
    key = opening_of(opening(p))
    assert key is not None
    return hrw_order(key.key, urls)[0]


def rival_first(work: PrefillWork) -> list[bool]:
    """Make ``work``'s next claim meet another group's claim counted just before it (once); the
    list records the frontend's claims' outcomes."""
    claim = work.claim
    outcomes: list[bool] = []

    def racing(
        prompt_ids: Sequence[int], weights: str, tokens: int, *, limit: int | None, tokens_per_block: int
    ) -> bool:
        if not outcomes:
            assert claim([7] * 64, weights, RIVAL_TOKENS, limit=None, tokens_per_block=tokens_per_block)
        outcomes.append(claim(prompt_ids, weights, tokens, limit=limit, tokens_per_block=tokens_per_block))
        return outcomes[-1]

    work.claim = racing  # type: ignore[method-assign]
    return outcomes


@contextlib.asynccontextmanager
async def fleet() -> AsyncIterator[tuple[list[RunningEngine], str]]:
    async with contextlib.AsyncExitStack() as stack:
        prefill = [
            await stack.enter_async_context(start_engine(sim_config("prefill"), serving_token=TOKEN)) for _ in range(2)
        ]
        decode = await stack.enter_async_context(start_engine(sim_config("decode"), serving_token=TOKEN))
        config = frontend_config(
            [e.url for e in prefill],
            [decode.url],
            group_lookup_engines=2,
            timeouts={"prefix_lookup": 2.0},  # a shared test machine (default 0.5 s)
        )
        running = await stack.enter_async_context(start_frontend(config, app=FrontendApp(config, serving_token=TOKEN)))
        async with asyncio.timeout(10):
            while running.app.prober.rounds < 1:
                await asyncio.sleep(0.01)
        yield prefill, running.url


@pytest.mark.parametrize("race", [True, False], ids=["claim-refused", "control-no-race"])
async def test_a_refused_claim_moves_the_whole_group_to_the_engine_it_claims_next(race: bool) -> None:
    async with fleet() as (prefill, url), httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        urls = [e.url for e in prefill]
        first = first_engine(0, urls)
        other = next(u for u in urls if u != first)
        engine = next(e for e in prefill if e.url == first)
        outcomes = rival_first(engine.server.state.prefill_work) if race else []

        answers = await asyncio.gather(
            *(
                client.post(
                    url + "/v1/chat/completions",
                    json={
                        "model": "sim",
                        "messages": opening(0),
                        "max_tokens": 4,
                        "conversation_params": {"conversation_id": f"p0-s{s}"},
                    },
                )
                for s in range(SIBLINGS)
            )
        )
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        engines = {a.headers[HEADER_PREFILL_ENGINE] for a in answers}
        metrics = (await client.get(url + "/metrics")).text
        refused = metric_value(metrics, CLAIMS, '{outcome="refused"}')
        claimed = metric_value(metrics, CLAIMS, '{outcome="claimed"}')

    if race:
        assert outcomes == [False], outcomes  # the frontend's one claim there, refused
        assert (refused, claimed) == (1.0, 1.0), metrics
        assert engines == {other}, (engines, first)
    else:
        assert (refused, claimed) == (0.0, 1.0), metrics
        assert engines == {first}, (engines, other)
