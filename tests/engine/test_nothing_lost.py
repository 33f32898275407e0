"""Refit safety and draining, with real sim engines on loopback.

* A leg that decodes across a weights load re-prefills its prompt plus what it generated so far
  under the new weights and resumes: every token after the boundary is exactly what the new
  weights produce over that context, and the answer names the version and the boundary.
* An engine told to stop (SIGTERM's path) drains: health and new legs answer 503 ``draining`` at
  once, a leg in flight finishes, a context state it holds is still handed to its decode engine,
  and only then does the server stop.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
from drs_engine.server.runner import RunningEngine
from drs_protocol.fields import HEADER_WEIGHTS_VERSION
from drs_protocol.lifecycle import DRAINING_ERROR_TYPE, FIELD_WEIGHTS_BOUNDARY, FIELD_WEIGHTS_VERSION

from .conftest import EngineFactory, auth
from .test_protocol import PROMPT_IDS, context_leg, generation_leg

#: Slow enough decoding that a load lands mid-leg (200 steps x 10 ms), no prefill time, instant loads.
SLOW_DECODE: dict[str, Any] = {
    "speed": 1.0,
    "decodeSecondsPerToken": 0.01,
    "decodeSecondsPerBatchSlot": 0.0,
    "prefillSecondsPerToken": 0.0,
    "weightsLoadSeconds": 0.0,
}
MAX_TOKENS = 200
WAIT_S = 30.0


def completion(prompt: list[int], max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    return {"model": "sim", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


async def sse_events(response: httpx.Response) -> Any:
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


async def test_a_leg_decoding_across_a_refit_continues_only_with_new_weights_tokens(
    client: httpx.AsyncClient, engine_factory: EngineFactory, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "step-2"
    checkpoint.write_text("new weights")
    async with engine_factory("prefill", sim=SLOW_DECODE) as engine, engine_factory("prefill") as old_weights:
        tokens: list[int] = []
        last: dict[str, Any] = {}
        request = completion(PROMPT_IDS, MAX_TOKENS, stream=True)
        async with client.stream("POST", engine.url + "/v1/completions", json=request) as response:
            assert response.headers[HEADER_WEIGHTS_VERSION] == "0"  # the version the leg started under
            async for chunk in sse_events(response):
                tokens += chunk["choices"][0]["token_ids"]
                last = chunk
                if len(tokens) == 5:  # mid-decode: load new weights (the sidecar's call)
                    load = await client.post(
                        engine.url + "/control/weights/load",
                        headers=auth(),
                        json={"path": str(checkpoint), "version": "step-2"},
                    )
                    assert load.status_code == 200, load.text
        boundary = last[FIELD_WEIGHTS_BOUNDARY]
        assert last[FIELD_WEIGHTS_VERSION] == "step-2"
        assert 5 <= boundary < MAX_TOKENS
        assert len(tokens) == MAX_TOKENS

        # What the new weights produce over the prompt plus the tokens before the boundary ...
        resumed = await client.post(
            engine.url + "/v1/completions", json=completion([*PROMPT_IDS, *tokens[:boundary]], MAX_TOKENS - boundary)
        )
        # ... and what the old weights would have continued with.
        stale = await client.post(
            old_weights.url + "/v1/completions",
            json=completion([*PROMPT_IDS, *tokens[:boundary]], MAX_TOKENS - boundary),
        )
    assert resumed.headers[HEADER_WEIGHTS_VERSION] == "step-2"
    assert tokens[boundary:] == resumed.json()["choices"][0]["token_ids"]
    assert tokens[boundary:] != stale.json()["choices"][0]["token_ids"]


async def test_a_draining_engine_refuses_new_legs_finishes_its_own_and_then_stops(
    client: httpx.AsyncClient, engine_factory: EngineFactory
) -> None:
    async with engine_factory("decode", sim=SLOW_DECODE, drainSeconds=WAIT_S) as engine:
        tokens: list[int] = []
        request = completion(PROMPT_IDS, 50, stream=True)
        async with client.stream("POST", engine.url + "/v1/completions", json=request) as response:
            async for chunk in sse_events(response):
                tokens += chunk["choices"][0]["token_ids"]
                if len(tokens) == 3:
                    engine.server.request_drain()
                    health = await client.get(engine.url + "/health")
                    refused = await client.post(engine.url + "/v1/completions", json=completion(PROMPT_IDS, 4))
                    assert health.status_code == 503
                    assert health.json()["error"]["type"] == DRAINING_ERROR_TYPE
                    assert refused.status_code == 503
                    assert refused.json()["error"]["type"] == DRAINING_ERROR_TYPE
        assert len(tokens) == 50  # the leg in flight ran to its end
        await asyncio.wait_for(engine.task, WAIT_S)  # and then the server stopped by itself


async def test_a_draining_prefill_engine_still_hands_over_the_context_states_it_holds(
    client: httpx.AsyncClient, engine_factory: EngineFactory, decode: RunningEngine
) -> None:
    body = {**completion(PROMPT_IDS, 8), "ignore_eos": True}
    async with engine_factory("prefill", drainSeconds=WAIT_S) as prefill:
        ctx = await client.post(prefill.url + "/v1/completions", json=context_leg(body, 2**41 + 99))
        assert ctx.status_code == 200, ctx.text
        prefill.server.request_drain()
        assert prefill.server.state.busy() == 1  # the unfetched context state holds the drain
        gen = await client.post(decode.url + "/v1/completions", json=generation_leg(body, ctx.json()))
        assert gen.status_code == 200, gen.text
        assert len(gen.json()["choices"][0]["token_ids"]) == 8
        await asyncio.wait_for(prefill.task, WAIT_S)
