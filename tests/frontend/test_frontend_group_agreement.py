"""A replica's frontends place a new group alike: the rule reads the engines' own figures (pure).

Each frontend used to walk with its own memory of what it placed, so two frontends that saw other
siblings, in another order, placed one group on two engines (its prompt computed twice). Now the
lookup's answer carries each engine's recent prefill work and the blocks its legs in flight will
store (``drs_protocol.prefix_lookup.PrefixHeld``): given the same answers, any two routers pick the
same engine, whatever they placed before, and a sibling that another frontend sent a moment ago is
followed before its prompt is cached. The real engines' side: tests/engine/test_prefill_work.py.
"""

from __future__ import annotations

from typing import Any

from drs_frontend.routing import Candidate, ConversationRouter, Reason, RouteRequest
from drs_frontend.routing.base import Sibling
from drs_frontend.routing.groups import opening_of
from drs_frontend.routing.placement import bounded_walk, work_bound
from drs_frontend.routing.rendezvous import hrw_order
from drs_protocol.prefix_lookup import PrefixHeld
from hypothesis import given, settings
from hypothesis import strategies as st

BLOCKS = 20
SIZE = BLOCKS * 32 + 5  #: every prompt's tokens here (the answers' scale)


def pool(n: int) -> list[str]:
    return [f"http://e{i}" for i in range(n)]


