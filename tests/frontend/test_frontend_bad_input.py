"""Bad client input gets a 4xx with a JSON error, and the frontend keeps serving."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from .conftest import Replica, chat_body, wait_for_status

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    ("content", "status", "fragment"),
    [
        pytest.param(b'{"model": "m", "messages": [', 400, "not valid JSON", id="malformed JSON"),
        pytest.param(b'{"model": "sim-qwen3", "max_tokens": 4}', 400, "messages", id="missing messages"),
        pytest.param(b"\xff\xfe not utf-8", 400, "not valid JSON", id="bytes that are not UTF-8"),
        pytest.param(
            b'{"model": "sim-qwen3", "messages": [{"role": "user", "content": "x"}], "conversation_params": {"id": 3}}',
            400,
            "conversation_params",
            id="conversation_params without a conversation_id",
        ),
        pytest.param(
            b'{"model": "sim-qwen3", "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}',
            400,
            "frobnicate",
            id="an unknown field, refused by the engine and passed through",
        ),
        pytest.param(
            b'{"model": "sim-qwen3", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}',
            400,
            "max_tokens",
            id="an out-of-range field, refused by the engine",
        ),
    ],
)
async def test_bad_requests_get_a_json_4xx_and_the_frontend_keeps_serving(
    replica: Replica, client: httpx.AsyncClient, content: bytes, status: int, fragment: str
) -> None:
    resp = await client.post(replica.url + CHAT, content=content, headers={"content-type": "application/json"})
    assert resp.status_code == status
    assert fragment in resp.text
    assert isinstance(resp.json(), dict)
    if b"frobnicate" in content or b'"max_tokens": -3' in content:  # refused by the engine: after routing
        assert resp.headers["x-drs-prefill"] == replica.prefill[0].url
    else:  # refused by the frontend: no engine was chosen
        assert "x-drs-prefill" not in resp.headers
    after = await client.post(replica.url + CHAT, json=chat_body())
    assert after.status_code == 200


async def test_a_twenty_megabyte_body_is_refused_with_413(replica: Replica, client: httpx.AsyncClient) -> None:
    huge = b'{"model": "sim-qwen3", "messages": [{"role": "user", "content": "' + b"a" * (20 * 1024 * 1024) + b'"}]}'
    resp = await client.post(replica.url + CHAT, content=huge, headers={"content-type": "application/json"})
    assert resp.status_code == 413
    assert "exceeds" in resp.json()["error"]["message"]
    assert (await client.post(replica.url + CHAT, json=chat_body())).status_code == 200


async def test_a_body_larger_than_announced_is_cut_off_at_the_limit(
    replica: Replica, client: httpx.AsyncClient
) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b"x" * (1024 * 1024)

    resp = await client.post(replica.url + CHAT, content=chunks())
    assert resp.status_code == 413
    assert (await client.post(replica.url + CHAT, json=chat_body())).status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        pytest.param("GET", CHAT, 405, id="GET on a POST route"),
        pytest.param("POST", "/v1/embeddings", 404, id="an unknown route"),
    ],
)
async def test_wrong_routes_get_json_errors(
    replica: Replica, client: httpx.AsyncClient, method: str, path: str, status: int
) -> None:
    resp = await client.request(method, replica.url + path)
    assert resp.status_code == status
    assert "error" in resp.json()


async def test_liveness_readiness_and_metrics_answer(replica: Replica, client: httpx.AsyncClient) -> None:
    assert (await client.get(replica.url + "/health")).status_code == 200
    ready = await wait_for_status(client, replica.url + "/ready", 200)
    assert ready.json() == {"ready": True, "prefill": 1, "decode": 1}
    await client.post(replica.url + CHAT, json=chat_body())
    metrics = (await client.get(replica.url + "/metrics")).text
    assert 'drs_frontend_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in metrics
    assert "drs_frontend_leg_seconds_bucket" in metrics
    assert f'drs_frontend_engine_in_flight{{engine="{replica.prefill[0].url}",role="prefill"}} 0.0' in metrics
