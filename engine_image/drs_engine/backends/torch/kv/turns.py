"""A turn's prompt in the paged KV store: its cached prefix shared in place, the rest written once.

With ``torch.kvLayout: paged`` the store's :class:`~drs_engine.backends.torch.kv.blocks.BlockPool`
is the engine's prefix cache (the slot layout's :class:`~drs_engine.backends.torch.kv.prefix.PrefixKv`
is not used). A prefill, on the GPU thread:

1. :meth:`PagedTurns.open`: a :class:`PagedTurn` takes a table whose first blocks are the cached
   blocks of the prompt's chained block keys (:func:`drs_engine.prefix_hash.block_hashes`, the keys
   ``prefix_held`` answers with), shared in place (refcount up, no KV copied); the last prompt token
   is always computed;
2. :meth:`PagedTurns.past`: the prefill's own KV tensor, the hit's tokens gathered into it from the
   table's blocks (the past the uncached rest attends to: read, not stored again);
3. :meth:`PagedTurns.settle`: the computed rest written into new blocks of the table (only those
   tokens; a hit that ended inside a block copies that block's kept tokens first, copy-on-write),
   the prompt's full blocks published under their keys. A turn that decodes here keeps its table
   (the decoding sequence takes it over, :meth:`BlockPool.rename`); a context handed over closes it
   (its blocks stay cached, idle, evicted least recently used first).

When the store has no blocks for the prompt the turn is closed and the prefill's own tensor is the
sequence's KV (it decodes outside the store, as one longer than a slot does with the slot pool),
and nothing of it is cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from drs_engine.backends.torch.kv.blocks import PoolExhausted
from drs_engine.backends.torch.kv.paged import PagedKv
from drs_engine.backends.torch.model import new_kv


class PagedTurn:
    """A prefilled prompt's place in the pool until a decoding sequence takes its table over
    (compared by identity)."""

    __slots__ = ("hit",)

    def __init__(self) -> None:
        #: the prompt's leading tokens shared from the cache (not computed, not written)
        self.hit = 0


class PagedTurns:
    """Prompts into the store (on the GPU thread). ``caching`` False: nothing looked up or
    published (``cacheCapacityTokens`` below a block)."""

    def __init__(self, store: PagedKv, *, caching: bool) -> None:
        self.store = store
        self.caching = caching
        #: prompts the store had no blocks for
        self.exhausted = 0

    def open(self, keys: Sequence[Any], tokens: int) -> PagedTurn:
        """A turn of a ``tokens``-token prompt whose full blocks' keys are ``keys``, its cached
        leading blocks shared (``turn.hit`` tokens, at most ``tokens - 1``)."""
        turn = PagedTurn()
        turn.hit = self.store.pool.open(turn, keys if self.caching else [], limit=tokens - 1)
        return turn

    def past(self, turn: PagedTurn, capacity: int) -> Any:
        """A KV tensor of ``capacity`` tokens for the prefill, holding the turn's cached prefix."""
        if turn.hit:
            return self.store.gather(turn, turn.hit, capacity)
        s = self.store
        return new_kv(s.shape, capacity, device=s.device, dtype=s.dtype)

    def settle(self, turn: PagedTurn, kv: Any, keys: Sequence[Any], tokens: int, *, stays: bool) -> PagedTurn | None:
        """Positions ``turn.hit … tokens-1`` of ``kv`` (the prefill's) into new blocks of the turn,
        its full blocks published under ``keys``. Returns the turn when it ``stays`` (decodes here:
        room for its next token too), else None: closed (a context handed over), or the store had
        no blocks for it (the caller keeps ``kv``)."""
        store, pool = self.store, self.store.pool
        try:
            store.grow(turn, tokens + int(stays))
        except PoolExhausted:
            pool.close(turn)
            self.exhausted += 1
            return None
        store.write(turn, kv, turn.hit, tokens)
        if self.caching:
            pool.publish(turn, keys)
        if stays:
            return turn
        pool.close(turn)
        return None

    def drop(self, turn: PagedTurn) -> None:
        """A turn whose sequence never decoded (finished on its first token, its client gone): its
        references go, its cached blocks stay cached. Nothing when it is gone already (taken over,
        or the store was freed: sleep)."""
        if turn in self.store.pool:
            self.store.pool.close(turn)
