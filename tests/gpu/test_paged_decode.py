"""The paged decode step (:mod:`drs_engine.backends.torch.paged`) on the CPU.

Both attentions (FlexAttention with a paged block mask, and the gather fallback) are compared with
the eager per-sequence step (:func:`~drs_engine.backends.torch.model.decode_step`, which the slot
pool's step is compared with too) in float32 on a tiny model, across joins, leaves, sequences
growing past a block, and two sequences sharing a cached prefix's blocks in place (no KV copied:
the hit's blocks are the very blocks of the store the first sequence wrote). The paged block mask
is checked against FlexAttention's own ``create_block_mask`` of the same ``mask_mod``. An engine
with ``kvLayout: paged`` gives the greedy tokens of one with the slot pool.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_engine.server.runner import start_engine

from .agree import alone_and_together, assert_same_or_near_ties
from .conftest import CONTROL_TOKEN, auth, prompt_ids, torch_config
from .test_torch_engine import tokens

TPB = 8


def _keys(ids: list[int], tokens: int) -> list[tuple[int, ...]]:
    return [tuple(ids[: (i + 1) * TPB]) for i in range(tokens // TPB)]


class Run:
    """A paged store and, beside it, each sequence's own KV stepped by the eager decode step."""

    def __init__(self, attention: str) -> None:
        import torch
        from drs_engine.backends.torch.kv.paged import PagedKv
        from drs_engine.backends.torch.model import SIZES, random_state_dict

        self.shape = SIZES["tiny"]
        self.params = random_state_dict(self.shape, seed=5, device="cpu", dtype=torch.float32)
        self.store = PagedKv(
            self.shape, blocks=24, tokens_per_block=TPB, device=torch.device("cpu"), dtype=torch.float32
        )
        self.attention = attention
        self.ids: dict[str, list[int]] = {}
        self.eager: dict[str, Any] = {}  # name -> its own KV (eager mirror)
        self.next: dict[str, int] = {}

    def join(self, name: str, prompt: list[int]) -> int:
        """Prefill ``prompt`` into the store after its cached prefix (returned: the hit's tokens)."""
        import torch
        from drs_engine.backends.torch.model import new_kv, prefill

        store, n = self.store, len(prompt)
        hit = store.pool.open(name, _keys(prompt, n), limit=n - 1)
        store.grow(name, n)
        own = store.gather(name, hit, n + 64) if hit else new_kv(self.shape, n + 64, device="cpu", dtype=torch.float32)
        logits = prefill(self.params, self.shape, prompt[hit:], own, hit)
        store.write(name, own, hit, n)
        store.pool.publish(name, _keys(prompt, n))
        mirror = new_kv(self.shape, n + 64, device="cpu", dtype=torch.float32)
        assert torch.allclose(prefill(self.params, self.shape, prompt, mirror, 0), logits, atol=1e-5)
        self.ids[name], self.eager[name], self.next[name] = list(prompt), mirror, int(logits.argmax())
        return hit

    def step(self, names: list[str]) -> None:
        import torch
        from drs_engine.backends.torch.model import decode_step
        from drs_engine.backends.torch.paged import paged_logits
        from drs_protocol.enums import PagedAttention

        for name in names:
            self.store.grow(name, len(self.ids[name]) + 1)
        tokens = [self.next[n] for n in names]
        logits = paged_logits(self.params, self.store, names, tokens, PagedAttention(self.attention))
        lengths = [len(self.ids[n]) for n in names]
        expected = decode_step(self.params, self.shape, tokens, [self.eager[n] for n in names], lengths)
        assert torch.allclose(logits, expected, atol=1e-5)
        assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()
        for name, token, row in zip(names, tokens, logits.argmax(-1).tolist(), strict=True):
            self.ids[name].append(token)
            self.next[name] = row


