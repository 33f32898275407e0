"""Step 4's lookup on a routing miss: ask prefill engines what their prefix caches hold of an opening.

The ctx router names the engines (:meth:`.routing.ConversationRouter.lookup_targets`: the first
``groupLookupEngines`` in rendezvous order of the opening's key) only when it knows neither the
conversation nor its opening; :meth:`PrefixLookup.ask` posts the turn's token ids where this
frontend tokenized (they start with the opening's; the engine renders nothing), else the opening's
messages (and tools), to each at once (``drs_protocol.prefix_lookup``, the serving token as every
leg) and returns the answers that came within ``timeouts.prefixLookup``: what each holds, will hold
once its legs in flight end, and its own recent prefill work. Concurrent misses of one prompt (the
siblings of a new group reaching this frontend together) share one lookup. An engine that is unreachable, slow, refuses
(a backend that cannot say: 501) or answers something else is left out: no answer at all sends
the turn by the load-free rule. ``drs_frontend_group_lookups_total{outcome}`` counts lookups:
``found`` (an engine holds a prefix), ``none`` (answers, nothing held), ``unanswered``.

:meth:`PrefixLookup.claim` then counts a new group's placement on the engine the walk chose
(``drs_protocol.prefix_lookup.PrefixClaim``); ``drs_frontend_group_claims_total{outcome}``:
``claimed``, ``refused`` (over the bound there by now: the relay walks on with the live figure),
``unanswered`` (no answer, or an engine from before claims: the placement stands).

An engine that answers 501 (its backend cannot say what it holds: ``trtllm``) is not asked again
for :data:`~drs_protocol.prefix_lookup.CANNOT_ANSWER_S` (it counts as no answer, at no round trip),
so a fleet of such engines pays the lookup once, not on every new conversation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from drs_protocol import routes
from drs_protocol.errors import NotSupportedError
from drs_protocol.prefix_lookup import CANNOT_ANSWER_S, PrefixClaim, PrefixHeld, PrefixHeldRequest
from pydantic import ValidationError

from drs_frontend import wire_json
from drs_frontend.errors import UpstreamError
from drs_frontend.metrics import FrontendMetrics
from drs_frontend.routing import Claim, CtxRouter, RouteRequest
from drs_frontend.routing.groups import opening_messages
from drs_frontend.routing.placement import ReportedWork
from drs_frontend.upstream import UpstreamClient

log = logging.getLogger(__name__)

#: Engines remembered as unable to answer (beyond it, the memory starts over: asked once more each).
MAX_CANNOT = 1024


class PrefixLookup:
    def __init__(
        self, upstream: UpstreamClient, metrics: FrontendMetrics, *, timeout: float, ahead: bool = False
    ) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.timeout = timeout
        self._in_flight: dict[tuple[bytes, tuple[str, ...]], asyncio.Future[dict[str, PrefixHeld]]] = {}
        #: the engines' figures from earlier answers: a new group's claim goes with its lookup when known
        self.reported = ReportedWork()
        #: claim the placement with the lookup (one round trip); False, the default: lookup, then claim.
        #: Off: measured no faster than lookup-then-claim (docs/grpo-routing.md, 2026-12-06); bench/grpo.py's
        #: ``ahead`` mode turns it on
        self.ahead = ahead
        self._releases: set[asyncio.Task[PrefixHeld | None]] = set()
        #: engine URL -> until when (monotonic) it is not asked: it answered 501, it cannot say
        self._cannot: dict[str, float] = {}

    async def ask(self, urls: list[str], route: RouteRequest, *, live: bool = False) -> dict[str, PrefixHeld]:
        """What each of ``urls`` holds of the opening of ``route``'s messages (those that answered)."""
        if route.messages is None:
            return {}
        urls = [url for url in urls if self._may_answer(url)]
        if not urls:  # every engine asked cannot say (501 lately): no body built, no round trip
            self.metrics.group_lookups_of("unanswered").inc()
            return {}
        body = self._body(route, route.messages, live=live)
        key = (body, tuple(urls))
        shared = self._in_flight.get(key)
        if shared is not None:
            return await asyncio.shield(shared)
        future: asyncio.Future[dict[str, PrefixHeld]] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        held: dict[str, PrefixHeld] = {}
        try:
            held = await self._ask_all(urls, body)
            self._note(held)
        finally:  # an asker cancelled (its client left) leaves the others no answer: the load-free rule
            del self._in_flight[key]
            future.set_result(held)
        return held

    async def place(self, router: CtxRouter, route: RouteRequest, asked: list[str]) -> RouteRequest:
        """The turn with the answers of ``asked`` (:meth:`ask`), and a new group's placement
        claimed on the engine the router's walk chose (:meth:`claim`: counted there if its work
        stays within the claim's limit). A refusal brings that engine's live work and the walk goes
        on with every engine's live work (asked again, ``live``), once per engine asked, and then
        claims where it ends whatever the limit; the router's
        ``pick`` then reads the same figures, so it places the group where the claim counted it.
        ``drs_frontend_group_placement_seconds`` observes the whole. The engines are asked
        ``live`` (their work now, not the quote: the replica's other frontend agrees through the
        claim, which its own lookup sees as pending, or which counts its sibling's claim once).

        One round trip where this frontend has every asked engine's figure from earlier answers
        (``ahead``; off by default, measured no faster): the claim the walk makes over those figures goes *with* the
        lookup (:meth:`_place_ahead`); only where it does not stand does the placement go on as
        above."""
        started = time.perf_counter()
        ahead = router.claim_ahead(route, asked, self.reported.figures()) if self.ahead else None
        if ahead is not None:
            route, done = await self._place_ahead(router, route, asked, ahead)
        else:
            with self._phase("lookup"):
                route = dataclasses.replace(route, held=await self.ask(asked, route, live=True))
            done = False
        for attempt in range(0 if done else len(asked) + 1):
            claim = router.claim_target(route, asked)
            if claim is None:
                break
            if attempt == len(asked):  # refused by every engine once: counted where the walk ends now
                claim = dataclasses.replace(claim, limit=None)
            with self._phase("claim"):
                answer = await self.claim(claim.url, route, claim)
            if answer is None or answer.claimed:
                break
            with self._phase("reask"):
                live = await self._ask_all(asked, self._body(route, route.messages or [], live=True), count=False)
            self._note(live)
            route = dataclasses.replace(route, held={**(route.held or {}), **live, claim.url: answer})
        self.metrics.group_placement_seconds.observe(time.perf_counter() - started)
        return route

    async def _place_ahead(
        self, router: CtxRouter, route: RouteRequest, asked: list[str], claim: Claim
    ) -> tuple[RouteRequest, bool]:
        """One round trip: the lookup to every engine asked (``live``), the claim with it to
        ``claim.url``. The turn with the answers, and whether it is placed: where the claim counted
        it when it stands (:meth:`.routing.ConversationRouter.claim_kept`: nobody holds the group,
        the engine within the bound by the live figures), or following a holder the answers found.
        A claim counted that does not stand is taken back (off the turn's path) and left out of the
        figures; then, as after a refusal, the caller's claim loop walks on over the live answers
        (no second lookup)."""
        lookup = self._body(route, route.messages or [], live=True)
        with_claim = self._body(
            route, route.messages or [], PrefixClaim(tokens=claim.tokens, limit=claim.limit), live=True
        )
        with self._phase("lookup_claim"):
            answers = await asyncio.gather(
                *(self._ask_one(url, with_claim if url == claim.url else lookup) for url in asked)
            )
        held = {url: a for url, a in zip(asked, answers, strict=True) if a is not None}
        outcome = "unanswered" if not held else "found" if any(a.held_blocks for a in held.values()) else "none"
        self.metrics.group_lookups_of(outcome).inc()
        answer = held.get(claim.url)
        claimed = None if answer is None else answer.claimed
        self.metrics.group_claims_of("unanswered" if claimed is None else "claimed" if claimed else "refused").inc()
        if answer is not None and claimed and answer.recent_work is not None:
            kept = router.claim_kept(dataclasses.replace(route, held=held), claim.url, asked)
            if kept:
                self._note(held)
                return dataclasses.replace(route, held=held, claimed=claim.url), True
            if not answer.will_cover:  # counted by this claim (else a sibling's claim or leg there already was)
                self._spawn_release(claim.url, route)  # the group is held or in flight elsewhere
                held[claim.url] = answer.model_copy(update={"recent_work": answer.recent_work - claim.tokens})
        self._note(held)
        return dataclasses.replace(route, held=held), claimed is None

    def _note(self, answers: dict[str, PrefixHeld]) -> None:
        """Keep the engines' figures of ``answers`` for the next claim ahead (only read with ``ahead``
        on: off, the default, nothing is kept)."""
        if self.ahead:
            self.reported.update(answers)

    def _spawn_release(self, url: str, route: RouteRequest) -> None:
        self.metrics.group_claims_of("taken_back").inc()
        body = self._body(route, route.messages or [], release=True)
        task = asyncio.get_running_loop().create_task(self._ask_one(url, body))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    @contextlib.contextmanager
    def _phase(self, phase: str) -> Iterator[None]:
        """``drs_frontend_group_round_trip_seconds{phase}``: one round trip of a placement."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.metrics.group_round_trip_seconds.labels(phase=phase).observe(time.perf_counter() - started)

    async def claim(self, url: str, route: RouteRequest, claim: Claim) -> PrefixHeld | None:
        """Count a new group's placement on ``url`` now (``drs_protocol.prefix_lookup.PrefixClaim``):
        its answer (``claimed``, the live ``recent_work``), or None (no answer within
        ``timeouts.prefixLookup``, or an engine from before claims: the placement stands unclaimed)."""
        if route.messages is None:
            return None
        body = self._body(route, route.messages, PrefixClaim(tokens=claim.tokens, limit=claim.limit))
        answer = await self._ask_one(url, body)
        if answer is not None:
            self._note({url: answer})
        outcome = (
            "unanswered" if answer is None or answer.claimed is None else "claimed" if answer.claimed else "refused"
        )
        self.metrics.group_claims_of(outcome).inc()
        return answer if answer is not None and answer.claimed is not None else None

    @staticmethod
    def _body(
        route: RouteRequest,
        messages: Sequence[Mapping[str, Any]],
        claim: PrefixClaim | None = None,
        *,
        live: bool = False,
        release: bool = False,
    ) -> bytes:
        """A turn this frontend tokenized: its ids, which start with the opening's (the engine
        renders nothing; a first turn's lookup is on a new group's critical path, and its siblings'
        identical ids share one lookup); else the opening's messages and tools, which the engine
        renders."""
        if route.prompt_ids:
            ids = list(route.prompt_ids)
            PrefixHeldRequest(prompt_token_ids=ids, claim=claim, live=live, release=release)  # fails here
            return wire_json.dumps({"prompt_token_ids": ids, **_extra_fields(claim, live, release)})
        opening_ = [dict(m) for m in opening_messages(messages)]
        tools = route.tools if isinstance(route.tools, list) and route.tools else None
        request = PrefixHeldRequest(
            messages=opening_, tools=tools, claim=claim, live=live, release=release
        )  # fails here, not on the engine
        fields = {"messages": request.messages, **({"tools": tools} if tools else {})}
        return wire_json.dumps({**fields, **_extra_fields(claim, live, release)})

    async def _ask_all(self, urls: list[str], body: bytes, *, count: bool = True) -> dict[str, PrefixHeld]:
        held: dict[str, PrefixHeld] = {}
        answers = await asyncio.gather(*(self._ask_one(url, body) for url in urls))
        for url, answer in zip(urls, answers, strict=True):
            if answer is not None:
                held[url] = answer
        if not count:
            return held
        outcome = "unanswered" if not held else "found" if any(a.held_blocks for a in held.values()) else "none"
        self.metrics.group_lookups_of(outcome).inc()
        return held

    def _may_answer(self, url: str) -> bool:
        """False while ``url`` is remembered as unable to say what it holds (it answered 501)."""
        until = self._cannot.get(url)
        if until is None:
            return True
        if time.monotonic() < until:
            return False
        del self._cannot[url]
        return True

    async def _ask_one(self, url: str, body: bytes) -> PrefixHeld | None:
        if not self._may_answer(url):
            return None
        try:
            response = await asyncio.wait_for(
                self.upstream.post_json(url + routes.PREFIX_HELD, body, self.timeout), self.timeout
            )
        except (UpstreamError, TimeoutError) as exc:
            log.debug("prefix lookup on %s: no answer (%s)", url, exc)
            return None
        if response.status != 200:
            log.debug("prefix lookup on %s: %d", url, response.status)
            if response.status == NotSupportedError.status:  # its backend cannot say (trtllm): not asked for a while
                if len(self._cannot) >= MAX_CANNOT:
                    self._cannot.clear()
                self._cannot[url] = time.monotonic() + CANNOT_ANSWER_S
            return None
        try:
            return PrefixHeld.model_validate_json(response.body)
        except ValidationError:
            log.warning("prefix lookup on %s: an answer that is not a PrefixHeld", url)
            return None


def _extra_fields(claim: PrefixClaim | None, live: bool, release: bool = False) -> dict[str, Any]:
    """Only what is set: an engine from before claims refuses either field (400: no answer)."""
    out: dict[str, Any] = {} if claim is None else {"claim": claim.model_dump(mode="json")}
    if live:
        out["live"] = True
    if release:
        out["release"] = True
    return out
