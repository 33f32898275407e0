"""GRPO groups through real frontends and sim engines: siblings of one prompt share its prefill.

The engines run at a real (scaled) prefill speed, so siblings sent together really overlap the
first one's prefill; what was computed is read from the engines' own prefix-cache counters
(``query - hit``), never from the router.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from drs_frontend.routing.groups import opening_of

from .conftest import Replica, ReplicaFactory, metric_value

SIBLINGS = 8
#: ~0.2 s to prefill the shared prompt, decode steps of 2 ms: siblings overlap the first's prefill.
ENGINE = {"sim": {"speed": 1.0, "prefillSecondsPerToken": 2e-4, "decodeSecondsPerToken": 0.002}}
SYSTEM = "You are a careful agent. Solve the task step by step, calling tools when useful. " * 12
TASK = "Task 17: " + " ".join(f"fact-{i}" for i in range(120))
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web. " * 20}}]


def opening() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]


async def computed_and_queried(client: httpx.AsyncClient, replica: Replica) -> tuple[float, float]:
    computed = queried = 0.0
    for engine in replica.prefill:
        text = (await client.get(engine.url + "/metrics")).text
        query = metric_value(text, "drs_engine_prefix_cache_query_tokens_total")
        computed += query - metric_value(text, "drs_engine_prefix_cache_hit_tokens_total")
        queried += query
    return computed, queried


async def post(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
    resp = await client.post(url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp


def body(session: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": "sim-qwen3",
        "messages": messages,
        "tools": TOOLS,
        "max_tokens": 4,
        "conversation_params": {"conversation_id": session},
    }


async def burst(client: httpx.AsyncClient, replica: Replica) -> list[httpx.Response]:
    return await asyncio.gather(*(post(client, replica.url, body(f"s{i}", opening())) for i in range(SIBLINGS)))


async def test_siblings_sent_together_compute_their_prompt_once_and_keep_their_engine_after_a_restart(
    replica_factory: ReplicaFactory,
) -> None:
    async with (
        replica_factory(prefill=4, decode=1, engine=ENGINE, tokenize=True) as replica,
        httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client,
    ):
        answers = await burst(client, replica)
        prompt = answers[0].json()["usage"]["prompt_tokens"]
        computed, queried = await computed_and_queried(client, replica)
        assert queried == SIBLINGS * prompt
        assert computed <= 1.2 * prompt, f"{computed} tokens computed for a {prompt}-token prompt"
        engines = {a.headers["x-drs-prefill"] for a in answers}
        assert len(engines) == 1
        metrics = (await client.get(replica.url + "/metrics")).text
        assert metric_value(metrics, "drs_frontend_group_siblings_total", '{placed="with_group"}') == SIBLINGS - 1
        assert metric_value(metrics, "drs_frontend_group_siblings_total", '{placed="apart"}') == 0
        assert metric_value(metrics, "drs_frontend_group_holds_total", '{outcome="released"}') >= 1
        assert metric_value(metrics, "drs_frontend_group_completion_seconds_count") == 1
        (engine,) = engines
        reused = metric_value(metrics, "drs_frontend_prefill_tokens_total", f'{{engine="{engine}",kind="reused"}}')
        done = metric_value(metrics, "drs_frontend_prefill_tokens_total", f'{{engine="{engine}",kind="computed"}}')
        assert done == computed and reused == queried - computed

        await replica.restart_frontend(0)  # its pins, groups and prefix index are gone
        later = []
        for i, answer in enumerate(answers):
            message = answer.json()["choices"][0]["message"]
            turn = [*opening(), {"role": "assistant", "content": message["content"]}, {"role": "user", "content": "go"}]
            later.append(post(client, replica.url, body(f"s{i}", turn)))
        for answer in await asyncio.gather(*later):
            assert answer.headers["x-drs-prefill"] == engine
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= (prompt // 32) * 32


async def test_routing_by_id_computes_the_prompt_once_per_engine_reached(replica_factory: ReplicaFactory) -> None:
    """The same burst with group routing off (today's): the check above can fail."""
    async with (
        replica_factory(prefill=4, decode=1, engine=ENGINE, tokenize=True, group_routing=False) as replica,
        httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client,
    ):
        answers = await burst(client, replica)
        prompt = answers[0].json()["usage"]["prompt_tokens"]
        computed, _ = await computed_and_queried(client, replica)
        assert len({a.headers["x-drs-prefill"] for a in answers}) > 1
        assert computed >= 2 * prompt


async def test_a_sibling_is_held_no_longer_than_the_first_ones_context_leg(replica_factory: ReplicaFactory) -> None:
    async with (
        replica_factory(prefill=2, decode=1, engine=ENGINE, tokenize=True) as replica,
        httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client,
    ):
        alone = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK.replace("17", "18")}]
        await post(client, replica.url, body("alone", alone))  # one first turn of another prompt, alone
        metrics = (await client.get(replica.url + "/metrics")).text
        lone_leg = metric_value(metrics, "drs_frontend_leg_seconds_sum", '{leg="context"}')
        await burst(client, replica)
        metrics = (await client.get(replica.url + "/metrics")).text
        held = metric_value(metrics, "drs_frontend_group_hold_seconds_sum")
        holds = metric_value(metrics, "drs_frontend_group_hold_seconds_count")
        assert holds == SIBLINGS - 1
        assert held / holds <= 1.5 * lone_leg  # each waited for one prefill of the prompt, not more
        assert metric_value(metrics, "drs_frontend_group_hold_seconds_bucket", '{le="1.0"}') == holds
        assert metric_value(metrics, "drs_frontend_group_holds_total", '{outcome="timed_out"}') == 0


async def test_without_an_id_and_without_tokenizing_sessions_with_tools_keep_their_engine(
    replica_factory: ReplicaFactory,
) -> None:
    """NeMo-Gym's default config: no conversation id, the engine tokenizes; tool results longer
    than a quarter of the prompt. Each session keeps its prefill engine."""
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "d " * 300}} for i in range(4)]
    async with (
        replica_factory(prefill=4, decode=1) as replica,
        httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client,
    ):
        sessions = [[{"role": "user", "content": f"Session {i}: find fact {i}."}] for i in range(8)]
        engines: list[set[str]] = [set() for _ in sessions]
        for turn in range(3):
            for i, messages in enumerate(sessions):
                resp = await post(
                    client, replica.url, {"model": "m", "messages": messages, "tools": tools, "max_tokens": 3}
                )
                engines[i].add(resp.headers["x-drs-prefill"])
                content = resp.json()["choices"][0]["message"]["content"]
                messages += [
                    {"role": "assistant", "content": content},
                    {"role": "tool", "content": f"result {turn} " * 400, "tool_call_id": f"c{turn}"},
                ]
        assert [len(e) for e in engines] == [1] * len(sessions)
        assert opening_of(sessions[0], tools) is not None
