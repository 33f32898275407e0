"""Prefix matching for requests without a conversation id.

A prompt becomes a chain of block hashes: ``h[i] = hash((h[i-1], block[i]))``, so ``h[i]``
names the whole prefix up to block ``i``. Blocks are ``block_tokens`` token ids when the frontend
tokenized, else one block for the ``tools`` (the chat template renders them first) and one per
message (``role`` and ``content``), or one per ``TEXT_BLOCK_CHARS`` of a completions prompt; each
block weighs its length (the message blocks as :func:`.groups.message_chars` counts them), so the
match ratio is the share of the prompt (tokens or characters) that some engine already saw. :class:`PrefixIndex` remembers, for a
bounded number of block hashes (LRU), the engine that last served a prompt containing it. The
hashes are Python's (salted per process): the index lives and dies with the process.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from drs_frontend.routing.groups import content_text, tools_text

#: Characters per block of a completions prompt (no messages, no token ids).
TEXT_BLOCK_CHARS = 1024


@dataclass(frozen=True, slots=True)
class BlockChain:
    hashes: list[int]
    weights: list[int]

    @property
    def total(self) -> int:
        return sum(self.weights)


def chain_from_ids(ids: Sequence[int], block_tokens: int) -> BlockChain:
    """Hashes of the full ``block_tokens`` blocks of ``ids`` (a trailing partial block is not hashed)."""
    raw = (ids if isinstance(ids, array) and ids.typecode == "i" else array("i", ids)).tobytes()
    step = 4 * block_tokens
    hashes: list[int] = []
    h = 0
    for start in range(0, len(raw) - step + 1, step):
        h = hash((h, raw[start : start + step]))
        hashes.append(h)
    return BlockChain(hashes, [block_tokens] * len(hashes))


def chain_from_messages(messages: Sequence[Mapping[str, Any]], tools: Any = None) -> BlockChain:
    """One block for the tools (if any), then one per message: its role and its content as text."""
    hashes: list[int] = []
    weights: list[int] = []
    h = 0
    tools_block = tools_text(tools)
    if tools_block:
        h = hash((h, "tools", tools_block))
        hashes.append(h)
        weights.append(len(tools_block))
    for message in messages:
        role = str(message.get("role", ""))
        content = message.get("content")
        text = content if isinstance(content, str) else content_text(content)
        h = hash((h, role, text))
        hashes.append(h)
        weights.append(len(role) + len(text) + 1)
    return BlockChain(hashes, weights)


def chain_from_text(text: str) -> BlockChain:
    hashes: list[int] = []
    weights: list[int] = []
    h = 0
    for start in range(0, len(text), TEXT_BLOCK_CHARS):
        block = text[start : start + TEXT_BLOCK_CHARS]
        h = hash((h, block))
        hashes.append(h)
        weights.append(len(block))
    return BlockChain(hashes, weights)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    url: str
    ratio: float


class PrefixIndex:
    """Block hash -> engine URL, bounded to ``max_blocks`` (least recently used go first)."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self._owner: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def longest_match(self, chain: BlockChain) -> PrefixMatch | None:
        """The engine that saw the longest known prefix of ``chain``, and that prefix's share."""
        total = chain.total
        if total == 0:
            return None
        matched = 0
        owner: str | None = None
        for h, weight in zip(chain.hashes, chain.weights, strict=True):
            url = self._owner.get(h)
            if url is None:
                break
            owner = url
            matched += weight
        return None if owner is None else PrefixMatch(owner, matched / total)

    def record(self, chain: BlockChain, url: str) -> None:
        """``url`` now holds every block of ``chain``."""
        owner = self._owner
        for h in chain.hashes:
            owner[h] = url
            owner.move_to_end(h)
        while len(owner) > self.max_blocks:
            owner.popitem(last=False)
