"""Which of NeMo-Gym's ids reach the engines.

Gym echoes the ids of every earlier turn on its assistant message (``prompt_token_ids``,
``generation_token_ids``, ``generation_log_probs``): over a conversation, O(turns²) ids. A
frontend that tokenizes has already built the prompt ids from them, so the engines get the
messages without them; a frontend that leaves rendering to the engine passes them on (and
``required_prefix_token_ids``), since then the engine splices.

Real sim engines and a real frontend; between them a pass-through proxy that keeps a copy of
every body it relays (an instrument: the engines answer every request themselves).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from drs_engine.server.runner import start_engine
from drs_frontend.app import FrontendApp
from drs_frontend.server import start_frontend
from drs_protocol.chat import GYM_MESSAGE_FIELDS
from drs_protocol.routes import Endpoint
from drs_protocol.token_prefix import PREFIX_FIELD

from .conftest import frontend_config, sim_config

HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


@contextlib.asynccontextmanager
async def recording_proxy(target: str) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """``(url, bodies)``: every turn's JSON request body relayed to ``target`` lands in ``bodies``."""
    bodies: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:

        async def relay(request: web.Request) -> web.Response:
            raw = await request.read()
            if raw and request.path in set(Endpoint):  # the legs, not a routing miss's prefix lookup
                bodies.append(json.loads(raw))
            headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP | {"host"}}
            async with session.request(request.method, target + request.path_qs, data=raw, headers=headers) as resp:
                body = await resp.read()
                out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
                return web.Response(status=resp.status, body=body, headers=out)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", relay)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            port = runner.addresses[0][1]
            yield f"http://127.0.0.1:{port}", bodies
        finally:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def proxied_fleet(**frontend: Any) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A frontend whose prefill and decode engines sit behind one recording proxy each."""
    async with contextlib.AsyncExitStack() as stack:
        bodies: list[dict[str, Any]] = []
        urls = {}
        for role in ("prefill", "decode"):
            engine = await stack.enter_async_context(start_engine(sim_config(role)))
            urls[role], seen = await stack.enter_async_context(recording_proxy(engine.url))
            bodies = bodies if role == "decode" else seen  # the context legs: what the prompt comes from
        config = frontend_config([urls["prefill"]], [urls["decode"]], **frontend)
        running = await stack.enter_async_context(start_frontend(config, app=FrontendApp(config)))
        yield running.url, bodies


async def gym_conversation(
    url: str, turns: int, *, required_prefix: bool, extra: dict[str, Any] | None = None
) -> list[list[int]]:
    """A Gym-shaped client: each answer's ids echoed back on the next request's assistant message
    (and, with ``required_prefix``, as ``required_prefix_token_ids``). Returns each turn's prompt
    ids followed by its generated ids."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello"}]
    sequences: list[list[int]] = []
    async with httpx.AsyncClient(timeout=30) as client:
        for turn in range(turns):
            body: dict[str, Any] = {
                "model": "sim-qwen3",
                "messages": messages,
                "max_tokens": 6,
                "logprobs": True,
                "top_logprobs": 0,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                "conversation_params": {"conversation_id": "gym-ids"},
                **(extra or {}),
            }
            if required_prefix and sequences:
                body[PREFIX_FIELD] = sequences[-1]
            resp = await client.post(url + Endpoint.CHAT.value, json=body)
            assert resp.status_code == 200, resp.text
            message = resp.json()["choices"][0]["message"]
            sequences.append(message["prompt_token_ids"] + message["generation_token_ids"])
            messages = [
                *messages,
                {"role": "assistant", "content": message["content"], **{k: message[k] for k in GYM_MESSAGE_FIELDS}},
                {"role": "user", "content": f"turn {turn}"},
            ]
    return sequences


def chat_legs(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [b for b in bodies if "messages" in b]


def engine_rendered(leg: dict[str, Any], turn: int) -> list[dict[str, Any]]:
    """The assistant messages of a context leg the engine renders (one per earlier turn)."""
    assert "prompt_token_ids_b64" not in leg  # no ids from the frontend: the engine renders
    assistants = [m for m in leg["messages"] if m["role"] == "assistant"]
    assert len(assistants) == turn
    return assistants


@pytest.mark.parametrize("required_prefix", [False, True])
async def test_a_tokenizing_frontend_sends_no_gym_ids_to_the_engines(required_prefix: bool) -> None:
    async with proxied_fleet(tokenize=True) as (url, context_legs):
        sequences = await gym_conversation(url, 4, required_prefix=required_prefix)
        legs = chat_legs(context_legs)
    assert len(legs) == 4
    for leg in legs:
        assert "prompt_token_ids_b64" in leg  # the frontend's ids
        assert PREFIX_FIELD not in leg
        assert all(set(GYM_MESSAGE_FIELDS).isdisjoint(m) for m in leg["messages"])
    assert [m["role"] for m in legs[-1]["messages"]] == ["user", "assistant"] * 3 + ["user"]
    for before, now in itertools.pairwise(sequences):  # and the ids still splice
        assert now[: len(before) - 1] == before[:-1]


@pytest.mark.parametrize("required_prefix", [False, True])
async def test_an_engine_that_renders_gets_the_gym_ids_and_splices(required_prefix: bool) -> None:
    async with proxied_fleet(tokenize=False) as (url, context_legs):
        sequences = await gym_conversation(url, 4, required_prefix=required_prefix)
        legs = chat_legs(context_legs)
    assert len(legs) == 4
    for turn, leg in enumerate(legs):
        assistants = engine_rendered(leg, turn)
        assert all(set(GYM_MESSAGE_FIELDS) <= set(m) for m in assistants)
        assert (PREFIX_FIELD in leg) == (required_prefix and turn > 0)
    for before, now in itertools.pairwise(sequences):
        assert now[: len(before) - 1] == before[:-1]


async def test_without_continuity_an_engine_that_renders_gets_no_gym_ids() -> None:
    async with proxied_fleet(tokenize=False, token_continuity=False) as (url, context_legs):
        await gym_conversation(url, 3, required_prefix=True)
        legs = chat_legs(context_legs)
    assert len(legs) == 3
    for leg in legs:
        assert PREFIX_FIELD not in leg
        assert all(set(GYM_MESSAGE_FIELDS).isdisjoint(m) for m in leg["messages"])


async def test_a_tokenizing_frontend_that_leaves_a_turn_to_the_engine_sends_gym_ids_as_the_client_did() -> None:
    """A tokenizing frontend parses Gym's arrays lazily (``drs_frontend.gym_ids``); a turn it does
    not tokenize after all (here: the request carries ``documents``, which the engine renders)
    goes to the engine with every id the client sent, parsed in full."""
    async with proxied_fleet(tokenize=True) as (url, context_legs):
        sequences = await gym_conversation(url, 4, required_prefix=True, extra={"documents": []})
        legs = chat_legs(context_legs)
    assert len(legs) == 4
    for turn, leg in enumerate(legs):
        for a, message in enumerate(engine_rendered(leg, turn)):
            assert message["prompt_token_ids"] + message["generation_token_ids"] == sequences[a]
        assert leg.get(PREFIX_FIELD) == (sequences[turn - 1] if turn else None)
    for before, now in itertools.pairwise(sequences):
        assert now[: len(before) - 1] == before[:-1]