@pytest.mark.parametrize("attention", ["flex", "gather"])
def test_the_paged_step_equals_the_eager_step_across_joins_leaves_growth_and_shared_prefix_blocks(
    attention: str,
) -> None:
    run = Run(attention)
    shared = prompt_ids(19, offset=700)  # two full blocks and three tokens
    assert run.join("a", shared) == 0
    assert run.join("b", prompt_ids(5, offset=40)) == 0
    for _ in range(6):  # a grows past its third block's end (19 + 6 > 24)
        run.step(["a", "b"])
    pool = run.store.pool
    assert len(pool.table("a")) == 4
    storage = [run.store.block_view(b).data_ptr() for b in pool.table("a")[:2]]
    assert run.join("c", shared[:16] + prompt_ids(4, offset=900)) == 16  # a's first two blocks, in place
    assert pool.table("c")[:2] == pool.table("a")[:2] and pool.copies == 0  # nothing copied
    assert [run.store.block_view(b).data_ptr() for b in pool.table("c")[:2]] == storage
    assert all(pool.refs(b) == 2 for b in pool.table("a")[:2])
    for _ in range(3):
        run.step(["c", "a", "b"])
    pool.close("b")  # leaves; a new one joins in its place
    assert run.join("d", prompt_ids(30, offset=1200)) == 0
    for _ in range(12):
        run.step(["a", "d", "c"])
    pool.close("a")
    assert pool.refs(pool.table("c")[0]) == 1 and pool.is_cached(pool.table("c")[0])  # c keeps them
    run.step(["c", "d"])


@pytest.mark.parametrize("attention", ["flex", "gather"])
def test_a_fully_cached_prompt_copies_only_its_last_partly_kept_block(attention: str) -> None:
    run = Run(attention)
    prompt = prompt_ids(24, offset=77)  # three full blocks, all cached after the first
    run.join("a", prompt)
    run.step(["a"])
    assert run.join("b", prompt) == 23  # its last token recomputed for its logits
    pool = run.store.pool
    assert pool.table("b")[:2] == pool.table("a")[:2] and pool.table("b")[2] != pool.table("a")[2]
    assert pool.copies == 1  # the third block, 7 of 8 tokens kept (copy-on-write)
    for _ in range(4):
        run.step(["a", "b"])


