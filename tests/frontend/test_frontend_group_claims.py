"""Groups placed at once stay within the load bound: each placement is claimed on its engine (pure).

The frontends of a replica place new groups from the engines' figures in the lookup's answers;
groups placed at once (a lookup and its dispatch take longer than the gap between groups) read one
snapshot, and counted only when their legs arrived they took the same room. Now the relay claims
the walk's engine first (:meth:`ConversationRouter.claim_target`, the engine's
:meth:`drs_engine.prefill_work.PrefillWork.claim`: counted at once, only within the walk's bound)
and a refusal brings the live figure, so the walk goes on. Here the engines are the real
bookkeeping (``PrefillWork``), the loop is the frontend's (``PrefixLookup.place``), every group reads the
same stale snapshot, and the groups are placed in any order.
"""

from __future__ import annotations

import dataclasses

from drs_engine.prefill_work import PrefillWork
from drs_frontend.routing import Candidate, ConversationRouter, RouteRequest
from drs_frontend.routing.groups import opening_of
from drs_frontend.routing.placement import bounded_choice, work_bound
from drs_frontend.routing.rendezvous import hrw_order
from drs_protocol.prefix_lookup import PrefixHeld
from hypothesis import given, settings
from hypothesis import strategies as st

from .groups import BLOCK, FACTOR, group, pool


def snapshot(engines: dict[str, PrefillWork], ids: list[int]) -> dict[str, PrefixHeld]:
    """What the lookup answered (the quote), before any of the groups was placed."""
    blocks = len(ids) // BLOCK
    return {
        u: PrefixHeld(tokens=len(ids), blocks=blocks, held_blocks=0, tokens_per_block=BLOCK, recent_work=w.quote(ids))
        for u, w in engines.items()
    }


def place(router: ConversationRouter, engines: dict[str, PrefillWork], req: RouteRequest, *, claims: bool) -> str:
    """:meth:`PrefixLookup.place`'s claim loop, then the pick; the group's leg arrives at the engine picked."""
    urls = list(engines)
    for attempt in range(len(urls) + 1):
        claim = router.claim_target(req, urls) if claims else None
        if claim is None:
            break
        limit = None if attempt == len(urls) else claim.limit
        assert req.prompt_ids is not None
        if engines[claim.url].claim(req.prompt_ids, "v1", claim.tokens, limit=limit, tokens_per_block=BLOCK):
            break
        assert req.held is not None  # refused: every engine asked again, live
        live = {u: a.model_copy(update={"recent_work": engines[u].recent_work()}) for u, a in req.held.items()}
        req = dataclasses.replace(req, held=live)
    url = router.pick(req, [Candidate(u) for u in urls]).url
    assert req.prompt_ids is not None
    engines[url].start(req.prompt_ids, "v1", held_tokens=0, tokens_per_block=BLOCK)
    return url


def concurrent_groups(n: int, sizes: list[int], order: list[int], *, claims: bool) -> dict[str, int]:
    """Every group looks up before any is placed (one snapshot), then they are placed in ``order``
    by as many frontends as groups (none knows another's placements)."""
    engines = {u: PrefillWork() for u in pool(n)}
    requests = []
    for g, size in enumerate(sizes):
        messages, ids = group(g, size)
        req = RouteRequest(f"c{g}", ids, messages, opening=opening_of(messages))
        requests.append(dataclasses.replace(req, held=snapshot(engines, ids)))
    for g in order:
        router = ConversationRouter(lookup_engines=4, load_factor=FACTOR)
        place(router, engines, requests[g], claims=claims)
    return {u: w.recent_work() for u, w in engines.items()}


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(2, 4),
    sizes=st.lists(st.integers(2 * BLOCK, 40 * BLOCK), min_size=1, max_size=12),
    data=st.data(),
)
def test_groups_placed_from_one_snapshot_end_within_the_bound(n: int, sizes: list[int], data: st.DataObject) -> None:
    """No engine ends above ``c`` times the mean (or one prompt) unless the least loaded engine
    would have (within the walk's tie, an eighth of a prompt): the bound the walk keeps for
    groups placed one by one."""
    order = data.draw(st.permutations(range(len(sizes))))
    work = concurrent_groups(n, sizes, order, claims=True)
    largest = max(sizes)
    bound = max(FACTOR * sum(work.values()) / n, largest)
    assert max(work.values()) <= max(bound, min(work.values()) + largest * 9 // 8 + 1), work


def test_without_claims_groups_placed_from_one_snapshot_pile_on_one_engine() -> None:
    """The same stale snapshot, no claims: every group takes the first engine of its walk with room
    by the snapshot, which is its first in rendezvous order: some engine ends far over the bound."""
    sizes = [30 * BLOCK] * 12
    unclaimed = concurrent_groups(4, sizes, list(range(12)), claims=False)
    claimed = concurrent_groups(4, sizes, list(range(12)), claims=True)
    size = sizes[0]
    assert max(claimed.values()) <= work_bound(11 * size, size, 4, FACTOR)  # 12 over 4: 3 each, bound 3
    assert max(unclaimed.values()) > work_bound(11 * size, size, 4, FACTOR), unclaimed


def test_a_claim_is_only_named_for_a_new_group_walked_over_reported_work() -> None:
    urls = pool(4)
    router = ConversationRouter(lookup_engines=4, load_factor=FACTOR)
    messages, ids = group(0, 300)
    held = {u: PrefixHeld(tokens=300, blocks=9, held_blocks=0, tokens_per_block=BLOCK, recent_work=0) for u in urls}
    req = RouteRequest("c0", ids, messages, opening=opening_of(messages), held=held)
    claim = router.claim_target(req, urls)
    assert claim is not None and claim.tokens == 300
    order = hrw_order(opening_of(messages).key, urls)  # type: ignore[union-attr]
    assert (claim.url, claim.limit) == bounded_choice(order, order, lambda u: 0, 300, FACTOR, 4)
    assert router.pick(req, [Candidate(u) for u in urls]).url == claim.url
    assert router.claim_target(req, urls) is None  # pinned now
    sibling = dataclasses.replace(req, conversation_id="c1")
    assert router.claim_target(sibling, urls) is None  # its opening is known here
    found = {**held, urls[2]: held[urls[2]].model_copy(update={"pending_blocks": 9})}
    other = ConversationRouter(lookup_engines=4, load_factor=FACTOR)
    assert other.claim_target(dataclasses.replace(req, held=found), urls) is None  # in flight there: followed
    unreported = {u: a.model_copy(update={"recent_work": None}) for u, a in held.items()}
    assert other.claim_target(dataclasses.replace(req, held=unreported), urls) is None  # an older engine
    assert ConversationRouter(lookup_engines=0).claim_target(req, urls) is None  # the lookup off
    later = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
    assert other.claim_target(RouteRequest("c2", ids, later, opening=opening_of(later), held=held), urls) is None
