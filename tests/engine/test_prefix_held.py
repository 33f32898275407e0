"""``POST /v1/prefix_cache/held``: the sim answers exactly what its prefix cache holds of a prompt."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import httpx
from drs_engine.backends.base import EngineBackend
from drs_engine.backends.torch.kv.prefix import PrefixKv
from drs_engine.backends.trtllm.engine import TrtllmBackend
from drs_engine.errors import NotSupportedError
from drs_engine.prefix_cache import PrefixCache, prefix_held
from drs_engine.prefix_hash import block_hashes
from drs_protocol.engine_config import TorchSpec
from drs_protocol.prefix_lookup import PrefixHeld
from drs_protocol.routes import PREFIX_HELD

from .conftest import EngineFactory, auth, metric_value
from .test_protocol import context_leg

TOKEN = "held-serving-token"
SYSTEM = {"role": "system", "content": "You are a careful agent. " * 40}
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search. " * 20}}]


def opening(task: str) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": task + ": " + "fact " * 100}]


def test_held_counts_the_leading_blocks_and_touches_neither_the_lru_nor_the_counters() -> None:
    cache = PrefixCache(tokens_per_block=4, capacity_tokens=8)
    seed = b"s" * 16
    cache.insert(block_hashes(seed, [1, 2, 3, 4, 5, 6, 7, 8], 4))  # two blocks: full
    answer = prefix_held(cache, seed, [1, 2, 3, 4, 9, 9, 9, 9, 1])
    assert (answer.tokens, answer.blocks, answer.held_blocks, answer.held_tokens) == (9, 2, 1, 4)
    assert (cache.query_tokens, cache.hit_tokens) == (0, 0)
    cache.insert(block_hashes(seed, [7, 7, 7, 7], 4))  # evicts the LRU block: [1..4]'s, not refreshed
    assert prefix_held(cache, seed, [1, 2, 3, 4]).held_blocks == 0
    assert prefix_held(cache, b"t" * 16, [7, 7, 7, 7]).held_blocks == 0  # other weights hold nothing


async def test_the_sim_answers_as_its_cache_holds_behind_the_serving_token(engine_factory: EngineFactory) -> None:
    async with (
        engine_factory("prefill", serving_token=TOKEN) as engine,
        httpx.AsyncClient(timeout=30, headers=auth(TOKEN)) as client,
    ):
        url = engine.url + PREFIX_HELD
        ask = {"messages": opening("task A"), "tools": TOOLS}
        cold = PrefixHeld.model_validate((await client.post(url, json=ask)).json())
        assert cold.blocks > 1 and cold.held_blocks == 0
        turn = {"model": "sim", "messages": opening("task A"), "tools": TOOLS, "max_tokens": 2}
        leg = await client.post(engine.url + "/v1/chat/completions", json=context_leg(turn, 1))
        assert leg.status_code == 200, leg.text
        before = (await client.get(engine.url + "/metrics")).text
        warm = PrefixHeld.model_validate((await client.post(url, json=ask)).json())
        assert warm.covers and warm.tokens == cold.tokens  # the opening, without the generation prompt
        other = PrefixHeld.model_validate(
            (await client.post(url, json={"messages": opening("task B"), "tools": TOOLS})).json()
        )
        assert 0 < other.held_blocks < other.blocks  # the shared system prompt and tools only
        after = (await client.get(engine.url + "/metrics")).text
        for name in ("drs_engine_prefix_cache_query_tokens_total", "drs_engine_prefix_cache_hit_tokens_total"):
            assert metric_value(after, name) == metric_value(before, name)
        by_ids = await client.post(url, json={"prompt_token_ids": list(range(5))})
        assert by_ids.status_code == 200 and by_ids.json()["held_blocks"] == 0
        async with httpx.AsyncClient(timeout=30) as anonymous:
            assert (await anonymous.post(url, json=ask)).status_code == 401
        bad = await client.post(url, json={"messages": opening("x"), "prompt_token_ids": [1]})
        assert bad.status_code == 400 and "exactly one of messages or prompt_token_ids" in bad.text
        worse = await client.post(url, json={"messages": [], "tools": TOOLS})
        assert worse.status_code == 400 and worse.json()["error"]["param"] == "messages"
        # ids outside the vocabulary: a 400 naming the field (a full block with an id past int32 was a 500)
        for ids in ([2**31] * 40, [5] * 40 + [2**40], [-1]):
            outside = await client.post(url, json={"prompt_token_ids": ids})
            assert outside.status_code == 400, (ids[-1], outside.text)
            assert outside.json()["error"]["param"] == "prompt_token_ids"
            assert f"token id {ids[-1]} is outside the vocabulary" in outside.text


def test_the_trtllm_backend_says_it_cannot_answer_with_a_501() -> None:
    """TensorRT-LLM keeps its block table in its executor and offers no lookup the server could ask
    (its KV-cache events could feed a mirror: not built); the frontend takes a 501 as no answer."""
    assert TrtllmBackend.prefix_held is EngineBackend.prefix_held
    try:
        EngineBackend.prefix_held(cast(Any, SimpleNamespace(name="trtllm")), [1, 2, 3])
    except NotSupportedError as exc:
        assert exc.status == 501 and "trtllm" in str(exc)
    else:
        raise AssertionError("no 501")


def test_the_torch_store_answers_the_blocks_whose_kv_it_would_copy() -> None:
    """The torch backend's answer is the same function over its prefix KV store (no GPU needed:
    the stored values are places in KV tensors, here stand-ins)."""
    store = PrefixKv(TorchSpec(tokens_per_block=4, cache_capacity_tokens=64))
    seed = b"w" * 16
    store.remember(seed, list(range(10)), kv=object(), from_block=0)
    answer = prefix_held(store.cache, seed, list(range(12)))
    assert (answer.blocks, answer.held_blocks) == (3, 2)
    assert store.lookup(seed, list(range(12))).blocks == answer.held_blocks  # what a prefill would reuse
