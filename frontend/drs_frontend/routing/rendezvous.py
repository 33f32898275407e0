"""Rendezvous (highest-random-weight) hashing with a bounded-load correction.

``hrw_order(key, urls)`` ranks engines by ``blake2b(key, url)``: a pure function of the
conversation id and the engine addresses, identical in every process (Python's ``hash`` is
salted per process, so it is not used). Two frontends of one replica, or a frontend that
restarted and lost its sticky table, therefore rank a conversation's engines the same way.
Removing an engine moves only the conversations whose first choice it was; adding one takes
about ``1/n`` of them.

``bounded_pick`` walks that order and takes the first engine whose load is within a bound of
``c`` times the mean, the mean counting the request being placed (Mirrokni, Thorup and
Zadimoghaddam, "Consistent Hashing with Bounded Loads"). Some engine is always at or below the
mean, so for one measure the walk always ends. Several measures can be bounded at once
(in-flight requests with :func:`load_bound`, pinned sessions with the stricter
:func:`share_bound`): an engine must pass all of them; if none does, the engine least over its
bounds is taken.
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
    """Most load an engine may carry and still take one more: ``ceil(factor * (total + 1) / n)``."""
    if n <= 0:
        raise ValueError("no engines")
    return max(1, math.ceil(factor * (total + 1) / n))


def share_bound(total: int, n: int, factor: float) -> float:
    """Most load an engine may carry *after* taking one more: ``factor * (total + 1) / n``, at least 1.

    Stricter than :func:`load_bound` (no rounding up, counted after placement), so that the
    loads it guards end within ``factor`` of their mean once there are enough of them.
    """
    if n <= 0:
        raise ValueError("no engines")
    return max(1.0, factor * (total + 1) / n)


Load = Callable[[str], int]


def bounded_pick(order: Sequence[str], limits: Sequence[tuple[Load, float]]) -> str:
    """The first URL in ``order`` whose every load is within its limit (``load(url) <= limit``);
    if none is, the one least over its limits (ties: the earlier in ``order``)."""
    if not order:
        raise ValueError("no engines")
    for url in order:
        if all(load(url) <= limit for load, limit in limits):
            return url
    return min(order, key=lambda u: max(load(u) / limit if limit > 0 else float("inf") for load, limit in limits))
