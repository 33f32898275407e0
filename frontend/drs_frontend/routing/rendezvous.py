"""Rendezvous (highest-random-weight) hashing with a bounded-load correction.

``hrw_order(key, urls)`` ranks engines by ``blake2b(key, url)``: a pure function of the
conversation id and the engine addresses, identical in every process (Python's ``hash`` is
salted per process, so it is not used). Two frontends of one replica, or a frontend that
restarted and lost its sticky table, therefore rank a conversation's engines the same way.
Removing an engine moves only the conversations whose first choice it was; adding one takes
about ``1/n`` of them.

``bounded_pick`` walks that order and takes the first engine whose load is at most
``ceil(c * mean)``, the mean counting the request being placed (Mirrokni, Thorup and
Zadimoghaddam, "Consistent Hashing with Bounded Loads"). Some engine is always at or below the
mean, so the walk always ends; no engine is pushed above ``ceil(c * mean)`` by it. Several load
measures can be bounded at once (in-flight requests and pinned sessions): an engine must pass
all of them; if none passes all, the least loaded engine by the first measure is taken.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence


def hrw_score(key: bytes, url: str) -> int:
    """The rendezvous weight of ``url`` for ``key`` (64 bits, stable across processes)."""
    digest = hashlib.blake2b(key + b"\x00" + url.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def hrw_order(key: str, urls: Sequence[str]) -> list[str]:
    """``urls`` from highest to lowest weight for ``key`` (ties, practically impossible, by URL)."""
    raw = key.encode()
    return sorted(urls, key=lambda u: (-hrw_score(raw, u), u))


def load_bound(total: int, n: int, factor: float) -> int:
    """Most load an engine may carry before it is skipped: ``ceil(factor * (total + 1) / n)``."""
    if n <= 0:
        raise ValueError("no engines")
    return max(1, math.ceil(factor * (total + 1) / n))


def bounded_pick(order: Sequence[str], loads: Sequence[Callable[[str], int]], factor: float) -> str:
    """The first URL in ``order`` within the bound of every load measure in ``loads``."""
    if not order:
        raise ValueError("no engines")
    bounds = [load_bound(sum(load(u) for u in order), len(order), factor) for load in loads]
    for url in order:
        if all(load(url) <= bound for load, bound in zip(loads, bounds, strict=True)):
            return url
    first = loads[0]
    return min(order, key=first)  # min keeps HRW order among equals
