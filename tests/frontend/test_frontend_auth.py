"""A frontend presents the fleet's serving token on every engine call (``drs_protocol.auth``).

Real sim engines that require the serving token, and a real frontend per upstream client: with
the token it serves a whole two-leg turn (the decode engine's KV fetch presents it too), streamed
and not, and its model list and readiness; without it the engines refuse its health probes, so it
is not ready and answers 503 instead of relaying anything.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from drs_engine.server.runner import RunningEngine, start_engine
from drs_frontend.app import FrontendApp
from drs_frontend.server import RunningFrontend, start_frontend

from .conftest import frontend_config, sim_config

TOKEN = "frontend-test-serving-token"
BODY = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


@contextlib.asynccontextmanager
async def fleet(upstream: str, frontend_token: str | None) -> AsyncIterator[tuple[RunningFrontend, RunningEngine]]:
    async with (
        start_engine(sim_config("prefill"), serving_token=TOKEN) as prefill,
        start_engine(sim_config("decode"), serving_token=TOKEN) as decode,
    ):
        config = frontend_config([prefill.url], [decode.url], upstream_client=upstream)
        app = FrontendApp(config, serving_token=frontend_token)
        async with start_frontend(config, app=app) as frontend:
            yield frontend, decode


async def ready(client: httpx.AsyncClient, url: str, want: int) -> int:
    """Poll ``/ready`` until it answers ``want`` (the prober's rounds are 0.2 s) or 5 s pass."""
    status = 0
    async with asyncio.timeout(5):
        while status != want:
            status = (await client.get(url + "/ready")).status_code
            if status != want:
                await asyncio.sleep(0.05)
    return status


@pytest.mark.parametrize("upstream", ["raw", "aiohttp", "httpx"])
async def test_a_frontend_with_the_serving_token_relays_turns_to_engines_that_require_it(upstream: str) -> None:
    async with fleet(upstream, TOKEN) as (frontend, decode), httpx.AsyncClient(timeout=30) as client:
        await ready(client, frontend.url, 200)
        turn = await client.post(frontend.url + "/v1/chat/completions", json=BODY)
        streamed = await client.post(frontend.url + "/v1/chat/completions", json={**BODY, "stream": True})
        models = await client.get(frontend.url + "/v1/models")
        direct = await client.post(decode.url + "/v1/chat/completions", json=BODY)
    assert turn.status_code == 200, turn.text
    assert turn.json()["choices"][0]["message"]["content"]
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text
    assert models.status_code == 200, models.text
    assert direct.status_code == 401  # the engines really require it


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("upstream", ["raw", "httpx"])
async def test_a_frontend_with_a_wrong_token_answers_502_naming_the_engine_not_the_clients_401(
    upstream: str, stream: bool
) -> None:
    """``/health`` is open, so the frontend is ready; the turn's first leg is refused: the client
    gets a 502 that blames the frontend's credential (an OpenAI client takes a 401 for its own key)."""
    async with fleet(upstream, "not-" + TOKEN) as (frontend, _), httpx.AsyncClient(timeout=30) as client:
        await ready(client, frontend.url, 200)
        turn = await client.post(frontend.url + "/v1/chat/completions", json={**BODY, "stream": stream})
    assert turn.status_code == 502, turn.text
    error = turn.json()["error"]
    assert "refused this frontend's serving token (401)" in error["message"] and "prefill engine" in error["message"]
    assert TOKEN not in turn.text
