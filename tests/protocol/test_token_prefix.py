"""The splice of drs_protocol.token_prefix: NeMo RL's ``replace_prefix_tokens`` semantics, on ids."""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest
from drs_protocol.token_prefix import (
    SMALL_IDS,
    KnownIds,
    PrefixOutcome,
    TokenPrefix,
    TokenPrefixError,
    eos_positions,
    find_prefix,
    history_end,
    splice,
    token_ids,
)
from hypothesis import given
from hypothesis import strategies as st

EOS = 2


def prefix(ids: list[int], param: str = "required_prefix_token_ids") -> TokenPrefix:
    found = find_prefix(ids, [], vocab_size=10_000, eos_id=EOS)
    assert found is not None
    return found


def test_the_nemo_rl_example_keeps_the_model_tokens_and_resumes_after_the_eos() -> None:
    # NeMo RL's docstring example: turn 1 prompt [11,12,13,40,41], the model emitted [220,17,2];
    # the template re-tokenizes " 4" as 1001, so turn 2's template ids differ inside the history.
    template = [11, 12, 13, 40, 41, 1001, 2, 21, 22, 40, 41]
    history_eos = 1  # the history [11,12,13,40,41,1001,2] holds one EOS
    got = splice(prefix([11, 12, 13, 40, 41, 220, 17, 2]), array("i", template), eos_positions(template, EOS), 1)
    assert got.ids.tolist() == [11, 12, 13, 40, 41, 220, 17, 2, 21, 22, 40, 41]
    assert got.outcome is PrefixOutcome.SPLICED
    assert got.history_eos == history_eos


def test_a_reply_cut_by_max_tokens_gets_the_templates_end_of_turn_token() -> None:
    template = [5, 1001, 2, 7, 8]
    got = splice(prefix([5, 220, 17]), array("i", template), eos_positions(template, EOS), 1)
    assert got.ids.tolist() == [5, 220, 17, 2, 7, 8]


def test_the_boundary_is_found_by_eos_count_when_the_template_drops_earlier_reasoning() -> None:
    # history: [sys 2] [user 2] [assistant <think>.. 2]; the full render drops the reasoning (77)
    template = [1, 2, 3, 2, 4, 2, 6, 2, 9]
    got = splice(prefix([1, 2, 3, 2, 77, 77, 4, 2]), array("i", template), eos_positions(template, EOS), 3)
    assert got.ids.tolist() == [1, 2, 3, 2, 77, 77, 4, 2, 6, 2, 9]
    assert got.outcome is PrefixOutcome.SPLICED


def test_a_prefix_with_another_eos_count_is_spliced_all_the_same_but_divergent() -> None:
    template = [1, 2, 3, 2, 4, 2, 9]
    got = splice(prefix([4, 4, 4]), array("i", template), eos_positions(template, EOS), 3)
    assert got.ids.tolist() == [4, 4, 4, 2, 9]
    assert got.outcome is PrefixOutcome.DIVERGENT
    assert (got.prefix_eos, got.history_eos) == (0, 3)


@pytest.mark.parametrize("history_eos", [0, 4])
def test_no_eos_boundary_is_an_error_naming_the_field(history_eos: int) -> None:
    template = [1, 2, 3, 2, 4, 2]
    with pytest.raises(TokenPrefixError, match="cannot splice") as caught:
        splice(prefix([1]), array("i", template), eos_positions(template, EOS), history_eos)
    assert caught.value.param == "required_prefix_token_ids"


@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=40),
    st.lists(st.integers(0, 50), max_size=40),
    st.data(),
)
def test_the_prefix_always_appears_verbatim_at_the_start(ids: list[int], template: list[int], data: Any) -> None:
    positions = eos_positions(template, EOS)
    if not positions:
        return
    k = data.draw(st.integers(1, len(positions)))
    got = splice(prefix(ids), array("i", template), positions, k).ids.tolist()
    assert got[: len(ids)] == ids
    assert got[len(ids) - (ids[-1] == EOS) :] == template[positions[k - 1] :]


