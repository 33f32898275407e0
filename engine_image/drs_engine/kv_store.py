"""Context states left on a prefill engine for decode engines to fetch (the ``sim`` KV handoff).

A context-only leg stores what a decode engine needs to continue the sequence under
``ctx_request_id``; the decode engine fetches it once (``GET /v1/disagg/kv/{ctx_request_id}``),
which removes it. Bounded two ways, like a real engine's transfer buffers: at most ``capacity``
states (the oldest is dropped first) and each lives at most ``ttl_seconds`` unfetched.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from drs_protocol.token_ids import decode_token_ids_b64, encode_token_ids_b64


@dataclass(frozen=True, slots=True)
class ContextState:
    """Everything needed to continue a sequence after its context phase."""

    ctx_request_id: int
    prompt_token_ids: list[int]
    first_gen_token: int
    first_gen_logprob: float
    first_gen_top_logprobs: list[tuple[int, float]]
    chain_hex: str
    tail: list[int]
    digest: str
    weights_version: str
    cached_tokens: int

    def to_wire(self) -> dict[str, Any]:
        """JSON body of the KV fetch route (ids as base64 int32, as on the relay)."""
        return {
            "ctx_request_id": self.ctx_request_id,
            "prompt_token_ids_b64": encode_token_ids_b64(self.prompt_token_ids),
            "first_gen_token": self.first_gen_token,
            "first_gen_logprob": self.first_gen_logprob,
            "first_gen_top_logprobs": [[t, lp] for t, lp in self.first_gen_top_logprobs],
            "chain": self.chain_hex,
            "tail": self.tail,
            "digest": self.digest,
            "weights_version": self.weights_version,
            "cached_tokens": self.cached_tokens,
        }

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> ContextState:
        """Inverse of :meth:`to_wire`; raises ``KeyError``/``ValueError``/``TypeError`` on a bad body."""
        return cls(
            ctx_request_id=int(body["ctx_request_id"]),
            prompt_token_ids=decode_token_ids_b64(body["prompt_token_ids_b64"]),
            first_gen_token=int(body["first_gen_token"]),
            first_gen_logprob=float(body["first_gen_logprob"]),
            first_gen_top_logprobs=[(int(t), float(lp)) for t, lp in body["first_gen_top_logprobs"]],
            chain_hex=str(body["chain"]),
            tail=[int(t) for t in body["tail"]],
            digest=str(body["digest"]),
            weights_version=str(body["weights_version"]),
            cached_tokens=int(body["cached_tokens"]),
        )


class _Keyed(Protocol):
    @property
    def ctx_request_id(self) -> int: ...


S = TypeVar("S", bound=_Keyed)


class ContextStore(Generic[S]):
    """Context states by ``ctx_request_id`` (the sim's :class:`ContextState`; the torch backend's KV)."""

    def __init__(
        self,
        *,
        capacity: int,
        ttl_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        on_drop: Callable[[S], None] | None = None,
    ) -> None:
        self.capacity = capacity
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        #: called with each state that leaves unfetched (expired, evicted, cleared), never on take
        self._on_drop = on_drop
        self._items: OrderedDict[int, tuple[float, S]] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def put(self, state: S) -> None:
        self._expire()
        self._items.pop(state.ctx_request_id, None)
        self._items[state.ctx_request_id] = (self._clock() + self.ttl_seconds, state)
        while len(self._items) > self.capacity:
            self._dropped(self._items.popitem(last=False)[1][1])

    def take(self, ctx_request_id: int) -> S | None:
        """Remove and return the state, or ``None`` when it is gone (expired, evicted, fetched, never made)."""
        self._expire()
        entry = self._items.pop(ctx_request_id, None)
        return None if entry is None else entry[1]

    def clear(self) -> int:
        count = len(self._items)
        while self._items:
            self._dropped(self._items.popitem(last=False)[1][1])
        return count

    def _dropped(self, state: S) -> None:
        if self._on_drop is not None:
            self._on_drop(state)

    def _expire(self) -> None:
        now = self._clock()
        while self._items:
            first = next(iter(self._items.values()))
            if first[0] > now:
                break
            self._dropped(self._items.popitem(last=False)[1][1])
