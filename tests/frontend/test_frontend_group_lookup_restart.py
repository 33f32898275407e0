"""A restarted frontend finds every bounded-moved group by asking the engines (real HTTP).

Real sim engines behind the serving token and real frontends that present it: eight prompts,
each a burst of siblings, placed one after another over four prefill engines under the load bound
(so some groups are moved past their opening's first rendezvous engine); then the frontend is
replaced by a fresh one (no pins, no groups, no load) and every sibling's later turn must land on
the engine that computed its group's prompt, reading that prompt from its cache. The same restart
with the lookup off sends the moved groups' turns to their first rendezvous engine: the check
this test makes fails there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from drs_engine.server.runner import RunningEngine, start_engine
from drs_frontend.app import FrontendApp
from drs_frontend.routing.groups import opening_of
from drs_frontend.routing.rendezvous import hrw_order
from drs_frontend.server import RunningFrontend, start_frontend

from .conftest import frontend_config, metric_value, sim_config

TOKEN = "group-lookup-serving-token"
PROMPTS = 8
SIBLINGS = 3
SYSTEM = "You are a careful agent. Solve the task step by step, calling tools when useful. " * 6
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web. " * 10}}]


def opening(p: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task {p}: " + "fact " * 60}]


def body(session: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": "sim",
        "messages": messages,
        "tools": TOOLS,
        "max_tokens": 4,
        "conversation_params": {"conversation_id": session},
    }


async def post(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> httpx.Response:
    resp = await client.post(url + "/v1/chat/completions", json=payload)
    assert resp.status_code == 200, resp.text
    return resp


@contextlib.asynccontextmanager
async def frontend(prefill: list[RunningEngine], decode: RunningEngine, lookups: int) -> AsyncIterator[RunningFrontend]:
    config = frontend_config(
        [e.url for e in prefill],
        [decode.url],
        group_lookup_engines=lookups,
        timeouts={"prefix_lookup": 2.0},  # 24 turns at once on a shared test machine (default 0.5 s)
    )
    async with start_frontend(config, app=FrontendApp(config, serving_token=TOKEN)) as running:
        async with asyncio.timeout(10):
            while running.app.prober.rounds < 1:
                await asyncio.sleep(0.01)
        yield running


@contextlib.asynccontextmanager
async def engines() -> AsyncIterator[tuple[list[RunningEngine], RunningEngine]]:
    async with contextlib.AsyncExitStack() as stack:
        prefill = [
            await stack.enter_async_context(start_engine(sim_config("prefill"), serving_token=TOKEN)) for _ in range(4)
        ]
        decode = await stack.enter_async_context(start_engine(sim_config("decode"), serving_token=TOKEN))
        yield prefill, decode


def prompts(urls: list[str]) -> list[int]:
    """Eight prompt numbers, three of them first in rendezvous order on one engine: more groups than
    the bound lets one engine take (c = 1.25: 2 of 8 each), so the bound moves at least one group
    whatever ports the engines got (with the first eight numbers, 4 % of port draws moved none)."""

    def first(p: int) -> str:
        key = opening_of(opening(p), TOOLS)
        assert key is not None
        return hrw_order(key.key, urls)[0]

    crowded = [p for p in range(1000) if first(p) == urls[0]][:3]
    return crowded + [p for p in range(1000) if p not in crowded][: PROMPTS - len(crowded)]


async def first_turns(
    client: httpx.AsyncClient, url: str, urls: list[str]
) -> dict[str, tuple[str, list[dict[str, Any]]]]:
    """Each prompt's siblings as one burst, prompt after prompt: session -> (engine, its later turn)."""
    placed: dict[str, tuple[str, list[dict[str, Any]]]] = {}
    for p in prompts(urls):
        answers = await asyncio.gather(*(post(client, url, body(f"p{p}-s{s}", opening(p))) for s in range(SIBLINGS)))
        for s, answer in enumerate(answers):
            content = answer.json()["choices"][0]["message"]["content"]
            later = [*opening(p), {"role": "assistant", "content": content}, {"role": "user", "content": "go on"}]
            placed[f"p{p}-s{s}"] = (answer.headers["x-drs-prefill"], later)
    return placed


def moved(placed: dict[str, tuple[str, list[dict[str, Any]]]], urls: list[str]) -> set[str]:
    """Sessions whose group is not on its opening's first rendezvous engine."""
    out = set()
    for session, (engine, later) in placed.items():
        key = opening_of(later, TOOLS)
        assert key is not None
        if hrw_order(key.key, urls)[0] != engine:
            out.add(session)
    return out


async def test_a_restarted_frontend_sends_every_later_turn_of_a_moved_group_to_its_engine() -> None:
    async with engines() as (prefill, decode), httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        urls = [e.url for e in prefill]
        async with frontend(prefill, decode, lookups=4) as first:
            placed = await first_turns(client, first.url, urls)
            metrics = (await client.get(first.url + "/metrics")).text
        counts = {u: len({s.split("-")[0] for s, (e, _) in placed.items() if e == u}) for u in urls}
        assert sorted(counts.values()) == [2, 2, 2, 2]  # 8 prompts, c = 1.25: within the bound, even
        assert moved(placed, urls), "no group was moved: the test would not test the lookup"
        assert metric_value(metrics, "drs_frontend_group_siblings_total", '{placed="moved"}') >= 1
        assert metric_value(metrics, "drs_frontend_group_claims_total", '{outcome="claimed"}') >= PROMPTS
        async with frontend(prefill, decode, lookups=4) as restarted:  # no pins, no groups, no load
            answers = await asyncio.gather(
                *(post(client, restarted.url, body(s, later)) for s, (_, later) in placed.items())
            )
            metrics = (await client.get(restarted.url + "/metrics")).text
        for (session, (engine, _)), answer in zip(placed.items(), answers, strict=True):
            assert answer.headers["x-drs-prefill"] == engine, session
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, session
        assert metric_value(metrics, "drs_frontend_group_lookups_total", '{outcome="found"}') >= PROMPTS
        assert metric_value(metrics, "drs_frontend_routes_total", '{reason="lookup",role="prefill"}') >= PROMPTS


async def test_without_the_lookup_a_restarted_frontend_misses_the_moved_groups() -> None:
    """The check above, with the restarted frontend not asking: it fails for every moved group."""
    async with engines() as (prefill, decode), httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        urls = [e.url for e in prefill]
        async with frontend(prefill, decode, lookups=4) as first:
            placed = await first_turns(client, first.url, urls)
        away = moved(placed, urls)
        assert away
        async with frontend(prefill, decode, lookups=0) as restarted:
            answers = await asyncio.gather(
                *(post(client, restarted.url, body(s, later)) for s, (_, later) in placed.items())
            )
        missed = {
            s
            for (s, (engine, _)), a in zip(placed.items(), answers, strict=True)
            if a.headers["x-drs-prefill"] != engine
        }
        assert missed == away
