"""The sim's prefix cache: unit behaviour, and what an engine reports through usage and /metrics."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
from drs_engine.backends.sim.model import weights_seed
from drs_engine.prefix_cache import PrefixCache
from drs_engine.prefix_hash import block_hashes
from drs_engine.server.runner import RunningEngine
from drs_protocol.fields import HEADER_WEIGHTS_VERSION

from .conftest import EngineFactory, auth, metric_value
from .test_protocol import context_leg

SEED = weights_seed("v1", b"content")
BLOCK = 4


def hashes(ids: list[int], seed: bytes = SEED) -> list[bytes]:
    return block_hashes(seed, ids, BLOCK)


def test_a_cold_lookup_hits_nothing_and_a_repeated_prompt_hits_all_but_its_last_token() -> None:
    cache = PrefixCache(tokens_per_block=BLOCK, capacity_tokens=100)
    ids = list(range(12))
    assert cache.lookup(12, hashes(ids)).hit_tokens == 0
    cache.insert(hashes(ids))
    second = cache.lookup(12, hashes(ids))
    assert second.hit_blocks == 3
    assert second.hit_tokens == 11  # the last prompt token is always computed
    assert (cache.query_tokens, cache.hit_tokens) == (24, 11)


def test_a_lookup_stops_at_the_first_block_that_differs() -> None:
    cache = PrefixCache(tokens_per_block=BLOCK, capacity_tokens=100)
    cache.insert(hashes(list(range(12))))
    changed = [0, 1, 2, 3, 4, 99, 6, 7, 8, 9, 10, 11]  # second block differs, third block is equal
    assert cache.lookup(13, hashes([*changed, 12])).hit_tokens == 4


def test_blocks_are_keyed_by_the_weights() -> None:
    cache = PrefixCache(tokens_per_block=BLOCK, capacity_tokens=100)
    ids = list(range(9))
    cache.insert(hashes(ids))
    assert cache.lookup(9, hashes(ids, weights_seed("v2", b"content"))).hit_tokens == 0
    assert cache.lookup(9, hashes(ids, weights_seed("v1", b"other"))).hit_tokens == 0


def test_least_recently_used_blocks_are_evicted_beyond_the_capacity() -> None:
    cache = PrefixCache(tokens_per_block=BLOCK, capacity_tokens=2 * BLOCK)
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    cache.insert(hashes(a))
    cache.insert(hashes(b))
    cache.lookup(5, hashes(a))  # touch a
    cache.insert(hashes(c))  # evicts b, the least recently used
    assert len(cache) == 2
    assert cache.lookup(5, hashes([*a, 0])).hit_blocks == 1
    assert cache.lookup(5, hashes([*b, 0])).hit_blocks == 0
    assert cache.lookup(5, hashes([*c, 0])).hit_blocks == 1


def test_reset_empties_the_cache_but_keeps_the_counters() -> None:
    cache = PrefixCache(tokens_per_block=BLOCK, capacity_tokens=100)
    cache.insert(hashes(list(range(8))))
    cache.lookup(9, hashes(list(range(9))))
    assert cache.reset() == 2
    assert len(cache) == 0
    assert cache.lookup(9, hashes(list(range(9)))).hit_tokens == 0
    assert cache.hit_tokens == 8


TURN1 = [1000 + i for i in range(70)]  # 2 full blocks of 32 + 6


async def context_turn(client: httpx.AsyncClient, engine: RunningEngine, ids: list[int], rid: int) -> dict[str, Any]:
    body = {"model": "sim", "messages": [], "prompt_token_ids": ids, "max_tokens": 16}
    response = await client.post(engine.url + "/v1/chat/completions", json=context_leg(body, rid))
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def test_a_second_turn_on_the_same_prefill_engine_hits_the_first_turns_tokens(
    client: httpx.AsyncClient, prefill: RunningEngine
) -> None:
    first = await context_turn(client, prefill, TURN1, 2**41 + 1)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    turn2 = [*TURN1, *first["choices"][0]["token_ids"], *range(500, 540)]
    second = await context_turn(client, prefill, turn2, 2**41 + 2)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # TURN1's two full blocks

    metrics = (await client.get(prefill.url + "/metrics")).text
    assert metric_value(metrics, "drs_engine_prefix_cache_query_tokens_total") == len(TURN1) + len(turn2)
    assert metric_value(metrics, "drs_engine_prefix_cache_hit_tokens_total") == 64


async def test_a_rendered_chat_conversation_reuses_its_first_turn(
    client: httpx.AsyncClient, prefill: RunningEngine
) -> None:
    user1 = {"role": "user", "content": "Tell me about prefix caching in large language model servers. " * 4}
    body1 = {"model": "sim", "messages": [user1], "max_tokens": 8}
    first = (await client.post(prefill.url + "/v1/chat/completions", json=body1)).json()
    turn1_len = len(first["prompt_token_ids"])
    answer = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    body2 = {"model": "sim", "messages": [user1, answer, {"role": "user", "content": "And eviction?"}], "max_tokens": 8}
    second = (await client.post(prefill.url + "/v1/chat/completions", json=body2)).json()
    assert second["prompt_token_ids"][:turn1_len] == first["prompt_token_ids"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= turn1_len // 32 * 32 > 0


async def test_after_reset_prefix_cache_nothing_hits(client: httpx.AsyncClient, prefill: RunningEngine) -> None:
    await context_turn(client, prefill, TURN1, 2**41 + 1)
    reset = await client.post(prefill.url + "/control/prefix_cache/reset", headers=auth())
    assert reset.status_code == 200, reset.text
    assert reset.json()["result"]["prefix_cache_blocks_evicted"] == 2
    again = await context_turn(client, prefill, TURN1, 2**41 + 2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    metrics = (await client.get(prefill.url + "/metrics")).text
    assert metric_value(metrics, "drs_engine_prefix_cache_hit_tokens_total") == 0


async def test_a_weights_update_changes_the_tokens_the_version_and_empties_the_cache(
    client: httpx.AsyncClient, prefill: RunningEngine, tmp_path: Path
) -> None:
    weights = tmp_path / "step-1"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"\x01" * 1000)
    body = {"model": "sim", "prompt_token_ids": TURN1, "messages": [], "max_tokens": 10}

    before = await client.post(prefill.url + "/v1/chat/completions", json=body)
    assert before.headers[HEADER_WEIGHTS_VERSION] == "0"
    load = await client.post(
        prefill.url + "/control/weights/load", headers=auth(), json={"path": str(weights), "version": "step-1"}
    )
    assert load.status_code == 200, load.text
    assert load.json()["weights_version"] == "step-1"
    after = await client.post(prefill.url + "/v1/chat/completions", json=body)

    assert after.headers[HEADER_WEIGHTS_VERSION] == "step-1"
    assert after.json()["choices"][0]["token_ids"] != before.json()["choices"][0]["token_ids"]
    assert after.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # old blocks are not reused
    metrics = (await client.get(prefill.url + "/metrics")).text
    assert metric_value(metrics, "drs_engine_weights_version", '{version="step-1"}') == 1
    assert 'drs_engine_weights_version{version="0"}' not in metrics
    info = (await client.get(prefill.url + "/server_info")).json()
    assert info["weights_version"] == "step-1"

    (weights / "model.safetensors").write_bytes(b"\x02" * 1000)  # same version name, other content
    reload = await client.post(
        prefill.url + "/control/weights/load", headers=auth(), json={"path": str(weights), "version": "step-1"}
    )
    assert reload.status_code == 200
    third = await client.post(prefill.url + "/v1/chat/completions", json=body)
    assert third.json()["choices"][0]["token_ids"] != after.json()["choices"][0]["token_ids"]


async def test_prefill_time_counts_only_uncached_tokens(
    client: httpx.AsyncClient, engine_factory: EngineFactory
) -> None:
    sim = {"speed": 1.0, "prefillSecondsPerToken": 0.001, "decodeSecondsPerToken": 0.0}
    body = {"model": "sim", "messages": [], "prompt_token_ids": list(range(100, 300)), "max_tokens": 1}
    async with engine_factory("prefill", sim=sim) as engine:
        started = time.monotonic()
        cold = await client.post(engine.url + "/v1/chat/completions", json=body)
        cold_s = time.monotonic() - started
        started = time.monotonic()
        warm = await client.post(engine.url + "/v1/chat/completions", json=body)
        warm_s = time.monotonic() - started
    assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    assert cold_s >= 0.2  # 200 uncached tokens at 1 ms
    assert warm_s < 0.15  # 8 uncached tokens at 1 ms, plus HTTP
