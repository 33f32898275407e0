"""The paged decode step: one step for every running sequence, attention over their block tables.

The sequences' KV is in :class:`~drs_engine.backends.torch.kv.paged.PagedKv` (one tensor of
blocks; a prefix hit's blocks are shared in place). Per layer the step writes each sequence's new
K/V at its position's block and offset, then attends with one call for the whole batch:

- ``"flex"`` (the default): PyTorch's FlexAttention with a **paged block mask**. The keys are the
  whole store as one sequence ``[1, kv_heads, blocks * tpb, head_dim]`` (a view, nothing
  gathered); query ``b`` (one token, ``[batch, heads, 1, head_dim]``) visits only the blocks of its
  table (the mask's ``kv_indices`` are the table itself) and, within them, a ``mask_mod`` maps the
  physical block back to the table's logical index (``-1``: not its block) and keeps positions up to
  its own. This is the recipe of ``torch.nn.attention.experimental._paged_attention`` (private, so
  rebuilt here on the public ``BlockMask.from_kv_blocks``). On CUDA ``flex_attention`` is compiled
  (Triton's flex-decoding kernel, which reads only the listed blocks; the batch padded to a power
  of two, :func:`flex_rows`); on the CPU it runs eagerly (dense over the store, correct, slow: tests
  only). Checked by hand on the CPU with torch 2.11: compiled with ``dynamic=False`` it matches the
  eager step (1.8e-7) and compiles once per batch size, not per step (the ``mask_mod`` is one
  function); with ``dynamic=True`` inductor's CPU C++ template fails to compile (and on CUDA a
  dynamic batch would forgo the flex-decoding kernel), hence eager on the CPU.
- ``"gather"`` (the fallback): the tables' tokens gathered into a contiguous ``[batch, kv_heads,
  longest, head_dim]`` per layer, then ``scaled_dot_product_attention`` masked to each row's length,
  as the slot pool's step does. One copy of the running batch's KV per layer and step; no kernel
  compile.

Why FlexAttention and not FlashInfer: it ships in the torch wheel the engine already depends on
(no second wheel, no nvcc JIT at start), it is maintained by PyTorch, and the same code runs on the
CPU, so CI checks the paging logic that the GPU runs. Numerics follow
:func:`~drs_engine.backends.torch.model.decode_step`; ``tests/gpu/test_paged_decode.py`` compares
them.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from drs_protocol.enums import PagedAttention

from drs_engine.backends.torch.fused import EAGER, StepOps
from drs_engine.backends.torch.kv.paged import PagedKv
from drs_engine.backends.torch.layers import Projections, decode_layers

#: FlexAttention's query block (one decode token per sequence: a block holds it, padded)
Q_BLOCK = 128


@cache
def flex_attention(compiled: bool) -> Any:
    """``flex_attention`` compiled (CUDA), or run eagerly without Dynamo (the CPU): eagerly it
    still traces itself through Dynamo unless its debug switch is on, and that crashed (a segfault
    in fake-tensor conversion, torch 2.11) when a second engine's GPU thread called it in one
    process (the tests' engines); the switch runs the same math directly, inference only."""
    from torch.nn.attention import flex_attention as module

    if compiled:
        # one compile per padded batch size (:func:`flex_rows`: 7 up to 64 rows, 9 up to 256; the slot
        # pool's batch buckets: 9 up to 64, 13 up to 256); Dynamo's default limit (8) would send a
        # larger ``maxDecodeBatch`` to the dense fallback
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        return torch.compile(module.flex_attention, dynamic=False)

    def eager(*args: Any, **kwargs: Any) -> Any:
        before = getattr(module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", False)
        module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
        try:
            return module.flex_attention(*args, **kwargs)
        finally:
            module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = before

    return eager


def flex_rows(rows: int) -> int:
    """The batch a FlexAttention step runs at: ``rows`` padded to a power of two. Inductor picks its
    flex-decoding kernel (one query token, query heads grouped per K/V head) only for a static
    batch, so the call is compiled per batch size; powers of two keep that to 7 compiles up to 64
    rows, within Dynamo's recompile limit (8). Padding rows visit no block."""
    return 1 << (rows - 1).bit_length()


class MaskBuffers:
    """The paged block mask's per-step inputs, in device buffers updated in place, and the one
    ``mask_mod`` that reads them: the same function object every step, so a compiled
    ``flex_attention`` is not traced again for a new closure each step."""

    def __init__(self, rows: int, store: PagedKv) -> None:
        tpb = store.tokens_per_block
        self.rows = rows
        self.inverse = torch.full((rows, store.blocks), -1, dtype=torch.long, device=store.device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=store.device)
        inverse, positions = self.inverse, self.positions

        def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
            logical = inverse[b, kv // tpb]  # the table's index of this physical block, -1: not its own
            return (logical >= 0) & (logical * tpb + kv % tpb <= positions[b])

        self.mask_mod = mask_mod


def paged_block_mask(store: PagedKv, tables: Sequence[Sequence[int]], positions: Any) -> Any:
    """The block mask of one decode step: row ``b`` sees the blocks of ``tables[b]`` up to
    ``positions[b]`` (inclusive), nothing else of the store. Its buffers are made once per store,
    for ``flex_rows(store.rows)`` rows, and kept through sleeps (``store.scratch``): the compiled
    ``flex_attention`` is guarded on the ``mask_mod`` and its buffers, so new ones (a larger batch,
    a wake) would compile every batch size again. Past Dynamo's recompile limit ``flex_attention``
    falls back, silently, to its unfused path, which materializes the whole score matrix: on an
    H100 at 64 streams it asked for 64 GiB (2026-12-06, when the buffers doubled as batches grew)."""
    from torch.nn.attention.flex_attention import BlockMask

    tpb, device, rows = store.tokens_per_block, store.device, len(tables)
    buffers = store.scratch.get("mask")
    if not isinstance(buffers, MaskBuffers):
        buffers = store.scratch["mask"] = MaskBuffers(flex_rows(store.rows), store)
    if rows > buffers.rows:
        raise ValueError(f"a paged step of {rows} rows: the store was made for at most {buffers.rows} (rows)")
    indices = torch.zeros((rows, 1, 1, store.blocks), dtype=torch.int32)  # as wide as the store
    inverse = torch.full((rows, store.blocks), -1, dtype=torch.long)
    for b, table in enumerate(tables):
        indices[b, 0, 0, : len(table)] = torch.tensor(table, dtype=torch.int32)
        inverse[b, torch.tensor(table, dtype=torch.long)] = torch.arange(len(table))
    counts = torch.tensor([len(t) for t in tables], dtype=torch.int32).view(rows, 1, 1)
    buffers.inverse[:rows].copy_(inverse)
    buffers.positions[:rows].copy_(positions)
    return BlockMask.from_kv_blocks(
        counts.to(device),
        indices.to(device),
        BLOCK_SIZE=(Q_BLOCK, tpb),
        mask_mod=buffers.mask_mod,
        seq_lengths=(1, store.blocks * tpb),
    )


def _gather_index(store: PagedKv, tables: Sequence[Sequence[int]]) -> Any:
    """``[batch, width * tpb]``: the store's token index of each row's logical positions (padding
    rows' blocks point at block 0, masked out by length)."""
    tpb = store.tokens_per_block
    width = max(len(t) for t in tables)
    padded = torch.zeros((len(tables), width), dtype=torch.long)
    for b, table in enumerate(tables):
        padded[b, : len(table)] = torch.tensor(table, dtype=torch.long)
    p = torch.arange(width * tpb)
    return (padded[:, p // tpb] * tpb + p % tpb).to(store.device)


def paged_logits(
    params: dict[str, Any],
    store: PagedKv,
    seqs: Sequence[Any],
    tokens: Sequence[int],
    attention: PagedAttention = PagedAttention.FLEX,
    ops: StepOps = EAGER,
    fused: list[Projections] | None = None,
) -> Any:
    """One decode step: ``seqs[b]`` (a holder of ``store.pool``, grown to cover its next token:
    :meth:`PagedKv.grow`) feeds ``tokens[b]`` at its position ``length - 1``. Returns float32
    logits ``[batch, vocab]``."""
    with torch.inference_mode():
        tables = [store.pool.table(s) for s in seqs]
        pos = torch.tensor([store.pool.length(s) - 1 for s in seqs], dtype=torch.long)
        tpb = store.tokens_per_block
        where = torch.tensor([t[int(p) // tpb] for t, p in zip(tables, pos, strict=True)]) * tpb + pos % tpb
        pos, where = pos.to(store.device), where.to(store.device)
        ids = torch.tensor(list(tokens), dtype=torch.long, device=store.device)
        if attention is PagedAttention.FLEX:
            rows, padded = len(tables), flex_rows(len(tables))
            at = torch.cat((pos, pos.new_zeros(padded - rows)))
            flex, mask = (
                flex_attention(store.device.type == "cuda"),
                paged_block_mask(store, tables + [[]] * (padded - rows), at),
            )

            def attend(q: Any, keys: Any, values: Any) -> Any:
                full = torch.cat((q, q.new_zeros((padded - rows, *q.shape[1:]))))[:, :, None]
                return flex(full, keys[None], values[None], block_mask=mask, enable_gqa=True)[:rows, :, 0]

        else:
            index = _gather_index(store, tables)
            cols = torch.arange(index.shape[1], device=store.device)
            dense = (cols[None, :] <= pos[:, None])[:, None, None, :]  # [batch, 1, 1, width]
            group = store.shape.heads // store.shape.kv_heads

            def attend(q: Any, keys: Any, values: Any) -> Any:
                rows, heads, d = q.shape
                queries = q.view(rows, heads // group, group, d)
                k, v = keys[:, index].transpose(0, 1), values[:, index].transpose(0, 1)
                return F.scaled_dot_product_attention(queries, k, v, attn_mask=dense).view(rows, heads, d)

        def store_and_attend(layer: int, q: Any, k: Any, v: Any) -> Any:
            keys, values = store.kv[layer, 0], store.kv[layer, 1]  # [kv_heads, blocks * tpb, head_dim]
            keys[:, where] = k.transpose(0, 1)
            values[:, where] = v.transpose(0, 1)
            return attend(q, keys, values)  # [rows, heads, head_dim]

        return decode_layers(params, store.shape, ids, pos, store_and_attend, ops, fused)
