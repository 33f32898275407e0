"""The paged KV store: every sequence's KV in one preallocated tensor of fixed-size blocks.

:class:`PagedKv` holds ``[layers, 2, kv_heads, blocks * tokens_per_block, head_dim]`` (the
per-sequence layout of :func:`~drs_engine.backends.torch.model.new_kv`, its token axis cut into
blocks), allocated once and kept until the engine releases its KV (sleep). Which sequence holds
which blocks, the prefix cache's blocks shared in place by refcount, copy-on-write and eviction are
:class:`~drs_engine.backends.torch.kv.blocks.BlockPool`; this module moves the tensors it says to
move. A sequence's token ``p`` is at token index ``table[p // tpb] * tpb + p % tpb`` of the store,
so a block's K of one layer is one contiguous ``[kv_heads, tpb, head_dim]`` run per head.
"""

from __future__ import annotations

from typing import Any

import torch

from drs_engine.backends.torch.kv.blocks import BlockPool, Copy
from drs_engine.backends.torch.model import ModelShape


class PagedKv:
    """The block store's tensor and its bookkeeping."""

    def __init__(
        self, shape: ModelShape, *, blocks: int, tokens_per_block: int, device: Any, dtype: Any, rows: int = 64
    ) -> None:
        self.shape = shape
        self.device = device
        self.dtype = dtype
        #: the most sequences one step over the store covers (``maxDecodeBatch``)
        self.rows = rows
        self.pool: BlockPool[Any, Any] = BlockPool(blocks, tokens_per_block)
        self.kv: Any = None
        #: buffers a step over the store keeps for the store's life, sleeps included (the paged
        #: block mask's: :class:`~drs_engine.backends.torch.paged.MaskBuffers`), by name
        self.scratch: dict[str, Any] = {}
        #: tokens of KV written into the store from a sequence's own tensor (:meth:`write`), and
        #: read out of it into one (:meth:`gather`): what paging still copies
        self.written = 0
        self.gathered = 0

    @property
    def tokens_per_block(self) -> int:
        return self.pool.tokens_per_block

    @property
    def blocks(self) -> int:
        return self.pool.blocks

    @property
    def nbytes(self) -> int:
        return self.blocks * self.tokens_per_block * self.shape.kv_bytes_per_token(self.dtype)

    def allocate(self) -> bool:
        """Make the store's tensor (on the GPU thread); False when it is there already."""
        if self.kv is not None:
            return False
        s = self.shape
        dims = (s.layers, 2, s.kv_heads, self.blocks * self.tokens_per_block, s.head_dim)
        self.kv = torch.zeros(dims, device=self.device, dtype=self.dtype)
        return True

    def free(self) -> None:
        """Drop the tensor and every table and cached block (sleep). ``scratch`` stays: a few
        bytes a row, and a compiled step is guarded on them (new ones would compile it again)."""
        self.kv = None
        self.pool.reset()

    def block_view(self, block: int) -> Any:
        """Block ``block`` of the store, ``[layers, 2, kv_heads, tpb, head_dim]`` (a view)."""
        tpb = self.tokens_per_block
        return self.kv[:, :, :, block * tpb : (block + 1) * tpb]

    def token_index(self, seq: Any, start: int, end: int) -> Any:
        """The store's token indices of ``seq``'s positions ``start … end-1`` (a long tensor)."""
        tpb = self.tokens_per_block
        table = torch.tensor(self.pool.table(seq), dtype=torch.long)
        p = torch.arange(start, end)
        return (table[p // tpb] * tpb + p % tpb).to(self.device)

    def apply(self, copies: list[Copy]) -> None:
        """Run :meth:`BlockPool.grow`'s copy-on-write copies (before the writes they precede)."""
        for c in copies:
            self.block_view(c.dst)[:, :, :, : c.tokens].copy_(self.block_view(c.src)[:, :, :, : c.tokens])

    def grow(self, seq: Any, length: int) -> None:
        """``seq``'s table made to cover ``length`` tokens, copies on write done (PoolExhausted: none)."""
        self.allocate()
        self.apply(self.pool.grow(seq, length))

    def write(self, seq: Any, kv: Any, start: int, end: int) -> None:
        """Positions ``start … end-1`` of a per-sequence KV tensor (computed by a prefill) into
        ``seq``'s blocks (grown to ``end`` first: :meth:`grow`)."""
        self.kv[:, :, :, self.token_index(seq, start, end)] = kv[:, :, :, start:end]
        self.written += end - start

    def gather(self, seq: Any, length: int, capacity: int) -> Any:
        """``seq``'s first ``length`` tokens as a per-sequence KV tensor of ``capacity`` tokens (the
        prefill of a prompt's uncached rest attends to its cached prefix this way)."""
        s = self.shape
        out = torch.empty((s.layers, 2, s.kv_heads, capacity, s.head_dim), device=self.device, dtype=self.dtype)
        out[:, :, :, :length] = self.kv[:, :, :, self.token_index(seq, 0, length)]
        self.gathered += length
        return out
