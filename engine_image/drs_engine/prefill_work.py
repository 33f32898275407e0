"""This engine's own prefill work and the prompts it is computing now: what the prefix-held lookup adds.

The frontends of a replica place a new GRPO group by the load of its engines
(``drs_frontend.routing.placement``); when each read only its own memory of what it placed, two
frontends placed one group apart (each saw other siblings, in another order). So the engine
reports its own figures in every lookup answer (``drs_protocol.prefix_lookup.PrefixHeld``), and
every frontend that asks reads the same facts:

* ``recent_work``: the prompt tokens its legs computed in the last
  :data:`~drs_protocol.prefix_lookup.RECENT_WORK_WINDOW_S` seconds, plus what the legs in flight
  are expected to compute (their prompt less what was held, or pending, when they arrived), so a
  group placed a moment ago counts at once and its end changes the figure only by the difference;
  *quoted*: every ask about one prompt within :data:`~drs_protocol.prefix_lookup.WORK_QUOTE_S`
  seconds gets the figure the first ask got (:meth:`PrefillWork.quote`), so two frontends that ask
  about one group while other groups' legs arrive still read the same loads;
* ``pending_blocks``: the leading full blocks of the asked prompt that a leg in flight here, under
  the weights served now, will store when its context phase ends: a sibling that another frontend
  sent here a moment ago, which the cache does not hold yet; or that a claim counted here will.
* *claims* (:meth:`PrefillWork.claim`, ``drs_protocol.prefix_lookup.PrefixClaim``): a frontend
  that placed a new group here counts its work at once, if the recent work stays within the
  claim's limit (checked and counted in one step: the event loop runs nothing between), until a
  leg of that prompt arrives (its expected work replaces the claim's) or
  :data:`~drs_protocol.prefix_lookup.CLAIM_TTL_S`.

And one decision of its own: a leg whose every full block a *context-only* leg in flight here
will store (a sibling that the replica's other frontend sent a moment ago: frontends hold only
their own siblings) waits for that leg's end, at most :data:`FOLLOW_SECONDS`, and then reads the
prompt from the cache; an engine shares no block still being computed (TensorRT-LLM neither), so
both would compute it otherwise. It waits at most one prefill of the prompt longer than it would
have alone. A leg that also generates (context and generation on one engine) is never followed:
its end is its last token, not its prefill, so a sibling would wait out a whole generation.

Kept by the server for every leg that prefills (not generation-only legs), whatever the backend:
bookkeeping only, no I/O.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from drs_protocol.prefix_lookup import CLAIM_TTL_S, RECENT_WORK_WINDOW_S, WORK_QUOTE_S

from drs_engine.prefix_hash import ids_digest

#: Prompts whose quote is kept (the oldest forgotten first).
MAX_QUOTES = 4096
#: Longest a leg waits for the leg in flight whose blocks it would read (the frontends' hold's default).
FOLLOW_SECONDS = 30.0


@dataclass(slots=True, eq=False)
class InFlight:
    """One leg between its arrival and its end."""

    prompt_ids: Sequence[int]
    weights: str
    expected: int  #: prompt tokens it is expected to compute
    #: a context-only leg: its end is its prefill's, so a sibling may wait for it
    followable: bool = True
    #: the leg in flight that will store every full block of this prompt (this one waits for it)
    follows: InFlight | None = None
    done: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)


def common_blocks(a: Sequence[int], b: Sequence[int], tokens_per_block: int) -> int:
    """Leading full blocks of ``tokens_per_block`` ids that ``a`` and ``b`` share."""
    blocks = min(len(a), len(b)) // tokens_per_block
    for i in range(blocks):
        lo = i * tokens_per_block
        if a[lo : lo + tokens_per_block] != b[lo : lo + tokens_per_block]:
            return i
    return blocks


@dataclass(slots=True, frozen=True)
class Claim:
    """A new group placed here by a frontend, before any of its legs arrived."""

    prompt_ids: Sequence[int]
    weights: str
    tokens: int
    until: float  #: the clock's time it lapses unless a leg of its prompt arrives


class PrefillWork:
    def __init__(
        self,
        *,
        window_s: float = RECENT_WORK_WINDOW_S,
        claim_ttl_s: float = CLAIM_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be above 0")
        if claim_ttl_s <= 0:
            raise ValueError("claim_ttl_s must be above 0")
        self._window = window_s
        self._claim_ttl = claim_ttl_s
        self._clock = clock
        self._done: deque[tuple[float, int]] = deque()
        self._done_tokens = 0
        self._in_flight: list[InFlight] = []
        self._claims: list[Claim] = []
        self._quotes: OrderedDict[bytes, tuple[float, int]] = OrderedDict()

    def claim(
        self, prompt_ids: Sequence[int], weights: str, tokens: int, *, limit: int | None, tokens_per_block: int
    ) -> bool:
        """Count ``tokens`` of work for this prompt now, if :meth:`recent_work` with them stays
        within ``limit`` (None: whatever it is); True when counted, or when a claim or a leg in
        flight here already covers every full block of the prompt (a sibling's: counted once)."""
        if tokens < 1:
            raise ValueError("tokens must be at least 1")
        blocks = len(prompt_ids) // tokens_per_block
        self._expire_claims()
        if blocks > 0:
            for ids, other_weights in self._counted():
                if other_weights == weights and common_blocks(prompt_ids, ids, tokens_per_block) == blocks:
                    return True
        if limit is not None and self.recent_work() + tokens > limit:
            return False
        self._claims.append(Claim(list(prompt_ids), weights, tokens, self._clock() + self._claim_ttl))
        return True

    def release(self, prompt_ids: Sequence[int], weights: str) -> int:
        """Drop the claims of exactly this prompt under ``weights`` that no leg has taken (a frontend
        that claimed with its lookup and found the group elsewhere); how many were dropped."""
        ids = list(prompt_ids)
        kept = [c for c in self._claims if c.weights != weights or list(c.prompt_ids) != ids]
        dropped = len(self._claims) - len(kept)
        self._claims = kept
        return dropped

    def _counted(self) -> Iterator[tuple[Sequence[int], str]]:
        """The prompts whose work is counted here ahead of their end: legs in flight and claims."""
        for leg in self._in_flight:
            yield leg.prompt_ids, leg.weights
        for claim in self._claims:
            yield claim.prompt_ids, claim.weights

    def _expire_claims(self) -> None:
        now = self._clock()
        if any(c.until <= now for c in self._claims):
            self._claims = [c for c in self._claims if c.until > now]

    def _take_claims(self, prompt_ids: Sequence[int], weights: str, tokens_per_block: int) -> None:
        """A leg arrived: the claims whose every full block it computes or reads are its own."""
        self._claims = [
            c
            for c in self._claims
            if c.weights != weights
            or common_blocks(prompt_ids, c.prompt_ids, tokens_per_block) < len(c.prompt_ids) // tokens_per_block
        ]

    def start(
        self,
        prompt_ids: Sequence[int],
        weights: str,
        *,
        held_tokens: int,
        tokens_per_block: int,
        followable: bool = True,
    ) -> InFlight:
        """A leg arrived: it is expected to compute its prompt less what the cache holds
        (``held_tokens``) or a leg in flight will store. It follows (waits for) only a
        ``followable`` leg: one that ends when its prefill does."""
        blocks = len(prompt_ids) // tokens_per_block
        follows, most = None, 0
        for other in self._in_flight:
            if other.weights == weights:
                shared = common_blocks(prompt_ids, other.prompt_ids, tokens_per_block)
                most = max(most, shared)
                whole = shared == blocks and shared * tokens_per_block > held_tokens
                if follows is None and whole and other.followable:
                    follows = other
        pending = most * tokens_per_block
        expected = max(0, len(prompt_ids) - max(held_tokens, pending))
        self._take_claims(prompt_ids, weights, tokens_per_block)
        leg = InFlight(prompt_ids, weights, expected, followable, follows)
        self._in_flight.append(leg)
        return leg

    def finish(self, leg: InFlight, computed: int) -> None:
        """The leg ended having computed ``computed`` prompt tokens (idempotent)."""
        if leg.done:
            return
        leg.done = True
        leg.ended.set()
        self._in_flight.remove(leg)
        if computed > 0:
            self._done.append((self._clock(), computed))
            self._done_tokens += computed

    def recent_work(self) -> int:
        """Prompt tokens computed within the window, plus those the legs in flight are expected to,
        plus the claims not yet taken by a leg."""
        horizon = self._clock() - self._window
        while self._done and self._done[0][0] < horizon:
            self._done_tokens -= self._done.popleft()[1]
        self._expire_claims()
        in_flight = sum(leg.expected for leg in self._in_flight)
        return self._done_tokens + in_flight + sum(c.tokens for c in self._claims)

    def quote(self, prompt_ids: Sequence[int], *, ttl_s: float = WORK_QUOTE_S) -> int:
        """:meth:`recent_work` as it stood at the first ask about ``prompt_ids`` within ``ttl_s``."""
        now = self._clock()
        while self._quotes and next(iter(self._quotes.values()))[0] + ttl_s < now:
            self._quotes.popitem(last=False)
        key = ids_digest(prompt_ids)
        quoted = self._quotes.get(key)
        if quoted is not None:
            return quoted[1]
        work = self.recent_work()
        self._quotes[key] = (now, work)
        if len(self._quotes) > MAX_QUOTES:
            self._quotes.popitem(last=False)
        return work

    def pending_blocks(self, prompt_ids: Sequence[int], weights: str, tokens_per_block: int) -> int:
        """Leading full blocks of ``prompt_ids`` that a leg in flight (or a claim) under ``weights`` will store."""
        if tokens_per_block < 1:
            raise ValueError("tokens_per_block must be at least 1")
        self._expire_claims()
        most = 0
        for ids, other_weights in self._counted():
            if other_weights == weights:
                most = max(most, common_blocks(prompt_ids, ids, tokens_per_block))
        return most

    def __len__(self) -> int:
        return len(self._in_flight)
