"""The routers, without HTTP: rendezvous stability, bounded load, stickiness, prefix matching."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from drs_frontend.routing import (
    Candidate,
    ConversationRouter,
    LeastLoadedRouter,
    Reason,
    RoundRobinRouter,
    RouteRequest,
)
from drs_frontend.routing.rendezvous import bounded_pick, hrw_order, load_bound
from hypothesis import given, settings
from hypothesis import strategies as st

POOL = [f"http://127.0.0.1:{8000 + i}" for i in range(4)]


def idle(urls: list[str]) -> list[Candidate]:
    return [Candidate(u, 0) for u in urls]


def test_rendezvous_order_is_a_function_of_key_and_pool_only() -> None:
    assert hrw_order("conv-1", POOL) == hrw_order("conv-1", list(reversed(POOL)))
    assert sorted(hrw_order("conv-1", POOL)) == sorted(POOL)


def test_rendezvous_spreads_keys_over_the_pool() -> None:
    firsts = Counter(hrw_order(f"conversation-{i}", POOL)[0] for i in range(4000))
    assert set(firsts) == set(POOL)
    assert max(firsts.values()) / min(firsts.values()) < 1.2


@given(key=st.text(min_size=1, max_size=40), removed=st.integers(0, 3))
def test_removing_an_engine_moves_only_the_keys_whose_first_choice_it_was(key: str, removed: int) -> None:
    before = hrw_order(key, POOL)
    remaining = [u for u in POOL if u != POOL[removed]]
    after = hrw_order(key, remaining)
    assert after == [u for u in before if u != POOL[removed]]


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        pytest.param([0, 0, 0, 0], 0, id="all idle: the first in order"),
        pytest.param([1, 0, 0, 0], 0, id="one in flight is within the bound of ceil(1.25*2/4)=1"),
        pytest.param([2, 0, 0, 0], 1, id="two in flight exceed ceil(1.25*3/4)=1: walk on"),
        pytest.param([5, 5, 0, 4], 0, id="five in flight is within ceil(1.25*15/4)=5"),
        pytest.param([9, 8, 0, 0], 2, id="both heavy engines above ceil(1.25*18/4)=6"),
    ],
)
def test_bounded_pick_takes_the_first_engine_within_ceil_c_times_mean(loads: list[int], expected: int) -> None:
    load = dict(zip(POOL, loads, strict=True))
    bound = load_bound(sum(loads), len(loads), 1.25)
    picked = bounded_pick(POOL, [(load.__getitem__, bound)])
    assert load[picked] <= bound
    assert picked == POOL[expected]


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.floats(1.0, 3.0))
def test_bounded_pick_never_exceeds_the_bound(loads: list[int], factor: float) -> None:
    urls = [f"http://e{i}" for i in range(len(loads))]
    load = dict(zip(urls, loads, strict=True))
    picked = bounded_pick(urls, [(load.__getitem__, load_bound(sum(loads), len(loads), factor))])
    assert load[picked] <= math.ceil(factor * (sum(loads) + 1) / len(loads))


def test_an_explicit_conversation_sticks_to_its_engine_even_when_it_is_busy() -> None:
    router = ConversationRouter()
    first = router.pick(RouteRequest(conversation_id="c1"), idle(POOL))
    assert first.reason is Reason.RENDEZVOUS
    busy = [Candidate(u, 50 if u == first.url else 0) for u in POOL]
    again = router.pick(RouteRequest(conversation_id="c1"), busy)
    assert again == type(first)(first.url, Reason.STICKY)


def test_a_new_conversation_goes_to_its_rendezvous_engine_when_loads_are_even() -> None:
    router = ConversationRouter()
    for i in range(50):
        cid = f"conversation-{i}"
        assert router.pick(RouteRequest(conversation_id=cid), idle(POOL)).url in POOL
    other = ConversationRouter()
    fresh = other.pick(RouteRequest(conversation_id="conversation-999"), idle(POOL))
    assert fresh.url == hrw_order("conversation-999", POOL)[0]


@settings(max_examples=30)
@given(n=st.integers(20, 400), engines=st.integers(1, 6))
def test_pinned_sessions_never_end_above_the_load_factor_of_their_mean(n: int, engines: int) -> None:
    pool = POOL[:engines] + [f"http://engine-{i}" for i in range(max(0, engines - 4))]
    router = ConversationRouter(load_factor=1.25)
    for i in range(n):
        router.pick(RouteRequest(conversation_id=f"k{i}"), idle(pool))
    assert max(router.sessions_on(u) for u in pool) <= max(1.0, 1.25 * n / len(pool))


def test_a_second_router_of_the_same_replica_agrees_on_known_conversations() -> None:
    a, b = ConversationRouter(), ConversationRouter()
    ids = [f"traj-{i}" for i in range(400)]
    placed_a = {cid: a.pick(RouteRequest(conversation_id=cid), idle(POOL)).url for cid in ids}
    placed_b = {cid: b.pick(RouteRequest(conversation_id=cid), idle(POOL)).url for cid in reversed(ids)}
    agree = sum(placed_a[c] == placed_b[c] for c in ids)
    assert agree / len(ids) >= 0.9


def test_pinned_sessions_stay_within_the_load_factor_of_the_mean() -> None:
    router = ConversationRouter(load_factor=1.25)
    for i in range(1000):
        router.pick(RouteRequest(conversation_id=f"s{i}"), idle(POOL))
    counts = [router.sessions_on(u) for u in POOL]
    assert sum(counts) == 1000
    assert max(counts) <= 1.25 * 1000 / 4


def test_an_unavailable_pinned_engine_repins_the_conversation() -> None:
    router = ConversationRouter()
    first = router.pick(RouteRequest(conversation_id="c7"), idle(POOL))
    rest = [u for u in POOL if u != first.url]
    moved = router.pick(RouteRequest(conversation_id="c7"), idle(rest))
    assert moved.reason is Reason.REPINNED
    assert moved.url in rest
    assert router.pinned("c7") == moved.url
    back = router.pick(RouteRequest(conversation_id="c7"), idle(POOL))
    assert back == type(back)(moved.url, Reason.STICKY)


def test_the_pin_table_is_bounded_and_forgets_the_least_recent() -> None:
    router = ConversationRouter(max_sessions=3)
    for cid in ("a", "b", "c"):
        router.pick(RouteRequest(conversation_id=cid), idle(POOL))
    router.pick(RouteRequest(conversation_id="a"), idle(POOL))  # touch a
    router.pick(RouteRequest(conversation_id="d"), idle(POOL))
    assert len(router) == 3
    assert router.pinned("b") is None
    assert router.pinned("a") is not None
    assert sum(router.sessions_on(u) for u in POOL) == 3


def test_without_an_id_a_prompt_follows_the_engine_holding_its_prefix() -> None:
    router = ConversationRouter(block_tokens=4)
    ids = list(range(100))
    first = router.pick(RouteRequest(prompt_ids=ids), idle(POOL))
    assert first.reason is Reason.LEAST_LOADED
    longer = router.pick(RouteRequest(prompt_ids=[*ids, *range(500, 520)]), idle(POOL))
    assert longer == type(longer)(first.url, Reason.PREFIX)


def test_a_prefix_below_the_match_ratio_is_not_followed() -> None:
    router = ConversationRouter(block_tokens=4, match_ratio=0.75)
    first = router.pick(RouteRequest(prompt_ids=list(range(40))), idle(POOL))
    other = router.pick(RouteRequest(prompt_ids=[*range(40), *range(1000, 1080)]), idle(POOL))
    assert other.reason is Reason.LEAST_LOADED
    assert other.url != first.url  # least loaded takes turns among equals


def test_message_text_prefixes_match_when_no_token_ids_are_known() -> None:
    router = ConversationRouter()
    turn1 = [{"role": "system", "content": "be brief " * 20}, {"role": "user", "content": "hello " * 30}]
    first = router.pick(RouteRequest(messages=turn1), idle(POOL))
    turn2 = [*turn1, {"role": "assistant", "content": "hi " * 30}, {"role": "user", "content": "more"}]
    second = router.pick(RouteRequest(messages=turn2), idle(POOL))
    assert second == type(second)(first.url, Reason.PREFIX)


def test_least_loaded_takes_the_idlest_and_alternates_between_equals() -> None:
    router = LeastLoadedRouter()
    cands = [Candidate(POOL[0], 3), Candidate(POOL[1], 1), Candidate(POOL[2], 1)]
    picks = [router.pick(cands).url for _ in range(4)]
    assert picks == [POOL[1], POOL[2], POOL[1], POOL[2]]


def test_round_robin_visits_every_engine_in_turn() -> None:
    router = RoundRobinRouter()
    assert [router.pick(idle(POOL)).url for _ in range(8)] == POOL * 2


@settings(max_examples=50)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", "d", "e"]), st.sets(st.integers(0, 3), min_size=1)), max_size=30
    )
)
def test_the_conversation_router_only_returns_offered_candidates(ops: list[tuple[str, set[int]]]) -> None:
    router = ConversationRouter(max_sessions=3)
    for cid, offered in ops:
        cands = idle([POOL[i] for i in sorted(offered)])
        decision = router.pick(RouteRequest(conversation_id=cid), cands)
        assert decision.url in {c.url for c in cands}
        assert sum(router.sessions_on(u) for u in POOL) == len(router) <= 3
