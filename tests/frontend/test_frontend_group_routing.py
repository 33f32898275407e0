"""Placing new conversations by their opening (GRPO groups), without HTTP: the rule is pure."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

from drs_frontend.routing import Candidate, ConversationRouter, Reason, RouteRequest
from drs_frontend.routing.base import Sibling
from drs_frontend.routing.groups import estimate_tokens, message_chars, opening_of
from drs_frontend.routing.rendezvous import hrw_order
from hypothesis import given, settings
from hypothesis import strategies as st

POOL = [f"http://127.0.0.1:{8000 + i}" for i in range(4)]
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def idle(urls: list[str]) -> list[Candidate]:
    return [Candidate(u, 0, 0) for u in urls]


def first_turn(task: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are an agent. " * 20}, {"role": "user", "content": task}]


def later_turn(opening: list[dict[str, Any]], reply: str, observation: str) -> list[dict[str, Any]]:
    assistant = {"role": "assistant", "content": reply, "prompt_token_ids": [1, 2], "generation_token_ids": [3]}
    return [*opening, assistant, {"role": "tool", "content": observation, "tool_call_id": "c1"}]


def request(cid: str | None, messages: list[dict[str, Any]], tools: Any = None) -> RouteRequest:
    return RouteRequest(cid, None, messages, tools=tools, opening=opening_of(messages, tools))


# -- the opening ---------------------------------------------------------------------------------


def test_every_turn_of_a_conversation_has_the_opening_of_its_first_turn() -> None:
    opening = first_turn("task 7")
    turn1 = opening_of(opening, TOOLS)
    turn3 = opening_of(later_turn(later_turn(opening, "a", "b"), "c", "d"), TOOLS)
    assert turn1 is not None and turn3 is not None
    assert turn1.key == turn3.key
    assert turn1.first_turn and not turn3.first_turn
    assert turn1.chars == turn3.chars == message_chars(opening, TOOLS)


def test_the_opening_includes_the_tools_and_ignores_gym_id_fields() -> None:
    opening = first_turn("task 7")
    with_tools, without = opening_of(opening, TOOLS), opening_of(opening)
    assert with_tools is not None and without is not None and with_tools.key != without.key
    a = later_turn(opening, "reply one", "obs")
    b = later_turn(opening, "another reply", "other obs")
    b[2]["generation_token_ids"] = [9, 9, 9]
    assert opening_of(a, TOOLS) == opening_of(b, TOOLS) == replace(with_tools, first_turn=False)


def test_a_conversation_that_opens_with_the_assistant_has_no_opening() -> None:
    assert opening_of([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]) is None


def test_the_key_is_the_same_in_another_process_with_another_hash_seed() -> None:
    messages = first_turn("the same task")
    code = f"from drs_frontend.routing.groups import opening_of;print(opening_of({messages!r}, {TOOLS!r}).key)"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    opening = opening_of(messages, TOOLS)
    assert opening is not None and out.stdout.strip() == opening.key


# -- siblings ------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 64), engines=st.integers(1, 8), task=st.text(min_size=1, max_size=30))
def test_the_siblings_of_a_group_all_go_to_the_engine_the_first_went_to(n: int, engines: int, task: str) -> None:
    pool = [f"http://e{i}" for i in range(engines)]
    router = ConversationRouter()
    messages = first_turn(task)
    decisions = [router.pick(request(f"sibling-{i}", messages, TOOLS), idle(pool)) for i in range(n)]
    opening = opening_of(messages, TOOLS)
    assert opening is not None
    assert {d.url for d in decisions} == {hrw_order(opening.key, pool)[0]}
    assert [d.sibling for d in decisions] == [Sibling.FIRST] + [Sibling.WITH_GROUP] * (n - 1)
    assert decisions[0].reason is Reason.RENDEZVOUS
    assert all(d.reason is Reason.GROUP for d in decisions[1:])
    assert router.groups_on(decisions[0].url) == 1


def test_a_sibling_costs_little_where_its_group_is_and_all_of_its_prompt_elsewhere() -> None:
    router = ConversationRouter()
    messages = first_turn("t")
    first = router.pick(request("s0", messages), idle(POOL))
    size = first.cost
    assert size > 10
    second = router.pick(request("s1", messages), idle(POOL))
    assert second.url == first.url and second.cost == 1


@settings(max_examples=60, deadline=None)
@given(pending=st.lists(st.integers(0, 200_000), min_size=4, max_size=4), seeded=st.booleans())
def test_a_first_turn_goes_to_its_openings_first_engine_whatever_the_load(pending: list[int], seeded: bool) -> None:
    """No bound moves a group: a burst of siblings costs its engine one prefill (the others are held
    and read it from the cache), and a moved group is one a restarted frontend looks for in vain."""
    router = ConversationRouter()
    messages = first_turn("hot prompt")
    if seeded:  # the group was placed here already: its engine holds the opening
        router.pick(request("leader", messages), idle(POOL))
    opening = opening_of(messages)
    assert opening is not None
    size = estimate_tokens(message_chars(messages))
    candidates = [Candidate(u, p // 100, p) for u, p in zip(POOL, pending, strict=True)]
    decision = router.pick(request("sibling", messages), candidates)
    assert decision.url == hrw_order(opening.key, POOL)[0]
    assert decision.cost == (1 if seeded else size)
    assert decision.sibling is (Sibling.WITH_GROUP if seeded else Sibling.FIRST)


def test_a_group_whose_engine_left_the_pool_is_placed_on_its_next_engine_and_says_so() -> None:
    router = ConversationRouter()
    messages = first_turn("pool change")
    opening = opening_of(messages)
    assert opening is not None
    order = hrw_order(opening.key, POOL)
    assert router.pick(request("s0", messages), idle(POOL)).url == order[0]
    decision = router.pick(request("s1", messages), idle(order[1:]))
    assert decision.url == order[1] and decision.sibling is Sibling.APART
    assert ConversationRouter().pick(request("s2", later_turn(messages, "r", "o")), idle(order[1:])).url == order[1]


# -- later turns, restarts and other frontends ---------------------------------------------------


@settings(max_examples=25, deadline=None)  # hundreds of picks per example, on a loaded machine
@given(groups=st.integers(1, 60), siblings=st.integers(1, 8), engines=st.integers(1, 6))
def test_a_fresh_router_sends_every_later_turn_where_its_group_was_placed(
    groups: int, siblings: int, engines: int
) -> None:
    """With the lookup off (``groupLookupEngines: 0``): a router that never saw the conversation
    computes the same opening and the same rendezvous order, and so the same engine. (With it on,
    the bound moves groups and a fresh router finds them by asking: test_frontend_group_lookup.py.)"""
    pool = [f"http://e{i}" for i in range(engines)]
    first = ConversationRouter(lookup_engines=0)
    placed: dict[str, tuple[str, list[dict[str, Any]]]] = {}
    for g in range(groups):
        messages = first_turn(f"prompt {g}")
        for s in range(siblings):
            decision = first.pick(request(f"g{g}-s{s}", messages, TOOLS), idle(pool))
            placed[f"g{g}-s{s}"] = (decision.url, messages)
    restarted = ConversationRouter(lookup_engines=0)
    for cid, (url, messages) in placed.items():
        assert restarted.pick(request(cid, later_turn(messages, "x", "y"), TOOLS), idle(pool)).url == url


def test_later_turns_stay_pinned_and_a_restarted_router_agrees_at_rest() -> None:
    a = ConversationRouter()
    messages = first_turn("only group")
    urls = {a.pick(request(f"s{i}", messages), idle(POOL)).url for i in range(8)}
    b = ConversationRouter()
    later = later_turn(messages, "reply", "obs")
    again = {b.pick(request(f"s{i}", later), idle(POOL)).url for i in range(8)}
    assert urls == again and len(urls) == 1
    assert a.pick(request("s3", later), idle(POOL)).reason is Reason.STICKY


def test_routing_by_id_is_kept_when_groups_are_off() -> None:
    router = ConversationRouter(groups=False)
    messages = first_turn("t")
    decisions = [router.pick(request(f"c{i}", messages), idle(POOL)) for i in range(8)]
    assert decisions[0].url == hrw_order("c0", POOL)[0]
    assert len({d.url for d in decisions}) > 1
    assert all(d.sibling is None for d in decisions)


# -- no conversation id (NeMo-Gym's default config), text only -----------------------------------


def test_without_an_id_a_later_turn_with_a_long_tool_result_stays_with_its_prefix() -> None:
    """The prefix is most of the prompt in characters only with the tools counted; a tool result
    longer than a quarter of the prompt no longer moves the session (the match covers the opening)."""
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 400}} for i in range(6)]
    router = ConversationRouter()
    opening = [{"role": "user", "content": "Find the capital."}]
    first = router.pick(request(None, opening, tools), idle(POOL))
    later = later_turn(opening, "calling search", "result " * 2000)
    loaded = [Candidate(u, 1 if u == first.url else 0, 0) for u in POOL]  # busier than the rest
    again = router.pick(request(None, later, tools), loaded)
    assert again.url == first.url and again.reason is Reason.PREFIX
    fresh = ConversationRouter().pick(request(None, later, tools), idle(POOL))
    assert fresh.url == first.url and fresh.reason is Reason.RENDEZVOUS


def test_without_an_id_different_tools_are_different_prefixes() -> None:
    router = ConversationRouter()
    messages = [{"role": "user", "content": "same words " * 10}]
    router.pick(request(None, messages, TOOLS), idle(POOL))
    other_tools = [{"type": "function", "function": {"name": "other", "description": "x" * 4000}}]
    decision = router.pick(request(None, messages, other_tools), idle(POOL))
    assert decision.reason is not Reason.PREFIX


def test_a_later_turn_a_router_never_saw_goes_where_its_group_is_at_rest_whatever_the_load() -> None:
    """Like a pinned turn: the bounds would only move it away from where its conversation is."""
    messages = later_turn(first_turn("busy group"), "r", "o")
    opening = opening_of(messages)
    assert opening is not None
    first = hrw_order(opening.key, POOL)[0]
    busy = [Candidate(u, 40 if u == first else 0, 100_000 if u == first else 0) for u in POOL]
    decision = ConversationRouter().pick(request("unknown", messages), busy)
    assert decision.url == first and decision.reason is Reason.RENDEZVOUS
    new = ConversationRouter().pick(request("new", first_turn("busy group")), busy)
    assert new.url == first  # so does a first turn: where its later turns will be looked for


# -- a restarted frontend, whatever the first one's load ------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    placements=st.lists(
        st.tuples(st.integers(0, 11), st.lists(st.integers(0, 50_000), min_size=4, max_size=4)),
        min_size=1,
        max_size=40,
    ),
    engines=st.integers(1, 4),
)
def test_a_restarted_router_sends_every_later_turn_where_the_first_router_placed_it_whatever_its_load(
    placements: list[tuple[int, list[int]]], engines: int
) -> None:
    """The restart property, without exceptions: first turns (of a few prompts, so siblings) placed
    under any pending work and in-flight counts the first router saw; a router that never saw them
    (a restarted frontend, or another frontend of the replica) is idle, and still sends every later
    turn to the engine its first turn went to. Before placement was load-independent this failed
    wherever a bound had moved a group (bench/grpo.py, M = 4: affinity 0.953 across a restart).
    The lookup off (``groupLookupEngines: 0``); with it on, test_frontend_group_lookup.py."""
    pool = POOL[:engines]
    first = ConversationRouter(lookup_engines=0)
    placed: list[tuple[str, str, list[dict[str, Any]]]] = []
    for i, (prompt, pending) in enumerate(placements):
        messages = first_turn(f"prompt {prompt}")
        loads = [Candidate(u, p // 1000, p) for u, p in zip(pool, pending, strict=False)]
        placed.append((f"c{i}", first.pick(request(f"c{i}", messages, TOOLS), loads).url, messages))
    restarted = ConversationRouter(lookup_engines=0)
    for cid, url, messages in placed:
        assert restarted.pick(request(cid, later_turn(messages, "r", "o"), TOOLS), idle(pool)).url == url