def test_the_paged_block_mask_lists_each_rows_own_blocks_and_agrees_with_create_block_mask() -> None:
    import torch
    from drs_engine.backends.torch.kv.paged import PagedKv
    from drs_engine.backends.torch.model import SIZES
    from drs_engine.backends.torch.paged import Q_BLOCK, flex_rows, paged_block_mask
    from torch.nn.attention.flex_attention import create_block_mask

    store = PagedKv(SIZES["tiny"], blocks=6, tokens_per_block=TPB, device=torch.device("cpu"), dtype=torch.float32)
    tables, positions = [[4, 1], [2], [1, 5, 0]], torch.tensor([9, 3, 17])
    mask = paged_block_mask(store, tables, positions)
    assert mask.kv_num_blocks.view(-1).tolist() == [2, 1, 3]
    assert [mask.kv_indices[b, 0, 0, : len(t)].tolist() for b, t in enumerate(tables)] == tables
    dense = torch.stack(
        [
            torch.stack([mask.mask_mod(torch.tensor(b), 0, 0, torch.tensor(kv)) for kv in range(6 * TPB)])
            for b in range(3)
        ]
    )
    for b, (table, p) in enumerate(zip(tables, positions.tolist(), strict=True)):
        seen = {table[i // TPB] * TPB + i % TPB for i in range(p + 1)}
        assert [kv for kv in range(6 * TPB) if dense[b, kv]] == sorted(seen)
    reference = create_block_mask(mask.mask_mod, 3, 1, 1, 6 * TPB, device="cpu", BLOCK_SIZE=(Q_BLOCK, TPB))
    for b, table in enumerate(tables):  # the same blocks (in another order): nothing else visited
        n = int(reference.kv_num_blocks[b, 0, 0])
        assert sorted(reference.kv_indices[b, 0, 0, :n].tolist()) == sorted(table)
    assert [flex_rows(n) for n in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]  # 7 batch shapes up to 64
    padded = paged_block_mask(store, [[2], []], torch.tensor([3, 0]))  # a padding row visits nothing
    assert padded.kv_num_blocks.view(-1).tolist() == [1, 0]
    assert not any(bool(padded.mask_mod(torch.tensor(1), 0, 0, torch.tensor(kv))) for kv in range(6 * TPB))
    again = paged_block_mask(store, [[3]], torch.tensor([2]))
    assert again.mask_mod is mask.mask_mod  # one function every step: a compiled kernel is not traced again
    assert [int(again.mask_mod(torch.tensor(0), 0, 0, torch.tensor(kv))) for kv in range(24, 32)] == [1, 1, 1] + [0] * 5
    # a whole batch of the store's rows, and a sleep, keep that function too: on the GPU a new one
    # compiled every batch size again, and past Dynamo's limit flex fell back to a dense 64 GiB step
    store.free()
    widest = paged_block_mask(store, [[b % 6] for b in range(store.rows)], torch.zeros(store.rows, dtype=torch.long))
    assert widest.mask_mod is mask.mask_mod and widest.kv_num_blocks.shape[0] == store.rows == 64
    with pytest.raises(ValueError, match="at most 64"):
        paged_block_mask(store, [[0]] * 65, torch.zeros(65, dtype=torch.long))


@pytest.mark.parametrize("attention", ["flex", "gather"])
async def test_an_engine_with_paged_kv_decodes_the_tokens_of_one_with_the_slot_pool(attention: str) -> None:
    """Blocks of 16 tokens, 10 of them (4 x 40 tokens): sequences cross block boundaries, and four
    at once outgrow the store, so some step outside it (eagerly); a repeated prompt is a prefix hit."""
    prompts = [prompt_ids(20 + 13 * i, offset=5000 + i) for i in range(4)]
    paged = torch_config(
        kvLayout="paged", pagedAttention=attention, tokensPerBlock=16, decodeSlotTokens=40, maxDecodeBatch=4
    )
    async with (
        start_engine(torch_config(tokensPerBlock=16, maxDecodeBatch=4), control_token=CONTROL_TOKEN) as slots,
        start_engine(paged, control_token=CONTROL_TOKEN) as p,
        httpx.AsyncClient(timeout=120) as client,
    ):
        expected = [await tokens(client, slots.url, ids, max_tokens=16) for ids in prompts]
        assert [await tokens(client, p.url, ids, max_tokens=16) for ids in prompts] == expected
        together = await asyncio.gather(*(tokens(client, p.url, ids, max_tokens=16) for ids in prompts))
        assert list(together) == expected
        info = (await client.get(p.url + "/server_info")).json()["engine"]["decode_batching"]["pool"]
        assert info["layout"] == "paged" and info["attention"] == attention
        assert info["paged_steps"] > 0 and info["exhausted"] > 0 and info["eager_rows"] > 0
        assert info["holders"] == 0 and info["free_blocks"] == info["blocks"] == 10


def test_the_paged_decoder_steps_the_stores_sequences_and_the_rest_eagerly_in_the_batchs_order() -> None:
    """A store of two 8-token blocks: of four sequences two fit, the others step eagerly (one more
    once it outgrows its block); the logits come back in the batch's order, a sequence the store
    has no more blocks for goes on with its KV gathered out, and one that leaves gives its blocks
    back without a copy."""
    import torch
    from drs_engine.backends.torch.model import SIZES, decode_step, new_kv, prefill, random_state_dict
    from drs_engine.backends.torch.paged_decoder import PagedDecoder
    from drs_protocol.enums import PagedAttention

    from .test_decode_pool import _seq

    shape = SIZES["tiny"]
    params = random_state_dict(shape, seed=5, device="cpu", dtype=torch.float32)
    decoder = PagedDecoder(
        shape,
        tokens=16,
        tokens_per_block=TPB,
        rows=4,
        attention=PagedAttention.FLEX,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    seqs: list[Any] = []
    mirrors: list[Any] = []
    for n in (6, 11, 3, 9):
        for out in (seqs, mirrors):
            kv = new_kv(shape, 32, device="cpu", dtype=torch.float32)
            prefill(params, shape, prompt_ids(n, offset=60 * n), kv, 0)
            out.append(_seq(kv, n, 20 + n))
    for _ in range(4):
        decoder.seat(seqs)
        for s in seqs:  # outside the store: grown, as the runner does
            if not s.pooled and s.length >= s.kv.shape[3]:
                s.kv = torch.cat((s.kv, new_kv(shape, 8, device="cpu", dtype=torch.float32)), dim=3)
        logits = decoder.step(params, "weights", seqs)
        expected = decode_step(
            params, shape, [m.next_token for m in mirrors], [m.kv for m in mirrors], [m.length for m in mirrors]
        )
        assert torch.allclose(logits, expected, atol=1e-5)
        for s, m, row in zip(seqs, mirrors, expected.argmax(-1).tolist(), strict=True):
            s.length, m.length, s.next_token, m.next_token = s.length + 1, m.length + 1, row, row
    # 6 and 3 tokens took a block each, 11 and 9 found none; the 6-token one left at its block's end
    assert [s.pooled for s in seqs] == [False, False, True, False] and decoder.exhausted >= 3
    assert decoder.paged_steps == 4 and decoder.eager_rows == 2 + 2 + 3 + 3
    assert torch.allclose(seqs[0].kv[:, :, :, :10], mirrors[0].kv[:, :, :, :10], atol=1e-5)  # gathered out
    decoder.release(seqs)
    assert not seqs[2].pooled and seqs[2].kv is None  # left without a copy out: its blocks are given back
    assert decoder.store.pool.free_blocks == 2


@pytest.mark.gpu(1)
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
async def test_paged_kv_on_the_gpu_decodes_the_tokens_of_the_slot_pool(precision: str) -> None:
    """On CUDA (FlexAttention compiled; the slot pool replaying its CUDA graphs): the same greedy
    tokens, alone and eight at once, blocks of 64 tokens crossed. float32 exactly; bfloat16 up to
    near-ties (two kernels order their sums differently: :mod:`.agree`)."""
    from . import procs

    prompts = [prompt_ids(30 + 97 * i, offset=4000 + i) for i in range(8)]
    config = {"role": "prefill", "device": "cuda:0", "model": "random:small", "precision": precision}
    async with (  # engine processes, as served: each compiles in its own process
        procs.engine(procs.engine_config(**config)) as slots,
        procs.engine(procs.engine_config(**config, kvLayout="paged")) as paged,
        httpx.AsyncClient(timeout=300) as client,
    ):
        reference, alone, together = await alone_and_together(client, slots, paged, prompts)
        info = (await client.get(paged + "/server_info")).json()["engine"]["decode_batching"]["pool"]
    assert info["layout"] == "paged" and info["paged_steps"] > 0 and info["eager_rows"] == 0
    assert_same_or_near_ties(precision, reference, alone, together)


def test_the_warm_up_steps_every_batch_size_compiled_flex_attention_will_see() -> None:
    """Compiled FlexAttention compiles once per padded batch size; the engine's warm-up steps each
    of them (up to ``maxDecodeBatch``) so that no request pays a compile; uncompiled, 1 and 2 rows."""
    import torch
    from drs_engine.backends.torch.model import SIZES
    from drs_engine.backends.torch.paged import flex_rows
    from drs_engine.backends.torch.paged_decoder import PagedDecoder
    from drs_protocol.enums import PagedAttention

    def decoder(rows: int, attention: PagedAttention, compiled: bool) -> PagedDecoder:
        made = PagedDecoder(
            SIZES["tiny"], tokens=64, tokens_per_block=TPB, rows=rows, attention=attention,
            device=torch.device("cpu"), dtype=torch.float32,
        )  # fmt: skip
        made.compiled = compiled  # as on CUDA
        return made

    for rows in (1, 5, 64, 100):
        warm = decoder(rows, PagedAttention.FLEX, True).warm_rows()
        assert warm == sorted({flex_rows(r) for r in range(1, rows + 1)}), rows
    assert decoder(64, PagedAttention.FLEX, False).warm_rows() == [1, 2]
    assert decoder(64, PagedAttention.GATHER, True).warm_rows() == [1, 2]


def test_a_refit_recomputes_a_paged_sequences_kv_into_its_blocks() -> None:
    """New weights while a sequence decodes in the store: ``rewrite`` puts the KV recomputed under
    them into its blocks, and its next step equals the eager step over KV computed with them."""
    import torch
    from drs_engine.backends.torch.model import SIZES, decode_step, new_kv, prefill, random_state_dict
    from drs_engine.backends.torch.paged_decoder import PagedDecoder
    from drs_protocol.enums import PagedAttention

    from .test_decode_pool import _seq

    shape = SIZES["tiny"]
    old, new = (random_state_dict(shape, seed=s, device="cpu", dtype=torch.float32) for s in (5, 6))
    decoder = PagedDecoder(
        shape,
        tokens=64,
        tokens_per_block=TPB,
        rows=4,
        attention=PagedAttention.GATHER,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    ids = prompt_ids(13, offset=300)
    kv = new_kv(shape, 16, device="cpu", dtype=torch.float32)
    prefill(old, shape, ids, kv, 0)
    seq = _seq(kv, 13, 42)
    decoder.seat([seq])
    decoder.rewrite(seq, lambda fresh: prefill(new, shape, ids, fresh, 0))
    logits = decoder.step(new, "new weights", [seq])
    mirror = new_kv(shape, 16, device="cpu", dtype=torch.float32)
    prefill(new, shape, ids, mirror, 0)
    assert torch.allclose(logits, decode_step(new, shape, [42], [mirror], [13]), atol=1e-5)


async def test_a_paged_engine_serves_loaded_weights_and_sleeps_and_wakes(tmp_path: Path) -> None:
    """New weights from safetensors, then release and resume (the store dropped and made again):
    the paged engine decodes what a slot-pool engine started on those weights decodes."""
    import torch
    from drs_engine.backends.torch.model import SIZES, random_state_dict
    from safetensors.torch import save_file

    save_file(
        random_state_dict(SIZES["tiny"], seed=5, device="cpu", dtype=torch.float32), str(tmp_path / "w.safetensors")
    )
    prompts = [prompt_ids(40, offset=70), prompt_ids(23, offset=90)]
    async with (
        start_engine(torch_config(kvLayout="paged", tokensPerBlock=16), control_token=CONTROL_TOKEN) as e,
        start_engine(torch_config(model="random:tiny@5"), control_token=CONTROL_TOKEN) as five,
        httpx.AsyncClient(timeout=60) as client,
    ):
        expected = [await tokens(client, five.url, ids, max_tokens=20) for ids in prompts]
        load = await client.post(
            e.url + "/control/weights/load", headers=auth(), json={"path": str(tmp_path), "version": "v5"}
        )
        assert load.status_code == 200, load.text
        assert list(await asyncio.gather(*(tokens(client, e.url, ids, max_tokens=20) for ids in prompts))) == expected
        assert (await client.post(e.url + "/control/memory/release", headers=auth(), json={})).status_code == 200
        assert (await client.post(e.url + "/control/memory/resume", headers=auth(), json={})).status_code == 200
        assert list(await asyncio.gather(*(tokens(client, e.url, ids, max_tokens=20) for ids in prompts))) == expected
        info = (await client.get(e.url + "/server_info")).json()["engine"]["decode_batching"]["pool"]
        assert info["layout"] == "paged" and info["paged_steps"] > 0 and info["eager_rows"] == 0
