"""Every answer shape validates against the ``openai`` SDK's pydantic response models, strictly.

The SDK itself builds its objects without validating them (``construct``), so a field it types as
required can be missing and a plain client never notices; NeMo-Gym does notice: it validates the
answers with the same models (``NeMoGymChatCompletion.model_validate``), and a missing
``top_logprobs`` or half of the token metadata failed every Gym session (issue 23). Here each
shape is validated with ``model_validate``: chat non-streamed and every streamed chunk, completions
non-streamed (and its streamed chunks that end a choice: the SDK types ``finish_reason`` as
required, so the chunks before the last, which OpenAI itself sends with ``null``, cannot satisfy
it), with and without log-probs (none, the sampled token only, two alternatives), with the tokens
as text and as ``token_id:N``, and with either leg ending the turn (the prefill engine ending on
EOS: ``x-drs-decode: none``). Real frontends over real sim engines (``conftest``).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from drs_protocol import fields
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from .conftest import ReplicaFactory, stop_engine

#: (request fields, how many alternatives each entry must carry); None: no log-probs asked
CHAT_LOGPROBS = {
    "none": ({}, None),
    "sampled only": ({"logprobs": True, "top_logprobs": 0}, 0),
    "two alternatives": ({"logprobs": True, "top_logprobs": 2}, 2),
}
COMPLETION_LOGPROBS = {
    "none": ({}, None),
    "sampled only": ({"logprobs": 0}, 0),
    "two alternatives": ({"logprobs": 2}, 2),
}
#: the sim's EOS probability: 1.0 ends every turn on the prefill engine's first token
LEG_ENDS = {"generation leg ends the turn": 0.0, "context leg ends the turn (EOS)": 1.0}


def sse_payloads(text: str) -> list[dict[str, Any]]:
    lines = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-200:]
    return [json.loads(line) for line in lines[:-1]]


def check_chat_entries(logprobs: Any, top: int | None, as_ids: bool, token_ids: list[int]) -> None:
    if top is None:
        assert logprobs is None
        return
    entries = logprobs["content"]
    assert len(entries) == len(token_ids)
    for entry, token_id in zip(entries, token_ids, strict=True):
        assert isinstance(entry["top_logprobs"], list) and len(entry["top_logprobs"]) == top
        if as_ids:
            assert entry["token"] == f"{fields.TOKEN_ID_PREFIX}{token_id}"
            assert all(alt["token"].startswith(fields.TOKEN_ID_PREFIX) for alt in entry["top_logprobs"])
        else:
            assert not entry["token"].startswith(fields.TOKEN_ID_PREFIX)


@pytest.mark.parametrize("eos", LEG_ENDS.values(), ids=LEG_ENDS.keys())
@pytest.mark.parametrize("as_ids", [False, True], ids=["tokens as text", "tokens as token_id:N"])
@pytest.mark.parametrize("case", CHAT_LOGPROBS.keys())
async def test_chat_answers_and_chunks_validate_against_the_sdk_models(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient, eos: float, as_ids: bool, case: str
) -> None:
    extra, top = CHAT_LOGPROBS[case]
    if as_ids:
        extra = {**extra, fields.RETURN_TOKENS_AS_TOKEN_IDS: True}
    body = {"model": "sim-qwen3", "messages": [{"role": "user", "content": "Say it"}], "max_tokens": 6, **extra}
    async with replica_factory(engine={"sim": {"eosProbability": eos}}, tokenize=True) as replica:
        url = replica.url + "/v1/chat/completions"
        whole = await client.post(url, json=body)
        assert whole.status_code == 200, whole.text
        assert (whole.headers["x-drs-decode"] == "none") is (eos == 1.0)
        data = whole.json()
        completion = ChatCompletion.model_validate(data)
        choice = data["choices"][0]
        assert completion.choices[0].finish_reason == ("stop" if eos == 1.0 else "length")
        # token metadata complete, whichever leg ended the turn (Gym: "partial token metadata")
        assert isinstance(data["prompt_token_ids"], list) and data["prompt_token_ids"]
        assert "prompt_token_ids_b64" not in data
        assert isinstance(choice["token_ids"], list) and choice["token_ids"]
        assert choice["message"]["prompt_token_ids"] == data["prompt_token_ids"]
        assert choice["message"]["generation_token_ids"] == choice["token_ids"]
        check_chat_entries(choice["logprobs"], top, as_ids, choice["token_ids"])

        streamed = await client.post(url, json={**body, "stream": True, "stream_options": {"include_usage": True}})
        assert streamed.status_code == 200, streamed.text
        chunks = sse_payloads(streamed.text)
        for chunk in chunks:
            ChatCompletionChunk.model_validate(chunk)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(choice["token_ids"])
        ids = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids") or []]
        assert ids == choice["token_ids"]  # the sim is deterministic: the same tokens streamed
        if top is not None:
            entries = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
            check_chat_entries({"content": entries}, top, as_ids, ids)


@pytest.mark.parametrize("eos", LEG_ENDS.values(), ids=LEG_ENDS.keys())
@pytest.mark.parametrize("as_ids", [False, True], ids=["tokens as text", "tokens as token_id:N"])
@pytest.mark.parametrize("case", COMPLETION_LOGPROBS.keys())
async def test_completions_answers_validate_against_the_sdk_models(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient, eos: float, as_ids: bool, case: str
) -> None:
    extra, top = COMPLETION_LOGPROBS[case]
    if as_ids:
        extra = {**extra, fields.RETURN_TOKENS_AS_TOKEN_IDS: True}
    body = {"model": "sim-qwen3", "prompt": "Once upon a time", "max_tokens": 5, **extra}
    async with replica_factory(engine={"sim": {"eosProbability": eos}}, tokenize=True) as replica:
        url = replica.url + "/v1/completions"
        whole = await client.post(url, json=body)
        assert whole.status_code == 200, whole.text
        assert (whole.headers["x-drs-decode"] == "none") is (eos == 1.0)
        data = whole.json()
        Completion.model_validate(data)
        choice = data["choices"][0]
        assert isinstance(data["prompt_token_ids"], list) and data["prompt_token_ids"]
        assert "prompt_token_ids_b64" not in data
        if top is None:
            assert choice["logprobs"] is None
        else:
            logprobs = choice["logprobs"]
            assert len(logprobs["token_logprobs"]) == len(choice["token_ids"])
            assert all(isinstance(lp, float) for lp in logprobs["token_logprobs"])
            assert [len(alts) for alts in logprobs["top_logprobs"]] == [top] * len(choice["token_ids"])
            want = [f"{fields.TOKEN_ID_PREFIX}{i}" for i in choice["token_ids"]]
            assert (logprobs["tokens"] == want) is as_ids

        streamed = await client.post(url, json={**body, "stream": True})
        assert streamed.status_code == 200, streamed.text
        chunks = sse_payloads(streamed.text)
        finishing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
        assert len(finishing) == 1
        for chunk in finishing:
            Completion.model_validate(chunk)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]


async def test_the_model_list_answers_on_the_frontend_and_the_engines(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    async with replica_factory() as replica:
        engine = await client.get(replica.prefill[0].url + "/v1/models")
        assert engine.status_code == 200
        served = [Model.model_validate(m) for m in engine.json()["data"]]
        assert [m.id for m in served] == ["sim-qwen3"]
        sdk = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="unused", max_retries=0)
        page = await sdk.models.list()
        assert [m.model_dump() for m in page.data] == [m.model_dump() for m in served]
        assert (await client.get(replica.url + "/v1/models")).json() == engine.json()


async def test_the_model_list_comes_from_a_decode_engine_while_no_prefill_engine_answers(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    async with replica_factory(health_interval=3600) as replica:  # no probe round marks them down
        await stop_engine(replica.prefill[0])
        resp = await client.get(replica.url + "/v1/models")
        assert resp.status_code == 200, resp.text
        assert resp.json() == (await client.get(replica.decode[0].url + "/v1/models")).json()
        await stop_engine(replica.decode[0])
        resp = await client.get(replica.url + "/v1/models")
        assert resp.status_code == 503
        tried = f"{replica.prefill[0].url}, {replica.decode[0].url}"
        assert resp.json()["error"]["message"] == f"no engine answered GET /v1/models (tried {tried})"
