"""The ``sim`` backend's "model": a deterministic token function (part of the test double).

Tokens are a function of (weights, token prefix) and nothing else, so a wrong KV handoff, a wrong
prefix or stale weights show up as different tokens:

- ``weights_seed = blake2b(version || weights content hash)``.
- The prefix state, the double's "KV cache": the chain of block hashes of
  :mod:`drs_engine.prefix_hash` over the token ids (seeded with ``weights_seed``), plus the ids
  of the trailing partial block. The same block hashes key
  the prefix cache, so cached blocks are keyed by weights too.
- ``next token = blake2b("next" || decoding weights_seed || c_full || int32le(tail))``: its first
  8 bytes mod ``vocab_size`` pick the token (or EOS, with probability ``eos_probability``), the
  next bytes give a log-probability and the ``top_logprobs`` alternatives.

The decoding weights enter next to the prefix state, and the prefix state embeds the weights it
was computed with: a decode engine that continues a context computed under other weights produces
other tokens, exactly the mix a real engine would produce.

Cost: one hash per 32 prompt tokens plus one per generated token; a 32k prompt takes ~1 ms.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from drs_engine.prefix_hash import DIGEST_BYTES, block_hashes, chain_block, int32le

_U64: Final = struct.Struct("<Q")
_U32: Final = struct.Struct("<I")
#: Log-probabilities of the chosen token lie in (-LOGPROB_SPAN, 0].
LOGPROB_SPAN: Final = 4.0


def weights_seed(version: str, content_hash: bytes) -> bytes:
    """The seed of a weights version: its name and the hash of its content."""
    return hashlib.blake2b(version.encode() + b"\0" + content_hash, digest_size=DIGEST_BYTES).digest()


@dataclass(frozen=True, slots=True)
class TokenChoice:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


@dataclass(slots=True)
class PrefixState:
    """Where a sequence stands: chain hash over its full blocks and the ids of the partial block.

    This is what a context-only leg hands to the decode engine ("the KV").
    """

    chain: bytes
    tail: list[int]
    length: int

    def digest(self) -> str:
        """A short fingerprint of the whole state (sent in the opaque state and checked on fetch)."""
        return hashlib.blake2b(self.chain + int32le(self.tail), digest_size=DIGEST_BYTES).hexdigest()


class TokenFunction:
    """The deterministic next-token function of one weights version."""

    def __init__(
        self, seed: bytes, *, vocab_size: int, eos_token_id: int, eos_probability: float, tokens_per_block: int
    ) -> None:
        if vocab_size < 2:
            raise ValueError("vocab_size must be at least 2")
        self.seed = seed
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.tokens_per_block = tokens_per_block
        self._eos_threshold = int(eos_probability * 2**32)

    def start(self, ids: Sequence[int], full_block_hashes: Sequence[bytes] | None = None) -> PrefixState:
        """The state after ``ids``; ``full_block_hashes`` (from the prefix cache lookup) saves rehashing."""
        nfull = len(ids) // self.tokens_per_block
        hashes = (
            list(full_block_hashes)
            if full_block_hashes is not None
            else block_hashes(self.seed, ids, self.tokens_per_block)
        )
        if len(hashes) != nfull:
            raise ValueError(f"expected {nfull} block hashes, got {len(hashes)}")
        chain = hashes[-1] if hashes else self.seed
        return PrefixState(chain=chain, tail=list(ids[nfull * self.tokens_per_block :]), length=len(ids))

    def advance(self, state: PrefixState, token_id: int) -> bytes | None:
        """Append one token to ``state``; returns the new block hash when this closes a block."""
        state.tail.append(token_id)
        state.length += 1
        if len(state.tail) < self.tokens_per_block:
            return None
        state.chain = chain_block(state.chain, state.tail)
        state.tail = []
        return state.chain

    def next_token(self, state: PrefixState, *, top_logprobs: int = 0, allow_eos: bool = True) -> TokenChoice:
        """The token that follows ``state`` under these weights."""
        h = hashlib.blake2b(b"next" + self.seed + state.chain + int32le(state.tail), digest_size=32).digest()
        pick = _U64.unpack_from(h, 0)[0]
        eos_draw = _U32.unpack_from(h, 8)[0]
        lp_draw = _U32.unpack_from(h, 12)[0]
        if allow_eos and eos_draw < self._eos_threshold:
            token = self.eos_token_id
        else:
            token = pick % self.vocab_size
            if token == self.eos_token_id:
                token = (token + 1) % self.vocab_size
        logprob = -LOGPROB_SPAN * lp_draw / 2**32
        alternatives: list[tuple[int, float]] = []
        if top_logprobs > 0:
            alternatives.append((token, logprob))
            for k in range(1, top_logprobs):
                alt = _U64.unpack(hashlib.blake2b(h + bytes([k]), digest_size=8).digest())[0] % self.vocab_size
                alternatives.append((alt, logprob - 0.5 * k))
        return TokenChoice(token_id=token, logprob=logprob, top_logprobs=tuple(alternatives))
