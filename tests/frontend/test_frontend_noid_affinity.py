"""Without a conversation id (NeMo-Gym's default), a later turn lands where its first turn went.

Properties over any opening (tools or none, any system and user text) and any appended turns
(an assistant reply and a tool output each, of any length): on the router that placed the first
turn, the later turn goes to the first turn's engine while that engine is within the in-flight
bound (by its prefix, which covers the opening), and past it too (by the opening, as a pinned turn
would); on a fresh router (a restart, another frontend) to the same engine, whatever was placed
before, with the lookup off (``groupLookupEngines: 0``: placement by opening reads no load; with it
on, a fresh router asks the engines, ``test_frontend_group_lookup.py``). Text only (a frontend that does
not tokenize), and with token ids whose last block is partial.
"""

from __future__ import annotations

from typing import Any

from drs_frontend.routing import Candidate, ConversationRouter, Reason, RouteRequest
from drs_frontend.routing.base import Sibling
from drs_frontend.routing.groups import opening_of
from hypothesis import given, settings
from hypothesis import strategies as st

POOL = [f"http://127.0.0.1:{8100 + i}" for i in range(4)]

_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=300)
_tools = st.one_of(
    st.none(),
    st.lists(
        st.builds(
            lambda name, doc: {"type": "function", "function": {"name": name, "description": doc}},
            st.text("abcdefgh_", min_size=1, max_size=12),
            st.text(max_size=2000),
        ),
        min_size=1,
        max_size=6,
    ),
)
_steps = st.lists(st.tuples(_text, st.text(max_size=6000)), min_size=1, max_size=4)


def _opening(system: str, task: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": task}]


def _later(opening: list[dict[str, Any]], steps: list[tuple[str, str]]) -> list[dict[str, Any]]:
    messages = list(opening)
    for i, (reply, output) in enumerate(steps):
        call = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
        messages.append({"role": "assistant", "content": reply, "tool_calls": call})
        messages.append({"role": "tool", "content": output, "tool_call_id": f"c{i}"})
    return messages


def _request(messages: list[dict[str, Any]], tools: Any, ids: list[int] | None = None) -> RouteRequest:
    return RouteRequest(None, ids, messages, tools=tools, opening=opening_of(messages, tools))


def _ids(messages: list[dict[str, Any]], tools: Any) -> list[int]:
    """Stand-in token ids: one per character of the rendered text, so a later turn extends the first."""
    text = repr(tools) + "".join(f"<{m['role']}>{m['content']}" for m in messages)
    return [ord(ch) for ch in text]


@settings(max_examples=150, deadline=None)
@given(
    system=_text,
    task=_text.filter(bool),
    tools=_tools,
    steps=_steps,
    others=st.lists(_text.filter(bool), max_size=12),
    tokenize=st.booleans(),
    busy=st.booleans(),
)
def test_a_later_turn_without_an_id_lands_where_its_first_turn_went(
    system: str,
    task: str,
    tools: Any,
    steps: list[tuple[str, str]],
    others: list[str],
    tokenize: bool,
    busy: bool,
) -> None:
    router = ConversationRouter(block_tokens=16, lookup_engines=0)
    idle = [Candidate(u, 0, 0) for u in POOL]
    for other in others:  # other conversations first: they must not move this one
        msgs = _opening("other", other)
        router.pick(_request(msgs, None, _ids(msgs, None) if tokenize else None), idle)
    opening = _opening(system, task)
    first = router.pick(_request(opening, tools, _ids(opening, tools) if tokenize else None), idle)
    later = _later(opening, steps)
    req = _request(later, tools, _ids(later, tools) if tokenize else None)
    # within the in-flight bound (one in flight on the first turn's engine), or far over it
    load = 50 if busy else 1
    loads = [Candidate(u, load if u == first.url else 0, 0) for u in POOL]
    again = router.pick(req, loads)
    assert again.url == first.url
    if not busy:
        assert again.reason in (Reason.PREFIX, Reason.GROUP)
    assert first.sibling is Sibling.FIRST or first.sibling is Sibling.WITH_GROUP
    assert ConversationRouter(block_tokens=16, lookup_engines=0).pick(req, idle).url == first.url  # a fresh one agrees


@settings(max_examples=100, deadline=None)
@given(task=_text.filter(bool), tools=_tools, steps=_steps)
def test_tools_are_part_of_the_text_prefix_a_later_turn_follows(
    task: str, tools: Any, steps: list[tuple[str, str]]
) -> None:
    """The same messages under other tools are another conversation: never its prefix match."""
    router = ConversationRouter()
    idle = [Candidate(u, 0, 0) for u in POOL]
    opening = _opening("s", task)
    router.pick(_request(opening, tools), idle)
    other = [{"type": "function", "function": {"name": "zz_other", "description": "x"}}]
    decision = router.pick(_request(_later(opening, steps), other), idle)
    assert decision.reason is not Reason.PREFIX
