"""The ``torch`` backend's prefix KV store: the KV of prompts' full blocks, kept for later prompts.

Blocks are keyed by :mod:`drs_engine.prefix_hash` (seeded with the weights), kept by
:class:`~drs_engine.prefix_cache.PrefixCache` (LRU), and their values are places in KV tensors:
``(tensor, first token)``. A hit gives copy runs: the cached blocks of one tensor that follow each
other merge into one copy into the new sequence's KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from drs_protocol.engine_config import TorchSpec

from drs_engine.prefix_cache import PrefixCache
from drs_engine.prefix_hash import block_hashes

#: ``(dst token, source tensor, src token, tokens)``: one copy of cached KV into a sequence's KV.
CopyRun = tuple[int, Any, int, int]


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """What the store holds of a prompt: how many tokens, in how many blocks, as copy runs."""

    tokens: int
    blocks: int
    runs: list[CopyRun]


class PrefixKv:
    """Cached prefix blocks of KV, by chained block hash."""

    def __init__(self, spec: TorchSpec) -> None:
        self.cache = PrefixCache(tokens_per_block=spec.tokens_per_block, capacity_tokens=spec.cache_capacity_tokens)

    @property
    def tokens_per_block(self) -> int:
        return self.cache.tokens_per_block

    @property
    def keeps_nothing(self) -> bool:
        return self.cache.capacity_blocks == 0

    def __len__(self) -> int:
        return len(self.cache)

    def reset(self) -> int:
        """Forget every block; returns how many."""
        return self.cache.reset()

    def lookup(self, seed: bytes, prompt: Sequence[int]) -> PrefixHit:
        """The cached prefix of ``prompt`` under the weights ``seed`` names (counted in the cache's metrics)."""
        hashes = block_hashes(seed, prompt, self.tokens_per_block)
        lookup = self.cache.lookup(len(prompt), hashes)
        return PrefixHit(lookup.hit_tokens, lookup.hit_blocks, self._runs(hashes[: lookup.hit_blocks]))

    def _runs(self, hashes: list[bytes]) -> list[CopyRun]:
        tpb = self.tokens_per_block
        runs: list[CopyRun] = []
        for i, h in enumerate(hashes):
            base, src = self.cache.value(h)
            if runs and runs[-1][1] is base and runs[-1][2] + runs[-1][3] == src:
                dst, _, first, n = runs[-1]
                runs[-1] = (dst, base, first, n + tpb)
            else:
                runs.append((i * tpb, base, src, tpb))
        return runs

    def remember(self, seed: bytes, ids: Sequence[int], kv: Any, from_block: int) -> None:
        """Cache the full blocks of ``ids`` (whose KV is in ``kv``) from ``from_block`` on."""
        tpb = self.tokens_per_block
        hashes = block_hashes(seed, ids, tpb)[from_block:]
        values = [(kv, (from_block + i) * tpb) for i in range(len(hashes))]
        self.cache.insert(hashes, values)
