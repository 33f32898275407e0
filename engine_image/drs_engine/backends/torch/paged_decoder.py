"""The ``torch`` backend's decode step with the ``paged`` KV layout (``torch.kvLayout: paged``).

:class:`PagedDecoder` is :class:`~drs_engine.backends.torch.decoder.BatchDecoder`'s counterpart
for :mod:`.paged`: the same calls on the GPU thread, once per batched step of
:class:`~drs_engine.backends.torch.batching.DecodeBatcher`:

1. sequences that left give their blocks back, their KV gathered into a tensor of their own first
   (the engine caches it in the prefix cache after, as with the slot pool);
2. a sequence new to the batch gets a block table and its KV written into its blocks once (the
   prompt's KV as prefilled); every sequence in the store gets room for its next token (a new block
   at each block boundary). When the store is out of blocks
   (:class:`~drs_engine.backends.torch.kv.blocks.PoolExhausted`) the sequence stays outside and
   steps eagerly, as one longer than a slot does with the slot pool;
3. the store's sequences step together through :func:`~drs_engine.backends.torch.paged.paged_logits`
   (FlexAttention over their block tables, or the gather fallback), the others through
   :func:`~drs_engine.backends.torch.model.decode_step` in the same call.

The store holds ``maxDecodeBatch x decodeSlotTokens`` tokens (the slot pool's memory) in blocks
of ``tokensPerBlock``; a sequence uses only the blocks it has filled. No CUDA graphs on this path
(the block mask is built on the host each step); ``compileDecode`` fuses the elementwise chains and
FlexAttention is compiled on CUDA. The prefix cache still hands a hit over as a copy into the
prompt's own KV (:mod:`.kv.prefix`); sharing the cached blocks in place is what
:meth:`~drs_engine.backends.torch.kv.blocks.BlockPool.open` does, not yet wired here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from drs_protocol.enums import PagedAttention

from drs_engine.backends.torch.batching import DecodeSeq
from drs_engine.backends.torch.fused import EAGER, StepOps, fused_ops
from drs_engine.backends.torch.kv.blocks import PoolExhausted
from drs_engine.backends.torch.kv.paged import PagedKv
from drs_engine.backends.torch.model import ModelShape, decode_step, new_kv
from drs_engine.backends.torch.paged import flex_rows, paged_logits
from drs_engine.backends.torch.pooled import Projections, fuse_projections


class PagedDecoder:
    """The paged KV store and the step that uses it."""

    def __init__(
        self,
        shape: ModelShape,
        *,
        tokens: int,
        tokens_per_block: int,
        rows: int,
        attention: PagedAttention,
        device: Any,
        dtype: Any,
        compiled: bool = False,
    ) -> None:
        blocks = -(-tokens // tokens_per_block)
        self.store = PagedKv(
            shape, blocks=blocks, tokens_per_block=tokens_per_block, device=device, dtype=dtype, rows=rows
        )
        self.attention = attention
        self.compiled = compiled and device.type == "cuda"
        self.ops: StepOps = fused_ops() if self.compiled else EAGER
        self.fused: list[Projections] | None = None
        self._fused_for: Any = None
        self.paged_steps = 0
        self.eager_rows = 0
        self.exhausted = 0

    def info(self) -> dict[str, Any]:
        pool = self.store.pool
        return {
            "layout": "paged",
            "attention": str(self.attention),
            "blocks": pool.blocks,
            "tokens_per_block": pool.tokens_per_block,
            "pool_bytes": self.store.nbytes,
            "allocated": self.store.kv is not None,
            "holders": len(pool.sequences),
            "free_blocks": pool.free_blocks,
            "cuda_graphs": False,
            "compiled": self.compiled,
            "paged_steps": self.paged_steps,
            "eager_rows": self.eager_rows,
            "exhausted": self.exhausted,
        }

    def warm_rows(self) -> list[int]:
        """The batch sizes the engine's warm-up steps: with compiled FlexAttention every padded size
        up to the store's rows (one compile each, :func:`~.paged.flex_rows`: 7 up to 64 rows, tens
        of seconds on an H100, paid at start rather than by the first request of each size);
        otherwise one and two rows, as with the slot pool."""
        if not (self.compiled and self.attention is PagedAttention.FLEX):
            return [1, 2]
        return [1 << i for i in range(flex_rows(self.store.rows).bit_length())]

    def fits(self, length: int) -> bool:
        """A sequence of ``length`` tokens so far could take one more step in the store."""
        return -(-(length + 1) // self.store.tokens_per_block) <= self.store.blocks

    # ---- on the GPU thread -----------------------------------------------------------------

    def free(self) -> None:
        """Drop the store (sleep); its holders were failed by the batcher."""
        self.fused = self._fused_for = None
        self.store.free()

    def release(self, seqs: list[DecodeSeq]) -> None:
        """``seqs`` give their blocks back; each keeps its KV in a tensor of its own."""
        for seq in seqs:
            if seq in self.store.pool:
                seq.kv = self.store.gather(seq, seq.length, seq.length + 1)
                self.store.pool.close(seq)
                seq.pooled = False

    def rewrite(self, seq: DecodeSeq, fill: Callable[[Any], None]) -> None:
        """A pooled ``seq``'s KV recomputed (new weights): ``fill`` writes its ``seq.length`` tokens
        into a fresh tensor, copied into its blocks."""
        fresh = new_kv(self.store.shape, seq.length + 1, device=self.store.device, dtype=self.store.dtype)
        fill(fresh)
        self.store.write(seq, fresh, 0, seq.length)

    def seat(self, batch: list[DecodeSeq]) -> None:
        """New sequences take blocks (their KV written in); every holder gets room for one more
        token; a sequence the store has no blocks for stays (or goes) outside."""
        pool = self.store.pool
        for seq in batch:
            try:
                if not seq.pooled:
                    pool.open(seq, [], limit=0)
                    self.store.grow(seq, seq.length + 1)
                    self.store.write(seq, seq.kv, 0, seq.length)
                    seq.kv, seq.pooled = None, True
                else:
                    self.store.grow(seq, seq.length + 1)
            except PoolExhausted:
                self.exhausted += 1
                if seq.pooled:
                    self.release([seq])
                elif seq in pool:
                    pool.close(seq)

    def step(self, params: dict[str, Any], weights_key: Any, batch: list[DecodeSeq]) -> Any:
        """Float32 logits ``[len(batch), vocab]`` of one step (call :meth:`seat` first)."""
        if self._fused_for is not weights_key:
            self._fused_for, self.fused = weights_key, fuse_projections(params, self.store.shape)
        inside = [i for i, s in enumerate(batch) if s.pooled]
        outside = [i for i, s in enumerate(batch) if not s.pooled]
        parts: list[tuple[list[int], Any]] = []
        if inside:
            self.paged_steps += 1
            seqs = [batch[i] for i in inside]
            tokens = [s.next_token for s in seqs]
            parts.append((inside, paged_logits(params, self.store, seqs, tokens, self.attention, self.ops, self.fused)))
        if outside:
            self.eager_rows += len(outside)
            seqs = [batch[i] for i in outside]
            logits = decode_step(
                params, self.store.shape, [s.next_token for s in seqs], [s.kv for s in seqs], [s.length for s in seqs]
            )
            parts.append((outside, logits))
        if len(parts) == 1 and parts[0][0] == list(range(len(batch))):
            return parts[0][1]
        out = torch.empty((len(batch), parts[0][1].shape[1]), device=self.store.device, dtype=torch.float32)
        for rows, logits in parts:
            out[torch.tensor(rows, device=self.store.device)] = logits
        return out
