"""A body the frontend accepts never meets an engine's bare 413 (drs_protocol.limits).

A tokenizing frontend forwards the prompt ids with the body, so the body an engine gets is larger
than the one the client sent. The engines' limit is derived to cover that growth for any prompt
they serve; when the ids would pass it anyway (a smaller limit, or a prompt longer than the
engines serve) the frontend forwards the turn without its ids, so the engine renders it and
answers itself (its 400 about the context length for an over-long prompt).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from drs_engine.server.runner import RunningEngine
from drs_frontend.wire_json import dumps
from drs_protocol.limits import DEFAULT_MAX_MODEL_LEN, engine_max_request_bytes

from .conftest import ReplicaFactory, metric_value

CHAT = "/v1/chat/completions"
FRONTEND_LIMIT = 64 * 1024


def _just_under_the_frontends_limit(limit: int = FRONTEND_LIMIT) -> bytes:
    """A chat body a few bytes under ``limit`` whose prompt is one token per 6 bytes (its base64
    ids, ~5 bytes a token, push the forwarded body well past the frontend's limit)."""
    body: dict[str, Any] = {"model": "sim-qwen3", "messages": [{"role": "user", "content": ""}], "max_tokens": 2}
    words = " hello" * (limit // 6 + 100)
    room = limit - 16 - len(dumps(body))
    body["messages"][0]["content"] = words[:room]
    raw = dumps(body)
    assert limit - 64 < len(raw) <= limit
    return raw


async def _engine_requests(client: httpx.AsyncClient, engine: RunningEngine) -> float:
    text = (await client.get(engine.url + "/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("drs_engine_requests_total{")
    )


async def test_a_body_just_under_the_frontends_limit_is_served_by_engines_at_the_derived_limit(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    derived = engine_max_request_bytes(FRONTEND_LIMIT, DEFAULT_MAX_MODEL_LEN)
    limits = {"max_request_bytes": FRONTEND_LIMIT, "engine_max_request_bytes": derived}
    async with replica_factory(tokenize=True, limits=limits, engine={"max_request_bytes": derived}) as replica:
        resp = await client.post(replica.url + CHAT, content=_just_under_the_frontends_limit())
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] > 4000


async def test_a_frontend_told_a_smaller_engine_limit_answers_413_naming_it_and_forwards_nothing(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    """The drift this guards against: engines at the frontend's own limit (no room for the ids)."""
    limits = {"max_request_bytes": FRONTEND_LIMIT, "engine_max_request_bytes": FRONTEND_LIMIT}
    async with replica_factory(tokenize=True, limits=limits, engine={"max_request_bytes": FRONTEND_LIMIT}) as replica:
        before = await _engine_requests(client, replica.prefill[0])
        resp = await client.post(replica.url + CHAT, content=_just_under_the_frontends_limit())
        assert resp.status_code == 413, resp.text
        error = json.loads(resp.content)["error"]
        assert error["type"] == "request_too_large"
        assert f"limit of {FRONTEND_LIMIT} bytes" in error["message"] and "engineMaxRequestBytes" in error["message"]
        assert await _engine_requests(client, replica.prefill[0]) == before
        metrics = (await client.get(replica.url + "/metrics")).text
        assert (
            metric_value(metrics, "drs_frontend_requests_total", '{endpoint="/v1/chat/completions",status="413"}') == 1
        )


async def test_a_prompt_longer_than_the_engines_serve_gets_their_400_about_context_length_not_413(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    """A tokenizing frontend with the limits the operator renders for a 1 MiB frontend limit and
    maxModelLen 1024: a prompt of ~175,000 tokens in a body just under 1 MiB, whose base64 ids push
    the forwarded body past the engines' limit, was this frontend's 413; it is the engine's own
    context-length 400."""
    max_model_len, frontend_limit = 1024, 1024 * 1024
    derived = engine_max_request_bytes(frontend_limit, max_model_len)
    limits = {"max_request_bytes": frontend_limit, "engine_max_request_bytes": derived}
    engine = {"max_request_bytes": derived, "model": {"path": "sim-qwen3", "maxModelLen": max_model_len}}
    async with replica_factory(tokenize=True, limits=limits, engine=engine) as replica:
        resp = await client.post(replica.url + CHAT, content=_just_under_the_frontends_limit(frontend_limit))
        assert resp.status_code == 400, resp.text
        error = json.loads(resp.content)["error"]
        assert (
            "context length exceeded" in error["message"] and f"maximum length is {max_model_len}" in error["message"]
        )
