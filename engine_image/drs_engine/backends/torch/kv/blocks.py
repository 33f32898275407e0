"""Paged KV bookkeeping: a pool of fixed-size blocks, each sequence's block table, and the prefix
cache's blocks shared in place.

Pure bookkeeping (no torch), so it is property-tested on any machine
(``tests/gpu/test_paged_blocks.py``). The KV store it indexes
(:class:`~drs_engine.backends.torch.kv.paged.PagedKv`) is ``blocks`` blocks of ``tokens_per_block``
tokens; a sequence's token ``p`` lives in block ``table[p // tokens_per_block]`` at offset
``p % tokens_per_block``.

- **Refcounts.** A block is referenced once by each table that holds it. A prompt whose first
  blocks are cached (:meth:`BlockPool.open`, keyed by the chained block hashes of
  :mod:`drs_engine.prefix_hash`) takes those very blocks into its table, refcount up: a prefix hit
  copies no KV.
- **Copy-on-write.** A block is written only by the one sequence that holds it alone and has not
  published it to the cache. When a sequence must write into a block it shares (its hit ended
  inside a cached block, e.g. the whole prompt was cached and its last token is recomputed for
  its logits), :meth:`BlockPool.grow` gives it a fresh block and returns the :class:`Copy` of the
  shared block's tokens it keeps: the only KV copy paging makes, at most one per sequence.
- **Cache and eviction.** :meth:`BlockPool.publish` adds a sequence's full blocks to the cache
  (they are immutable from then on). A cached block nobody references stays cached, least recently
  used first in line to be evicted when a sequence needs a block and none is free.
- **Exhaustion.** When no block is free or evictable, :class:`PoolExhausted` names the pool's
  size; the pool is left as it was.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

S = TypeVar("S", bound=Hashable)  # a sequence's identity
K = TypeVar("K", bound=Hashable)  # a block's cache key (its chained prefix hash)


class PoolExhausted(RuntimeError):
    """Every block of the pool is referenced by a running sequence."""


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy-on-write: the first ``tokens`` tokens of block ``src`` into block ``dst``."""

    src: int
    dst: int
    tokens: int


