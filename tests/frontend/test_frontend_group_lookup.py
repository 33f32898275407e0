"""Bounded placement of new groups and the prefix-held lookup that finds them again: the pure rule.

The engines' answers are computed here as an engine's prefix cache would give them (it holds an
opening where a first turn of it was computed), so these tests need no HTTP; the real path is
tests/frontend/test_frontend_group_lookup_restart.py.
"""

from __future__ import annotations

from typing import Any

from drs_frontend.routing import Candidate, ConversationRouter, Reason, RouteRequest
from drs_frontend.routing.base import Sibling
from drs_frontend.routing.groups import estimate_tokens, message_chars, opening_of
from drs_frontend.routing.placement import TIE_PARTS, RecentWork, bounded_walk, found_engine, work_bound
from drs_frontend.routing.rendezvous import hrw_order
from drs_protocol.prefix_lookup import PrefixHeld
from hypothesis import given, settings
from hypothesis import strategies as st

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
BLOCKS = 20  #: full blocks of every opening here (the answers' scale)


def pool(n: int) -> list[str]:
    return [f"http://e{i}" for i in range(n)]


def idle(urls: list[str]) -> list[Candidate]:
    return [Candidate(u, 0, 0) for u in urls]


def first_turn(task: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are an agent. " * 20}, {"role": "user", "content": task}]


def later_turn(opening: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [*opening, {"role": "assistant", "content": "r"}, {"role": "tool", "content": "o", "tool_call_id": "c"}]


def request(cid: str | None, messages: list[dict[str, Any]], held: dict[str, PrefixHeld] | None = None) -> RouteRequest:
    return RouteRequest(cid, None, messages, tools=TOOLS, opening=opening_of(messages, TOOLS), held=held)


def answer(held_blocks: int, blocks: int = BLOCKS) -> PrefixHeld:
    return PrefixHeld(tokens=blocks * 32 + 5, blocks=blocks, held_blocks=held_blocks, tokens_per_block=32)


class Caches:
    """What each engine's prefix cache holds: the openings whose first turns it computed (plus a
    system prompt every engine that computed anything holds, as in the benchmark)."""

    def __init__(self) -> None:
        self.openings: dict[str, set[str]] = {}

    def computed(self, url: str, messages: list[dict[str, Any]]) -> None:
        opening = opening_of(messages, TOOLS)
        assert opening is not None
        self.openings.setdefault(url, set()).add(opening.key)

    def answers(self, targets: list[str], messages: list[dict[str, Any]]) -> dict[str, PrefixHeld]:
        opening = opening_of(messages, TOOLS)
        assert opening is not None
        out = {}
        for url in targets:
            keys = self.openings.get(url, set())
            out[url] = answer(BLOCKS if opening.key in keys else 3 if keys else 0)
        return out


def route(router: ConversationRouter, caches: Caches, cid: str, messages: list[dict[str, Any]], urls: list[str]) -> str:
    """One turn as the relay runs it: the lookup the router asks for, then the pick."""
    req = request(cid, messages)
    targets = router.lookup_targets(req, urls)
    if targets:
        req = request(cid, messages, caches.answers(targets, messages))
    return router.pick(req, idle(urls)).url


# -- the bound -------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    work=st.lists(st.integers(0, 20_000), min_size=1, max_size=8),
    size=st.integers(1, 5_000),
    factor=st.floats(1.0, 3.0),
    key=st.text(min_size=1, max_size=8),
)
def test_the_walk_takes_the_first_engine_within_c_times_the_mean_and_never_ends_above_it_needlessly(
    work: list[int], size: int, factor: float, key: str
) -> None:
    urls = pool(len(work))
    loads = dict(zip(urls, work, strict=True))
    order = hrw_order(key, urls)
    chosen = bounded_walk(order, urls, loads.__getitem__, size, factor, width=len(urls))
    bound = work_bound(sum(work), size, len(urls), factor)
    within = [u for u in order if loads[u] + size <= bound]
    least = [u for u in order if TIE_PARTS * (loads[u] - min(work)) <= size]  # within 1/8 prompt: a tie
    assert chosen == (within[0] if within else least[0])
    mean_after = (sum(work) + size) / len(urls)
    # no engine ends above c x mean unless even the least loaded one would (within 1/8 prompt)
    assert loads[chosen] + size <= max(factor * mean_after, min(work) + size + size / TIE_PARTS) + 1e-9


@settings(max_examples=60, deadline=None)
@given(groups=st.integers(1, 40), engines=st.integers(1, 6), factor=st.sampled_from([1.0, 1.25, 1.5, 2.0]))
def test_groups_of_one_size_end_within_c_times_their_mean(groups: int, engines: int, factor: float) -> None:
    """Openings of one size placed one after another (the lookup asks every engine): the busiest
    engine holds at most max(c x mean, the least loaded's + one) openings, whatever the keys."""
    urls = pool(engines)
    router = ConversationRouter(load_factor=factor, lookup_engines=engines)
    caches = Caches()
    count = dict.fromkeys(urls, 0)
    for g in range(groups):
        messages = first_turn(f"prompt {g:04d}")
        url = route(router, caches, f"g{g}", messages, urls)
        caches.computed(url, messages)
        count[url] += 1
        mean = (g + 1) / engines
        assert count[url] <= max(factor * mean, min(count.values()) + 1) + 1e-9, count


def test_a_hot_first_engine_moves_a_new_group_and_the_metric_says_so() -> None:
    urls = pool(4)
    router = ConversationRouter(lookup_engines=4)
    caches = Caches()
    placed: dict[str, int] = {}
    moved = 0
    for g in range(8):
        messages = first_turn(f"prompt {g}")
        req = request(f"g{g}", messages)
        targets = router.lookup_targets(req, urls)
        assert targets == hrw_order(req.opening.key if req.opening else "", urls)
        decision = router.pick(request(f"g{g}", messages, caches.answers(targets, messages)), idle(urls))
        caches.computed(decision.url, messages)
        placed[decision.url] = placed.get(decision.url, 0) + 1
        moved += decision.sibling is Sibling.MOVED
        assert decision.sibling in (Sibling.FIRST, Sibling.MOVED)
        assert decision.reason is Reason.RENDEZVOUS
    assert sorted(placed.values()) == [2, 2, 2, 2]  # 8 openings, c = 1.25: floor(1.25 x 2) = 2 each
    assert moved > 0


# -- the lookup ----------------------------------------------------------------------------------


def test_only_a_routing_miss_asks_and_it_asks_the_first_engines_of_the_openings_order() -> None:
    urls = pool(6)
    router = ConversationRouter(lookup_engines=3)
    messages = first_turn("task")
    opening = opening_of(messages, TOOLS)
    assert opening is not None
    assert router.lookup_targets(request("s0", messages), urls) == hrw_order(opening.key, urls)[:3]
    url = router.pick(request("s0", messages, {}), idle(urls)).url
    assert router.lookup_targets(request("s0", later_turn(messages)), urls) == []  # pinned
    assert router.lookup_targets(request("s1", messages), urls) == []  # the opening is known
    assert router.lookup_targets(request("s1", messages), [u for u in urls if u != url]) != []  # its engine left
    assert ConversationRouter(lookup_engines=0).lookup_targets(request("s0", messages), urls) == []
    assert ConversationRouter(groups=False).lookup_targets(request("s0", messages), urls) == []


def test_the_longest_held_prefix_wins_and_a_first_turn_follows_only_a_whole_opening() -> None:
    order = pool(4)
    held = {order[0]: answer(3), order[1]: answer(0), order[2]: answer(12), order[3]: answer(12)}
    assert found_engine(order, held, whole=False) == order[2]  # the longest; ties: earlier in order
    assert found_engine(order, held, whole=True) is None  # a system prompt every group shares
    assert found_engine(order, {**held, order[3]: answer(BLOCKS)}, whole=True) == order[3]
    assert found_engine(order, {}, whole=False) is None
    assert found_engine(order, {order[1]: answer(0, blocks=0)}, whole=True) is None


def test_no_answer_falls_back_to_the_openings_first_engine() -> None:
    urls = pool(4)
    messages = later_turn(first_turn("t"))
    opening = opening_of(messages, TOOLS)
    assert opening is not None
    decision = ConversationRouter(lookup_engines=4).pick(request("x", messages, {}), idle(urls))
    assert decision.url == hrw_order(opening.key, urls)[0] and decision.reason is Reason.RENDEZVOUS


@settings(max_examples=40, deadline=None)
@given(
    groups=st.integers(1, 24),
    siblings=st.integers(1, 4),
    engines=st.integers(1, 6),
    width=st.integers(1, 6),
    earlier=st.lists(st.integers(1, 400), max_size=12),
)
def test_a_restarted_router_finds_every_later_turns_engine_by_asking(
    groups: int, siblings: int, engines: int, width: int, earlier: list[int]
) -> None:
    """The restart property with the bound on: the first router moves groups by its own load (some
    engines start with other work), a router that never saw them (restarted, or the replica's
    other frontend) places none of them itself and still sends every later turn to the engine
    that computed its group's first turns, by asking the engines it may have been placed on."""
    urls = pool(engines)
    first = ConversationRouter(lookup_engines=width)
    caches = Caches()
    for i, words in enumerate(earlier):  # other prompts of other sizes placed before: the walk's load
        messages = first_turn(f"earlier {i}: " + "word " * words)
        caches.computed(route(first, caches, f"e{i}", messages, urls), messages)
    placed: list[tuple[str, str, list[dict[str, Any]]]] = []
    for g in range(groups):
        messages = first_turn(f"prompt {g}")
        for s in range(siblings):
            url = route(first, caches, f"g{g}-s{s}", messages, urls)
            caches.computed(url, messages)
            placed.append((f"g{g}-s{s}", url, messages))
    restarted = ConversationRouter(lookup_engines=width)
    for cid, url, messages in placed:
        assert route(restarted, caches, cid, later_turn(messages), urls) == url


def test_recent_work_forgets_beyond_its_window() -> None:
    recent = RecentWork(2)
    recent.add("a", 10)
    recent.add("b", 5)
    recent.add("a", 1)
    assert (recent("a"), recent("b")) == (1, 5)


def test_a_first_turn_found_held_elsewhere_joins_it_and_costs_one_token() -> None:
    """A sibling placed by the replica's other frontend (its first turn computed there already)."""
    urls = pool(4)
    messages = first_turn("other frontend's group")
    opening = opening_of(messages, TOOLS)
    assert opening is not None
    there = hrw_order(opening.key, urls)[2]
    held = {u: answer(BLOCKS if u == there else 0) for u in urls}
    decision = ConversationRouter(lookup_engines=4).pick(request("s9", messages, held), idle(urls))
    assert decision.url == there and decision.reason is Reason.LOOKUP and decision.sibling is Sibling.FOUND
    assert decision.cost == 1
    size = estimate_tokens(message_chars(messages, TOOLS))
    assert size > 1
