"""The disaggregated protocol across real sim engines (PROTOCOL.md sections 2 and 3)."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import httpx
import pytest
from drs_engine.server.runner import RunningEngine
from drs_engine.wire import MAX_STOP_STRINGS
from drs_protocol.chat import load_tokenizer
from drs_protocol.fields import HEADER_WEIGHTS_VERSION

from .conftest import EngineFactory

PROMPT_IDS = [100 + 7 * i for i in range(70)]  # two full 32-token blocks and a partial one
CHAT_BODY: dict[str, Any] = {
    "model": "sim",
    "messages": [{"role": "user", "content": "Write a haiku about disaggregated serving."}],
    "max_tokens": 12,
}


def context_leg(body: dict[str, Any], disagg_request_id: int, *, b64: bool = False) -> dict[str, Any]:
    """What a frontend sends to the prefill engine (PROTOCOL.md section 2, step 2)."""
    return {
        **body,
        "stream": False,
        "disaggregated_params": {
            "request_type": "context_only",
            "disagg_request_id": disagg_request_id,
            "return_prompt_token_ids_b64": b64,
        },
    }


def generation_leg(body: dict[str, Any], ctx_response: dict[str, Any]) -> dict[str, Any]:
    """What a frontend sends to the decode engine (PROTOCOL.md section 2, step 4)."""
    params = dict(ctx_response["choices"][0]["disaggregated_params"])
    params["request_type"] = "generation_only"
    params["ctx_usage"] = ctx_response["usage"]
    leg = {**body, "disaggregated_params": params}
    if ctx_response.get("prompt_token_ids_b64"):
        leg["prompt_token_ids_b64"] = ctx_response["prompt_token_ids_b64"]
    else:
        leg["prompt_token_ids"] = ctx_response["prompt_token_ids"]
    return leg


async def two_legs(
    client: httpx.AsyncClient,
    prefill: RunningEngine,
    decode: RunningEngine,
    body: dict[str, Any],
    route: str,
    *,
    b64: bool = False,
    disagg_request_id: int = 2**41 + 17,
) -> dict[str, Any]:
    ctx = await client.post(prefill.url + route, json=context_leg(body, disagg_request_id, b64=b64))
    assert ctx.status_code == 200, ctx.text
    gen = await client.post(decode.url + route, json=generation_leg(body, ctx.json()))
    assert gen.status_code == 200, gen.text
    result: dict[str, Any] = gen.json()
    return result


@pytest.mark.parametrize(
    ("route", "body", "b64"),
    [
        pytest.param("/v1/chat/completions", CHAT_BODY, False, id="chat-rendered-by-the-engine"),
        pytest.param("/v1/chat/completions", CHAT_BODY, True, id="chat-with-ids-relayed-as-base64"),
        pytest.param(
            "/v1/chat/completions",
            {**CHAT_BODY, "prompt_token_ids": PROMPT_IDS, "logprobs": True, "top_logprobs": 3},
            False,
            id="chat-with-token-ids-and-logprobs",
        ),
        pytest.param(
            "/v1/completions",
            {"model": "sim", "prompt": "Once upon a time", "max_tokens": 9},
            True,
            id="completions-with-a-text-prompt",
        ),
        pytest.param(
            "/v1/completions",
            {"model": "sim", "prompt": PROMPT_IDS, "max_tokens": 40, "logprobs": 2},
            False,
            id="completions-with-ids-crossing-a-block-boundary",
        ),
    ],
)
async def test_context_then_generation_legs_give_exactly_the_tokens_of_one_combined_call(
    client: httpx.AsyncClient,
    prefill: RunningEngine,
    decode: RunningEngine,
    route: str,
    body: dict[str, Any],
    b64: bool,
) -> None:
    combined = await client.post(decode.url + route, json=body)
    assert combined.status_code == 200, combined.text
    expected = combined.json()["choices"][0]

    result = await two_legs(client, prefill, decode, body, route, b64=b64)
    choice = result["choices"][0]

    assert choice["token_ids"] == expected["token_ids"]
    assert len(choice["token_ids"]) == body["max_tokens"]
    assert choice["finish_reason"] == expected["finish_reason"] == "length"
    assert choice["logprobs"] == expected["logprobs"]
    text_key = "message" if "messages" in body else "text"
    assert choice[text_key] == expected[text_key]
    assert result["prompt_token_ids"] == combined.json()["prompt_token_ids"]


async def test_context_response_carries_the_handoff_and_relays_unknown_fields(
    client: httpx.AsyncClient, prefill: RunningEngine
) -> None:
    leg = context_leg(CHAT_BODY, 2**42 + 1)
    leg["disaggregated_params"]["future_field"] = {"kept": True}
    response = await client.post(prefill.url + "/v1/chat/completions", json=leg)
    assert response.status_code == 200, response.text
    body = response.json()
    params = body["choices"][0]["disaggregated_params"]
    assert params["ctx_request_id"] == params["disagg_request_id"] == 2**42 + 1
    assert params["ctx_info_endpoint"] == prefill.url
    assert params["first_gen_tokens"] == body["choices"][0]["token_ids"]
    assert base64.b64decode(params["encoded_opaque_state"], validate=True)
    assert params["future_field"] == {"kept": True}
    assert body["choices"][0]["finish_reason"] == "not_finished"
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]


async def test_a_generation_leg_whose_context_state_is_gone_fails_with_a_404_naming_it(
    client: httpx.AsyncClient, prefill: RunningEngine, decode: RunningEngine
) -> None:
    ctx = await client.post(prefill.url + "/v1/chat/completions", json=context_leg(CHAT_BODY, 2**41 + 99))
    gen_leg = generation_leg(CHAT_BODY, ctx.json())
    first = await client.post(decode.url + "/v1/chat/completions", json=gen_leg)
    assert first.status_code == 200

    again = await client.post(decode.url + "/v1/chat/completions", json=gen_leg)  # fetched once already
    assert again.status_code == 404
    error = again.json()["error"]
    assert str(2**41 + 99) in error["message"]
    assert error["param"] == "disaggregated_params.ctx_request_id"
    assert error["code"] == 404

    gen_leg["disaggregated_params"]["ctx_request_id"] = 123456  # never created
    never = await client.post(decode.url + "/v1/chat/completions", json=gen_leg)
    assert never.status_code == 404
    assert "123456" in never.json()["error"]["message"]


async def test_a_generation_leg_with_another_prompt_than_its_context_is_refused(
    client: httpx.AsyncClient, prefill: RunningEngine, decode: RunningEngine
) -> None:
    body = {**CHAT_BODY, "prompt_token_ids": PROMPT_IDS}
    ctx = await client.post(prefill.url + "/v1/chat/completions", json=context_leg(body, 2**41 + 5))
    gen_leg = generation_leg(body, ctx.json())
    gen_leg["prompt_token_ids"] = [*PROMPT_IDS[:-1], 4242]
    response = await client.post(decode.url + "/v1/chat/completions", json=gen_leg)
    assert response.status_code == 400
    assert str(2**41 + 5) in response.json()["error"]["message"]


async def test_a_decode_engine_under_other_weights_recomputes_the_context_so_no_turn_mixes_versions(
    client: httpx.AsyncClient, prefill: RunningEngine, engine_factory: EngineFactory
) -> None:
    body = {**CHAT_BODY, "prompt_token_ids": PROMPT_IDS, "max_tokens": 8}
    async with (
        engine_factory("decode", weightsVersion="other") as stale_decode,
        engine_factory("prefill", weightsVersion="other") as other_prefill,
    ):
        old = await client.post(prefill.url + "/v1/chat/completions", json=body)
        new = await client.post(other_prefill.url + "/v1/chat/completions", json=body)
        mixed = await two_legs(client, prefill, stale_decode, body, "/v1/chat/completions")
    assert old.json()["choices"][0]["token_ids"] != new.json()["choices"][0]["token_ids"]
    # the context came from weights "0", the decode engine serves "other": it redid the context
    assert mixed["choices"][0]["token_ids"] == new.json()["choices"][0]["token_ids"]
    assert mixed["weights_version"] == "other"


@pytest.mark.parametrize("ids", [[0, 1, 151668, 77], PROMPT_IDS], ids=["lowest-and-highest-vocab-ids", "70-ids"])
async def test_prompt_token_ids_b64_round_trips_as_int32_little_endian(
    client: httpx.AsyncClient, prefill: RunningEngine, ids: list[int]
) -> None:
    b64 = base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode()
    body = {**CHAT_BODY, "prompt_token_ids_b64": b64, "max_tokens": 2}
    plain = await client.post(prefill.url + "/v1/chat/completions", json=body)
    assert plain.status_code == 200, plain.text
    assert plain.json()["prompt_token_ids"] == ids

    ctx = await client.post(prefill.url + "/v1/chat/completions", json=context_leg(body, 2**41 + 3, b64=True))
    assert ctx.status_code == 200, ctx.text
    assert ctx.json()["prompt_token_ids"] is None
    raw = base64.b64decode(ctx.json()["prompt_token_ids_b64"])
    assert list(struct.unpack(f"<{len(raw) // 4}i", raw)) == ids


async def test_streaming_sends_openai_chunks_with_the_same_tokens_and_ends_with_done(
    client: httpx.AsyncClient, decode: RunningEngine
) -> None:
    body = {**CHAT_BODY, "max_tokens": 20, "logprobs": True}
    full = (await client.post(decode.url + "/v1/chat/completions", json=body)).json()["choices"][0]

    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events: list[str] = []
    async with client.stream("POST", decode.url + "/v1/chat/completions", json=stream_body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers[HEADER_WEIGHTS_VERSION] == "0"
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    with_choices = [c for c in chunks if c["choices"]]
    tokens = [t for c in with_choices for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in with_choices)
    assert tokens == full["token_ids"]
    assert text == full["message"]["content"]
    assert with_choices[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20
    logprob_entries = [
        e for c in with_choices if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert [e["logprob"] for e in logprob_entries] == [e["logprob"] for e in full["logprobs"]["content"]]


async def test_streaming_completions_end_with_done(client: httpx.AsyncClient, decode: RunningEngine) -> None:
    body = {"model": "sim", "prompt": "abc", "max_tokens": 5, "stream": True}
    async with client.stream("POST", decode.url + "/v1/completions", json=body) as response:
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_a_streamed_generation_leg_with_a_missing_context_is_a_4xx_not_a_broken_stream(
    client: httpx.AsyncClient, prefill: RunningEngine, decode: RunningEngine
) -> None:
    body = {**CHAT_BODY, "prompt_token_ids": PROMPT_IDS}
    leg = generation_leg(
        body,
        {
            "choices": [{"disaggregated_params": {"ctx_request_id": 31337, "ctx_info_endpoint": prefill.url}}],
            "usage": {"prompt_tokens": 70},
            "prompt_token_ids": PROMPT_IDS,
        },
    )
    response = await client.post(decode.url + "/v1/chat/completions", json={**leg, "stream": True})
    assert response.status_code == 404
    assert "31337" in response.json()["error"]["message"]


async def test_eos_ends_a_turn_with_stop_even_on_the_context_leg(
    client: httpx.AsyncClient, engine_factory: EngineFactory
) -> None:
    async with engine_factory("prefill", sim={"eosProbability": 1.0}) as eager:
        ctx = await client.post(eager.url + "/v1/chat/completions", json=context_leg(CHAT_BODY, 2**41 + 8))
        combined = await client.post(eager.url + "/v1/chat/completions", json={**CHAT_BODY, "max_tokens": 50})
        ignoring = await client.post(
            eager.url + "/v1/chat/completions", json={**CHAT_BODY, "max_tokens": 4, "ignore_eos": True}
        )
    assert ctx.json()["choices"][0]["finish_reason"] == "stop"
    assert combined.json()["choices"][0]["finish_reason"] == "stop"
    assert combined.json()["choices"][0]["token_ids"] == [151645]  # Qwen3's <|im_end|>
    # ignore_eos as TensorRT-LLM means it: EOS is not banned (it wins every pick here), it only does not stop
    assert ignoring.json()["choices"][0]["finish_reason"] == "length"
    assert ignoring.json()["choices"][0]["token_ids"] == [151645] * 4


async def test_health_and_server_info_describe_the_engine_as_a_test_double(
    client: httpx.AsyncClient, prefill: RunningEngine
) -> None:
    assert (await client.get(prefill.url + "/health")).json()["status"] == "ok"
    info = (await client.get(prefill.url + "/server_info")).json()
    assert info["disaggregated_params"]["ctx_info_endpoint"] == prefill.url
    assert info["max_batch_size"] == 256
    assert info["tokens_per_block"] == 32
    assert info["role"] == "prefill"
    assert info["backend"] == "sim"
    assert info["test_double"] is True
    assert info["engine"]["kind"] == "test double"
    metrics = (await client.get(prefill.url + "/metrics")).text
    assert 'drs_engine_info{backend="sim",kind="test double",role="prefill"} 1.0' in metrics


async def test_a_stop_string_ends_generation_with_it_as_the_stop_reason(
    client: httpx.AsyncClient, decode: RunningEngine
) -> None:
    tokenizer = load_tokenizer(None)
    body = {**CHAT_BODY, "prompt_token_ids": PROMPT_IDS, "max_tokens": 30}
    free = (await client.post(decode.url + "/v1/chat/completions", json=body)).json()["choices"][0]
    stop_ids = free["token_ids"][4:5]  # the 5th token, as text, is the stop string
    stop = tokenizer.decode(stop_ids)
    assert tokenizer.encode(stop, add_special_tokens=False) == stop_ids  # holds for these fixed ids

    response = await client.post(decode.url + "/v1/chat/completions", json={**body, "stop": [stop]})
    stopped = response.json()["choices"][0]

    assert stopped["finish_reason"] == "stop"
    assert stopped["stop_reason"] == stop
    assert stopped["token_ids"] == free["token_ids"][: free["token_ids"].index(stop_ids[0]) + 1]
    assert free["message"]["content"].startswith(stopped["message"]["content"])

    # as many stop strings as a request may name, the one that matches last: the same stop
    many = [f"never {i}" for i in range(MAX_STOP_STRINGS - 1)] + [stop]
    response = await client.post(decode.url + "/v1/chat/completions", json={**body, "stop": many})
    assert response.json()["choices"][0] == stopped


async def test_the_models_route_lists_the_served_model(client: httpx.AsyncClient, decode: RunningEngine) -> None:
    response = await client.get(decode.url + "/v1/models")
    assert response.json()["data"][0]["id"] == "sim-qwen3"
