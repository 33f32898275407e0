"""The decode pool (slots, compaction, buckets) and the pooled decode step, on the CPU; its CUDA
graphs on a GPU.

The slot table is pure bookkeeping, so hypothesis drives it through any order of joins and leaves
against a model of the pool's memory. The pooled step (:func:`pooled_logits` through
:class:`BatchDecoder`) is compared with the eager per-sequence step it replaces, in float32 on a
tiny model, across joins, leaves (a holder moved into the freed slot) and a sequence outgrowing
its slot; an engine whose slots are too small for anything (every step eager) gives the same tokens.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from drs_engine.backends.torch.kv.slots import BATCH_BUCKETS, SlotTable, batch_bucket, token_bucket, token_buckets
from drs_engine.server.runner import start_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from .agree import alone_and_together, assert_same_or_near_ties
from .conftest import CONTROL_TOKEN, prompt_ids, torch_config
from .test_torch_engine import tokens

#: ops: ("join", n) admits holder n (if new), ("leave", k) releases the k-th holder (mod count)
OPS = st.lists(st.tuples(st.sampled_from(["join", "leave"]), st.integers(0, 40)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(slots=st.integers(1, 12), ops=OPS)
def test_holders_stay_compact_and_every_move_keeps_each_holders_kv_in_its_slot(
    slots: int, ops: list[tuple[str, int]]
) -> None:
    table: SlotTable[int] = SlotTable(slots)
    memory: dict[int, int] = {}  # slot -> whose KV it holds (the pool's memory, moved as told)
    for op, n in ops:
        if op == "join" and n not in table:
            slot = table.admit(n)
            if len(memory) >= slots:
                assert slot is None
                continue
            assert slot == len(table) - 1
            memory[slot] = n
        elif op == "leave" and len(table):
            holder = table.holders[n % len(table)]
            freed, move = table.release(holder, tokens_of_last=7)
            if move is not None:
                assert (move.src, move.dst, move.tokens) == (len(table), freed, 7)
                memory[move.dst] = memory[move.src]
            del memory[len(table)]
        assert sorted(memory) == list(range(len(table)))  # compact: slots 0 … n-1
        assert all(memory[table.slot_of(h)] == h for h in table.holders)


@given(limit=st.integers(1, 300), rows=st.integers(1, 300))
def test_a_step_runs_at_the_smallest_batch_bucket_that_holds_its_rows(limit: int, rows: int) -> None:
    if rows > limit:
        with pytest.raises(ValueError, match="rows must be in"):
            batch_bucket(rows, limit=limit)
        return
    b = batch_bucket(rows, limit=limit)
    assert rows <= b <= limit
    assert b == limit or b in BATCH_BUCKETS
    assert not any(rows <= smaller < b for smaller in BATCH_BUCKETS)


@given(slot_tokens=st.integers(1, 50_000), tokens=st.integers(1, 50_000))
def test_a_step_attends_over_the_smallest_token_bucket_that_holds_its_longest_row(
    slot_tokens: int, tokens: int
) -> None:
    buckets = token_buckets(slot_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == slot_tokens
    assert all(b % 256 == 0 for b in buckets[:-1])
    assert len(buckets) <= 2 + 3 * max(1, slot_tokens).bit_length()  # few shapes: one graph each
    if tokens > slot_tokens:
        with pytest.raises(ValueError, match="tokens must be in"):
            token_bucket(tokens, slot_tokens=slot_tokens)
        return
    b = token_bucket(tokens, slot_tokens=slot_tokens)
    assert b >= tokens and all(smaller < tokens for smaller in buckets if smaller < b)


def _seq(kv: Any, length: int, token: int) -> Any:
    from drs_engine.backends.torch.batching import DecodeSeq
    from drs_engine.backends.torch.sampling import Sampling

    greedy = Sampling(temperature=0.0, top_p=1.0, top_k=0, logprobs=False, top_logprobs=0)
    return DecodeSeq(kv, length, token, greedy, [token], check=lambda _: (None, None), banned=lambda _: None)


def test_projections_back_to_back_in_one_buffer_are_one_matrix_without_a_copy() -> None:
    import torch
    from drs_engine.backends.torch.layers import back_to_back, fuse_projections
    from drs_engine.backends.torch.model import SIZES, random_state_dict
    from drs_engine.backends.torch.weights.packed import pack

    shape = SIZES["tiny"]
    loose = random_state_dict(shape, seed=5, device="cpu", dtype=torch.float32)
    packed = pack(loose, torch.device("cpu")).params
    for layer, fused in enumerate(fuse_projections(packed, shape)):
        a, m = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        qkv = [packed[a + n + "_proj.weight"] for n in "qkv"]
        assert fused.qkv is not None and fused.qkv.data_ptr() == qkv[0].data_ptr()  # a view
        assert torch.equal(fused.qkv, torch.cat(qkv))
        assert fused.gate_up is not None
        assert torch.equal(fused.gate_up, torch.cat([packed[m + "gate_proj.weight"], packed[m + "up_proj.weight"]]))
    assert all(f.qkv is None and f.gate_up is None for f in fuse_projections(loose, shape))  # separate tensors
    rows = torch.zeros(6, 4)
    assert back_to_back(rows[:2], rows[3:]) is None  # a gap between them
    assert back_to_back(rows[:2], rows[2:4].view(1, 8)) is None  # another width


def test_the_slot_mask_lists_each_rows_key_blocks_up_to_its_position_and_masks_the_rest() -> None:
    """The compiled kernel reads only the blocks the mask counts (the CPU's eager FlexAttention reads
    them all, so the step's CPU test cannot see a wrong count): row ``b`` visits blocks
    ``0 … pos[b] // 128`` and, within them, keys up to ``pos[b]``."""
    import torch
    from drs_engine.backends.torch.model import SIZES
    from drs_engine.backends.torch.pooled import DecodePool

    pool = DecodePool(SIZES["tiny"], slots=4, slot_tokens=512, device=torch.device("cpu"), dtype=torch.float32)
    pool.allocate()
    pool.positions.copy_(torch.tensor([0, 127, 128, 511]))
    slot_mask = pool.slot_mask()
    mask = slot_mask.block_mask(pool.positions[:3])
    assert mask.kv_num_blocks.view(-1).tolist() == [1, 1, 2]
    assert mask.kv_indices.shape == (3, 1, 1, 4) and mask.kv_indices[2, 0, 0].tolist() == [0, 1, 2, 3]
    keys = torch.arange(512)
    for b in range(4):
        assert torch.equal(slot_mask.mask_mod(b, 0, 0, keys), keys <= int(pool.positions[b]))
    assert pool.slot_mask() is slot_mask  # one mask_mod for the pool's life: no recompile per step
    pool.free()
    pool.allocate()
    assert pool.slot_mask() is slot_mask  # nor after a sleep


@pytest.mark.parametrize(
    ("packed", "attention"),
    [(True, "sdpa"), (False, "sdpa"), (True, "flex")],
    ids=["packed weights", "separate tensors", "packed weights, flex attention"],
)
def test_the_pooled_step_equals_the_eager_step_across_joins_leaves_and_a_sequence_outgrowing_its_slot(
    packed: bool, attention: str
) -> None:
    """SDPA over 40-token slots; FlexAttention (its block mask over the slot's 128-token key
    blocks, the rows' lengths read from the static positions) over 256-token slots, one row crossing
    a block and one outgrowing its slot."""
    import torch
    from drs_engine.backends.torch.decoder import BatchDecoder
    from drs_engine.backends.torch.model import SIZES, decode_step, new_kv, prefill, random_state_dict
    from drs_engine.backends.torch.weights.packed import pack
    from drs_protocol.enums import SlotAttention

    shape = SIZES["tiny"]
    params = random_state_dict(shape, seed=5, device="cpu", dtype=torch.float32)
    if packed:  # as the engine holds them: q/k/v and gate/up multiplied at once (views of one buffer)
        params = pack(params, torch.device("cpu")).params
    flex = attention == "flex"
    decoder = BatchDecoder(
        shape,
        slots=4,
        slot_tokens=256 if flex else 40,
        cuda_graphs=True,
        device=torch.device("cpu"),
        dtype=torch.float32,
        attention=SlotAttention(attention),
    )
    lengths = (5, 249, 125, 9) if flex else (5, 33, 17, 9)
    pooled: list[Any] = []
    eager: list[Any] = []
    for n in lengths:
        for out in (pooled, eager):
            kv = new_kv(shape, max(64, n + 16), device="cpu", dtype=torch.float32)
            prefill(params, shape, prompt_ids(n, offset=50 * n), kv, 0)
            out.append(_seq(kv, n, 11 + n))
    batch = pooled[:3]
    for step in range(10):
        if step == 3:
            decoder.release([pooled[0]])  # the last holder moves into slot 0
            batch = pooled[1:4]  # and a new one joins
        decoder.seat(batch)
        for s in batch:  # outside the pool (the 33-token one outgrows its 40 tokens): grown, as the runner does
            if not s.pooled and s.length >= s.kv.shape[3]:
                s.kv = torch.cat((s.kv, new_kv(shape, 8, device="cpu", dtype=torch.float32)), dim=3)
        logits = decoder.step(params, "weights", batch)
        mirror = [eager[pooled.index(s)] for s in batch]
        expected = decode_step(
            params, shape, [s.next_token for s in mirror], [s.kv for s in mirror], [s.length for s in mirror]
        )
        assert torch.allclose(logits, expected, atol=1e-5), step
        for s, e, row in zip(batch, mirror, logits.argmax(-1).tolist(), strict=True):
            s.length, e.length, s.next_token, e.next_token = s.length + 1, e.length + 1, row, row
    assert not pooled[1].pooled and decoder.eager_rows > 0  # the 33-token sequence outgrew a 40-token slot
    assert decoder.fused is not None and (decoder.fused[0].qkv is not None) == packed
    decoder.release(batch)
    assert len(decoder.pool.table) == 0
    for s, e in zip(pooled[1:4], eager[1:4], strict=True):  # each KV its own again, equal to the eager one
        assert torch.allclose(s.kv[:, :, :, : s.length], e.kv[:, :, :, : e.length], atol=1e-5)


async def test_concurrent_requests_in_the_pool_decode_the_tokens_of_an_engine_without_one() -> None:
    """Slots of 80 tokens: some prompts start in the pool and outgrow it mid-way, the longest never
    fits; a 1-token slot holds nothing (every step eager). Same greedy tokens, alone and together."""
    prompts = [prompt_ids(40 + 12 * i, offset=3000 + i) for i in range(5)]
    async with (
        start_engine(torch_config(decodeSlotTokens=80, maxDecodeBatch=4), control_token=CONTROL_TOKEN) as pool,
        start_engine(torch_config(decodeSlotTokens=1), control_token=CONTROL_TOKEN) as plain,
        httpx.AsyncClient(timeout=60) as client,
    ):
        expected = [await tokens(client, plain.url, ids, max_tokens=24) for ids in prompts]
        together = await asyncio.gather(*(tokens(client, pool.url, ids, max_tokens=24) for ids in prompts))
        assert list(together) == expected
        assert [await tokens(client, pool.url, ids, max_tokens=24) for ids in prompts] == expected
        info = (await client.get(pool.url + "/server_info")).json()["engine"]["decode_batching"]["pool"]
        assert info["pooled_steps"] > 0 and info["eager_rows"] > 0 and info["holders"] == 0
        assert info["layout"] == "slots"
        plain_info = (await client.get(plain.url + "/server_info")).json()["engine"]["decode_batching"]["pool"]
        assert plain_info["pooled_steps"] == 0


@pytest.mark.gpu(1)
async def test_cuda_graphs_decode_the_tokens_of_the_eager_pooled_step_on_the_gpu() -> None:
    """float32 on the GPU: an engine replaying CUDA graphs and one stepping the same pool eagerly
    give the same greedy tokens, alone and eight at once (several buckets captured)."""
    prompts = [prompt_ids(30 + 97 * i, offset=4000 + i) for i in range(8)]
    graphs = torch_config(model="random:small", device="cuda:0")
    eager = torch_config(model="random:small", device="cuda:0", cudaGraphs=False)
    async with (
        start_engine(graphs, control_token=CONTROL_TOKEN) as g,
        start_engine(eager, control_token=CONTROL_TOKEN) as e,
        httpx.AsyncClient(timeout=120) as client,
    ):
        expected = [await tokens(client, e.url, ids, max_tokens=32) for ids in prompts]
        assert [await tokens(client, g.url, ids, max_tokens=32) for ids in prompts] == expected
        together = await asyncio.gather(*(tokens(client, g.url, ids, max_tokens=32) for ids in prompts))
        assert list(together) == expected
        info = (await client.get(g.url + "/server_info")).json()["engine"]["decode_batching"]["pool"]
        assert info["cuda_graphs"] and info["graphs_captured"] >= 3 and info["eager_rows"] == 0


@pytest.mark.gpu(1)
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
async def test_flex_attention_in_the_graphs_decodes_the_tokens_of_sdpa_on_the_gpu(precision: str) -> None:
    """``slotAttention: flex`` (FlexAttention's decoding kernel, compiled, captured in the pool's CUDA
    graphs) against ``sdpa``: the same greedy tokens, alone and eight at once, across key blocks of
    128; float32 exactly, bfloat16 up to near-ties (:mod:`.agree`)."""
    from . import procs

    prompts = [prompt_ids(30 + 97 * i, offset=4000 + i) for i in range(8)]
    config = {"role": "prefill", "device": "cuda:0", "model": "random:small", "precision": precision}
    async with (  # engine processes, as served: each compiles in its own process
        procs.engine(procs.engine_config(**config, slotAttention="sdpa")) as sdpa,
        procs.engine(procs.engine_config(**config, slotAttention="flex")) as flex,
        httpx.AsyncClient(timeout=300) as client,
    ):
        reference, alone, together = await alone_and_together(client, sdpa, flex, prompts)
        info = (await client.get(flex + "/server_info")).json()["engine"]["decode_batching"]["pool"]
    assert info["attention"] == "flex" and info["cuda_graphs"] and info["eager_rows"] == 0
    assert info["graphs_captured"] >= 3
    assert_same_or_near_ties(precision, reference, alone, together)
