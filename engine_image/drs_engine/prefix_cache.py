"""A block prefix cache: chained block hashes, LRU, capacity in tokens.

Like TensorRT-LLM's KV block reuse: a prompt is cut into blocks of ``tokens_per_block`` ids; each
full block is keyed by the chain hash of every block before it and itself (so a block is reused
only after the same prefix, and — since the chain is seeded with the weights — only under the same
weights). A lookup walks the prompt's blocks from the start and stops at the first miss; the hit
length is capped at ``len(prompt) - 1`` because the last prompt token must always be computed to
produce logits. Blocks are evicted least-recently-used once the cache holds more than
``capacity_tokens``.

Invariants: ``len(self) * tokens_per_block <= capacity_tokens``; ``query_tokens`` and
``hit_tokens`` only grow (they back the two Prometheus counters), ``hit_tokens <= query_tokens``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from drs_protocol.prefix_lookup import PrefixHeld

from drs_engine.prefix_hash import block_hashes


@dataclass(frozen=True, slots=True)
class CacheLookup:
    """One prompt's lookup: how many tokens were asked and how many were already cached."""

    query_tokens: int
    hit_tokens: int
    hit_blocks: int


class PrefixCache:
    def __init__(self, *, tokens_per_block: int, capacity_tokens: int) -> None:
        if tokens_per_block < 1:
            raise ValueError("tokens_per_block must be >= 1")
        self.tokens_per_block = tokens_per_block
        self.capacity_blocks = max(0, capacity_tokens // tokens_per_block)
        #: block hash -> what the engine keeps for it (the sim: nothing; torch: where its KV lies)
        self._blocks: OrderedDict[bytes, Any] = OrderedDict()
        self.query_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, prompt_len: int, block_hashes: Sequence[bytes]) -> CacheLookup:
        """Count the cached leading blocks of a prompt (``block_hashes``: its full blocks, in order)."""
        hits = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            hits += 1
        hit_tokens = min(hits * self.tokens_per_block, max(prompt_len - 1, 0))
        self.query_tokens += prompt_len
        self.hit_tokens += hit_tokens
        return CacheLookup(query_tokens=prompt_len, hit_tokens=hit_tokens, hit_blocks=hits)

    def held(self, block_hashes: Sequence[bytes]) -> int:
        """The leading blocks of ``block_hashes`` held now; neither the LRU order nor the counters
        change (a frontend's question, not a prompt: ``drs_protocol.prefix_lookup``)."""
        held = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            held += 1
        return held

    def insert(self, block_hashes: Sequence[bytes], values: Sequence[Any] | None = None) -> list[bytes]:
        """Store (or refresh) the blocks of a computed sequence (with ``values[i]`` kept for block
        ``i``, if given), evicting LRU blocks beyond capacity; returns the evicted hashes."""
        if self.capacity_blocks == 0:
            return []
        for i, h in enumerate(block_hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = None if values is None else values[i]
        evicted: list[bytes] = []
        while len(self._blocks) > self.capacity_blocks:
            evicted.append(self._blocks.popitem(last=False)[0])
        return evicted

    def value(self, block_hash: bytes) -> Any:
        """What was stored with a cached block (``KeyError`` if it is not cached)."""
        return self._blocks[block_hash]

    def reset(self) -> int:
        """Drop every block; returns how many there were. The counters keep counting."""
        count = len(self._blocks)
        self._blocks.clear()
        return count


def prefix_held(cache: PrefixCache, seed: bytes, prompt_ids: Sequence[int]) -> PrefixHeld:
    """What ``cache`` holds of ``prompt_ids`` under the weights ``seed`` names, as the prefix-held
    lookup answers it (``drs_protocol.prefix_lookup``): exactly the blocks a prefill would reuse now."""
    hashes = block_hashes(seed, prompt_ids, cache.tokens_per_block)
    return PrefixHeld(
        tokens=len(prompt_ids),
        blocks=len(hashes),
        held_blocks=cache.held(hashes),
        tokens_per_block=cache.tokens_per_block,
    )
