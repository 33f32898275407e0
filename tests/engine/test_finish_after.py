"""``finish_after``: when a leg ends (stop token id, EOS, stop string, ``max_tokens``), checked
against the plain rule (every stop string compared at every token, in request order) over random
legs; the index by last token only skips stop strings the new token cannot end."""

from __future__ import annotations

from drs_engine.backends.base import LegRequest, finish_after
from drs_engine.wire import CompletionRequest, RequestType
from hypothesis import given, settings
from hypothesis import strategies as st

EOS = 7


def leg(
    stops: list[tuple[int, ...]], stop_ids: list[int], *, min_tokens: int = 0, ignore_eos: bool = False
) -> LegRequest:
    request = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": [1],
            "stop_token_ids": stop_ids,
            "min_tokens": min_tokens,
            "ignore_eos": ignore_eos,
        }
    )
    return LegRequest(
        request_type=RequestType.CONTEXT_AND_GENERATION,
        prompt_token_ids=[1],
        max_tokens=64,
        request=request,
        logprobs=False,
        top_logprobs=0,
        conversation_id=None,
        streaming=False,
        stop_sequences=tuple((f"s{i}", ids) for i, ids in enumerate(stops)),
    )


def plain_rule(leg: LegRequest, generated: list[int]) -> tuple[str | None, int | str | None]:
    """The rule as written before the index: every stop string at every token."""
    request, token = leg.request, generated[-1]
    may_stop = len(generated) >= request.min_tokens
    if may_stop and token in (request.stop_token_ids or []):
        return "stop", token
    if may_stop and token == EOS and not request.ignore_eos:
        return "stop", None
    if may_stop:
        for text, ids in leg.stop_sequences:
            if ids and generated[-len(ids) :] == list(ids):
                return "stop", text
    if len(generated) >= leg.max_tokens:
        return "length", None
    return None, None


tokens = st.integers(min_value=0, max_value=9)


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.lists(tokens, max_size=4).map(tuple), max_size=6),
    stop_ids=st.lists(tokens, max_size=2),
    generated=st.lists(tokens, min_size=1, max_size=12),
    min_tokens=st.integers(min_value=0, max_value=4),
    ignore_eos=st.booleans(),
)
def test_the_index_answers_as_the_plain_rule(
    stops: list[tuple[int, ...]], stop_ids: list[int], generated: list[int], min_tokens: int, ignore_eos: bool
) -> None:
    one = leg(stops, stop_ids, min_tokens=min_tokens, ignore_eos=ignore_eos)
    for end in range(1, len(generated) + 1):
        assert finish_after(one, generated[:end], EOS) == plain_rule(one, generated[:end])


def test_the_first_stop_string_in_request_order_wins_and_a_stop_id_beats_eos_and_strings() -> None:
    one = leg([(3, 4), (4,), (2, 3, 4)], [5])
    assert finish_after(one, [2, 3, 4], EOS) == ("stop", "s0")  # s0, s1 and s2 all end here
    assert finish_after(one, [9, 4], EOS) == ("stop", "s1")
    assert finish_after(leg([(5,)], [5]), [5], EOS) == ("stop", 5)
    assert finish_after(leg([(EOS,)], []), [EOS], EOS) == ("stop", None)
    assert finish_after(leg([(3, 4)], [], min_tokens=3), [3, 4], EOS) == (None, None)
