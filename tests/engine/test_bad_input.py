"""Bad input gets a 4xx with an OpenAI-shaped JSON error, and the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from drs_engine.server.runner import RunningEngine
from drs_engine.wire import MAX_STOP_STRINGS
from drs_protocol.limits import DEFAULT_ENGINE_MAX_REQUEST_BYTES

from .conftest import EngineFactory, metric_value

GOOD: dict[str, Any] = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
CHAT = "/v1/chat/completions"


def with_(**changes: Any) -> dict[str, Any]:
    return {**GOOD, **changes}


CASES = [
    pytest.param(CHAT, b'{"model": "sim", "messages": [', 400, None, "malformed JSON", id="malformed-json"),
    pytest.param(CHAT, b"[1, 2, 3]", 400, None, "JSON object", id="a-json-array-instead-of-an-object"),
    pytest.param(CHAT, b"", 400, None, "empty", id="an-empty-body"),
    pytest.param(
        CHAT,
        with_(disaggregated_params={"request_type": "prefill_only"}),
        400,
        "disaggregated_params.request_type",
        "context_only",
        id="an-unknown-request-type",
    ),
    pytest.param(CHAT, with_(max_tokens=-5), 400, "max_tokens", "greater than or equal to 1", id="negative-max-tokens"),
    pytest.param(CHAT, with_(max_tokens=0), 400, "max_tokens", "greater than or equal to 1", id="zero-max-tokens"),
    pytest.param(
        CHAT, b"x" * (DEFAULT_ENGINE_MAX_REQUEST_BYTES + 1), 413, None, "exceeds the limit", id="a-body-over-the-limit"
    ),
    pytest.param(
        CHAT,
        with_(prompt_token_ids_b64="not base64!"),
        400,
        "prompt_token_ids_b64",
        "invalid base64",
        id="invalid-base64-prompt-ids",
    ),
    pytest.param(
        CHAT,
        with_(prompt_token_ids_b64="AAAAAAA="),
        400,
        "prompt_token_ids_b64",
        "whole number of int32",
        id="base64-that-is-not-whole-int32s",
    ),
    pytest.param(
        CHAT,
        with_(
            disaggregated_params={
                "request_type": "generation_only",
                "ctx_request_id": 1,
                "ctx_info_endpoint": "http://127.0.0.1:9",
                "encoded_opaque_state": "%%%",
            },
            prompt_token_ids=[1, 2],
        ),
        502,
        None,
        "ctx_request_id 1",
        id="a-generation-leg-whose-prefill-engine-is-unreachable",
    ),
    pytest.param(
        CHAT, with_(return_token_ids=True), 400, "return_token_ids", "unknown field", id="an-unknown-top-level-field"
    ),
    pytest.param(CHAT, with_(messages=[]), 400, "messages", "at least one message", id="no-messages"),
    pytest.param(CHAT, with_(messages=[{"content": "x"}]), 400, "messages", "role", id="a-message-without-a-role"),
    pytest.param(
        CHAT,
        with_(prompt_token_ids=[5, 999_999]),
        400,
        "prompt_token_ids",
        "outside the vocabulary",
        id="a-token-id-outside-the-vocabulary",
    ),
    pytest.param(
        CHAT,
        with_(prompt_token_ids=list(range(100, 700))),
        400,
        "prompt_token_ids",
        "context length exceeded:",
        id="a-context-longer-than-the-model",
    ),
    pytest.param(
        CHAT, with_(stream_options={"include_usage": True}), 400, None, "stream", id="stream-options-without-stream"
    ),
    pytest.param(CHAT, with_(top_logprobs=2), 400, None, "logprobs must be true", id="top-logprobs-without-logprobs"),
    pytest.param(CHAT, with_(n=2), 400, "n", "n > 1", id="several-choices"),
    pytest.param(
        CHAT,
        with_(disaggregated_params={"request_type": "context_only"}, stream=True),
        400,
        "stream",
        "cannot stream",
        id="a-streaming-context-leg",
    ),
    pytest.param(CHAT, with_(model=None), 400, "model", "string", id="no-model"),
    pytest.param(
        CHAT,
        with_(stop=[f"stop {i}" for i in range(MAX_STOP_STRINGS + 1)]),
        400,
        "stop",
        f"at most {MAX_STOP_STRINGS} stop strings, got {MAX_STOP_STRINGS + 1}",
        id="more-stop-strings-than-the-limit",
    ),
    pytest.param(
        "/v1/completions",
        {"model": "sim", "max_tokens": 2},
        400,
        "prompt",
        "required",
        id="completions-without-a-prompt",
    ),
    pytest.param(
        "/v1/completions",
        {"model": "sim", "prompt": "a", "suffix": "b"},
        400,
        "suffix",
        "not supported",
        id="completions-with-a-suffix",
    ),
    pytest.param("/v1/nope", GOOD, 404, None, "Not Found", id="an-unknown-route"),
    pytest.param("/v1/disagg/kv/not-a-number", None, 400, "ctx_request_id", "integer", id="a-kv-fetch-with-a-bad-id"),
]


@pytest.mark.parametrize(("route", "body", "status", "param", "fragment"), CASES)
async def test_bad_input_gets_a_json_error_and_the_server_keeps_serving(
    client: httpx.AsyncClient,
    engine_factory: EngineFactory,
    route: str,
    body: dict[str, Any] | bytes | None,
    status: int,
    param: str | None,
    fragment: str,
) -> None:
    async with engine_factory("decode", model={"path": "sim", "maxModelLen": 512}) as engine:
        if body is None:
            response = await client.get(engine.url + route)
        elif isinstance(body, bytes):
            response = await client.post(engine.url + route, content=body, headers={"content-type": "application/json"})
        else:
            response = await client.post(engine.url + route, json=body)
        good = await client.post(engine.url + CHAT, json=GOOD)

    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert fragment in error["message"]
    if param is not None:
        assert error["param"] == param
    assert good.status_code == 200, good.text


async def test_a_body_over_the_cap_without_content_length_is_still_refused(
    client: httpx.AsyncClient, decode: RunningEngine
) -> None:
    async def chunks() -> Any:
        for _ in range(DEFAULT_ENGINE_MAX_REQUEST_BYTES // (1024 * 1024) + 1):
            yield b"y" * (1024 * 1024)

    response = await client.post(decode.url + CHAT, content=chunks())
    assert response.status_code == 413
    assert (await client.post(decode.url + CHAT, json=GOOD)).status_code == 200


async def test_a_client_that_disconnects_mid_stream_does_not_leak_a_batch_slot(
    client: httpx.AsyncClient, engine_factory: EngineFactory
) -> None:
    async with engine_factory("decode", maxBatchSize=1, sim={"speed": 1.0, "decodeSecondsPerToken": 0.01}) as engine:
        # 5000 tokens at 10 ms would hold the only slot for 50 s if the hang-up went unnoticed.
        async with client.stream("POST", engine.url + CHAT, json=with_(stream=True, max_tokens=5000)) as response:
            async for _ in response.aiter_lines():
                break  # hang up after the first chunk
        after = await client.post(engine.url + CHAT, json=with_(max_tokens=2), timeout=10.0)
    assert after.status_code == 200


async def test_a_non_streaming_client_that_disconnects_stops_its_leg_and_frees_the_slot(
    client: httpx.AsyncClient, engine_factory: EngineFactory
) -> None:
    async with engine_factory("decode", maxBatchSize=1, sim={"speed": 1.0, "decodeSecondsPerToken": 0.01}) as engine:
        # 5000 tokens at 10 ms: the only slot would be held for 50 s if the leg ran on for nobody.
        with pytest.raises(httpx.ReadTimeout):
            async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=0.3)) as impatient:
                await impatient.post(engine.url + CHAT, json=with_(max_tokens=5000))
        after = await client.post(engine.url + CHAT, json=with_(max_tokens=2), timeout=10.0)
        metrics = (await client.get(engine.url + "/metrics")).text
    assert after.status_code == 200
    assert (
        metric_value(metrics, "drs_engine_requests_total", '{leg="context_and_generation",status="disconnected"}') == 1
    )
    assert metric_value(metrics, "drs_engine_requests_in_flight") == 0
