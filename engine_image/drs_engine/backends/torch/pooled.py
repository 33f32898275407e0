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
view of the pool, nothing gathered), each row masked to its own length. Numerics are those of
:func:`~drs_engine.backends.torch.model.decode_step`; ``tests/gpu`` compares the two. Its
elementwise chains come from :mod:`.fused` (compiled by inductor on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from drs_engine.backends.torch.fused import EAGER, StepOps
from drs_engine.backends.torch.kv.slots import Move, SlotTable
from drs_engine.backends.torch.model import ModelShape, _lm_head, rope_tables


class DecodePool:
    """The decode pool's KV, its slot table and the static inputs of a pooled step."""

    def __init__(self, shape: ModelShape, *, slots: int, slot_tokens: int, device: Any, dtype: Any) -> None:
        self.shape = shape
        self.slot_tokens = slot_tokens
        self.device = device
        self.dtype = dtype
        self.table: SlotTable[Any] = SlotTable(slots)
        self.kv: Any = None
        self.tokens: Any = None
        self.positions: Any = None

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
        self.tokens = torch.zeros(self.slots, device=self.device, dtype=torch.long)
        self.positions = torch.zeros(self.slots, device=self.device, dtype=torch.long)
        return True

    def free(self) -> None:
        """Drop the tensors and every holder (sleep); :meth:`allocate` makes new ones."""
        self.kv = self.tokens = self.positions = None
        self.table = SlotTable(self.slots)

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


def back_to_back(first: Any, *rest: Any) -> Any | None:
    """``first`` and ``rest`` (row-major matrices of one dtype and width) as one matrix of all their
    rows, when they lie back to back in one storage: a view, no copy. The packed refit layout keeps
    a layer's q, k, v projections so, and its gate and up projections, so a decode step multiplies
    once by each pair instead of once by each matrix. None when they do not (weights not packed)."""
    if not first.is_contiguous():
        return None
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr() + first.numel() * first.element_size()
    rows = first.shape[0]
    for t in rest:
        same = t.dtype == first.dtype and t.shape[1:] == first.shape[1:] and t.is_contiguous()
        if not same or t.untyped_storage().data_ptr() != storage or t.data_ptr() != end:
            return None
        end += t.numel() * t.element_size()
        rows += t.shape[0]
    return first.as_strided((rows, *first.shape[1:]), first.stride())


@dataclass(frozen=True, slots=True)
class Projections:
    """A layer's q/k/v and gate/up weights as one matrix each (:func:`back_to_back`), or None."""

    qkv: Any
    gate_up: Any


def fuse_projections(params: dict[str, Any], shape: ModelShape) -> list[Projections]:
    """Per layer, the matrices :func:`pooled_logits` multiplies by at once (views of ``params``)."""
    out = []
    for i in range(shape.layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out.append(
            Projections(
                qkv=back_to_back(params[a + "q_proj.weight"], params[a + "k_proj.weight"], params[a + "v_proj.weight"]),
                gate_up=back_to_back(params[m + "gate_proj.weight"], params[m + "up_proj.weight"]),
            )
        )
    return out


def pooled_logits(
    params: dict[str, Any],
    pool: DecodePool,
    rows: int,
    tokens: int,
    ops: StepOps = EAGER,
    fused: list[Projections] | None = None,
) -> Any:
    """One decode step of the pool's first ``rows`` slots: row ``b`` feeds ``pool.tokens[b]`` at
    ``pool.positions[b]`` and attends over its positions ``0 … positions[b]`` (within the first
    ``tokens``). ``ops``: the step's elementwise chains (:mod:`.fused`); ``fused``: the layers'
    back-to-back projections (:func:`fuse_projections`; None: one matmul per matrix). Returns float32
    logits ``[rows, vocab]``."""
    with torch.inference_mode():
        ids, pos = pool.tokens[:rows], pool.positions[:rows]
        return _pooled_logits(params, pool.shape, pool.kv, ids, pos, tokens, ops, fused)


def _project(h: Any, joined: Any, params: dict[str, Any], names: tuple[str, ...]) -> tuple[Any, ...]:
    """``h`` times each named matrix: one matmul over ``joined`` when there is one, split after."""
    if joined is None:
        return tuple(h @ params[n].T for n in names)
    return tuple((h @ joined.T).split([params[n].shape[0] for n in names], dim=-1))


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
    eps = shape.rms_eps
    x = params["model.embed_tokens.weight"][ids]
    cos, sin = rope_tables(pos, shape, x.dtype)
    cols = torch.arange(tokens, device=ids.device)
    mask = (cols[None, :] <= pos[:, None])[:, None, None, :]  # [rows, 1, 1, tokens]
    row = torch.arange(rows, device=ids.device)
    h = ops.rms(x, params["model.layers.0.input_layernorm.weight"], eps)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layer = fused[i] if fused is not None else Projections(None, None)
        q, k, v = _project(h, layer.qkv, params, (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"))
        q = q.view(rows, shape.heads, shape.head_dim)
        k = k.view(rows, shape.kv_heads, shape.head_dim)
        v = v.view(rows, shape.kv_heads, shape.head_dim)
        q = ops.norm_rope(q, params[a + "q_norm.weight"], eps, cos, sin)
        k = ops.norm_rope(k, params[a + "k_norm.weight"], eps, cos, sin)
        keys, values = kv[i, 0], kv[i, 1]  # [slots, kv_heads, slot_tokens, head_dim]
        keys[row, :, pos] = k
        values[row, :, pos] = v
        queries = q.view(rows, shape.kv_heads, group, shape.head_dim)  # a K/V head's query heads as its rows
        attn = F.scaled_dot_product_attention(
            queries, keys[:rows, :, :tokens], values[:rows, :, :tokens], attn_mask=mask
        )
        x, h = ops.add_norm(
            x,
            attn.reshape(rows, -1) @ params[a + "o_proj.weight"].T,
            params[p + "post_attention_layernorm.weight"],
            eps,
        )
        m = p + "mlp."
        gate, up = _project(h, layer.gate_up, params, (m + "gate_proj.weight", m + "up_proj.weight"))
        gated = ops.silu_mul(gate, up)
        after = f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < shape.layers else "model.norm.weight"
        x, h = ops.add_norm(x, gated @ params[m + "down_proj.weight"].T, params[after], eps)
    return (h @ _lm_head(params, shape).T).to(torch.float32)