def assistant(**ids: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": "x", **ids}


def test_the_prefix_comes_from_the_last_assistant_message_unless_the_request_names_one() -> None:
    messages = [
        {"role": "user", "content": "a"},
        assistant(prompt_token_ids=[1], generation_token_ids=[2]),
        {"role": "user", "content": "b"},
        assistant(prompt_token_ids=[1, 2, 3], generation_token_ids=[4, EOS]),
        {"role": "tool", "content": "c"},
    ]
    found = find_prefix(None, messages, vocab_size=10, eos_id=EOS)
    assert found is not None
    assert (found.ids.tolist(), found.param, found.keep, found.eos_count) == ([1, 2, 3, 4, 2], "messages[3]", 4, 1)
    required = find_prefix([7, 8], messages, vocab_size=10, eos_id=EOS)
    assert required is not None and required.ids.tolist() == [7, 8]
    assert find_prefix(None, messages[:1], vocab_size=10, eos_id=EOS) is None
    assert find_prefix(None, [*messages[:3], assistant()], vocab_size=10, eos_id=EOS) is None  # no ids: no splice
    assert find_prefix([], messages, vocab_size=10, eos_id=EOS) is None
    assert history_end(messages) == 4
    assert history_end(messages[:1]) == 1


@pytest.mark.parametrize(
    ("required", "message", "param"),
    [
        ({"a": 1}, {}, "required_prefix_token_ids"),
        ([1.5], {}, "required_prefix_token_ids"),
        ([2**40], {}, "required_prefix_token_ids"),
        ([10], {}, "required_prefix_token_ids"),
        (None, {"prompt_token_ids": [1]}, "messages[0].generation_token_ids"),
        (None, {"generation_token_ids": [1]}, "messages[0].prompt_token_ids"),
        (None, {"prompt_token_ids": "1", "generation_token_ids": []}, "messages[0].prompt_token_ids"),
        (None, {"prompt_token_ids": [], "generation_token_ids": [-3]}, "messages[0].generation_token_ids"),
    ],
)
def test_a_malformed_prefix_names_its_field(required: Any, message: dict[str, Any], param: str) -> None:
    with pytest.raises(TokenPrefixError) as caught:
        find_prefix(required, [assistant(**message)], vocab_size=10, eos_id=EOS)
    assert caught.value.param == param
    assert caught.value.message.startswith(param)


VOCAB = 151_669


@given(st.lists(st.integers(0, VOCAB - 1), max_size=300), st.integers(0, VOCAB - 1))
def test_prefix_ids_are_read_exactly(ids: list[int], eos: int) -> None:
    got, eos_count = token_ids(list(ids), "p", VOCAB, eos)
    assert got.tolist() == ids
    assert eos_count == ids.count(eos)


BAD_ID = st.sampled_from([-1, VOCAB, 2**31, 2**32, 2**40, -(2**40), 1.0, 7.5, "7", None, [7]])


@given(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=300), st.data(), BAD_ID)
def test_one_bad_id_anywhere_is_refused_naming_the_field(ids: list[int], data: Any, bad: Any) -> None:
    at = data.draw(st.integers(0, len(ids) - 1))
    corrupted = [*ids[:at], bad, *ids[at + 1 :]]
    with pytest.raises(TokenPrefixError) as caught:
        token_ids(corrupted, "messages[3].prompt_token_ids", VOCAB, 2)
    assert caught.value.param == "messages[3].prompt_token_ids"
    assert caught.value.message.startswith("messages[3].prompt_token_ids: ")


def known_ids(ids: list[int], eos: int) -> KnownIds:
    return KnownIds(array("I", ids).tobytes(), ids.count(eos))


@given(
    st.lists(st.integers(0, VOCAB - 1), max_size=200),
    st.lists(st.integers(0, VOCAB - 1), max_size=50),
    st.data(),
)
def test_known_ids_change_the_cost_not_the_result(head: list[int], tail: list[int], data: Any) -> None:
    """The known head (a conversation's previous prompt) is used only where the ids sent begin
    with it exactly: one id changed anywhere in the head, or a shorter list, reads as sent."""
    eos = data.draw(st.sampled_from([*head[:3], 151_645]))
    sent = head + tail
    if head and data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(head) - 1))
        sent[at] = data.draw(st.integers(0, VOCAB - 1))
    if data.draw(st.booleans()):
        sent = sent[: data.draw(st.integers(0, len(sent)))]
    got, eos_count = token_ids(list(sent), "p", VOCAB, eos, known_ids(head, eos))
    assert got.tolist() == sent
    assert eos_count == sent.count(eos)


@pytest.mark.parametrize("size", [SMALL_IDS - 1, SMALL_IDS, SMALL_IDS + 1, 3 * SMALL_IDS])
@pytest.mark.parametrize("head", [0, 1, SMALL_IDS])
def test_long_and_short_tails_are_bounded_and_counted_alike(size: int, head: int) -> None:
    """After a known head, the rest is checked with builtins (short) or numpy (long): same answers."""
    rng = random.Random(size * 7 + head)
    ids = [rng.randrange(VOCAB) for _ in range(head + size)]
    known = known_ids(ids[:head], 5) if head else None
    ids[-1] = 5
    got, eos_count = token_ids(list(ids), "p", VOCAB, 5, known)
    assert got.tolist() == ids and eos_count == ids.count(5)
    for at in (0, head // 2, head, head + size // 2, head + size - 1):  # in the known head too
        bad = [*ids[:at], VOCAB + at, *ids[at + 1 :]]
        with pytest.raises(TokenPrefixError, match=f"token id {VOCAB + at} is outside"):
            token_ids(bad, "p", VOCAB, 5, known)
