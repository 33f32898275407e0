"""Prefix block hashing, the one definition every backend keys its prefix cache with.

A prompt's full blocks of ``tokens_per_block`` ids are keyed by a chain of hashes,
``c_0 = seed``, ``c_{k+1} = blake2b(c_k || int32le(block k))``: a block's key names the whole
prefix up to its end, so two prompts share a cached block only when they agree on every id before
it. The seed names the weights (each backend derives its own from the weights version), so KV
computed under other weights never matches. :mod:`drs_engine.prefix_cache` stores the keys; the
sim's token function (:mod:`drs_engine.backends.sim.model`) continues the same chain over generated
tokens.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from typing import Final

DIGEST_BYTES: Final = 16


def int32le(ids: Sequence[int]) -> bytes:
    """``ids`` as little-endian 32-bit integers."""
    arr = array("i", ids)
    if arr.itemsize != 4:  # pragma: no cover - every platform CPython runs on has 4-byte int
        raise RuntimeError("array('i') is not 32-bit here")
    return arr.tobytes() if struct.pack("=i", 1) == struct.pack("<i", 1) else _swap(arr)


def _swap(arr: array[int]) -> bytes:  # pragma: no cover - big-endian hosts only
    arr.byteswap()
    return arr.tobytes()


def ids_digest(ids: Sequence[int]) -> bytes:
    """BLAKE2b-128 of ``ids`` as little-endian int32: one whole prompt's key (not a block chain's)."""
    return hashlib.blake2b(int32le(ids), digest_size=DIGEST_BYTES).digest()


def chain_block(previous: bytes, block: Sequence[int]) -> bytes:
    """One step of the block-hash chain."""
    return hashlib.blake2b(previous + int32le(block), digest_size=DIGEST_BYTES).digest()


def block_hashes(seed: bytes, ids: Sequence[int], tokens_per_block: int) -> list[bytes]:
    """The chain hash after each FULL block of ``ids`` (``len(ids) // tokens_per_block`` entries)."""
    out: list[bytes] = []
    current = seed
    for start in range(0, len(ids) - tokens_per_block + 1, tokens_per_block):
        current = chain_block(current, ids[start : start + tokens_per_block])
        out.append(current)
    return out
