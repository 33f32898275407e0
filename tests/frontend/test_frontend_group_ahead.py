"""A new group's claim sent with its lookup (one round trip): the rule, and the relay's loop over real bookkeeping.

:meth:`ConversationRouter.claim_ahead` names the claim from the engines' figures of earlier answers;
the engine counts it (within its limit) while answering the lookup, its ``pending_blocks`` as they
stood before the claim; :meth:`ConversationRouter.claim_kept` says whether it stands (nobody holds
the group), else :meth:`PrefixLookup.place` takes it back and follows the holder.
Here the engines are a double of the prefix-held route (``BookkeepingEngines``: no cache, the real
``PrefillWork`` bookkeeping the engine's server keeps, answered in the order the server answers),
and the loop is the frontend's own (``PrefixLookup.place``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, cast

from drs_engine.prefill_work import PrefillWork
from drs_frontend.lookup import PrefixLookup
from drs_frontend.metrics import FrontendMetrics
from drs_frontend.routing import Candidate, ConversationRouter, RouteRequest
from drs_frontend.routing.groups import opening_of
from drs_frontend.routing.placement import work_bound
from drs_frontend.routing.rendezvous import hrw_order
from drs_frontend.upstream import UpstreamClient
from drs_frontend.upstream.base import UpstreamResponse
from drs_protocol import routes
from drs_protocol.prefix_lookup import PrefixHeld, PrefixHeldRequest
from hypothesis import given, settings
from hypothesis import strategies as st

from .groups import BLOCK, FACTOR, group, pool


class BookkeepingEngines:
    """A double of the engines' prefix-held route over their real ``PrefillWork``: releases, then
    pending blocks (before the claim), then the claim, then the live work, as the server does."""

    def __init__(self, urls: list[str]) -> None:
        self.work = {u: PrefillWork() for u in urls}
        self.requests: list[tuple[str, PrefixHeldRequest]] = []

    async def post_json(self, url: str, body: bytes, timeout: float, headers: Any = None) -> UpstreamResponse:
        engine = url.removesuffix(routes.PREFIX_HELD)
        req = PrefixHeldRequest.model_validate_json(body)
        self.requests.append((engine, req))
        ids, work = list(req.prompt_token_ids or ()), self.work[engine]
        if req.release:
            work.release(ids, "v1")
        pending = work.pending_blocks(ids, "v1", BLOCK)
        claimed = None
        if req.claim is not None:
            claimed = work.claim(ids, "v1", req.claim.tokens, limit=req.claim.limit, tokens_per_block=BLOCK)
        answer = PrefixHeld(
            tokens=len(ids),
            blocks=len(ids) // BLOCK,
            held_blocks=0,
            tokens_per_block=BLOCK,
            pending_blocks=pending,
            recent_work=work.recent_work(),
            claimed=claimed,
        )
        return UpstreamResponse(200, "application/json", answer.model_dump_json().encode())


async def place_group(
    lookup: PrefixLookup, router: ConversationRouter, engines: BookkeepingEngines, cid: str, g: int, size: int
) -> str:
    """The relay's step 4 for a new group's first sibling: lookup (and claims), pick, the leg arrives."""
    messages, ids = group(g, size)
    urls = list(engines.work)
    route = RouteRequest(cid, ids, messages, opening=opening_of(messages))
    targets = router.lookup_targets(route, urls)
    if targets:
        route = await lookup.place(router, route, targets)
    url = router.pick(route, [Candidate(u) for u in urls]).url
    engines.work[url].start(ids, "v1", held_tokens=0, tokens_per_block=BLOCK)
    return url


def frontend(engines: BookkeepingEngines, *, ahead: bool = True) -> tuple[PrefixLookup, ConversationRouter]:
    lookup = PrefixLookup(cast(UpstreamClient, engines), FrontendMetrics(), timeout=1.0, ahead=ahead)
    return lookup, ConversationRouter(lookup_engines=4, load_factor=FACTOR)


def test_the_second_group_is_placed_in_one_round_trip_and_the_first_in_two() -> None:
    async def run() -> tuple[list[int], list[str]]:
        engines = BookkeepingEngines(pool(2))
        lookup, router = frontend(engines)
        trips = []
        for g in range(2):
            before = len(engines.requests)
            await place_group(lookup, router, engines, f"c{g}", g, 300)
            trips.append(len({(e, r.claim is not None) for e, r in engines.requests[before:]}))
        return trips, [e for e, r in engines.requests if r.claim is not None]

    trips, claimed_on = asyncio.run(run())
    # group 0: no figures yet, so a lookup to both engines, then the claim (three requests, two round
    # trips); group 1: the claim rides on the lookup (two requests, one round trip)
    assert trips == [3, 2]
    assert len(claimed_on) == 2


def test_without_the_claim_ahead_no_figures_are_kept_and_every_group_takes_two_round_trips() -> None:
    async def run() -> tuple[list[int], dict[str, int]]:
        engines = BookkeepingEngines(pool(2))
        lookup, router = frontend(engines, ahead=False)
        trips = []
        for g in range(2):
            before = len(engines.requests)
            await place_group(lookup, router, engines, f"c{g}", g, 300)
            trips.append(len({(e, r.claim is not None) for e, r in engines.requests[before:]}))
        return trips, lookup.reported.figures()

    trips, figures = asyncio.run(run())
    assert trips == [3, 3]  # lookup to both engines, then the claim: for the second group too
    assert figures == {}  # the engines' answers are not kept when nothing reads them


def test_a_claim_ahead_on_another_engine_than_the_groups_is_taken_back_and_the_group_followed() -> None:
    """The replica's other frontend moved the group off its first engine a moment ago (a rival's
    work there, since gone) and its leg is in flight on the second. This frontend, whose figures say
    every engine is idle, claims the first engine with its lookup; the answers show the group in
    flight on the second: the claim is taken back and the sibling goes where the group is."""

    async def run() -> tuple[list[str], str, str, list[str], dict[str, int]]:
        engines = BookkeepingEngines(pool(2))
        messages, _ = group(0, 300)
        order = hrw_order(opening_of(messages).key, pool(2))  # type: ignore[union-attr]
        rival = list(range(900_000, 901_000))
        engines.work[order[0]].claim(rival, "v1", 1000, limit=None, tokens_per_block=BLOCK)
        lookup_a, router_a = frontend(engines)
        placed = await place_group(lookup_a, router_a, engines, "c0", 0, 300)
        engines.work[order[0]].release(rival, "v1")
        lookup_b, router_b = frontend(engines)
        lookup_b.reported.update(
            {u: PrefixHeld(tokens=0, blocks=0, held_blocks=0, tokens_per_block=BLOCK, recent_work=0) for u in pool(2)}
        )
        sibling = await place_group(lookup_b, router_b, engines, "c1", 0, 300)
        await asyncio.gather(*lookup_b._releases)  # the take-back, off the turn's path
        released = [e for e, r in engines.requests if r.release]
        return order, placed, sibling, released, {u: w.recent_work() for u, w in engines.work.items()}

    order, placed, sibling, released, work = asyncio.run(run())
    assert placed == order[1] and sibling == placed
    assert released == [order[0]]
    assert work[order[0]] == 0  # the claim taken back
    assert work[order[1]] == 300 + 300 % BLOCK  # the group once: the sibling's leg follows the first's in flight


def concurrent_groups(n: int, sizes: list[int], order: list[int], *, ahead: bool) -> dict[str, int]:
    """Groups placed at once by as many frontends as groups, each with the same stale figures (all
    idle) from earlier answers, all looking up before any leg arrives."""

    async def run() -> dict[str, int]:
        engines = BookkeepingEngines(pool(n))
        idle = {
            u: PrefixHeld(tokens=0, blocks=0, held_blocks=0, tokens_per_block=BLOCK, recent_work=0) for u in pool(n)
        }
        routers = []
        for _ in order:
            lookup, router = frontend(engines, ahead=ahead)
            lookup.reported.update(idle)
            routers.append((lookup, router))
        for (lookup, router), g in zip(routers, order, strict=True):
            await place_group(lookup, router, engines, f"c{g}", g, sizes[g])
        return {u: w.recent_work() for u, w in engines.work.items()}

    return asyncio.run(run())


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 4),
    sizes=st.lists(st.integers(2 * BLOCK, 40 * BLOCK), min_size=1, max_size=10),
    data=st.data(),
)
def test_groups_claimed_with_their_lookup_from_stale_figures_end_within_the_bound(
    n: int, sizes: list[int], data: st.DataObject
) -> None:
    """The bound the two-round-trip placement keeps (``test_frontend_group_claims``) holds with the
    claim sent ahead from figures that say every engine is idle."""
    order = data.draw(st.permutations(range(len(sizes))))
    work = concurrent_groups(n, sizes, order, ahead=True)
    largest = max(sizes)
    bound = max(FACTOR * sum(work.values()) / n, largest)
    assert max(work.values()) <= max(bound, min(work.values()) + largest * 9 // 8 + 1), work


def test_the_same_groups_end_alike_with_and_without_the_claim_ahead() -> None:
    sizes = [30 * BLOCK] * 12
    ahead = concurrent_groups(4, sizes, list(range(12)), ahead=True)
    before = concurrent_groups(4, sizes, list(range(12)), ahead=False)
    size = sizes[0]
    assert max(ahead.values()) <= work_bound(11 * size, size, 4, FACTOR)
    assert sorted(ahead.values()) == sorted(before.values())


def test_no_claim_ahead_for_a_known_group_a_later_turn_or_missing_figures() -> None:
    urls = pool(4)
    router = ConversationRouter(lookup_engines=4, load_factor=FACTOR)
    messages, ids = group(0, 300)
    req = RouteRequest("c0", ids, messages, opening=opening_of(messages))
    figures = dict.fromkeys(urls, 0)
    claim = router.claim_ahead(req, urls, figures)
    order = hrw_order(opening_of(messages).key, urls)  # type: ignore[union-attr]
    assert claim is not None and (claim.url, claim.tokens) == (order[0], 300)  # named without figures
    assert claim.limit == work_bound(0, 300, 4, FACTOR)  # the walk's own limit
    busy = {**figures, order[0]: 10_000}
    assert router.claim_ahead(req, urls, busy) is None  # the walk would move it: the lookup first
    assert router.claim_ahead(req, urls, {u: 0 for u in urls[:3]}) is None  # an engine without a figure
    assert ConversationRouter(lookup_engines=0).claim_ahead(req, urls, figures) is None
    later = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
    assert router.claim_ahead(RouteRequest("c2", ids, later, opening=opening_of(later)), urls, figures) is None
    held = {u: PrefixHeld(tokens=300, blocks=9, held_blocks=0, tokens_per_block=BLOCK, recent_work=0) for u in urls}
    router.pick(dataclasses.replace(req, held=held), [Candidate(u) for u in urls])
    assert router.claim_ahead(dataclasses.replace(req, conversation_id="c1"), urls, figures) is None  # known here
