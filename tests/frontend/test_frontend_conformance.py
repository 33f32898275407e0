"""Clients against a real frontend over real sim engines: the official ``openai`` client, and
NeMo-Gym-shaped multi-turn requests with their extra fields."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from drs_protocol.chat import load_tokenizer, render_prompt_ids
from drs_protocol.token_prefix import find_prefix, render_spliced_ids
from openai.types.chat import ChatCompletionMessageParam

from .conftest import Replica, ReplicaFactory, chat_body, metric_value

GENERATION_OK = '{leg="generation_only",status="ok"}'
GYM_FIELDS: dict[str, Any] = {
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "required_prefix_token_ids": [1, 2],
}


def openai_client(replica: Replica) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="unused", max_retries=0)


async def test_the_openai_client_gets_a_chat_completion_with_the_engines_named(replica: Replica) -> None:
    client = openai_client(replica)
    raw = await client.chat.completions.with_raw_response.create(
        model="sim-qwen3", messages=[{"role": "user", "content": "Say something"}], max_tokens=6
    )
    completion = raw.parse()
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 6
    assert raw.headers["x-drs-prefill"] == replica.prefill[0].url
    assert raw.headers["x-drs-decode"] == replica.decode[0].url
    async with httpx.AsyncClient() as http:
        decode_metrics = (await http.get(replica.decode[0].url + "/metrics")).text
    assert metric_value(decode_metrics, "drs_engine_requests_total", GENERATION_OK) == 1


async def test_the_openai_client_streams_the_same_text_it_gets_without_streaming(replica: Replica) -> None:
    client = openai_client(replica)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Stream me a reply"}]
    whole = await client.chat.completions.create(model="sim-qwen3", messages=messages, max_tokens=10)
    stream = await client.chat.completions.create(
        model="sim-qwen3",
        messages=messages,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 10


async def test_the_openai_client_gets_completions_streamed_and_not(replica: Replica) -> None:
    client = openai_client(replica)
    whole = await client.completions.create(model="sim-qwen3", prompt="Once upon a time", max_tokens=5)
    assert whole.choices[0].text
    stream = await client.completions.create(model="sim-qwen3", prompt="Once upon a time", max_tokens=5, stream=True)
    text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert text == whole.choices[0].text


@pytest.mark.parametrize("tokenize", [True, False], ids=["frontend tokenizes", "engine tokenizes"])
async def test_a_gym_shaped_conversation_gets_token_ids_where_gym_reads_them(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient, tokenize: bool
) -> None:
    tokenizer = load_tokenizer(None)
    async with replica_factory(prefill=2, decode=2, tokenize=tokenize, tokenize_shadow_rate=1.0) as replica:
        messages: list[dict[str, object]] = [{"role": "system", "content": "You are a rollout policy."}]
        for turn in range(4):
            messages.append({"role": "user", "content": f"Step {turn}: what next?"})
            body = chat_body(
                messages=messages,
                logprobs=True,
                top_logprobs=0,
                chat_template_kwargs={"enable_thinking": False},
                conversation_params={"conversation_id": "gym-trajectory-1"},
                return_tokens_as_token_ids=True,
                return_token_ids=True,
            )
            resp = await client.post(replica.url + "/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            message = resp.json()["choices"][0]["message"]
            # turn 1 is the template's; every later one is spliced after the ids echoed back
            kwargs = {"enable_thinking": False}
            prefix = find_prefix(None, messages, vocab_size=len(tokenizer), eos_id=tokenizer.eos_token_id)
            expected_prompt = (
                render_prompt_ids(tokenizer, messages, chat_template_kwargs=kwargs)
                if prefix is None
                else render_spliced_ids(tokenizer, messages, prefix, chat_template_kwargs=kwargs).ids.tolist()
            )
            assert message["prompt_token_ids"] == expected_prompt
            assert len(message["generation_token_ids"]) == 8
            assert len(message["generation_log_probs"]) == 8
            assert all(isinstance(lp, float) for lp in message["generation_log_probs"])
            messages.append(
                {
                    "role": "assistant",
                    "content": message["content"],
                    "prompt_token_ids": message["prompt_token_ids"],
                    "generation_token_ids": message["generation_token_ids"],
                    "generation_log_probs": message["generation_log_probs"],
                }
            )
        metrics = (await client.get(replica.url + "/metrics")).text
        assert metric_value(metrics, "drs_frontend_affinity_total", '{outcome="hit"}') == 3
        if tokenize:
            assert metric_value(metrics, "drs_frontend_tokenize_shadow_total", '{result="match"}') == 4
            assert metric_value(metrics, "drs_frontend_tokenize_shadow_total", '{result="mismatch"}') == 0


async def test_the_engines_reject_the_gym_only_fields_the_frontend_strips(
    replica: Replica, client: httpx.AsyncClient
) -> None:
    body = chat_body(**GYM_FIELDS)
    direct = await client.post(replica.prefill[0].url + "/v1/chat/completions", json=body)
    assert direct.status_code == 400  # the sim engine is extra="forbid", like TensorRT-LLM
    relayed = await client.post(replica.url + "/v1/chat/completions", json=body)
    assert relayed.status_code == 200, relayed.text


async def test_a_turn_the_context_leg_finishes_is_answered_without_a_decode_engine(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    async with replica_factory(engine={"sim": {"eosProbability": 1.0}}) as replica:
        resp = await client.post(replica.url + "/v1/chat/completions", json=chat_body(logprobs=True))
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert "disaggregated_params" not in choice
        assert choice["message"]["prompt_token_ids"]
        assert resp.headers["x-drs-decode"] == "none"
        streamed = await client.post(replica.url + "/v1/chat/completions", json=chat_body(stream=True))
        assert streamed.status_code == 200
        assert streamed.text.rstrip().endswith("data: [DONE]")
        decode_metrics = (await client.get(replica.decode[0].url + "/metrics")).text
        assert metric_value(decode_metrics, "drs_engine_requests_total", GENERATION_OK) == 0