class BlockPool(Generic[S, K]):
    """Blocks ``0 … blocks-1`` of ``tokens_per_block`` tokens, shared by refcount."""

    def __init__(self, blocks: int, tokens_per_block: int) -> None:
        if blocks < 1:
            raise ValueError(f"blocks must be >= 1, got {blocks}")
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.blocks = blocks
        self.tokens_per_block = tokens_per_block
        self.reset()

    def reset(self) -> None:
        """Forget every sequence and cached block (the KV store was freed: sleep)."""
        self._free: list[int] = list(range(self.blocks - 1, -1, -1))  # pop() takes block 0 first
        self._refs = [0] * self.blocks
        self._tables: dict[S, list[int]] = {}
        self._lengths: dict[S, int] = {}
        self._cached: dict[K, int] = {}
        self._key_of: dict[int, K] = {}
        #: cached blocks no table references, least recently used first (evicted in this order)
        self._idle: OrderedDict[int, None] = OrderedDict()
        self.hits = 0
        self.evictions = 0
        self.copies = 0

    # ---- reading ---------------------------------------------------------------------------

    def __contains__(self, seq: object) -> bool:
        return seq in self._tables

    @property
    def sequences(self) -> list[S]:
        return list(self._tables)

    def table(self, seq: S) -> list[int]:
        """``seq``'s blocks in order (a copy)."""
        return list(self._tables[seq])

    def length(self, seq: S) -> int:
        """Tokens of ``seq`` its table covers as computed (or being computed)."""
        return self._lengths[seq]

    def refs(self, block: int) -> int:
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    @property
    def cached_blocks(self) -> int:
        """Blocks in the cache now (referenced by a table or idle)."""
        return len(self._cached)

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence can take now: free ones and cached ones nobody references."""
        return len(self._free) + len(self._idle)

    def cached_run(self, keys: Sequence[K]) -> int:
        """How many of ``keys`` (a prompt's chained block hashes) are cached, from the first on."""
        n = 0
        while n < len(keys) and keys[n] in self._cached:
            n += 1
        return n

    # ---- changing --------------------------------------------------------------------------

    def open(self, seq: S, keys: Sequence[K], *, limit: int) -> int:
        """Start ``seq``'s table with the cached blocks of ``keys`` (its prompt's full-block hashes),
        shared in place, covering at most ``limit`` tokens (the prompt's tokens minus the ones it
        must compute). Returns the tokens it starts with: whole blocks, unless ``limit`` cuts the hit
        inside a block (that block is shared too, and :meth:`grow` copies it before it is written)."""
        if seq in self._tables:
            raise ValueError("the sequence already has a block table")
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        tpb = self.tokens_per_block
        hit = min(self.cached_run(keys) * tpb, limit)
        table = [self._cached[k] for k in keys[: -(-hit // tpb)]]
        for block in table:
            self._take(block)
        self.hits += len(table)
        self._tables[seq] = table
        self._lengths[seq] = hit
        return hit

    def grow(self, seq: S, length: int) -> list[Copy]:
        """Make ``seq``'s table cover ``length`` tokens, about to be written from its current length
        on: new blocks as it grows, and a private copy of a shared or cached block it would write
        into (the returned copies, to run before the write). :class:`PoolExhausted` when the blocks
        needed are not there (nothing changed then)."""
        table, old = self._tables[seq], self._lengths[seq]
        if length < old:
            raise ValueError(f"length must be >= the sequence's {old} tokens, got {length}")
        tpb = self.tokens_per_block
        needed = -(-length // tpb) - len(table)
        partial = old % tpb != 0 and length > old and self._shared(table[old // tpb])
        if needed + int(partial) > self.free_blocks:
            raise PoolExhausted(
                f"paged KV: a sequence needs {needed + int(partial)} more blocks of {tpb} tokens, "
                f"{self.free_blocks} of the store's {self.blocks} are free "
                "(the store is torch.maxDecodeBatch x torch.decodeSlotTokens tokens)"
            )
        copies = []
        if partial:
            at = old // tpb
            fresh = self._allocate()
            copies.append(Copy(src=table[at], dst=fresh, tokens=old % tpb))
            self._drop(table[at])
            table[at] = fresh
            self.copies += 1
        table.extend(self._allocate() for _ in range(needed))
        self._lengths[seq] = length
        return copies

    def publish(self, seq: S, keys: Sequence[K]) -> int:
        """Cache ``seq``'s full blocks under ``keys`` (its tokens' chained block hashes, the first
        ``len(keys)`` blocks, all within its length). A key already cached keeps its block (the
        sequence's own stays private). Returns how many blocks were added."""
        table = self._tables[seq]
        if len(keys) * self.tokens_per_block > self._lengths[seq]:
            raise ValueError(f"keys cover {len(keys)} blocks, the sequence {self._lengths[seq]} tokens")
        added = 0
        for key, block in zip(keys, table, strict=False):
            if key in self._cached or block in self._key_of:
                continue
            self._cached[key] = block
            self._key_of[block] = key
            added += 1
        return added

    def rename(self, seq: S, new: S) -> None:
        """``seq``'s table is ``new``'s from now on (a prefilled turn becomes a decoding sequence);
        no block or refcount changes."""
        if new in self._tables:
            raise ValueError("the new sequence already has a block table")
        self._tables[new] = self._tables.pop(seq)
        self._lengths[new] = self._lengths.pop(seq)

    def close(self, seq: S) -> None:
        """``seq`` leaves: its references go; its cached blocks stay cached, the rest are free."""
        for block in reversed(self._tables.pop(seq)):
            self._drop(block)
        del self._lengths[seq]

    def forget_cached(self) -> int:
        """Drop every cache key (new weights): referenced blocks stay with their tables, idle ones
        are free. Returns how many keys were dropped."""
        n = len(self._cached)
        for block in self._idle:
            self._free.append(block)
        self._idle.clear()
        self._cached.clear()
        self._key_of.clear()
        return n

    # ---- internals -------------------------------------------------------------------------

    def _shared(self, block: int) -> bool:
        return self._refs[block] > 1 or block in self._key_of

    def _take(self, block: int) -> None:
        self._idle.pop(block, None)
        self._refs[block] += 1

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block]:
            return
        if block in self._key_of:
            self._idle[block] = None  # most recently used last
        else:
            self._free.append(block)

    def _allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._idle.popitem(last=False)
            del self._cached[self._key_of.pop(block)]
            self.evictions += 1
        self._refs[block] = 1
        return block
