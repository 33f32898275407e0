"""Paged KV bookkeeping (:mod:`drs_engine.backends.torch.kv.blocks`), driven by hypothesis.

Sequences join (their prompt's cached blocks shared in place), grow token by token, publish their
full blocks to the cache, are taken over by another identity (a prefilled turn becoming a decoding
sequence) and leave, and the cache is forgotten (new weights), in any order, against a model of the
KV memory: each written
token's "KV" is the tuple of ids up to it (what real KV depends on). After every operation: every
block is exactly one of free, cached-and-idle or referenced; refcounts equal the tables'
references; every sequence reads its own ids' KV at every position (so a shared block was never
written by a sequence that did not compute it, and a copy-on-write copied the right tokens); a
cached block holds the KV its key names.
"""

from __future__ import annotations

from typing import Any

import pytest
from drs_engine.backends.torch.kv.blocks import BlockPool, PoolExhausted
from hypothesis import given, settings
from hypothesis import strategies as st

TPB = 4
#: ("join", prompt) | ("step", (k, token)) | ("leave", k) | ("rename", k) | ("forget", 0): k picks
#: a running sequence (mod count)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.lists(st.integers(0, 1), min_size=1, max_size=14)),
        st.tuples(st.just("step"), st.tuples(st.integers(0, 20), st.integers(0, 1))),
        st.tuples(st.just("leave"), st.integers(0, 20)),
        st.tuples(st.just("rename"), st.integers(0, 20)),
        st.tuples(st.just("forget"), st.just(0)),
    ),
    max_size=60,
)


