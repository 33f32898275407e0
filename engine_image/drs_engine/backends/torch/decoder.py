"""The ``torch`` backend's decode step for a batch: in the decode pool (CUDA graphs) where a
sequence fits, eagerly where it does not.

:class:`BatchDecoder` runs on the GPU thread, once per batched step of
:class:`~drs_engine.backends.torch.batching.DecodeBatcher`:

1. sequences that left the batch give their slot back (their KV copied out, the last holder moved
   into the hole: :meth:`~drs_engine.backends.torch.pooled.DecodePool.release`);
2. a sequence that would outgrow its slot leaves the pool too, and one new to the batch takes a
   free slot if it fits (its KV copied in once);
3. the pool's holders step together: their tokens and positions go into the pool's static
   buffers and the step's bucket's CUDA graph replays (:mod:`.graphs`); sequences outside the pool
   (longer than a slot, or no slot free) step through
   :func:`~drs_engine.backends.torch.model.decode_step` in the same call. With ``compiled`` (on
   CUDA) the pooled step's elementwise chains are inductor's fused kernels (:mod:`.fused`); with
   ``attention`` flex its attention is FlexAttention's compiled decoding kernel
   (:class:`~drs_engine.backends.torch.pooled.SlotMask`), captured in the same graphs.

Logits come back in the batch's order. Before step 3 the runner's ``prepare`` gives an outside
sequence room for one more token and recomputes any KV computed under other weights (written back
into the slot of a pooled one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from drs_protocol.enums import SlotAttention

from drs_engine.backends.torch.batching import DecodeSeq
from drs_engine.backends.torch.fused import EAGER, StepOps, fused_ops
from drs_engine.backends.torch.graphs import DecodeGraphs
from drs_engine.backends.torch.kv.slots import BATCH_BUCKETS, batch_bucket, token_bucket
from drs_engine.backends.torch.layers import Projections, fuse_projections
from drs_engine.backends.torch.model import ModelShape, decode_step
from drs_engine.backends.torch.pooled import DecodePool, pooled_logits


class BatchDecoder:
    """The decode pool, its CUDA graphs, and the step that uses both."""

    def __init__(
        self,
        shape: ModelShape,
        *,
        slots: int,
        slot_tokens: int,
        cuda_graphs: bool,
        device: Any,
        dtype: Any,
        compiled: bool = False,
        attention: SlotAttention = SlotAttention.SDPA,
    ) -> None:
        self.pool = DecodePool(shape, slots=slots, slot_tokens=slot_tokens, device=device, dtype=dtype)
        self.graphs = DecodeGraphs(device, enabled=cuda_graphs)
        self.compiled = compiled and device.type == "cuda"
        self.attention = attention
        self.ops: StepOps = fused_ops() if self.compiled else EAGER
        #: the layers' back-to-back projections of the weights the graphs were captured for
        self.fused: list[Projections] | None = None
        self.pooled_steps = 0
        self.eager_rows = 0

    def info(self) -> dict[str, Any]:
        return {
            "layout": "slots",
            "attention": self.attention.value,
            "slots": self.pool.slots,
            "slot_tokens": self.pool.slot_tokens,
            "pool_bytes": self.pool.nbytes,
            "allocated": self.pool.kv is not None,
            "holders": len(self.pool.table),
            "cuda_graphs": self.graphs.enabled,
            "compiled": self.compiled,
            "graphs_captured": len(self.graphs),
            "pooled_steps": self.pooled_steps,
            "eager_rows": self.eager_rows,
        }

    def warm_rows(self) -> list[int]:
        """The batch sizes the engine's warm-up steps (each captured as a graph on CUDA): one and two
        rows, larger batches capturing theirs on first use; with compiled FlexAttention every batch
        bucket up to the pool's slots (one compile each, paid at start, not by a request)."""
        if not (self.compiled and self.attention is SlotAttention.FLEX):
            return [1, 2]
        return [b for b in BATCH_BUCKETS if b < self.pool.slots] + [self.pool.slots]

    def fits(self, length: int) -> bool:
        """A sequence of ``length`` tokens so far can take one more step in a slot."""
        return self.pool.fits(length)

    # ---- on the GPU thread -----------------------------------------------------------------

    def rewrite(self, seq: DecodeSeq, fill: Callable[[Any], None]) -> None:
        """A pooled ``seq``'s KV recomputed (new weights): ``fill`` writes it into its slot."""
        fill(seq.kv)

    def free(self) -> None:
        """Drop the pool and the graphs (sleep); holders were failed by the batcher."""
        self.graphs.clear()
        self.fused = None
        self.pool.free()

    def release(self, seqs: list[DecodeSeq]) -> None:
        """``seqs`` give their slots back; each keeps its KV in a tensor of its own."""
        table = self.pool.table
        for seq in seqs:
            if seq not in table:
                continue
            last = table.holders[-1]
            own, move = self.pool.release(seq, seq.length, last.length)
            seq.kv, seq.pooled = own, False
            if move is not None:
                last.kv = self.pool.view(move.dst)

    def seat(self, batch: list[DecodeSeq]) -> None:
        """Sequences that outgrow their slot leave the pool; new ones that fit take a free slot."""
        self.release([s for s in batch if s.pooled and not self.pool.fits(s.length)])
        for seq in batch:
            if not seq.pooled and self.pool.fits(seq.length):
                view = self.pool.admit(seq, seq.kv, seq.length)
                if view is not None:
                    seq.kv, seq.pooled = view, True

    def step(self, params: dict[str, Any], weights_key: Any, batch: list[DecodeSeq]) -> Any:
        """Float32 logits ``[len(batch), vocab]`` of one step (call :meth:`seat` first): the graph's
        own output rows when the batch is the pool's holders in slot order (read them before the next
        step), else gathered into the batch's order."""
        if self.graphs.captured_for is not weights_key:
            self.graphs.clear()  # new weight tensors: the graphs point at the old ones
            self.graphs.captured_for = weights_key
            self.fused = fuse_projections(params, self.pool.shape)
        parts: list[Any] = []
        offset = 0
        pooled = [s for s in batch if s.pooled]
        # The rows of the result in the batch's order, worked out before any GPU work is queued:
        # a host-to-device copy after the replay would wait for it (a host sync, the GIL given up).
        table = self.pool.table
        n_eager = len(batch) - len(pooled)
        offset = batch_bucket(len(table.holders), limit=self.pool.slots) if pooled else 0
        at_eager = iter(range(offset, offset + n_eager))
        index = [table.slot_of(s) if s.pooled else next(at_eager) for s in batch]
        gather = None if index == list(range(len(batch))) else torch.tensor(index, device=self.pool.device)
        if pooled:
            parts.append(self._pooled(params))
        eager = [s for s in batch if not s.pooled]
        if eager:
            self.eager_rows += len(eager)
            parts.append(
                decode_step(
                    params,
                    self.pool.shape,
                    [s.next_token for s in eager],
                    [s.kv for s in eager],
                    [s.length for s in eager],
                )
            )
        combined = parts[0] if len(parts) == 1 else torch.cat(parts)
        return combined[: len(batch)] if gather is None else combined[gather]

    def _pooled(self, params: dict[str, Any]) -> Any:
        """Every holder steps (one not in this batch writes the same K/V again: idempotent)."""
        pool = self.pool
        holders = pool.table.holders
        rows = batch_bucket(len(holders), limit=pool.slots)
        pad = rows - len(holders)
        longest = max(s.length for s in holders) + 1
        tokens = token_bucket(longest, slot_tokens=pool.slot_tokens)
        host = torch.tensor(
            [[s.next_token for s in holders] + [0] * pad, [s.length for s in holders] + [0] * pad], dtype=torch.long
        )
        pool.tokens[:rows].copy_(host[0])
        pool.positions[:rows].copy_(host[1])
        self.pooled_steps += 1
        run: Callable[[], Any] = lambda: pooled_logits(  # noqa: E731
            params, pool, rows, tokens, self.ops, self.fused, self.attention
        )
        return self.graphs.run((rows, tokens), run)
