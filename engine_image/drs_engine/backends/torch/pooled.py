"""The decode pool: decoding sequences' KV in one preallocated tensor, and the decode step over it.

:class:`DecodePool` holds ``[layers, 2, slots, kv_heads, slot_tokens, head_dim]``, allocated once
(on the first decode, or at warm-up) and kept until the engine releases its KV (sleep). A
sequence that joins the decode batch has its KV copied into a slot once (:meth:`DecodePool.admit`)
and its ``kv`` becomes that slot's view, which has the per-sequence layout of
:func:`~drs_engine.backends.torch.model.new_kv`; when it leaves, its KV is copied out into a tensor
of its own (:meth:`DecodePool.release`), so nothing outside the pool (the prefix cache) ever
points into a slot that is reused. Which sequence holds which slot is
:class:`~drs_engine.backends.torch.kv.slots.SlotTable` (holders compact in slots ``0 … n-1``).

:func:`pooled_logits` is one decode step for the first ``rows`` slots, every shape fixed by
``(rows, tokens)`` and every input read from the pool's static buffers (``tokens``,
``positions``), so it can be captured once as a CUDA graph per bucket and replayed
(:mod:`.graphs`). Per layer the new K/V are written into the pool at each row's position, and one
``scaled_dot_product_attention`` call attends over the rows' first ``tokens`` positions (a strided
view of the pool, nothing gathered), each row masked to its own length; with ``slotAttention:
flex`` instead one FlexAttention call over each row's whole slot, whose block mask
(:class:`SlotMask`, worked out on the device from the static positions, inside the graph) lists
only the key blocks up to the row's position, so the flex-decoding kernel reads no more of the slot
than the row has written (split over the keys: one row's attention is spread over the GPU, where
SDPA's kernel gives it a few blocks). Numerics are those of
:func:`~drs_engine.backends.torch.model.decode_step`; ``tests/gpu`` compares the two. Its
elementwise chains come from :mod:`.fused` (compiled by inductor on CUDA).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from drs_protocol.engine_config import SLOT_FLEX_BLOCK
from drs_protocol.enums import SlotAttention

from drs_engine.backends.torch.fused import EAGER, StepOps
from drs_engine.backends.torch.kv.slots import Move, SlotTable
from drs_engine.backends.torch.layers import Projections, decode_layers
from drs_engine.backends.torch.model import ModelShape


class DecodePool:
    """The decode pool's KV, its slot table and the static inputs of a pooled step."""

    def __init__(self, shape: ModelShape, *, slots: int, slot_tokens: int, device: Any, dtype: Any) -> None:
        self.shape = shape
        self.slot_tokens = slot_tokens
        self.device = device
        self.dtype = dtype
        self.table: SlotTable[Any] = SlotTable(slots)
        self.kv: Any = None
        #: the step's static inputs, kept through sleeps (a few bytes; a compiled FlexAttention's
        #: ``mask_mod`` reads ``positions``, and a new tensor would compile it again)
        self.tokens: Any = None
        self.positions: Any = None
        self.mask: SlotMask | None = None

    @property
    def slots(self) -> int:
        return self.table.slots

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_tokens * self.shape.kv_bytes_per_token(self.dtype)

    def allocate(self) -> bool:
        """Make the pool's tensors (on the GPU thread); False when they are there already."""
        if self.kv is not None:
            return False
        s = self.shape
        dims = (s.layers, 2, self.slots, s.kv_heads, self.slot_tokens, s.head_dim)
        self.kv = torch.zeros(dims, device=self.device, dtype=self.dtype)
        if self.tokens is None:
            self.tokens = torch.zeros(self.slots, device=self.device, dtype=torch.long)
            self.positions = torch.zeros(self.slots, device=self.device, dtype=torch.long)
        return True

    def free(self) -> None:
        """Drop the KV and every holder (sleep); :meth:`allocate` makes a new one. The step's small
        static inputs stay (see ``positions``)."""
        self.kv = None
        self.table = SlotTable(self.slots)

    def slot_mask(self) -> SlotMask:
        """The FlexAttention mask's buffers and ``mask_mod`` (made once, with the static inputs)."""
        self.allocate()
        if self.mask is None:
            self.mask = SlotMask(self)
        return self.mask

    def view(self, slot: int) -> Any:
        """Slot ``slot``'s KV, ``[layers, 2, kv_heads, slot_tokens, head_dim]``."""
        return self.kv[:, :, slot]

    def fits(self, length: int) -> bool:
        """A sequence of ``length`` tokens so far can take one more step in a slot."""
        return length < self.slot_tokens

    def admit(self, holder: Any, kv: Any, length: int) -> Any | None:
        """``holder``'s first ``length`` tokens of ``kv`` copied into a free slot: the slot's view,
        or None when no slot is free or it does not fit."""
        if not self.fits(length):
            return None
        self.allocate()
        slot = self.table.admit(holder)
        if slot is None:
            return None
        view = self.view(slot)
        view[:, :, :, :length].copy_(kv[:, :, :, :length])
        return view

    def release(self, holder: Any, length: int, last_length: int) -> tuple[Any, Move | None]:
        """``holder`` leaves: its first ``length`` tokens as a tensor of its own, and the move of the
        last holder (``last_length`` tokens) into the freed slot, already copied."""
        slot = self.table.slot_of(holder)
        own = self.view(slot)[:, :, :, :length].clone()
        _, move = self.table.release(holder, last_length)
        if move is not None:
            self.view(move.dst)[:, :, :, : move.tokens].copy_(self.view(move.src)[:, :, :, : move.tokens])
        return own, move


