"""The ``conversation`` ctx router: keep a conversation's turns on the prefill engine holding its prefix.

In order:

1. An explicit conversation id seen before goes to its pinned engine (``STICKY``) while that
   engine is a candidate. The pin table is an LRU bounded by ``max_sessions``.
2. An explicit id not seen before (or whose engine is gone: ``REPINNED``) goes to the first engine
   in rendezvous order of the id (:mod:`.rendezvous`) whose in-flight requests are within
   ``ceil(c * mean)`` and whose pinned sessions, counting this one, stay within ``c * mean``
   (so pinned sessions end within ``c`` of their mean). Without the bound this is a pure function of the
   id and the replica's prefill pool, so a restarted frontend, or a second frontend of the same
   replica, picks the engine that already holds the conversation; the bound moves a new
   conversation off an engine only when that engine is running well above the mean.
3. No id: the engine that saw the longest prefix of the prompt (block hashes, :mod:`.prefix`)
   if that prefix is at least ``match_ratio`` of the prompt and the engine is within the bound.
4. Else the least loaded engine (``LEAST_LOADED``), ties in turn.

Every decision pins (1, 2) or records the prompt's blocks (3, 4) at once, so a retry of the same
turn on another engine moves the pin with it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from drs_protocol.frontend_config import (
    DEFAULT_AFFINITY_LOAD_FACTOR,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_PREFIX_BLOCK_TOKENS,
    DEFAULT_PREFIX_MATCH_RATIO,
)

from drs_frontend.routing.balance import LeastLoadedRouter
from drs_frontend.routing.base import Candidate, Decision, Reason, RouteRequest
from drs_frontend.routing.prefix import BlockChain, PrefixIndex, chain_from_ids, chain_from_messages, chain_from_text
from drs_frontend.routing.rendezvous import bounded_pick, hrw_order, load_bound, share_bound

DEFAULT_PREFIX_BLOCKS = 262_144


class ConversationRouter:
    def __init__(
        self,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        load_factor: float = DEFAULT_AFFINITY_LOAD_FACTOR,
        match_ratio: float = DEFAULT_PREFIX_MATCH_RATIO,
        block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS,
        prefix_blocks: int = DEFAULT_PREFIX_BLOCKS,
    ) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if load_factor < 1.0:
            raise ValueError("load_factor must be at least 1")
        self.max_sessions = max_sessions
        self.load_factor = load_factor
        self.match_ratio = match_ratio
        self.block_tokens = block_tokens
        self._pins: OrderedDict[str, str] = OrderedDict()
        self._sessions: dict[str, int] = {}
        self._prefixes = PrefixIndex(prefix_blocks)
        self._fallback = LeastLoadedRouter()

    # -- what the relay calls --------------------------------------------------------------------

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        cid = request.conversation_id
        if cid is not None:
            return self._pick_for_conversation(cid, candidates)
        return self._pick_by_prefix(request, candidates)

    def pinned(self, conversation_id: str) -> str | None:
        """The engine a conversation is pinned to (no LRU touch)."""
        return self._pins.get(conversation_id)

    def sessions_on(self, url: str) -> int:
        return self._sessions.get(url, 0)

    def __len__(self) -> int:
        return len(self._pins)

    # -- explicit conversation id ----------------------------------------------------------------

    def _pick_for_conversation(self, cid: str, candidates: Sequence[Candidate]) -> Decision:
        pinned = self._pins.get(cid)
        if pinned is not None:
            if any(c.url == pinned for c in candidates):
                self._pins.move_to_end(cid)
                return Decision(pinned, Reason.STICKY)
            reason = Reason.REPINNED
        else:
            reason = Reason.RENDEZVOUS
        in_flight = {c.url: c.in_flight for c in candidates}
        order = hrw_order(cid, list(in_flight))
        n, c = len(order), self.load_factor
        sessions = share_bound(sum(self.sessions_on(u) for u in order), n, c) - 1  # counted before this one
        limits = [
            (in_flight.__getitem__, float(load_bound(sum(in_flight.values()), n, c))),
            (self.sessions_on, sessions),
        ]
        url = bounded_pick(order, limits)
        self._pin(cid, url)
        return Decision(url, reason)

    def _pin(self, cid: str, url: str) -> None:
        old = self._pins.pop(cid, None)
        if old is not None:
            self._sessions[old] -= 1
        self._pins[cid] = url
        self._sessions[url] = self._sessions.get(url, 0) + 1
        while len(self._pins) > self.max_sessions:
            _, evicted = self._pins.popitem(last=False)
            self._sessions[evicted] -= 1

    # -- no id: prefix, else least loaded --------------------------------------------------------

    def _pick_by_prefix(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        chain = self._chain(request)
        if chain is not None:
            match = self._prefixes.longest_match(chain)
            if match is not None and match.ratio >= self.match_ratio:
                loads = {c.url: c.in_flight for c in candidates}
                load = loads.get(match.url)
                if load is not None and load <= load_bound(sum(loads.values()), len(loads), self.load_factor):
                    self._prefixes.record(chain, match.url)
                    return Decision(match.url, Reason.PREFIX)
        decision = self._fallback.pick(candidates)
        if chain is not None:
            self._prefixes.record(chain, decision.url)
        return decision

    def _chain(self, request: RouteRequest) -> BlockChain | None:
        if request.prompt_ids is not None:
            return chain_from_ids(request.prompt_ids, self.block_tokens)
        if request.messages is not None:
            return chain_from_messages(request.messages)
        if request.prompt is not None:
            return chain_from_text(request.prompt)
        return None