def first_turn(task: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are an agent. " * 20}, {"role": "user", "content": task}]


def request(cid: str, messages: list[dict[str, Any]], held: dict[str, PrefixHeld] | None = None) -> RouteRequest:
    ids = list(range(SIZE))  # the frontend's ids: the walk's size is the same in every router
    return RouteRequest(cid, ids, messages, opening=opening_of(messages), held=held)


def answer(work: int, *, held: int = 0, pending: int = 0) -> PrefixHeld:
    return PrefixHeld(
        tokens=SIZE, blocks=BLOCKS, held_blocks=held, tokens_per_block=32, pending_blocks=pending, recent_work=work
    )


class Engines:
    """What the engines would answer: per engine its recent work and the openings it holds or is
    computing (a leg in flight stores its blocks when its context phase ends)."""

    def __init__(self, urls: list[str]) -> None:
        self.work = dict.fromkeys(urls, 0)
        self.openings: dict[str, set[str]] = {u: set() for u in urls}

    def answers(self, targets: list[str], key: str) -> dict[str, PrefixHeld]:
        return {u: answer(self.work[u], pending=BLOCKS if key in self.openings[u] else 0) for u in targets}

    def run(self, url: str, key: str) -> None:
        if key not in self.openings[url]:  # the first leg computes the prompt; a sibling reads it
            self.openings[url].add(key)
            self.work[url] += SIZE


def route(
    router: ConversationRouter, engines: Engines, cid: str, messages: list[dict[str, Any]], urls: list[str]
) -> str:
    req = request(cid, messages)
    targets = router.lookup_targets(req, urls)
    if targets:
        assert req.opening is not None
        req = request(cid, messages, engines.answers(targets, req.opening.key))
    url = router.pick(req, [Candidate(u) for u in urls]).url
    assert req.opening is not None
    engines.run(url, req.opening.key)
    return url


@settings(max_examples=200, deadline=None)
@given(
    work=st.lists(st.integers(0, 50_000), min_size=1, max_size=6),
    history_a=st.lists(st.integers(0, 10_000), max_size=12),
    history_b=st.lists(st.integers(0, 10_000), max_size=12),
    factor=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
    task=st.text(max_size=12),
)
def test_routers_with_other_memories_place_a_new_group_alike_from_the_same_answers(
    work: list[int], history_a: list[int], history_b: list[int], factor: float, task: str
) -> None:
    urls = pool(len(work))
    routers = []
    for history in (history_a, history_b):  # each frontend placed other groups before
        router = ConversationRouter(load_factor=factor, lookup_engines=len(urls))
        for i, tag in enumerate(history):
            router.pick(request(f"old{i}", first_turn(f"old {tag}"), {}), [Candidate(u) for u in urls])
        routers.append(router)
    messages = first_turn(f"new: {task}")
    opening = opening_of(messages)
    assert opening is not None
    held = {u: answer(w) for u, w in zip(urls, work, strict=True)}
    picked = {r.pick(request("s", messages, held), [Candidate(u) for u in urls]).url for r in routers}
    order = hrw_order(opening.key, urls)
    reported = dict(zip(urls, work, strict=True))
    assert picked == {bounded_walk(order, order, reported.__getitem__, SIZE, factor, len(order))}


@settings(max_examples=60, deadline=None)
@given(
    engines=st.integers(1, 5),
    groups=st.integers(1, 16),
    arrivals=st.lists(st.tuples(st.integers(0, 15), st.integers(0, 1)), min_size=1, max_size=80),
)
def test_siblings_through_two_frontends_meet_on_one_engine_within_the_bound(
    engines: int, groups: int, arrivals: list[tuple[int, int]]
) -> None:
    """Siblings of many groups reach a replica's two frontends in any order: every group's
    siblings land on one engine (its prompt computed once), and each new group's engine stays
    within max(c x mean, the least loaded + one prompt) of the engines' reported work."""
    urls = pool(engines)
    fleet = Engines(urls)
    frontends = [ConversationRouter(lookup_engines=engines) for _ in range(2)]
    where: dict[int, str] = {}
    for n, (group, f) in enumerate(arrivals):
        g = group % groups
        before = dict(fleet.work)
        url = route(frontends[f], fleet, f"g{g}-s{n}", first_turn(f"prompt {g}"), urls)
        if g in where:
            assert url == where[g]
            continue
        where[g] = url
        bound = work_bound(sum(before.values()), SIZE, engines, 1.25)
        assert before[url] + SIZE <= max(bound, min(before.values()) + SIZE)
    assert sum(fleet.work.values()) == SIZE * len(where)  # one prefill per group


def test_a_sibling_in_flight_elsewhere_is_followed_before_it_is_cached() -> None:
    urls = pool(4)
    messages = first_turn("placed by the other frontend a moment ago")
    opening = opening_of(messages)
    assert opening is not None
    there = hrw_order(opening.key, urls)[3]
    held = {u: answer(0 if u == there else 10_000, pending=BLOCKS if u == there else 0) for u in urls}
    decision = ConversationRouter(lookup_engines=4).pick(request("s", messages, held), [Candidate(u) for u in urls])
    assert decision.url == there and decision.reason is Reason.LOOKUP and decision.sibling is Sibling.FOUND
    partly = {**held, there: answer(50_000, pending=BLOCKS - 1)}  # a shared system prompt: not this group
    walked = ConversationRouter(lookup_engines=4).pick(request("s", messages, partly), [Candidate(u) for u in urls])
    assert walked.url != there and walked.reason is Reason.RENDEZVOUS


def test_an_engine_that_reports_no_work_leaves_the_walk_to_the_frontends_memory() -> None:
    urls = pool(2)
    messages = first_turn("t")
    opening = opening_of(messages)
    assert opening is not None
    first, second = hrw_order(opening.key, urls)
    silent = PrefixHeld(tokens=SIZE, blocks=BLOCKS, held_blocks=0, tokens_per_block=32)  # an older engine
    busy = {first: answer(100_000), second: answer(0)}
    assert (
        ConversationRouter(lookup_engines=2).pick(request("s", messages, busy), [Candidate(u) for u in urls]).url
        == second
    )
    mixed = {first: answer(100_000), second: silent}
    assert (
        ConversationRouter(lookup_engines=2).pick(request("s", messages, mixed), [Candidate(u) for u in urls]).url
        == first
    )
    assert ConversationRouter(lookup_engines=0).looks_up is False and ConversationRouter(lookup_engines=2).looks_up


def test_groups_placed_from_one_snapshot_spread_over_engines_a_few_tokens_apart() -> None:
    """Every engine at its bound, their work a few tokens apart (what siblings' cache hits leave):
    new groups placed from that one snapshot (concurrently) spread by their rendezvous order, not
    all onto the engine a few tokens below the others."""
    urls = pool(4)
    held = {u: answer(SIZE + 7 * i) for i, u in enumerate(urls)}
    picked = set()
    for g in range(16):
        router = ConversationRouter(lookup_engines=4)
        picked.add(router.pick(request(f"g{g}", first_turn(f"prompt {g}"), held), [Candidate(u) for u in urls]).url)
    assert len(picked) >= 3
