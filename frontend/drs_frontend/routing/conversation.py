"""The ``conversation`` ctx router: keep a conversation's turns on the prefill engine holding its prefix.

In order:

1. An explicit conversation id seen before goes to its pinned engine (``STICKY``) while that
   engine is a candidate. The pin table is an LRU bounded by ``max_sessions``.
2. An explicit id not seen before (or whose engine is gone: ``REPINNED``) is placed by its
   *opening* (:mod:`.groups`: the tools and the messages before the first assistant message), so
   the siblings of a GRPO group, each its own session, land on one engine: it goes to the first engine in rendezvous order of the opening's key (:mod:`.rendezvous`),
   whatever the load (``GROUP`` where this frontend placed the opening already, else
   ``RENDEZVOUS``). A burst of siblings costs that engine one prefill of the prompt (the relay
   holds siblings until the first one's context leg is done, then they read it from the cache),
   so a hot prompt is one prompt's work wherever its siblings go; what differs between engines is
   how many openings rendezvous gives each, which spreads as the openings do.

   Why later turns find their engine without shared state: every later turn starts with the
   same opening, so a frontend that has no pin for the conversation (restarted, or another
   frontend of the replica) computes the same key and the same rendezvous order and takes the
   same first engine. The placement reads only the request and the replica's prefill pool, never
   this frontend's load (pending work, in-flight counts, groups placed): a load bound would move
   a group on one frontend and not on the next, and a restarted frontend would look for it where
   it is not (bench/grpo.py, M = 4: later-turn affinity 0.953 across a restart with the work
   bound, 1.000 without). Only a change of the pool (an engine gone or added) moves a group.
   Without an opening (completions), rendezvous over the id, with the in-flight and pinned
   sessions bounds of before.
3. No id: the engine that saw the longest prefix of the prompt (block hashes, :mod:`.prefix`,
   tools included) if that prefix is at least ``match_ratio`` of the prompt or covers the
   opening (an earlier turn of this conversation, or a sibling's) and the engine is within the
   in-flight bound; else placed by its opening as in 2; else the least loaded engine.

Every decision pins (1, 2) or records the prompt's blocks (3) at once, so a retry of the same
turn on another engine moves the pin with it. ``groups=False`` is the routing before openings
(rendezvous over the id; no id: prefix match, else least loaded), kept for comparison.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from drs_protocol.frontend_config import (
    DEFAULT_AFFINITY_LOAD_FACTOR,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_PREFIX_BLOCK_TOKENS,
    DEFAULT_PREFIX_MATCH_RATIO,
)

from drs_frontend.routing.balance import LeastLoadedRouter
from drs_frontend.routing.base import Candidate, Decision, Reason, RouteRequest, Sibling
from drs_frontend.routing.groups import Opening, estimate_tokens, message_chars, opening_of
from drs_frontend.routing.prefix import BlockChain, PrefixIndex, chain_from_ids, chain_from_messages, chain_from_text
from drs_frontend.routing.rendezvous import bounded_pick, hrw_order, load_bound, share_bound

DEFAULT_PREFIX_BLOCKS = 262_144


@dataclass(slots=True)
class _Pin:
    url: str
    tokens: int  #: the last turn's prompt tokens (the frontend's ids, else estimated from its text)
    messages: int  #: its messages, and their characters: the next turn counts only what follows
    chars: int


class ConversationRouter:
    def __init__(
        self,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        load_factor: float = DEFAULT_AFFINITY_LOAD_FACTOR,
        match_ratio: float = DEFAULT_PREFIX_MATCH_RATIO,
        block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS,
        prefix_blocks: int = DEFAULT_PREFIX_BLOCKS,
        groups: bool = True,
    ) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if load_factor < 1.0:
            raise ValueError("load_factor must be at least 1")
        self.max_sessions = max_sessions
        self.load_factor = load_factor
        self.match_ratio = match_ratio
        self.block_tokens = block_tokens
        self.groups = groups
        self._pins: OrderedDict[str, _Pin] = OrderedDict()
        self._sessions: dict[str, int] = {}
        self._openings: OrderedDict[str, str] = OrderedDict()  # opening key -> engine (LRU, max_sessions)
        self._groups: dict[str, int] = {}
        self._prefixes = PrefixIndex(prefix_blocks)
        self._fallback = LeastLoadedRouter()

    # -- what the relay calls --------------------------------------------------------------------

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        cid = request.conversation_id
        if cid is not None:
            return self._pick_for_conversation(cid, request, candidates)
        return self._pick_by_prefix(request, candidates)

    def pinned(self, conversation_id: str) -> str | None:
        """The engine a conversation is pinned to (no LRU touch)."""
        pin = self._pins.get(conversation_id)
        return None if pin is None else pin.url

    def sessions_on(self, url: str) -> int:
        return self._sessions.get(url, 0)

    def groups_on(self, url: str) -> int:
        """Openings placed on ``url`` that this router remembers."""
        return self._groups.get(url, 0)

    def group_engine(self, key: str) -> str | None:
        return self._openings.get(key)

    def __len__(self) -> int:
        return len(self._pins)

    # -- explicit conversation id ----------------------------------------------------------------

    def _pick_for_conversation(self, cid: str, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        pin = self._pins.get(cid)
        if pin is not None and any(c.url == pin.url for c in candidates):
            self._pins.move_to_end(cid)
            previous = pin.tokens
            self._measure(pin, request)  # counting only the messages after the last turn's
            return Decision(pin.url, Reason.STICKY, cost=max(1, pin.tokens - previous))
        reason = Reason.RENDEZVOUS if pin is None else Reason.REPINNED
        fresh = _Pin("", 0, 0, 0)
        self._measure(fresh, request)
        opening = self._opening(request)
        if opening is not None:
            decision = self._place_by_opening(opening, request, fresh.tokens, candidates, reason)
        else:
            decision = Decision(self._place_by_id(cid, candidates), reason, cost=fresh.tokens)
        fresh.url = decision.url
        self._pin(cid, fresh)
        return decision

    def _opening(self, request: RouteRequest) -> Opening | None:
        if not self.groups or request.messages is None:
            return None
        return request.opening or opening_of(request.messages, request.tools)

    @staticmethod
    def _measure(pin: _Pin, request: RouteRequest) -> None:
        """The prompt's size: the frontend's ids, else the text (only what follows the pin's messages)."""
        messages = request.messages
        if messages is not None:
            if len(messages) < pin.messages:  # not a continuation: count it all again
                pin.messages = pin.chars = 0
            tools = request.tools if pin.messages == 0 else None
            pin.chars += message_chars(messages[pin.messages :], tools)
            pin.messages = len(messages)
        else:
            pin.chars = len(request.prompt or "")
        pin.tokens = len(request.prompt_ids) if request.prompt_ids is not None else estimate_tokens(pin.chars)

    def _place_by_id(self, cid: str, candidates: Sequence[Candidate]) -> str:
        in_flight = {c.url: c.in_flight for c in candidates}
        order = hrw_order(cid, list(in_flight))
        n, c = len(order), self.load_factor
        sessions = share_bound(sum(self.sessions_on(u) for u in order), n, c) - 1  # counted before this one
        limits = [
            (in_flight.__getitem__, float(load_bound(sum(in_flight.values()), n, c))),
            (self.sessions_on, sessions),
        ]
        return bounded_pick(order, limits)

    def _pin(self, cid: str, pin: _Pin) -> None:
        old = self._pins.pop(cid, None)
        if old is not None:
            self._sessions[old.url] -= 1
        self._pins[cid] = pin
        self._sessions[pin.url] = self._sessions.get(pin.url, 0) + 1
        while len(self._pins) > self.max_sessions:
            _, evicted = self._pins.popitem(last=False)
            self._sessions[evicted.url] -= 1

    # -- by opening ------------------------------------------------------------------------------

    def _place_by_opening(
        self, opening: Opening, request: RouteRequest, size: int, candidates: Sequence[Candidate], reason: Reason
    ) -> Decision:
        """The first engine in rendezvous order of the opening's key, whatever the load: the one
        rule a restarted frontend, or another frontend of the replica, applies to a later turn."""
        urls = [c.url for c in candidates]
        known = self._openings.get(opening.key)
        url = hrw_order(opening.key, urls)[0]
        held = size - 1 if opening.first_turn else min(size - 1, size * opening.chars // self._chars(request))
        cost = max(1, size - held) if url == known else size
        sibling = None
        if opening.first_turn and reason in (Reason.RENDEZVOUS, Reason.GROUP):
            # apart: the pool changed since the group was placed (its engine gone, or one added first)
            sibling = Sibling.FIRST if known is None else Sibling.WITH_GROUP if url == known else Sibling.APART
        if url != known:
            self._record_opening(opening.key, url)
        else:
            reason = Reason.GROUP
        return Decision(url, reason, cost=cost, sibling=sibling)

    def _record_opening(self, key: str, url: str) -> None:
        old = self._openings.pop(key, None)
        if old is not None:
            self._groups[old] -= 1
        self._openings[key] = url
        self._groups[url] = self._groups.get(url, 0) + 1
        while len(self._openings) > self.max_sessions:
            _, evicted = self._openings.popitem(last=False)
            self._groups[evicted] -= 1

    def _size(self, request: RouteRequest) -> int:
        """The prompt's tokens: the frontend's ids, else estimated from the text."""
        if request.prompt_ids is not None:
            return max(1, len(request.prompt_ids))
        return estimate_tokens(self._chars(request))

    @staticmethod
    def _chars(request: RouteRequest) -> int:
        if request.messages is not None:
            return max(1, message_chars(request.messages, request.tools))
        return max(1, len(request.prompt or ""))

    # -- no id: prefix, else opening, else least loaded ------------------------------------------

    def _pick_by_prefix(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        chain = self._chain(request)
        opening = self._opening(request)
        size = self._size(request)
        if chain is not None:
            match = self._prefixes.longest_match(chain)
            if match is not None and (match.ratio >= self.match_ratio or self._covers(match.ratio, request, opening)):
                loads = {c.url: c.in_flight for c in candidates}
                load = loads.get(match.url)
                if load is not None and load <= load_bound(sum(loads.values()), len(loads), self.load_factor):
                    self._prefixes.record(chain, match.url)
                    return Decision(match.url, Reason.PREFIX, cost=max(1, round(size * (1 - match.ratio))))
        if opening is not None:
            decision = self._place_by_opening(opening, request, size, candidates, Reason.RENDEZVOUS)
        else:
            decision = self._fallback.pick(candidates)
            decision = Decision(decision.url, decision.reason, cost=size)
        if chain is not None:
            self._prefixes.record(chain, decision.url)
        return decision

    def _covers(self, ratio: float, request: RouteRequest, opening: Opening | None) -> bool:
        """The matched prefix holds at least the opening (an earlier turn's, or a sibling's prompt)."""
        return opening is not None and ratio >= opening.chars / self._chars(request) - 1e-9

    def _chain(self, request: RouteRequest) -> BlockChain | None:
        if request.prompt_ids is not None:
            return chain_from_ids(request.prompt_ids, self.block_tokens)
        if request.messages is not None:
            return chain_from_messages(request.messages, request.tools)
        if request.prompt is not None:
            return chain_from_text(request.prompt)
        return None
