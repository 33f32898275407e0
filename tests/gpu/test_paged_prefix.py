"""The paged layout's prefix cache (:mod:`drs_engine.backends.torch.kv.turns`) on the CPU.

With ``kvLayout: paged`` a later turn's prefill shares the cached blocks of its prefix in place and
writes only its new tokens into the store; a finished turn's blocks become the cache's without a
copy out. The store counts the KV it copies (``tokens_written`` into it from a prefill's own
tensor, ``tokens_gathered`` out of it), so a copy per turn shows as a count. Greedy tokens equal the
slot layout's (float32) across turns; a refit, ``reset_prefix_cache`` and sleep drop the cached
blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_engine.server.runner import start_engine
from drs_protocol.routes import PREFIX_HELD

from .conftest import COMPLETIONS, CONTROL_TOKEN, auth, completion_body, prompt_ids, torch_config
from .test_torch_engine import disaggregated, tokens

TPB = 16
PAGED: dict[str, Any] = {"kvLayout": "paged", "tokensPerBlock": TPB, "decodeSlotTokens": 128, "maxDecodeBatch": 4}


async def _turn(client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int) -> tuple[list[int], int]:
    """One completion: its token ids and its cached prompt tokens."""
    response = await client.post(url + COMPLETIONS, json=completion_body(ids, max_tokens=max_tokens))
    assert response.status_code == 200, response.text
    body = response.json()
    return list(body["choices"][0]["token_ids"]), int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


async def _pool(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    engine = (await client.get(url + "/server_info")).json()["engine"]
    pool = dict(engine["decode_batching"]["pool"])
    assert engine["prefix_cache_blocks"] == pool["cached_blocks"]  # the pool is the engine's cache
    return pool


@pytest.mark.parametrize("attention", ["flex", "gather"])
async def test_a_later_turns_prefill_shares_the_cached_blocks_in_place_and_writes_only_its_new_tokens(
    attention: str,
) -> None:
    """Three turns of one conversation (each prompt the last one, its answer and a new message): the
    paged engine gives the slot engine's greedy tokens and cached counts, and its store takes in
    only each prompt's uncached tokens (nothing else written, nothing gathered but the hits' past,
    no copy-on-write); a turn that ends on its first token leaves its blocks cached too."""
    async with (
        start_engine(torch_config(tokensPerBlock=TPB), control_token=CONTROL_TOKEN) as slots,
        start_engine(torch_config(pagedAttention=attention, **PAGED), control_token=CONTROL_TOKEN) as paged,
        httpx.AsyncClient(timeout=120) as client,
    ):
        warm = await _pool(client, paged.url)  # the warm-up's throwaway sequences were written in
        assert warm["prefix_hit_blocks"] > 0 and warm["cached_blocks"] == 0  # the hit path warmed, forgotten
        ids, written, gathered = prompt_ids(37, offset=3000), warm["tokens_written"], warm["tokens_gathered"]
        for turn in range(3):
            out, cached = await _turn(client, paged.url, ids, 12)
            assert (out, cached) == await _turn(client, slots.url, ids, 12)
            assert cached == (0 if turn == 0 else (len(ids) - 9 - 1) // TPB * TPB)  # last turn's computed blocks
            written, gathered = written + len(ids) - cached, gathered + cached
            pool = await _pool(client, paged.url)
            assert (pool["tokens_written"], pool["tokens_gathered"]) == (written, gathered)
            assert pool["cow_copies"] == warm["cow_copies"] and pool["holders"] == 0 and pool["eager_rows"] == 0
            assert pool["cached_blocks"] == (len(ids) + 11) // TPB  # this turn's computed full blocks
            ids = ids + out + prompt_ids(9, offset=4000 + turn)
        assert pool["prefix_hit_blocks"] - warm["prefix_hit_blocks"] == (gathered - warm["tokens_gathered"]) // TPB
        # a prompt answered by its first token never steps: its turn is dropped, its blocks cached
        head = prompt_ids(50, offset=9000)
        first, cached = await _turn(client, paged.url, head, 1)
        assert cached == 0 and len(first) == 1
        again, cached = await _turn(client, paged.url, head[:48] + prompt_ids(5, offset=9500), 1)
        assert cached == 48 and again == (await _turn(client, slots.url, head[:48] + prompt_ids(5, offset=9500), 1))[0]
        pool = await _pool(client, paged.url)
        assert pool["holders"] == 0 and pool["tokens_written"] == written + 50 + 5


async def test_prompts_sharing_a_prefix_sent_together_share_its_blocks_and_keep_the_slot_pools_tokens() -> None:
    """Four prompts with one 40-token head, sent at once (prefilled together in one batched pass:
    each written into the store after, a later one sharing an earlier one's head blocks), then again
    with new tails (each a prefix hit): the greedy tokens of the slot engine, no table left."""
    import asyncio

    head = prompt_ids(40, offset=11000)
    rounds = [[head + prompt_ids(5 + 3 * i, offset=12000 + 100 * r + i) for i in range(4)] for r in range(2)]
    async with (
        start_engine(torch_config(tokensPerBlock=TPB), control_token=CONTROL_TOKEN) as slots,
        start_engine(torch_config(**PAGED), control_token=CONTROL_TOKEN) as paged,
        httpx.AsyncClient(timeout=120) as client,
    ):
        warm = await _pool(client, paged.url)
        for prompts in rounds:
            expected = [await tokens(client, slots.url, ids, max_tokens=10) for ids in prompts]
            got = await asyncio.gather(*(tokens(client, paged.url, ids, max_tokens=10) for ids in prompts))
            assert list(got) == expected
        pool = await _pool(client, paged.url)
        batching = (await client.get(paged.url + "/server_info")).json()["engine"]["prefill_batching"]
    assert batching["prompts"] > batching["batches"]  # some prompts were prefilled together
    assert pool["holders"] == 0 and pool["prefix_hit_blocks"] - warm["prefix_hit_blocks"] >= 4 * 2
    assert pool["cow_copies"] == warm["cow_copies"]


async def test_a_refit_a_reset_and_a_sleep_drop_the_paged_stores_cached_blocks(tmp_path: Path) -> None:
    """Cached blocks are KV of the weights served: new weights, ``reset_prefix_cache`` and release
    each drop them all (counted in the answer; ``prefix_held`` answers from the store's blocks),
    and the next prompt is computed whole."""
    import torch
    from drs_engine.backends.torch.model import SIZES, random_state_dict
    from safetensors.torch import save_file

    save_file(
        random_state_dict(SIZES["tiny"], seed=5, device="cpu", dtype=torch.float32), str(tmp_path / "w.safetensors")
    )
    ids = prompt_ids(40, offset=600)
    async with (
        start_engine(torch_config(**PAGED), control_token=CONTROL_TOKEN) as e,
        start_engine(torch_config(model="random:tiny@5", tokensPerBlock=TPB), control_token=CONTROL_TOKEN) as five,
        httpx.AsyncClient(timeout=60) as client,
    ):

        async def held() -> int:
            answer = await client.post(e.url + PREFIX_HELD, json={"prompt_token_ids": ids})
            assert answer.status_code == 200, answer.text
            return int(answer.json()["held_blocks"])

        async def cached_then_dropped(drop: Any, *, asleep: bool = False) -> dict[str, Any]:
            await _turn(client, e.url, ids, 4)
            assert await held() == 2  # the frontends' question answered from the store's blocks
            assert (await _turn(client, e.url, ids, 4))[1] == 32 and (await _pool(client, e.url))["cached_blocks"] == 2
            answer = await drop()
            assert answer.status_code == 200, answer.text
            assert (await _pool(client, e.url))["cached_blocks"] == 0 and (asleep or await held() == 0)
            return dict(answer.json()["result"])

        reset = await cached_then_dropped(lambda: client.post(e.url + "/control/prefix_cache/reset", headers=auth()))
        assert reset["prefix_cache_blocks_evicted"] == 2
        load = await cached_then_dropped(
            lambda: client.post(
                e.url + "/control/weights/load", headers=auth(), json={"path": str(tmp_path), "version": "v5"}
            )
        )
        assert load["prefix_cache_blocks_evicted"] == 2
        out, cached = await _turn(client, e.url, ids, 4)
        assert cached == 0 and (out, 0) == await _turn(client, five.url, ids, 4)  # computed whole, new weights
        release = await cached_then_dropped(
            lambda: client.post(e.url + "/control/memory/release", headers=auth(), json={}), asleep=True
        )
        assert release["prefix_cache_blocks_evicted"] == 2
        assert (await client.post(e.url + "/control/memory/resume", headers=auth(), json={})).status_code == 200
        assert await _turn(client, e.url, ids, 4) == (out, 0)


def test_a_leaving_sequence_publishes_its_blocks_and_a_refit_rewrite_leaves_the_shared_ones_alone() -> None:
    """On the decoder: a sequence that takes over its prefilled turn steps from its table; leaving,
    its full blocks are published (nothing gathered out); another sequence's refit rewrite moves it
    to blocks of its own, so the cache's shared blocks keep the KV their keys name."""
    import torch
    from drs_engine.backends.torch.batching import DecodeSeq
    from drs_engine.backends.torch.model import SIZES, decode_step, new_kv, prefill, random_state_dict
    from drs_engine.backends.torch.paged_decoder import PagedDecoder
    from drs_protocol.enums import PagedAttention

    from .test_decode_pool import _seq

    shape = SIZES["tiny"]
    old, new = (random_state_dict(shape, seed=s, device="cpu", dtype=torch.float32) for s in (5, 6))
    decoder = PagedDecoder(
        shape,
        tokens=128,
        tokens_per_block=8,
        rows=4,
        attention=PagedAttention.GATHER,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    decoder.keys = lambda seq: [tuple(seq.prompt[: (i + 1) * 8]) for i in range(seq.length // 8)]
    turns, pool = decoder.turns, decoder.store.pool
    ids = prompt_ids(17, offset=50)

    def prefilled(params: Any) -> DecodeSeq:
        keys = [tuple(ids[: (i + 1) * 8]) for i in range(2)]
        turn = turns.open(keys, 17)
        kv = turns.past(turn, 24)
        logits = prefill(params, shape, ids[turn.hit :], kv, turn.hit)
        seq: DecodeSeq = _seq(turns.settle(turn, kv, keys, 17, stays=True), 17, int(logits.argmax()))
        seq.prompt = list(ids)
        return seq

    a = prefilled(old)
    decoder.seat([a])
    assert a.pooled and a.kv is None and len(pool.sequences) == 1
    mirror = new_kv(shape, 24, device="cpu", dtype=torch.float32)
    prefill(old, shape, ids, mirror, 0)
    expected = decode_step(old, shape, [a.next_token], [mirror], [17])
    assert torch.allclose(decoder.step(old, "old", [a]), expected, atol=1e-5)
    shared = pool.table(a)[:2]
    b = prefilled(old)
    decoder.seat([b])
    assert pool.table(b)[:2] == shared and pool.copies == 0  # b's prefix is a's blocks
    before = decoder.store.kv[:, :, :, shared[0] * 8 : shared[1] * 8 + 8].clone()
    decoder.rewrite(b, lambda fresh: prefill(new, shape, ids, fresh, 0))  # new weights: b's blocks its own
    assert not set(pool.table(b)) & set(shared) and torch.equal(
        decoder.store.kv[:, :, :, shared[0] * 8 : shared[1] * 8 + 8], before
    )
    gathered = decoder.store.gathered
    a.length += 1
    decoder.release([a, b])
    assert decoder.store.gathered == gathered and a.kv is None and not a.pooled  # nothing copied out
    assert pool.cached_blocks == 2 and not pool.sequences and pool.free_blocks == pool.blocks
    c = prefilled(old)  # leaves before its first step: its turn is dropped, its blocks stay cached
    decoder.release([c])
    assert not pool.sequences and pool.cached_blocks == 2


async def test_a_paged_prefill_engine_hands_contexts_over_and_keeps_their_blocks_for_the_next_turn() -> None:
    """Context legs on a paged engine: the decode engine (slot layout) decodes what one engine does;
    the context's full blocks are cached in the prefill engine's store (its table closed), so the
    next turn's context leg shares them, and a context leg leaves no table behind."""
    first = prompt_ids(45, offset=7000)
    later = first + prompt_ids(20, offset=7100)
    async with (
        start_engine(torch_config("prefill", **PAGED), control_token=CONTROL_TOKEN) as p,
        start_engine(torch_config("decode", kvTransport="auto", tokensPerBlock=TPB), control_token=CONTROL_TOKEN) as d,
        start_engine(torch_config(tokensPerBlock=TPB), control_token=CONTROL_TOKEN) as one,
        httpx.AsyncClient(timeout=60) as client,
    ):
        warm = (await _pool(client, p.url))["prefix_hit_blocks"]  # the warm-up's throwaway hit
        for ids in (first, later):
            assert await disaggregated(client, p.url, d.url, ids, max_tokens=8) == await tokens(
                client, one.url, ids, max_tokens=8
            )
        pool = await _pool(client, p.url)
        assert pool["holders"] == 0 and pool["cached_blocks"] == len(later) // TPB
        assert pool["prefix_hit_blocks"] - warm == len(first) // TPB  # the second context shared the first's


async def test_a_prefill_result_whose_client_left_before_taking_it_goes_to_discard() -> None:
    """The prefill queue hands a result nobody took to ``discard`` (the paged engine drops the
    turn's table there), so a client gone mid-prefill leaves no blocks held."""
    import asyncio
    import threading

    import torch
    from drs_engine.backends.torch.batching import PrefillQueue
    from drs_engine.backends.torch.worker import GpuWorker

    worker = GpuWorker(torch.device("cpu"))
    started, go = threading.Event(), threading.Event()
    dropped: list[str] = []

    def run_many(jobs: list[str]) -> list[str | Exception]:
        started.set()
        go.wait(30)
        return [f"result of {job}" for job in jobs]

    queue: PrefillQueue[str, str] = PrefillQueue(
        worker, run_many, budget=100, tokens=lambda job: 1, discard=dropped.append
    )
    try:
        waiter = asyncio.create_task(queue.submit("a"))
        await asyncio.to_thread(started.wait, 30)
        waiter.cancel()
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert queue._task is not None
        await queue._task
        assert dropped == ["result of a"]
        assert await queue.submit("b") == "result of b" and dropped == ["result of a"]
    finally:
        go.set()
        worker.close()


@pytest.mark.gpu(1)
async def test_on_the_gpu_later_turns_share_their_prefix_in_place_and_decode_the_slot_pools_tokens() -> None:
    """On CUDA, float32 (FlexAttention compiled): three turns of a conversation on a paged engine
    give the slot engine's greedy tokens and cached counts, and the store takes in only each
    prompt's uncached tokens."""
    from . import procs

    config = {"role": "prefill", "device": "cuda:0", "model": "random:small", "precision": "float32"}
    async with (  # engine processes, as served
        procs.engine(procs.engine_config(**config)) as slots,
        procs.engine(procs.engine_config(**config, kvLayout="paged")) as paged,
        httpx.AsyncClient(timeout=300) as client,
    ):
        warm = await _pool(client, paged)
        ids, written = prompt_ids(300, offset=8000), warm["tokens_written"]
        for turn in range(3):
            out, cached = await _turn(client, paged, ids, 32)
            assert (out, cached) == await _turn(client, slots, ids, 32)
            assert (cached > 0) == (turn > 0)
            written += len(ids) - cached
            pool = await _pool(client, paged)
            assert pool["tokens_written"] == written and pool["holders"] == 0
            ids = ids + out + prompt_ids(40, offset=8100 + turn)
