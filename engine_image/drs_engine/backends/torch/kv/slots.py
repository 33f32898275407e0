"""Which decoding sequence holds which slot of the decode pool, and the shapes a pooled step runs at.

Pure bookkeeping (no torch), so it is property-tested on any machine. The pool
(:mod:`drs_engine.backends.torch.pooled`) is one preallocated KV tensor of ``slots`` rows of
``slot_tokens`` tokens each; a step attends over rows ``0 … n-1``, so the holders are kept
**compact**: the ``n`` holders sit in slots ``0 … n-1``. When one leaves, the last holder moves
into its slot (one copy of that sequence's KV), so a step's keys are one strided view of the
pool, with no gather.

A step runs at a **bucket**: ``(rows, tokens)``, the smallest batch size of :data:`BATCH_BUCKETS`
and the smallest token length of :func:`token_buckets` that cover the holders, so that few shapes
exist (one CUDA graph each) and a step reads the KV of its rows up to the longest one, not the
whole pool.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

T = TypeVar("T", bound=Hashable)

#: Batch sizes a pooled step runs at (padded up to the next one).
BATCH_BUCKETS: Final = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
#: The shortest token bucket; longer ones grow by about half each time.
TOKEN_GRANULE: Final = 256


@dataclass(frozen=True, slots=True)
class Move:
    """A holder's KV copied from slot ``src`` to slot ``dst`` (``tokens`` of it), on a release."""

    src: int
    dst: int
    tokens: int


class SlotTable(Generic[T]):
    """Slots ``0 … slots-1``; holders are always the first ``len(self)`` of them."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self._holders: list[T] = []
        self._slot: dict[T, int] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def __contains__(self, holder: object) -> bool:
        return holder in self._slot

    @property
    def holders(self) -> list[T]:
        """The holders in slot order (slot ``i`` holds ``holders[i]``)."""
        return list(self._holders)

    def slot_of(self, holder: T) -> int:
        return self._slot[holder]

    def admit(self, holder: T) -> int | None:
        """The slot ``holder`` now holds (the next free one), or None when every slot is taken."""
        if holder in self._slot:
            raise ValueError("already holds a slot")
        if len(self._holders) >= self.slots:
            return None
        self._slot[holder] = len(self._holders)
        self._holders.append(holder)
        return self._slot[holder]

    def release(self, holder: T, tokens_of_last: int) -> tuple[int, Move | None]:
        """Free ``holder``'s slot: ``(its slot, the move that keeps the holders compact)``; the move
        (None when ``holder`` was last) carries the last holder's ``tokens_of_last`` tokens into it."""
        slot = self._slot.pop(holder)
        last = self._holders.pop()
        if last is holder:
            return slot, None
        self._holders[slot] = last
        self._slot[last] = slot
        return slot, Move(src=len(self._holders), dst=slot, tokens=tokens_of_last)


def batch_bucket(rows: int, *, limit: int) -> int:
    """The batch size a step of ``rows`` runs at (at most ``limit``, the pool's slots)."""
    if not 1 <= rows <= limit:
        raise ValueError(f"rows must be in 1..{limit}, got {rows}")
    return next((b for b in BATCH_BUCKETS if b >= rows and b <= limit), limit)


def token_buckets(slot_tokens: int) -> list[int]:
    """The token lengths a step attends over: 256, 512, 768, 1024, 1536, 2304, … (about 1.5x the
    one before, multiples of the granule) below ``slot_tokens``, and ``slot_tokens`` itself last."""
    out: list[int] = []
    n = TOKEN_GRANULE
    while n < slot_tokens:
        out.append(n)
        n = max(n + TOKEN_GRANULE, (n * 3 // 2) // TOKEN_GRANULE * TOKEN_GRANULE)
    out.append(slot_tokens)
    return out


def token_bucket(tokens: int, *, slot_tokens: int) -> int:
    """The token length a step whose longest row attends over ``tokens`` tokens runs at."""
    if not 1 <= tokens <= slot_tokens:
        raise ValueError(f"tokens must be in 1..{slot_tokens}, got {tokens}")
    return next(b for b in token_buckets(slot_tokens) if b >= tokens)
