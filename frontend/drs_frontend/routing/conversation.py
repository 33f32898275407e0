"""The ``conversation`` ctx router: keep a conversation's turns on the prefill engine holding its prefix.

In order:

1. An explicit conversation id seen before goes to its pinned engine (``STICKY``) while that
   engine is a candidate. The pin table is an LRU bounded by ``max_sessions``.
2. An explicit id not seen before (or whose engine is gone: ``REPINNED``) is placed by its
   *opening* (:mod:`.groups`: the tools and the messages before the first assistant message), so
   the siblings of a GRPO group, each its own session, land on one engine, and the relay holds
   siblings until the first one's context leg is done, so they read the prompt from the cache:

   * an opening this frontend placed (or found) already goes to that engine (``GROUP``);
   * else, with ``lookup_engines`` > 0, the relay first asks the first ``lookup_engines`` engines
     in rendezvous order of the opening's key what their prefix caches hold of the opening, or
     will hold once their legs in flight end (:meth:`lookup_targets`,
     ``drs_protocol.prefix_lookup``), and the turn goes to the engine holding the longest prefix
     (``LOOKUP``; a first turn only to one holding all of it: a sibling placed by the replica's
     other frontend a moment ago, or before a restart);
   * else a first turn (a new group) takes the first of those engines whose recent prefill work
     is within ``c`` times the mean (:func:`.placement.bounded_walk`: ``RENDEZVOUS``), the work
     each engine reported in its answer (so every frontend that asks walks with the same loads),
     else this frontend's memory; a later turn whose group no engine holds the first engine in
     the order (``RENDEZVOUS``);
   * ``lookup_engines`` = 0: the first engine in rendezvous order, whatever the load (the rule
     before the lookup, kept for comparison).

   Why later turns find their engine without shared state: the walk reads this frontend's memory,
   so another frontend may not place the group where this one did; but a frontend that knows
   neither the conversation nor its opening (restarted, or the replica's other frontend) asks the
   same engines the walk chooses from, and the one that holds the opening is where its
   conversations' turns were computed. No answer (every engine asked timed out or refused):
   the first engine in the order, the load-free rule. Without an opening (completions),
   rendezvous over the id, with the in-flight and pinned sessions bounds of before.
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from drs_protocol.frontend_config import (
    DEFAULT_AFFINITY_LOAD_FACTOR,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_PREFIX_BLOCK_TOKENS,
    DEFAULT_PREFIX_MATCH_RATIO,
)
from drs_protocol.prefix_lookup import DEFAULT_LOOKUP_ENGINES

from drs_frontend.routing.balance import LeastLoadedRouter
from drs_frontend.routing.base import Candidate, Claim, Decision, Reason, RouteRequest, Sibling
from drs_frontend.routing.groups import Opening, estimate_tokens, message_chars, opening_of
from drs_frontend.routing.placement import (
    RecentWork,
    bounded_choice,
    bounded_walk,
    found_engine,
    reported_work,
)
from drs_frontend.routing.prefix import (
    BlockChain,
    PrefixIndex,
    PrefixMatch,
    chain_from_ids,
    chain_from_messages,
    chain_from_text,
)
from drs_frontend.routing.rendezvous import bounded_pick, hrw_order, load_bound, share_bound

DEFAULT_PREFIX_BLOCKS = 262_144
#: Openings whose prompt tokens make up an engine's recent work (the load the placement bounds).
RECENT_OPENINGS = 256


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
        lookup_engines: int = DEFAULT_LOOKUP_ENGINES,
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
        if lookup_engines < 0:
            raise ValueError("lookup_engines must be at least 0")
        self.lookup_engines = lookup_engines if groups else 0
        self._recent = RecentWork(RECENT_OPENINGS)
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

    @property
    def looks_up(self) -> bool:
        """Whether :meth:`lookup_targets` can name any engine (``lookup_engines`` > 0)."""
        return self.lookup_engines > 0

    def lookup_targets(self, request: RouteRequest, urls: Sequence[str]) -> list[str]:
        """The engines to ask what they hold of this turn's opening before :meth:`pick` (in
        rendezvous order of its key): only on a routing miss, i.e. neither the conversation (or,
        without an id, a prefix this router would follow) nor its opening is known here; else []."""
        if self.lookup_engines == 0 or not urls:
            return []
        cid = request.conversation_id
        if cid is not None:
            pin = self._pins.get(cid)
            if pin is not None and pin.url in urls:
                return []
        opening = self._opening(request)
        if opening is None or self._openings.get(opening.key) in urls:
            return []
        if cid is None and self._follows_prefix(request, opening) is not None:
            return []
        return hrw_order(opening.key, urls)[: self.lookup_engines]

    def claim_target(self, request: RouteRequest, urls: Sequence[str]) -> Claim | None:
        """Where :meth:`pick` will place a new group from the lookup's answers (``request.held``),
        with the prompt's tokens and the walk's bound: the claim the relay posts there first, so
        the engine counts the placement at once (``drs_protocol.prefix_lookup.PrefixClaim``).
        None when the turn is not a new group's first turn placed by the walk over the engines'
        reported work (pinned, a known or found opening, the lookup off, an engine that did not
        report): nothing to claim."""
        if request.held is None:
            return None
        order = self._new_group_order(request, urls)
        if order is None or found_engine(order, request.held, whole=True) is not None:
            return None
        asked = order[: self.lookup_engines]
        reported = reported_work(asked, request.held)
        return None if reported is None else self._claim(request, asked, reported)

    def claim_ahead(self, request: RouteRequest, urls: Sequence[str], work: Mapping[str, int]) -> Claim | None:
        """The claim to send *with* the lookup (one round trip), when the walk over ``work``, the
        engines' figures from earlier answers (:class:`.placement.ReportedWork`), leaves the group on
        the opening's first engine in rendezvous order (the one every frontend of the replica names
        without any figures, so two frontends that see a group's siblings at once claim alike; the
        engine counts the second as the first's sibling, once), with the walk's limit: the engine
        refuses if other groups' work took the room since those figures (a refusal, as after any,
        and the relay walks on over the live figures the same round trip brought). None where the
        walk would move the group, where :meth:`claim_target` would name none, or an engine asked
        has no figure: then the lookup comes first and the claim after it, as before."""
        order = self._new_group_order(request, urls)
        if order is None:
            return None
        asked = order[: self.lookup_engines]
        if any(u not in work for u in asked):
            return None
        claim = self._claim(request, asked, work)
        return claim if claim.url == asked[0] else None

    def claim_kept(self, request: RouteRequest, claimed: str, urls: Sequence[str]) -> bool:
        """Whether a claim sent with the lookup, and counted, stands given the answers
        (``request.held``, the claimed engine's pending blocks as they stood before the claim): it
        does unless an engine holds the group or has it in flight (the replica's other frontend
        placed it a moment ago: :meth:`pick` follows that engine, and the relay takes the claim
        back). The bound needs no second look: the engine counted the claim only within the limit
        the walk gave it, a bound over figures no larger than the live ones (recent work within a
        window only grows between two answers but for what ages out of it)."""
        order = self._new_group_order(request, urls)
        if order is None or request.held is None or claimed not in urls:
            return False
        return found_engine(order, request.held, whole=True) is None

    def _new_group_order(self, request: RouteRequest, urls: Sequence[str]) -> list[str] | None:
        """The opening's rendezvous order when the turn is a new group's first turn that this router
        places by the walk (lookup on, not pinned, opening unknown here, no prefix followed); else None."""
        if self.lookup_engines == 0 or not urls:
            return None
        cid = request.conversation_id
        pin = self._pins.get(cid) if cid is not None else None
        opening = self._opening(request)
        if (pin is not None and pin.url in urls) or opening is None or not opening.first_turn:
            return None
        if self._openings.get(opening.key) in urls:
            return None
        if cid is None and self._follows_prefix(request, opening) is not None:
            return None
        return hrw_order(opening.key, urls)

    def _claim(self, request: RouteRequest, asked: Sequence[str], work: Mapping[str, int]) -> Claim:
        size = self._size(request)
        url, limit = bounded_choice(asked, asked, lambda u: work[u], size, self.load_factor, len(asked))
        return Claim(url, size, limit)

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
        """Where the opening's group is, else where a new group goes (the module's step 2)."""
        urls = [c.url for c in candidates]
        known = self._openings.get(opening.key)
        order = hrw_order(opening.key, urls)
        tokens = size if opening.first_turn else max(1, size * opening.chars // self._chars(request))
        placed = Sibling.FIRST
        if self.lookup_engines == 0:  # the load-free rule
            url = order[0]
        elif known in urls:
            url = known
        elif (found := found_engine(order, request.held or {}, whole=opening.first_turn)) is not None:
            url, reason, placed = found, Reason.LOOKUP, Sibling.FOUND
        elif opening.first_turn and request.claimed in urls:  # counted there with the lookup, within the bound
            url = request.claimed
            placed = Sibling.FIRST if url == order[0] else Sibling.MOVED
        elif opening.first_turn:
            url = self._walk(order, urls, request, size)
            placed = Sibling.FIRST if url == order[0] else Sibling.MOVED
        else:  # a later turn that no engine asked holds (or none answered): the load-free rule
            url = order[0]
        held = tokens - 1 if opening.first_turn else min(size - 1, tokens)
        cost = max(1, size - held) if url == known or reason is Reason.LOOKUP else size
        sibling = None
        if opening.first_turn and reason in (Reason.RENDEZVOUS, Reason.GROUP, Reason.LOOKUP):
            # apart: the pool changed since the group was placed (its engine gone, or one added first)
            sibling = placed if known is None else Sibling.WITH_GROUP if url == known else Sibling.APART
        if url != known:
            self._record_opening(opening.key, url)
            self._recent.add(url, tokens)
        else:
            reason = Reason.GROUP
        return Decision(url, reason, cost=cost, sibling=sibling)

    def _walk(self, order: Sequence[str], urls: Sequence[str], request: RouteRequest, size: int) -> str:
        """A new group's engine: the bounded walk over the engines' own recent work when every
        engine asked reported it (the replica's frontends then read the same loads), else over
        this frontend's memory of what it placed."""
        asked = order[: self.lookup_engines]
        reported = reported_work(asked, request.held or {})
        if reported is not None:
            return bounded_walk(asked, asked, lambda u: reported[u], size, self.load_factor, len(asked))
        return bounded_walk(order, urls, self._recent, size, self.load_factor, self.lookup_engines)

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
        match = self._follows_prefix(request, opening, chain)
        if match is not None:
            loads = {c.url: c.in_flight for c in candidates}
            load = loads.get(match.url)
            if load is not None and load <= load_bound(sum(loads.values()), len(loads), self.load_factor):
                if chain is not None:
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

    def _follows_prefix(
        self, request: RouteRequest, opening: Opening | None, chain: BlockChain | None = None
    ) -> PrefixMatch | None:
        """The engine that saw the longest prefix of the prompt, if that prefix is long enough to
        follow (``match_ratio`` of the prompt, or the opening); the in-flight bound is the caller's."""
        chain = chain if chain is not None else self._chain(request)
        if chain is None:
            return None
        match = self._prefixes.longest_match(chain)
        if match is not None and (match.ratio >= self.match_ratio or self._covers(match.ratio, request, opening)):
            return match
        return None

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
