"""The ``torch`` backend's decode step with the ``paged`` KV layout (``torch.kvLayout: paged``).

:class:`PagedDecoder` is :class:`~drs_engine.backends.torch.decoder.BatchDecoder`'s counterpart
for :mod:`.paged`: the same calls on the GPU thread, once per batched step of
:class:`~drs_engine.backends.torch.batching.DecodeBatcher`:

1. sequences that left publish their full blocks to the pool's cache under their tokens' chained
   keys (KV of the weights now served only) and give their references back: nothing is copied
   out, the blocks stay cached until the pool's LRU evicts them;
2. a sequence new to the batch takes over its prefilled turn's table
   (:class:`~drs_engine.backends.torch.kv.turns.PagedTurn`: the prompt's cached prefix shared in
   place, the rest written at prefill), or, with KV of its own (received from a prefill engine, or
   prefilled when the store was full), gets a table and that KV written into its blocks once; every
   sequence in the store gets room for its next token (a new block at each block boundary). When
   the store is out of blocks (:class:`~drs_engine.backends.torch.kv.blocks.PoolExhausted`) the
   sequence goes outside, its KV gathered into a tensor of its own, and steps eagerly, as one
   longer than a slot does with the slot pool;
3. the store's sequences step together through :func:`~drs_engine.backends.torch.paged.paged_logits`
   (FlexAttention over their block tables, or the gather fallback), the others through
   :func:`~drs_engine.backends.torch.model.decode_step` in the same call.

The store holds ``maxDecodeBatch x decodeSlotTokens`` tokens (the slot pool's memory) in blocks
of ``tokensPerBlock``; a sequence uses only the blocks it has filled. No CUDA graphs on this path
(the block mask is built on the host each step); ``compileDecode`` fuses the elementwise chains and
FlexAttention is compiled on CUDA. The pool is the engine's prefix cache in this layout
(:mod:`.kv.turns`); a refit, ``reset_prefix_cache`` and sleep drop its cached blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from drs_protocol.enums import PagedAttention

from drs_engine.backends.torch.batching import DecodeSeq
from drs_engine.backends.torch.fused import EAGER, StepOps, fused_ops
from drs_engine.backends.torch.kv.blocks import PoolExhausted
from drs_engine.backends.torch.kv.paged import PagedKv
from drs_engine.backends.torch.kv.turns import PagedTurn, PagedTurns
from drs_engine.backends.torch.layers import Projections, fuse_projections
from drs_engine.backends.torch.model import ModelShape, decode_step, new_kv
from drs_engine.backends.torch.paged import flex_rows, paged_logits
from drs_engine.errors import EngineError


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
        caching: bool = True,
    ) -> None:
        blocks = -(-tokens // tokens_per_block)
        self.store = PagedKv(
            shape, blocks=blocks, tokens_per_block=tokens_per_block, device=device, dtype=dtype, rows=rows
        )
        self.turns = PagedTurns(self.store, caching=caching)
        #: a leaving sequence's full blocks' cache keys (none: its KV is not of the weights served)
        self.keys: Callable[[DecodeSeq], Sequence[Any]] = lambda seq: []
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
            "exhausted": self.exhausted + self.turns.exhausted,
            "cached_blocks": pool.cached_blocks,
            "prefix_hit_blocks": pool.hits,
            "evictions": pool.evictions,
            "cow_copies": pool.copies,
            "tokens_written": self.store.written,
            "tokens_gathered": self.store.gathered,
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
        """``seqs`` left: their full blocks published to the cache (:attr:`keys`), their references
        given back; nothing copied out (a sequence's KV after it left is what the cache keeps)."""
        pool = self.store.pool
        for seq in seqs:
            if isinstance(seq.kv, PagedTurn):  # left before its first step
                self.turns.drop(seq.kv)
                seq.kv = None
            elif seq in pool:
                if self.turns.caching:
                    pool.publish(seq, self.keys(seq))
                pool.close(seq)
                seq.kv, seq.pooled = None, False

    def _unseat(self, seq: DecodeSeq) -> None:
        """``seq`` out of the store (no blocks for its next token): its KV in a tensor of its own."""
        seq.kv = self.store.gather(seq, seq.length, seq.length + 1)
        self.store.pool.close(seq)
        seq.pooled = False

    def rewrite(self, seq: DecodeSeq, fill: Callable[[Any], None]) -> None:
        """A pooled ``seq``'s KV recomputed (new weights): ``fill`` writes its ``seq.length`` tokens
        into a fresh tensor, copied into fresh blocks of its own (its old ones may be shared, cached
        under the old weights). No blocks for that: it goes on outside with the fresh tensor."""
        fresh = new_kv(self.store.shape, seq.length + 1, device=self.store.device, dtype=self.store.dtype)
        fill(fresh)
        pool = self.store.pool
        pool.close(seq)
        pool.open(seq, [], limit=0)
        try:
            self.store.grow(seq, seq.length + 1)
        except PoolExhausted:
            self.exhausted += 1
            pool.close(seq)
            seq.kv, seq.pooled = fresh, False
            return
        self.store.write(seq, fresh, 0, seq.length)

    def seat(self, batch: list[DecodeSeq]) -> None:
        """New sequences take blocks (their KV written in); every holder gets room for one more
        token; a sequence the store has no blocks for stays (or goes) outside."""
        pool = self.store.pool
        for seq in batch:
            if isinstance(seq.kv, PagedTurn):  # prefilled into the store: its table becomes the sequence's
                if seq.kv not in pool:
                    raise EngineError("the engine released its KV cache (sleep) after this prompt's prefill")
                pool.rename(seq.kv, seq)
                seq.kv, seq.pooled = None, True
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
                    self._unseat(seq)
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