def keys_of(ids: list[int], tokens: int) -> list[tuple[int, ...]]:
    """The chained keys of the full blocks within ``ids[:tokens]`` (a prefix, as the real hash)."""
    return [tuple(ids[: (i + 1) * TPB]) for i in range(tokens // TPB)]


class Model:
    """The pool under test and the KV memory it indexes (block -> offset -> ids the KV is of)."""

    def __init__(self, blocks: int) -> None:
        self.pool: BlockPool[int, tuple[int, ...]] = BlockPool(blocks, TPB)
        self.memory: dict[int, dict[int, tuple[int, ...]]] = {}
        self.ids: dict[int, list[int]] = {}
        self.next_seq = 0

    def write(self, seq: int, start: int, end: int) -> None:
        table = self.pool.table(seq)
        for p in range(start, end):
            block = table[p // TPB]
            assert self.pool.refs(block) == 1 and not self.pool.is_cached(block)  # its own, unpublished
            self.memory.setdefault(block, {})[p % TPB] = tuple(self.ids[seq][: p + 1])

    def grow(self, seq: int, length: int) -> None:
        start = self.pool.length(seq)
        for c in self.pool.grow(seq, length):
            assert c.tokens == start % TPB and 0 < c.tokens < TPB  # only a partly kept shared block
            self.memory[c.dst] = {o: kv for o, kv in self.memory[c.src].items() if o < c.tokens}
        self.write(seq, start, length)
        self.pool.publish(seq, keys_of(self.ids[seq], length))

    def join(self, prompt: list[int]) -> None:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.ids[seq] = list(prompt)
        before = self.pool.cached_run(keys_of(prompt, len(prompt)))
        hit = self.pool.open(seq, keys_of(prompt, len(prompt)), limit=len(prompt) - 1)
        assert hit == min(before * TPB, len(prompt) - 1)  # every cached block shared, the last token computed
        try:
            self.grow(seq, len(prompt))
        except PoolExhausted:
            self.pool.close(seq)
            del self.ids[seq]

    def check(self) -> None:
        pool = self.pool
        refs = [0] * pool.blocks
        for seq in pool.sequences:
            for block in pool.table(seq):
                refs[block] += 1
        free, idle = set(pool._free), set(pool._idle)  # the pool's internals, read to check them
        assert len(free) == len(pool._free) and not free & idle
        for block in range(pool.blocks):
            assert pool.refs(block) == refs[block]
            assert (block in free) + (block in idle) + (refs[block] > 0) == 1, block
            assert (block in idle) <= pool.is_cached(block)
        for seq in pool.sequences:
            table, ids = pool.table(seq), self.ids[seq]
            assert len(table) == -(-pool.length(seq) // TPB)
            for p in range(pool.length(seq)):
                assert self.memory[table[p // TPB]][p % TPB] == tuple(ids[: p + 1]), (seq, p)
        for key, block in pool._cached.items():
            assert self.memory[block][TPB - 1] == key


@settings(max_examples=300, deadline=None)
@given(blocks=st.integers(1, 12), ops=OPS)
def test_blocks_are_shared_by_refcount_written_only_by_their_own_sequence_and_evicted_least_recent_first(
    blocks: int, ops: list[tuple[str, Any]]
) -> None:
    m = Model(blocks)
    for op, arg in ops:
        running = m.pool.sequences
        if op == "join":
            m.join(arg)
        elif op == "step" and running:
            seq = running[arg[0] % len(running)]
            m.ids[seq].append(arg[1])
            try:
                m.grow(seq, m.pool.length(seq) + 1)
            except PoolExhausted:
                m.ids[seq].pop()
        elif op == "leave" and running:
            m.pool.close(running[arg % len(running)])
        elif op == "rename" and running:
            seq, new = running[arg % len(running)], m.next_seq
            m.next_seq += 1
            m.pool.rename(seq, new)
            m.ids[new] = m.ids.pop(seq)
        elif op == "forget":
            m.pool.forget_cached()
            assert m.pool.cached_blocks == 0 and not m.pool._idle  # idle cached blocks are free now
        m.check()


def test_a_prefix_hit_shares_the_blocks_and_only_a_partly_kept_last_block_is_copied() -> None:
    pool: BlockPool[str, tuple[int, ...]] = BlockPool(8, TPB)
    prompt = list(range(12))  # three full blocks
    assert pool.open("a", keys_of(prompt, 12), limit=11) == 0
    assert pool.grow("a", 12) == []
    assert pool.publish("a", keys_of(prompt, 12)) == 3
    longer = [*prompt, 99, 98]
    assert pool.open("b", keys_of(longer, 14), limit=13) == 12  # all three blocks, in place
    assert pool.table("b") == pool.table("a") and all(pool.refs(b) == 2 for b in pool.table("a"))
    assert pool.grow("b", 14) == [] and pool.copies == 0  # its own new block, nothing copied
    assert pool.open("c", keys_of(prompt, 12), limit=11) == 11  # the same prompt: its last token recomputed
    (copy,) = pool.grow("c", 12)
    assert (copy.src, copy.tokens) == (pool.table("a")[2], 3) and copy.dst not in pool.table("a")
    assert pool.table("c")[:2] == pool.table("a")[:2]


def test_idle_cached_blocks_are_evicted_least_recently_used_first_and_a_full_pool_says_its_size() -> None:
    pool: BlockPool[str, tuple[int, ...]] = BlockPool(3, TPB)
    for name, prompt in (("a", [1] * 4), ("b", [2] * 4), ("c", [3] * 4)):
        pool.open(name, keys_of(prompt, 4), limit=3)
        pool.grow(name, 4)
        pool.publish(name, keys_of(prompt, 4))
    pool.close("b")
    pool.close("a")  # idle now: b (least recent), then a
    assert pool.free_blocks == 2
    pool.open("d", [], limit=0)
    first = pool.table("d")
    pool.grow("d", 4)
    assert pool.evictions == 1 and pool.cached_run(keys_of([2] * 4, 4)) == 0  # b's block went first
    assert pool.cached_run(keys_of([1] * 4, 4)) == 1 and first == []
    before = (pool.table("d"), pool.length("d"), pool.free_blocks)
    with pytest.raises(PoolExhausted, match=r"needs 2 more blocks of 4 tokens, 1 of the store's 3 are free"):
        pool.grow("d", 12)
    assert (pool.table("d"), pool.length("d"), pool.free_blocks) == before  # nothing changed


def test_a_renamed_table_keeps_its_blocks_and_a_taken_name_is_refused() -> None:
    pool: BlockPool[str, tuple[int, ...]] = BlockPool(4, TPB)
    pool.open("turn", [], limit=0)
    pool.grow("turn", 6)
    table = pool.table("turn")
    pool.rename("turn", "seq")
    assert "turn" not in pool and pool.table("seq") == table and pool.length("seq") == 6
    assert [pool.refs(b) for b in table] == [1, 1]
    pool.open("other", [], limit=0)
    with pytest.raises(ValueError, match="already has a block table"):
        pool.rename("other", "seq")
