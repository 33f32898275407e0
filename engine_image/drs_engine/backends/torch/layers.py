"""The decoder layers of one decode step, shared by the slot pool's step (:mod:`.pooled`) and the
paged step (:mod:`.paged`): embeddings, per layer the projections, q/k norms and rotary
embeddings, the output projection and the MLP, then the final norm and the LM head. What differs
between the two layouts, where a step's new K/V go and how attention reads the earlier ones, is the
caller's ``attend``. Numerics are those of :func:`~drs_engine.backends.torch.model.decode_step`
(``tests/gpu`` compares them); the elementwise chains come from :mod:`.fused`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from drs_engine.backends.torch.fused import StepOps
from drs_engine.backends.torch.model import ModelShape, _lm_head, rope_tables

#: ``attend(layer, q [rows, heads, d], k [rows, kv_heads, d], v [rows, kv_heads, d])``: the new K/V
#: stored, then each row's attention output (any shape of ``rows x heads * d`` elements)
Attend = Callable[[int, Any, Any, Any], Any]


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
    """Per layer, the matrices :func:`decode_layers` multiplies by at once (views of ``params``)."""
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


def project(h: Any, joined: Any, params: dict[str, Any], names: tuple[str, ...]) -> tuple[Any, ...]:
    """``h`` times each named matrix: one matmul over ``joined`` when there is one, split after."""
    if joined is None:
        return tuple(h @ params[n].T for n in names)
    return tuple((h @ joined.T).split([params[n].shape[0] for n in names], dim=-1))


def decode_layers(
    params: dict[str, Any],
    shape: ModelShape,
    ids: Any,
    pos: Any,
    attend: Attend,
    ops: StepOps,
    fused: list[Projections] | None = None,
) -> Any:
    """Float32 logits ``[rows, vocab]`` of one decode step: row ``b`` feeds token ``ids[b]`` at
    position ``pos[b]``; ``fused``: the layers' back-to-back projections (None: one matmul each)."""
    rows, eps = ids.shape[0], shape.rms_eps
    x = params["model.embed_tokens.weight"][ids]
    cos, sin = rope_tables(pos, shape, x.dtype)
    h = ops.rms(x, params["model.layers.0.input_layernorm.weight"], eps)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layer = fused[i] if fused is not None else Projections(None, None)
        q, k, v = project(h, layer.qkv, params, (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"))
        q = ops.norm_rope(q.view(rows, shape.heads, shape.head_dim), params[a + "q_norm.weight"], eps, cos, sin)
        k = ops.norm_rope(k.view(rows, shape.kv_heads, shape.head_dim), params[a + "k_norm.weight"], eps, cos, sin)
        attn = attend(i, q, k, v.view(rows, shape.kv_heads, shape.head_dim))
        x, h = ops.add_norm(
            x,
            attn.reshape(rows, -1) @ params[a + "o_proj.weight"].T,
            params[p + "post_attention_layernorm.weight"],
            eps,
        )
        m = p + "mlp."
        gate, up = project(h, layer.gate_up, params, (m + "gate_proj.weight", m + "up_proj.weight"))
        after = f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < shape.layers else "model.norm.weight"
        x, h = ops.add_norm(x, ops.silu_mul(gate, up) @ params[m + "down_proj.weight"].T, params[after], eps)
    return (h @ _lm_head(params, shape).T).to(torch.float32)
