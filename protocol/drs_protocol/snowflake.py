"""The snowflake ``disagg_request_id`` a frontend mints for each turn.

Layout (64 bits): ``0 | timestamp_ms (39) | node_id (8) | process_id (6) | counter (10)``, then
rotated into ``[2**40, 2**63 - 1)`` because ids below ``2**40`` are reserved for engine-local
request ids. ``node_id = replica * F + frontend`` is unique over all N×F frontends, which is why
``N * F <= 256``; ``process_id`` tells apart the processes serving one frontend URL (0, and 1 for
its standby, ``spec.frontend.standby``), so two of them never mint the same id. Within one millisecond a minter issues at most 1024 ids; past that it waits for
the next millisecond rather than repeat one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Final

TIMESTAMP_BITS = 39
NODE_ID_BITS: Final = 8
#: Node ids a fleet can give its frontends (``N * F`` at most this many): 0 … NODE_IDS - 1.
NODE_IDS: Final = 2**NODE_ID_BITS
PROCESS_ID_BITS: Final = 6
#: Processes that may mint under one node id (a frontend URL's process and its standby): 0 … PROCESS_IDS - 1.
PROCESS_IDS: Final = 2**PROCESS_ID_BITS
COUNTER_BITS = 10
MIN_ID = 2**40
MAX_ID = 2**63 - 1
#: 2025-01-01T00:00:00Z: keeps the 39-bit millisecond field valid for ~17 years.
EPOCH_MS = 1_735_689_600_000


class SnowflakeMinter:
    """Mints unique, increasing request ids for one frontend process."""

    def __init__(self, node_id: int, process_id: int = 0, clock_ms: Callable[[], int] | None = None) -> None:
        if not 0 <= node_id < 2**NODE_ID_BITS:
            raise ValueError(f"node_id must be in [0, {2**NODE_ID_BITS}), got {node_id}")
        if not 0 <= process_id < 2**PROCESS_ID_BITS:
            raise ValueError(f"process_id must be in [0, {2**PROCESS_ID_BITS}), got {process_id}")
        self.node_id = node_id
        self.process_id = process_id
        self._clock_ms = clock_ms or (lambda: time.time_ns() // 1_000_000)
        self._lock = threading.Lock()
        self._last_ms = -1
        self._counter = 0

    def next_id(self) -> int:
        with self._lock:
            now = self._clock_ms() - EPOCH_MS
            if now < self._last_ms:  # the wall clock stepped back: keep issuing from the last ms
                now = self._last_ms
            if now == self._last_ms:
                self._counter += 1
                if self._counter >= 2**COUNTER_BITS:
                    while now <= self._last_ms:
                        now = self._clock_ms() - EPOCH_MS
                    self._counter = 0
            else:
                self._counter = 0
            self._last_ms = now
            raw = (
                ((now & (2**TIMESTAMP_BITS - 1)) << (NODE_ID_BITS + PROCESS_ID_BITS + COUNTER_BITS))
                | (self.node_id << (PROCESS_ID_BITS + COUNTER_BITS))
                | (self.process_id << COUNTER_BITS)
                | self._counter
            )
            return rotate_into_range(raw)


def rotate_into_range(raw: int) -> int:
    """Map a 63-bit id into ``[MIN_ID, MAX_ID)`` without losing uniqueness for ids below the span."""
    span = MAX_ID - MIN_ID
    return MIN_ID + raw % span


def node_id_of(request_id: int) -> int:
    """The node id field of an id minted by :class:`SnowflakeMinter` (ids minted after rotation)."""
    raw = request_id - MIN_ID
    return (raw >> (PROCESS_ID_BITS + COUNTER_BITS)) & ((1 << NODE_ID_BITS) - 1)