class SlotMask:
    """The slot pool's FlexAttention block mask inputs: per slot the key blocks' indices ``0 … n-1``
    (constant) and one ``mask_mod`` (keys up to the row's position), the same objects every step so
    that a compiled ``flex_attention`` is traced once per batch size. How many blocks a row visits is
    worked out on the device each step (:meth:`block_mask`), inside the captured graph."""

    def __init__(self, pool: DecodePool) -> None:
        self.blocks = pool.slot_tokens // SLOT_FLEX_BLOCK
        self.slot_tokens = pool.slot_tokens
        ordered = torch.arange(self.blocks, dtype=torch.int32, device=pool.device)
        self.indices = ordered.repeat(pool.slots, 1, 1, 1).contiguous()  # [slots, 1, 1, blocks]
        positions = pool.positions

        def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return kv <= positions[b]

        self.mask_mod = mask_mod

    def block_mask(self, pos: Any) -> Any:
        """The mask of a step of ``len(pos)`` rows: row ``b`` visits blocks ``0 … pos[b] // 128``."""
        from torch.nn.attention.flex_attention import BlockMask

        rows = pos.shape[0]
        counts = (torch.div(pos, SLOT_FLEX_BLOCK, rounding_mode="floor") + 1).to(torch.int32).view(rows, 1, 1)
        return BlockMask.from_kv_blocks(
            counts,
            self.indices[:rows],
            BLOCK_SIZE=(SLOT_FLEX_BLOCK, SLOT_FLEX_BLOCK),
            mask_mod=self.mask_mod,
            seq_lengths=(1, self.slot_tokens),
            compute_q_blocks=False,
        )


def pooled_logits(
    params: dict[str, Any],
    pool: DecodePool,
    rows: int,
    tokens: int,
    ops: StepOps = EAGER,
    fused: list[Projections] | None = None,
    attention: SlotAttention = SlotAttention.SDPA,
) -> Any:
    """One decode step of the pool's first ``rows`` slots: row ``b`` feeds ``pool.tokens[b]`` at
    ``pool.positions[b]`` and attends over its positions ``0 … positions[b]`` (within the first
    ``tokens``). ``ops``: the step's elementwise chains (:mod:`.fused`); ``fused``: the layers'
    back-to-back projections (:func:`~.layers.fuse_projections`; None: one matmul per matrix);
    ``attention``: SDPA over the token bucket, or FlexAttention over the row's blocks (``tokens``
    then unused). Returns float32 logits ``[rows, vocab]``."""
    with torch.inference_mode():
        ids, pos = pool.tokens[:rows], pool.positions[:rows]
        if attention is SlotAttention.FLEX:
            return _flex_logits(params, pool, ids, pos, ops, fused)
        return _pooled_logits(params, pool.shape, pool.kv, ids, pos, tokens, ops, fused)


def _flex_logits(
    params: dict[str, Any], pool: DecodePool, ids: Any, pos: Any, ops: StepOps, fused: list[Projections] | None
) -> Any:
    from drs_engine.backends.torch.paged import flex_attention

    rows, kv = ids.shape[0], pool.kv
    flex = flex_attention(pool.device.type == "cuda")
    mask = pool.slot_mask().block_mask(pos)
    row = torch.arange(rows, device=ids.device)

    def attend(layer: int, q: Any, k: Any, v: Any) -> Any:
        keys, values = kv[layer, 0], kv[layer, 1]  # [slots, kv_heads, slot_tokens, head_dim]
        keys[row, :, pos] = k
        values[row, :, pos] = v
        return flex(q[:, :, None], keys[:rows], values[:rows], block_mask=mask, enable_gqa=True)

    return decode_layers(params, pool.shape, ids, pos, attend, ops, fused)


def _pooled_logits(
    params: dict[str, Any],
    shape: ModelShape,
    kv: Any,
    ids: Any,
    pos: Any,
    tokens: int,
    ops: StepOps,
    fused: list[Projections] | None = None,
) -> Any:
    rows = ids.shape[0]
    group = shape.heads // shape.kv_heads
    cols = torch.arange(tokens, device=ids.device)
    mask = (cols[None, :] <= pos[:, None])[:, None, None, :]  # [rows, 1, 1, tokens]
    row = torch.arange(rows, device=ids.device)

    def attend(layer: int, q: Any, k: Any, v: Any) -> Any:
        keys, values = kv[layer, 0], kv[layer, 1]  # [slots, kv_heads, slot_tokens, head_dim]
        keys[row, :, pos] = k
        values[row, :, pos] = v
        queries = q.view(rows, shape.kv_heads, group, shape.head_dim)  # a K/V head's query heads as its rows
        return F.scaled_dot_product_attention(
            queries, keys[:rows, :, :tokens], values[:rows, :, :tokens], attn_mask=mask
        )

    return decode_layers(params, shape, ids, pos, attend, ops, fused)
