"""The digest of a torch engine's weights, on their device (:mod:`drs_protocol.weights_digest`).

Packed weights (one flat ``uint8`` buffer in the refit layout, ``backends.torch.weights.packed``) are
digested in place; weights kept as separate tensors (an unaligned layout) go through one
staging buffer, in their order. Blocks (device work): the backend runs it on its GPU thread.

On CUDA the packed buffer's chunk sums are one fused multiply-reduce (:func:`chunk_sums`,
``torch.compile``: each chunk's lanes read once, the products summed in registers, wrapping
``int64`` as the reference does), so the digest runs at the device's read speed;
``drs_protocol``'s :func:`~drs_protocol.weights_digest.digest_torch` (the trainer-side helper,
16 MiB steps through a temporary) gives the same value, and ``tests/gpu/test_weights_digest.py``
checks both against the pure reference. On the CPU the same function runs uncompiled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from drs_protocol import weights_digest as wd


def torch_weights_digest(flat: Any | None, params: Mapping[str, Any]) -> str:
    """The digest of ``flat`` when the weights are packed into it, else of ``params`` in order."""
    if flat is not None:
        return fused_digest(flat)
    return wd.digest_torch_tensors(params.values())


def lane_sums(lanes: Any, weights: Any) -> Any:
    """Chunk sums of ``lanes`` ``[chunks, LANES]`` (``int64``): ``Σ lane * weight`` per row, wrapping."""
    import torch

    return (lanes * weights).sum(dim=1, dtype=torch.int64)


@functools.cache
def _compiled_lane_sums() -> Callable[[Any, Any], Any]:
    import torch

    return torch.compile(lane_sums, dynamic=True, fullgraph=True)  # type: ignore[no-any-return]


@functools.cache
def _weights(device: str) -> Any:
    import torch

    return torch.tensor([wd.signed(w) for w in wd.lane_weights()], dtype=torch.int64, device=device)


def chunk_sums(flat: Any, *, compiled: bool | None = None) -> Any:
    """``flat``'s chunk sums (``int64``, on its device, in order): whole chunks in one
    :func:`lane_sums` call (compiled by inductor on CUDA unless ``compiled`` says otherwise), the
    short last chunk zero-padded to whole lanes."""
    import torch

    total = int(flat.numel())
    weights = _weights(str(flat.device))
    whole = total // wd.CHUNK_BYTES
    parts: list[Any] = []
    if whole:
        rows = flat[: whole * wd.CHUNK_BYTES]
        if rows.storage_offset() % wd.LANE_BYTES or not rows.is_contiguous():
            rows = rows.clone()  # a view as int64 needs a contiguous, 8-byte aligned start
        lanes = rows.view(torch.int64).view(whole, wd.LANES)
        use_compiled = flat.device.type == "cuda" if compiled is None else compiled
        parts.append((_compiled_lane_sums() if use_compiled else lane_sums)(lanes, weights))
    rest = total - whole * wd.CHUNK_BYTES
    if rest:
        tail = torch.zeros(-(-rest // wd.LANE_BYTES) * wd.LANE_BYTES, dtype=torch.uint8, device=flat.device)
        tail[:rest] = flat[whole * wd.CHUNK_BYTES :]
        lanes = tail.view(torch.int64)
        parts.append(lane_sums(lanes[None], weights[None, : lanes.numel()]))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=flat.device)


def fused_digest(flat: Any, *, compiled: bool | None = None) -> str:
    """:func:`drs_protocol.weights_digest.digest_torch` of a flat ``uint8`` tensor (the same value),
    through :func:`chunk_sums`. One host sync (8 bytes per MiB)."""
    import torch

    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("fused_digest: needs a flat uint8 tensor")
    return wd.finish(int(flat.numel()), chunk_sums(flat, compiled=compiled).cpu().tolist())


def warm_up(device: Any) -> None:
    """Compile the fused chunk sums (two chunks and a tail, so later sizes reuse the dynamic-shape
    kernel) before a load needs them; nothing on the CPU."""
    import torch

    if device.type == "cuda":
        fused_digest(torch.zeros(2 * wd.CHUNK_BYTES + 8, dtype=torch.uint8, device=device))
