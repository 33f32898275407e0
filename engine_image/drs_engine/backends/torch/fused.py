"""The pooled decode step's elementwise chains, each one function, fused by ``torch.compile`` on CUDA.

Per layer a decode step is seven projections, the K/V writes and one attention call; everything
else is short elementwise chains (RMSNorm in float32 is eight kernels, RoPE five, the residual adds
and SiLU·up more), ~57 kernels a layer, ~1,600 a step of a 28-layer model. Replayed from a CUDA
graph each still costs a few microseconds of the GPU's time however little it computes, so the
step took ~5 ms at any batch size (``docs/results.md``). Here each chain is one Python function
(:class:`StepOps`): eager they are exactly :mod:`.model`'s arithmetic; :func:`fused_ops` gives
them compiled by inductor (``dynamic=True``: one compile serves every batch bucket; Dynamo still
specializes a batch of one, which the engine's warm-up runs too), one kernel each. The CUDA graphs
of :mod:`.graphs` then capture the compiled kernels. Only on CUDA: on the CPU (tests, CI) the same
functions run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from drs_engine.backends.torch.model import _rms, _rope


def norm_rope(x: Any, weight: Any, eps: float, cos: Any, sin: Any) -> Any:
    """Qwen3's per-head RMSNorm of q or k, then RoPE: ``x`` ``[rows, heads, head_dim]``."""
    return _rope(_rms(x, weight, eps), (cos, sin))


def add_norm(x: Any, delta: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    """The residual stream after ``delta`` is added, and its RMSNorm (the next block's input)."""
    out = x + delta
    return out, _rms(out, weight, eps)


def silu_mul(gate: Any, up: Any) -> Any:
    return F.silu(gate) * up


@dataclass(frozen=True)
class StepOps:
    """The elementwise chains a pooled step calls (eager or compiled)."""

    rms: Any = _rms
    norm_rope: Any = norm_rope
    add_norm: Any = add_norm
    silu_mul: Any = silu_mul


EAGER = StepOps()


@cache
def fused_ops() -> StepOps:
    """The chains compiled by inductor (compiled on first call, per process)."""

    def compiled(fn: Any) -> Any:
        return torch.compile(fn, dynamic=True, fullgraph=True)

    return StepOps(
        rms=compiled(_rms),
        norm_rope=compiled(norm_rope),
        add_norm=compiled(add_norm),
        silu_mul=compiled(silu_mul),
    )
